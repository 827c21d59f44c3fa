"""The torch actor's update in float32 against bf16 autocast over fp32 weights, side by side on one
batch: the measurement `model.dtype=auto` rests on.

    python benchmarks/update_dtype.py --quick   # tiny-llama
    python benchmarks/update_dtype.py           # tiny-llama, then SmolLM2-135M-Instruct

The batch is the CPU demo's shape (`micro_batches.demo_batch`: 32 trajectories, prompts 60-180
tokens, responses 10-120), `actor.micro_batch_size=8`. Per model, the two actors start from one
state, take one update each to warm up, then alternate (fp32, bf16, fp32, bf16, ...); reported:
update seconds, and the median of the per-pair ratios fp32 / bf16 (above 1: bf16 is faster). The
report also names what multiplies bf16 natively here (`engines/training/config.py` `native_bf16`),
or null where nothing does (there `auto` keeps float32).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, result_line, write_result  # noqa: E402
from micro_batches import demo_batch  # noqa: E402

DTYPES = ("float32", "bfloat16")


def compare(name: str, pairs: int) -> dict[str, Any]:
    """One model: its two actors alternated `pairs` times after a warm-up update each."""
    import torch

    from engines.models import resolve_model
    from engines.training.config import ActorConfig
    from engines.training.losses import LossConfig
    from engines.training.torch_actor import TorchActor

    model = str(resolve_model(name))
    torch.manual_seed(0)
    actors = {d: TorchActor(ActorConfig(lr=1e-6, micro_batch_size=8), model, dtype=d, progress=False) for d in DTYPES}
    actors["bfloat16"].module.load_state_dict(actors["float32"].module.state_dict())
    batch = demo_batch(int(actors["float32"].module.config.vocab_size))
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))[:, None] * batch.response_mask
    times: dict[str, list[float]] = {d: [] for d in DTYPES}
    for round_ in range(pairs + 1):
        for dtype, actor in actors.items():
            t0 = time.perf_counter()
            actor.update(batch, adv, None, None, LossConfig())
            if round_:  # the first round warms up (allocator, kernels)
                times[dtype].append(time.perf_counter() - t0)
                print(f"{name} {dtype}: {times[dtype][-1]:.2f} s", flush=True)
    ratios = [f / b for f, b in zip(times["float32"], times["bfloat16"])]
    return {"parameters": sum(p.numel() for p in actors["float32"].module.parameters()),
            "update_s": times, "fp32_over_bf16_median": statistics.median(ratios)}


def main() -> None:
    from engines.training.config import native_bf16

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny-llama only, 2 pairs")
    ap.add_argument("--pairs", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = ["tiny-llama"] if args.quick else ["tiny-llama", "smollm2-135m-instruct"]
    pairs = args.pairs or (2 if args.quick else 3)
    report: dict[str, Any] = {"machine": machine(), "native_bf16": native_bf16("cpu"), "pairs": pairs,
                              "models": {n: compare(n, pairs) for n in names}}
    path = write_result("update_dtype", report, args.out)
    print(f"wrote {path}")
    print(result_line({f"{n.split('-')[0]}_fp32_over_bf16": r["fp32_over_bf16_median"]
                       for n, r in report["models"].items()}))


if __name__ == "__main__":
    main()
