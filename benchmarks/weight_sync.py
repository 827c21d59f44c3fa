"""Weight sync throughput: resharding Megatron shards to the HF layout and loading them into an
engine, next to a plain memcpy of the same bytes, measured side by side in one run.

Why: after every RL step the whole policy moves from the trainer's layout into the engines. If
that is much slower than copying the bytes, it is a cost worth removing.

Setup (not timed): the model's HF tensors are cut into Megatron TP shards (`parallel/reshard.py`,
SmolLM2-135M at TP 3 by default: its 3 key/value groups allow 1 or 3) and an hf engine is started.
Timed, per repetition, in alternation:
  memcpy       copy every HF tensor's bytes into preallocated tensors of the same sizes
  reshard      Megatron shards -> HF tensors (TP gather by concatenation, fused QKV and gate/up
               split, vocabulary padding removed), streamed one tensor at a time
  in-process   reshard + `load_into_engine` into an hf engine in this process (colocated case)
  bus          reshard + `push_weights` over the ZMQ bus into an hf EngineServer process
               (CRC32 per 64 MiB bucket, engine-side check, versioned commit), two buckets in
               flight (the next gathered while the engine loads the last)
  bus_serial   the same, one bucket at a time (each waits for the engine's ack)
GB/s counts the HF bytes moved (fp32 here). With CUDA the shards and the memcpy live on the GPU.

    python benchmarks/weight_sync.py                   # SmolLM2-135M, TP 3
    python benchmarks/weight_sync.py --quick           # tiny llama, TP 2
    python benchmarks/weight_sync.py --model /path/to/hf-dir --tp 4
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, result_line, servers, write_result  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny llama at TP 2, fewer repetitions")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--out", default=None, help=f"JSON path (default {RESULTS}/weight_sync.json)")
    args = ap.parse_args(argv)
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from engines.inference.hf import HFEngine
    from engines.models import resolve_model
    from parallel.reshard import DecoderLayout, hf_to_megatron, iter_megatron_to_hf
    from rollout.client import GenerateClient
    from rollout.weight_sync import load_into_engine, push_weights

    name = args.model or ("tiny-llama" if args.quick else "smollm2-135m-instruct")
    tp = args.tp or (2 if args.quick else 3)
    reps = args.reps or (3 if args.quick else 5)
    path = Path(resolve_model(name))
    lay = DecoderLayout.from_hf_config(AutoConfig.from_pretrained(path))
    lay.check(tp, args.pp)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    state = load_file(str(path / "model.safetensors"))
    shards = {(r, s): {k: v.to(device) for k, v in hf_to_megatron(state.__getitem__, lay, r, tp, s, args.pp).items()}
              for r in range(tp) for s in range(args.pp)}
    sources = [v.to(device) for v in state.values()]
    targets = [torch.empty_like(v) for v in sources]
    nbytes = sum(v.numel() * v.element_size() for v in sources)
    bucket = args.bucket_mb << 20
    print(f"{name}: {nbytes / 1e9:.3f} GB of HF tensors, TP {tp} x PP {args.pp} shards, device {device}", flush=True)

    def memcpy() -> None:
        for s, t in zip(sources, targets):
            t.copy_(s)
        if device.type == "cuda":
            torch.cuda.synchronize()

    def reshard() -> None:
        for _, t in iter_megatron_to_hf(shards, lay, tp, args.pp):
            pass
        if device.type == "cuda":
            torch.cuda.synchronize()

    engine = HFEngine(str(path))
    times: dict[str, list[float]] = {"memcpy": [], "reshard": [], "in_process": [], "bus": [], "bus_serial": []}
    with tempfile.TemporaryDirectory(prefix="sy-wsync-") as tmp, servers("hf", str(path), 1, Path(tmp)) as addrs:
        async def run_all() -> None:
            await engine.start()
            async with GenerateClient(addrs) as client:
                await client.wait_ready(timeout_s=600)
                version = 0
                for rep in range(reps + 1):  # the first round warms up and is not counted
                    for kind in (["memcpy", "reshard", "in_process", "bus", "bus_serial"] if rep % 2 else
                                 ["bus_serial", "bus", "in_process", "reshard", "memcpy"]):
                        t0 = time.perf_counter()
                        if kind == "memcpy":
                            memcpy()
                        elif kind == "reshard":
                            reshard()
                        elif kind == "in_process":
                            await load_into_engine(engine, ((n, t.cpu()) for n, t in
                                                            iter_megatron_to_hf(shards, lay, tp, args.pp)), bucket)
                        else:  # bus: two buckets in flight (the default); bus_serial: one at a time
                            version += 1
                            await push_weights(client, iter_megatron_to_hf(shards, lay, tp, args.pp), version, bucket,
                                               inflight=1 if kind == "bus_serial" else 2)
                        if rep:
                            times[kind].append(time.perf_counter() - t0)
            # the engines hold exactly the resharded weights
            loaded = engine.model.state_dict()
            assert all(torch.equal(loaded[k].cpu(), state[k]) for k in state), "in-process engine weights differ"
            await engine.close()

        asyncio.run(run_all())
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    ratios = {"reshard_vs_memcpy": gbps["reshard"] / gbps["memcpy"],
              "in_process_vs_memcpy": gbps["in_process"] / gbps["memcpy"],
              "bus_vs_memcpy": gbps["bus"] / gbps["memcpy"], "bus_pipelined_vs_serial": gbps["bus"] / gbps["bus_serial"]}
    info = machine()
    print(f"\n{'path':>11} | {'median s':>8} | {'GB/s':>7} | vs memcpy   ({info['device']})")
    for k in times:
        print(f"{k:>11} | {statistics.median(times[k]):>8.3f} | {gbps[k]:>7.2f} | {gbps[k] / gbps['memcpy']:.3f}")
    report = {"benchmark": "weight_sync", "machine": info, "model": name, "tp": tp, "pp": args.pp,
              "bytes": nbytes, "bucket_mb": args.bucket_mb, "reps": reps, "device": str(device),
              "seconds": times, "gb_per_s": gbps, "ratios": ratios,
              "command": " ".join(["python benchmarks/weight_sync.py", *(argv if argv is not None else sys.argv[1:])])}
    write_result("weight_sync", report, args.out)
    print(result_line(ratios))
    return report


if __name__ == "__main__":
    main()
