"""Repack vLLM's CUDA wheel into a slim one for a dense model on a Hopper GPU, and cut it into parts.

A device call carries at most 64 MiB; vllm 0.26.0's wheel is 290 MiB. What a dense llama/qwen2 in bf16
on an H100/H200 needs of it is the python package, the `_C` kernels (cache ops, norms, activations,
sampling) and FlashAttention 3, which vLLM picks on compute capability 9.x. Left out (DROPPED below):

  vllm_flash_attn/_vllm_fa2_C   FlashAttention 2: vLLM uses it below or above Hopper, not on it (123 MiB)
  _moe_C_stable_libtorch        the fused-MoE kernels; imported only if present (39 MiB)
  vllm-rs                       the Rust HTTP frontend; the in-process engine never starts it (15 MiB)
  third_party/deep_gemm         FP8 block GEMMs (headers and per-Python builds) (6 MiB)
  third_party/fmha_sm100        Blackwell attention sources (4 MiB)
  _flashmla*_C                  multi-head latent attention (DeepSeek-style models)
  _qutlass_C                    FP4 quantization kernels; imported only if present

Every other file stays, so a model that needs a dropped kernel fails where vLLM imports it, by name.
The parts are `<wheel>.part-NN`, each at most --part-mib MiB, one folder per part (`part-NN/`) so each
device call carries one folder; `vllm_device_install.sh` joins them and checks the sha256 written here.

    python benchmarks/vllm_slim_wheel.py WHEEL OUT_DIR [--part-mib 58]
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import zipfile
from pathlib import Path

DROPPED = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.",
    "vllm/_moe_C",
    "vllm/vllm-rs",
    "vllm/third_party/deep_gemm/",
    "vllm/third_party/fmha_sm100/",
    "vllm/_flashmla_C.",
    "vllm/_flashmla_extension_C.",
    "vllm/_qutlass_C.",
)
NEEDED = ("vllm/_C_stable_libtorch.", "vllm/vllm_flash_attn/_vllm_fa3_C.")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim(src: Path, dst: Path) -> list[str]:
    """Write dst: src without DROPPED, RECORD rewritten to match. Returns the dropped names."""
    dropped, rows = [], []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        names = zin.namelist()
        for need in NEEDED:
            if not any(n.startswith(need) for n in names):
                raise SystemExit(f"{src.name} has no {need}*: not the vLLM CUDA wheel this script expects")
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            if info.filename.startswith(DROPPED):
                dropped.append(info.filename)
                continue
            if info.filename == record:
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            rows.append((info.filename, _record_hash(data), str(len(data))))
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerows(rows + [(record, "", "")])
        zout.writestr(record, out.getvalue())
    return dropped


def split(wheel: Path, out_dir: Path, part_bytes: int) -> list[Path]:
    data = wheel.read_bytes()
    parts = []
    for i, start in enumerate(range(0, len(data), part_bytes)):
        folder = out_dir / f"part-{i:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / f"{wheel.name}.part-{i:02d}"
        part.write_bytes(data[start:start + part_bytes])
        parts.append(part)
    (out_dir / "SHA256").write_text(f"{hashlib.sha256(data).hexdigest()}  {wheel.name}\n")
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", type=Path, help="vLLM's CUDA wheel (vllm-*-manylinux*_x86_64.whl)")
    ap.add_argument("out_dir", type=Path, help="where the slim wheel and its part-NN/ folders go")
    ap.add_argument("--part-mib", type=int, default=58,
                    help="largest part, MiB (a device call carries 64, the checkout included)")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for old in args.out_dir.glob("part-*/*"):
        old.unlink()
    slim_wheel = args.out_dir / args.wheel.name
    dropped = slim(args.wheel, slim_wheel)
    parts = split(slim_wheel, args.out_dir, args.part_mib * 2**20)
    mib = 2**20
    print(f"slim wheel {slim_wheel.name}: {args.wheel.stat().st_size / mib:.1f} MiB -> "
          f"{slim_wheel.stat().st_size / mib:.1f} MiB, {len(dropped)} files dropped")
    for p in parts:
        print(f"  {p.parent.name}/{p.name}: {p.stat().st_size / mib:.1f} MiB")


if __name__ == "__main__":
    main()
