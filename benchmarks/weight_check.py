"""What checking a weight push costs on its critical path: every tensor against a rotating share.

    python benchmarks/weight_check.py                 # SmolLM2-135M-Instruct in bf16, share 1/8, 5 rounds
    python benchmarks/weight_check.py --quick         # tiny-llama, 2 rounds
    python benchmarks/weight_check.py --every 4

After a push rank 0 compares what the engines serve with what it sent (`rollout/weights/verify.py`):
the trainer digests each tensor as the route consumes it (`DigestTap`: a cast and a matrix-vector
product per tensor), then every engine digests what it holds (`weights_digest`) and the two are
compared. With `rollout.verify_weights_every` N a push after the first does that for every N-th
tensor only. Here, in one process, an `HFEngine` holding the model and the model's tensors as the
trainer would send them; per round, alternating: the whole check (the tap over every tensor, the
engine's digest of every tensor, the comparison) and the check of one share (offset moving by one a
round). Beside them the floor of the push itself: one copy of the same bytes (`memcpy`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, result_line, write_result  # noqa: E402

sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny-llama, 2 rounds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.model, args.rounds = "tiny-llama", 2
    import torch

    from engines.inference.hf import HFEngine
    from engines.models import resolve_model
    from engines.weight_digest import compare
    from rollout.weights.verify import DigestTap, tied_embeddings

    model_dir = str(resolve_model(args.model))
    engine = HFEngine(model_dir, dtype="bfloat16")
    tied = tied_embeddings(model_dir)
    sent: list[tuple[str, Any]] = []

    async def check(every: int, offset: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        tap = DigestTap(iter(sent), torch.bfloat16, every, offset)
        for _ in tap:  # the route consuming the tensors
            pass
        names = tap.asked(tied)
        held = await engine.weight_digest(names or None)
        bad, compared = compare(tap.sent, held, "bfloat16", tied)
        assert not bad, bad
        return time.perf_counter() - t0, compared

    async def rounds() -> dict[str, Any]:
        await engine.start()
        sent.extend((n, t.detach().clone()) for n, t in engine.model.state_dict().items()
                    if not (tied and n == "lm_head.weight"))  # a tied head is not sent (named_sync_weights)
        out: dict[str, list[float]] = {"all": [], "share": [], "memcpy": []}
        counts: dict[str, list[int]] = {"all": [], "share": []}
        buf = [torch.empty_like(t) for _, t in sent]
        try:
            await check(1, 0)  # warm-up
            for r in range(args.rounds):
                s, n = await check(1, 0)
                out["all"].append(s)
                counts["all"].append(n)
                s, n = await check(args.every, r)
                out["share"].append(s)
                counts["share"].append(n)
                t0 = time.perf_counter()
                for b, (_, t) in zip(buf, sent):
                    b.copy_(t)
                out["memcpy"].append(time.perf_counter() - t0)
        finally:
            await engine.close()
        return {"seconds": out, "compared": counts}

    got = asyncio.run(rounds())
    nbytes = sum(t.numel() * t.element_size() for _, t in sent)
    med = {k: statistics.median(v) for k, v in got["seconds"].items()}
    report = {"machine": machine(), "model": args.model, "every": args.every, "rounds": args.rounds,
              "tensors": len(sent), "gb": nbytes / 1e9, **got, "median_s": med,
              "share_over_all": med["share"] / med["all"]}
    write_result("weight_check", report, args.out)
    print(f"{args.model}: {len(sent)} tensors, {nbytes / 1e9:.3f} GB; check of every tensor {med['all']:.3f} s, of "
          f"1/{args.every} {med['share']:.3f} s (median of {args.rounds}); a copy of the bytes {med['memcpy']:.3f} s")
    print(result_line({"check_all_s": med["all"], "check_share_s": med["share"], "memcpy_s": med["memcpy"]}))


if __name__ == "__main__":
    main()
