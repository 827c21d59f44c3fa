"""The CPU actor's update with and without `actor.retain_freed_memory`, side by side.

    python benchmarks/host_memory.py            # SmolLM2-135M-Instruct, bf16 autocast, eager attention, 3 pairs
    python benchmarks/host_memory.py --quick    # tiny-llama, 2 pairs
    python benchmarks/host_memory.py --dtype float32

Why: glibc hands every block above its mmap threshold (at most 32 MiB) back to the system on free, so
a CPU update that allocates logits, their fp32 chunks, casts and attention scores of hundreds of MiB
per micro-batch faults all of them in again, page by page (`parallel/host.py`). Three settings: `on`
(the default: freed memory kept through an update, handed back when it ends), `keep` (kept for good,
never handed back: the RSS stays at its highest) and `off` (glibc's defaults). Each runs in its own
process (the setting is process-wide), in turn (on, keep, off, on, ...); each process builds the
actor, runs one update to warm up and then `--updates` timed ones on the CPU demo's batch
(`micro_batches.demo_batch`: 32 trajectories, 8 rows per micro-batch). Reported per setting: the
median update seconds, minor page faults per update (in GiB of 4 KiB pages), the RSS after the last
update and the process's peak RSS; and the median of the per-round speed ratios against `off`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, result_line, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


SETTINGS = ("on", "keep", "off")


def one(model: str, dtype: str, attn: str, setting: str, updates: int, trajectories: int = 32) -> dict[str, Any]:
    """In this process: the actor's warm-up update, then `updates` timed ones."""
    import resource
    import time

    import psutil
    import torch

    from engines.models import resolve_model
    from engines.training.config import ActorConfig
    from engines.training.losses import LossConfig
    from engines.training.torch_actor import TorchActor
    from micro_batches import demo_batch

    torch.manual_seed(0)
    actor = TorchActor(ActorConfig(lr=1e-6, micro_batch_size=8, attn_implementation=attn,
                                   retain_freed_memory=setting != "off"), str(resolve_model(model)), dtype=dtype,
                       progress=False)
    if setting == "keep":  # retained, never handed back: the release at the end of each update turned off
        actor._retaining = False
    batch = demo_batch(int(actor.module.config.vocab_size), trajectories)
    adv = torch.randn(len(batch))[:, None] * batch.response_mask
    seconds, faults = [], []
    for i in range(updates + 1):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        actor.update(batch, adv, None, None, LossConfig())
        if i:  # the first update warms up
            seconds.append(time.perf_counter() - t0)
            faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) * 4096 / 2 ** 30)
    return {"update_s": seconds, "fault_gib": faults, "rss_after_gib": psutil.Process().memory_info().rss / 2 ** 30,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny-llama, 2 pairs")
    ap.add_argument("--pairs", type=int, default=None)
    ap.add_argument("--updates", type=int, default=2, help="timed updates per process, after one warm-up")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--trajectories", type=int, default=32, help="the batch: the CPU demo's 32, or fewer")
    ap.add_argument("--attn", default="eager")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one setting in this process
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = "tiny-llama" if args.quick else "smollm2-135m-instruct"
    if args.one is not None:
        print(json.dumps(one(model, args.dtype, args.attn, args.one, args.updates, args.trajectories)))
        return
    pairs = args.pairs or (2 if args.quick else 3)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
    for p in range(pairs):
        for setting in SETTINGS:
            cmd = [sys.executable, __file__, "--one", setting, "--dtype", args.dtype, "--attn", args.attn,
                   "--updates", str(args.updates), "--trajectories", str(args.trajectories),
                   *(["--quick"] if args.quick else [])]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
            if out.returncode:
                raise SystemExit(f"{setting} run failed:\n{out.stderr[-3000:]}")
            runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = runs[setting][-1]
            print(f"round {p + 1} retain {setting}: update {[round(s, 2) for s in r['update_s']]} s, faults "
                  f"{[round(f, 2) for f in r['fault_gib']]} GiB, RSS after {r['rss_after_gib']:.2f} GiB, "
                  f"peak RSS {r['peak_rss_gib']:.2f} GiB", flush=True)
    med = {k: statistics.median(statistics.median(r["update_s"]) for r in v) for k, v in runs.items()}
    speed = {k: [statistics.median(off["update_s"]) / statistics.median(r["update_s"])
                 for r, off in zip(runs[k], runs["off"])] for k in ("on", "keep")}
    median = lambda key: {k: statistics.median(r[key] for r in v) for k, v in runs.items()}  # noqa: E731
    report = {"machine": machine(), "model": model, "dtype": args.dtype, "attn": args.attn, "pairs": pairs,
              "trajectories": args.trajectories,
              "updates": args.updates, "runs": runs, "update_s_median": med, "speedup_per_pair": speed["on"],
              "speedup_median": statistics.median(speed["on"]), "keep_speedup_median": statistics.median(speed["keep"]),
              "fault_gib_median": {k: statistics.median(f for r in v for f in r["fault_gib"]) for k, v in runs.items()},
              "rss_after_gib_median": median("rss_after_gib"), "peak_rss_gib_median": median("peak_rss_gib")}
    write_result("host_memory", report, args.out)
    print(result_line({"retain_vs_default_update_speed": report["speedup_median"],
                       "keep_vs_default_update_speed": report["keep_speedup_median"],
                       "faults_gib_on": report["fault_gib_median"]["on"], "faults_gib_off": report["fault_gib_median"]["off"],
                       "rss_after_gib_on": report["rss_after_gib_median"]["on"],
                       "rss_after_gib_keep": report["rss_after_gib_median"]["keep"]}))


if __name__ == "__main__":
    main()
