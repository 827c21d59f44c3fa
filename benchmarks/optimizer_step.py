"""AdamW's step over a model's parameters, torch's three implementations side by side: the
per-tensor loop (torch's CPU default), `foreach` and `fused` (what every switchyard trainer uses
where the device has it: `engines/training/actor.py` `adamw`).

    python benchmarks/optimizer_step.py            # SmolLM2-135M-Instruct's parameters
    python benchmarks/optimizer_step.py --quick    # tiny-llama's

Each implementation gets the same parameters and gradients (fp32, one seed) and its own AdamW
state; they alternate (loop, foreach, fused, loop, ...) for `--rounds` steps after one warm-up step
each. Reported: the median seconds of a step, the loop's over fused, and the largest difference
between fused's parameters and the loop's after the last step (float rounding, not a drift).
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

KINDS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def measure(name: str, rounds: int) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.models import resolve_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(resolve_model(name))))
    start = [p.detach().float().clone() for p in model.parameters()]
    grads = [torch.randn_like(p) * 1e-3 for p in start]
    params, optimizers = {}, {}
    for kind, options in KINDS.items():
        params[kind] = [torch.nn.Parameter(p.clone()) for p in start]
        for p, g in zip(params[kind], grads):
            p.grad = g.clone()
        optimizers[kind] = torch.optim.AdamW(params[kind], lr=1e-5, weight_decay=0.01, **options)
        optimizers[kind].step()  # warm-up: the moments are allocated here
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(rounds):
        for kind, optimizer in optimizers.items():
            t0 = time.perf_counter()
            optimizer.step()
            times[kind].append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in times.items()}
    diff = max((a - b).abs().max().item() for a, b in zip(params["fused"], params["loop"]))
    return {"parameters": sum(p.numel() for p in start), "tensors": len(start), "step_s": times,
            "median_s": median, "loop_over_fused": median["loop"] / median["fused"], "max_abs_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny-llama's parameters")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name = "tiny-llama" if args.quick else "smollm2-135m-instruct"
    found = measure(name, args.rounds)
    report = {"benchmark": "optimizer_step", "machine": machine(), "model": name, **found}
    print(f"{name}: {found['parameters'] / 1e6:.1f}M parameters in {found['tensors']} tensors; median step "
          + ", ".join(f"{k} {v:.3f} s" for k, v in found["median_s"].items()), flush=True)
    write_result("optimizer_step", report, args.out)
    print(result_line({"loop_over_fused": found["loop_over_fused"], "fused_s": found["median_s"]["fused"],
                       "max_abs_diff": found["max_abs_diff"]}))


if __name__ == "__main__":
    main()
