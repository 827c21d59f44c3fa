"""The drift guard: every step, the engines' logprobs of the sampled tokens against the actor's
(`drift/mean`, `drift/max`) are held to a limit per dtype. Past it a loud warning says so and names
the tensors whose engine copy differs from what the trainer sent (the last push's digests,
rollout/weights/verify.py); past `trainer.max_drift` the run stops, exit non-zero.

`DRIFT_LIMITS` (drift/mean, per model dtype), from runs of 4 GRPO steps with every parameter of
SmolLM2-135M training on CPU: fp32 7.6e-6 to 8.6e-6 for the hf and (fixed) vllm engines, against
7.1e-3 to 9.4e-3 when vLLM served a stale output head; so fp32's 1e-4 is ~12x the noise and ~70x
below that fault. bf16: 0.016 measured on one H200 (a 1B llama, hf engine against the torch actor):
0.05 is ~3x. fp16 (not measured): an fp16 mantissa is 8x finer than bf16's, 0.01 keeps a margin.
With top-p below 1 vLLM reports the truncated distribution's logprobs,
which differ from the actor's by design (engines/inference/vllm.py): the warning says so.
"""

from __future__ import annotations

import sys
from typing import Any

DRIFT_LIMITS = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}


class DriftError(RuntimeError):
    """The engines' policy is further from the actor's than `trainer.max_drift` allows."""


class DriftGuard:
    def __init__(self, dtype: str, warn_at: float | None = None, stop_at: float | None = None,
                 truncated_sampling: bool = False, show: bool = True) -> None:
        self.dtype = dtype
        self.warn_at = DRIFT_LIMITS.get(dtype, DRIFT_LIMITS["float32"]) if warn_at is None else warn_at
        self.stop_at = stop_at
        self.truncated = truncated_sampling
        self.show = show  # rank 0 prints; every rank stops alike (the drift is reduced over ranks)

    def check(self, step: int, metrics: dict[str, Any], mismatched: dict[int, list[tuple[str, float]]]) -> None:
        """Warn past the limit, naming the differing tensors; raise DriftError past `stop_at`."""
        mean = metrics.get("drift/mean")
        if mean is None or mean <= self.warn_at:
            return
        metrics["drift/over_limit"] = 1.0
        if mismatched:
            where = "; ".join(f"engine {e}: " + ", ".join(n for n, _ in bad[:6]) + (" ..." if len(bad) > 6 else "")
                              for e, bad in mismatched.items())
            cause = f"the last push left these tensors different on the engines: {where}"
        else:
            cause = ("every tensor the engines reported matched what was sent (or they could not report): the "
                     "difference is in how they compute (kernels, dtype, an output head or layer the digest does not "
                     "cover)")
        if self.truncated:
            cause += "; sampling uses top_p < 1, whose truncated logprobs differ from the actor's by design"
        text = (f"step {step}: drift/mean={mean:.3g} (drift/max={metrics.get('drift/max', float('nan')):.3g}) is above "
                f"{self.warn_at:.0e}, the limit for {self.dtype}: the engines sample from another policy than the "
                f"one being trained; {cause}")
        if self.stop_at is not None and mean > self.stop_at:
            raise DriftError(f"{text}. trainer.max_drift={self.stop_at:g} stops the run")
        if self.show:
            print(f"WARNING: {text}. Set trainer.max_drift to stop a run past a drift.", file=sys.stderr, flush=True)
