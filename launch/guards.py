"""The run's guards: a run that does not learn what it should says so, and stops where told.

The drift guard: every step, the engines' logprobs of the sampled tokens against the actor's
(`drift/mean`, `drift/max`) are held to a limit per dtype. Past it a loud warning says so and names
the tensors whose engine copy differs from what the trainer sent (the last push's digests,
rollout/weights/verify.py); past `trainer.max_drift` the run stops, exit non-zero.

`DRIFT_LIMITS` (drift/mean, per model dtype), from runs of 4 GRPO steps with every parameter of
SmolLM2-135M training on CPU: fp32 1.6e-5 to 1.8e-5 for the hf and (fixed) vllm engines, against
7.1e-3 to 9.4e-3 when vLLM served a stale output head; so fp32's 1e-4 is ~6x the noise and ~70x
below that fault. bf16: 0.016 measured on one H200 (a 1B llama, hf engine against the torch actor):
0.05 is ~3x. fp16 (not measured): an fp16 mantissa is 8x finer than bf16's, 0.01 keeps a margin.
With top-p below 1 vLLM reports the truncated distribution's logprobs, which differ from the
actor's by design (engines/inference/vllm.py): the warning says so.

The invalid guard: a trajectory that failed (its loop, a tool, the engine or the reward raised) is
never trained on. A step in which none is valid fails: nothing is learned or pushed, and the step's
line says why (the reasons counted, the first error quoted). A run whose every step failed exits
non-zero, and one whose batches stay mostly invalid (`trainer.max_invalid_fraction` in
`INVALID_PATIENCE` steps in a row) stops.
"""

from __future__ import annotations

import sys
from typing import Any

DRIFT_LIMITS = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
INVALID_PATIENCE = 3  # steps in a row above trainer.max_invalid_fraction before the run stops


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


class InvalidError(RuntimeError):
    """Every step failed, or the batches stayed mostly invalid: the run did not train."""


def _reason(error: str) -> str:
    """A failed trajectory's reason, for counting: the error's kind (the text before its first ':')."""
    kind = (error or "unknown").strip().split(":", 1)[0].strip().splitlines()[0] if error else "unknown"
    kind = kind.removeprefix("the ").replace(" ", "_")
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in kind)[:48] or "unknown"


class InvalidGuard:
    def __init__(self, max_fraction: float, show: bool = True) -> None:
        self.max_fraction = max_fraction
        self.show = show
        self.steps = self.failed = self.over = 0
        self.first_error = ""

    def check(self, step: int, batch: Any, metrics: dict[str, Any]) -> bool:
        """Count the step's invalid trajectories and their reasons into `metrics`; True when the step
        failed (no valid trajectory: nothing to learn). Counts are over every rank (each holds a shard).
        Raises InvalidError when the batches stayed mostly invalid for INVALID_PATIENCE steps."""
        import torch

        from parallel.reduce import over_ranks

        errors = [e for e, ok in zip(batch.errors, batch.valid.tolist()) if not ok]
        reasons: dict[str, int] = {}
        for e in errors:
            reasons[_reason(e)] = reasons.get(_reason(e), 0) + 1
        counts = [float(len(batch)), float(len(errors))]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1 and batch.is_shard:
            counts, _ = over_ranks(counts)
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, (reasons, errors[:1]))
            reasons, errors = {}, []
            for r, first in gathered:
                errors += first
                for k, v in r.items():
                    reasons[k] = reasons.get(k, 0) + v
        total, invalid = int(counts[0]), int(counts[1])
        self.steps += 1
        metrics["rollout/invalid"] = float(invalid)
        metrics.update({f"rollout/invalid_reason/{k}": float(v) for k, v in reasons.items()})
        failed = total > 0 and invalid == total
        fraction = invalid / max(total, 1)
        self.over = self.over + 1 if fraction > self.max_fraction else 0
        why = ", ".join(f"{k} x{v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
        first = (errors[0].strip().splitlines() or [""])[0][:300] if errors else ""
        self.first_error = self.first_error or first
        if failed:
            self.failed += 1
            metrics["step/failed"] = 1.0
            if self.show:
                print(f"ERROR: step {step} failed: none of its {total} trajectories is valid ({why}); the first "
                      f"error: {first}. Nothing is learned or pushed this step.", file=sys.stderr, flush=True)
        elif invalid and self.show:
            print(f"WARNING: step {step}: {invalid} of {total} trajectories failed and are not trained on ({why}); "
                  f"the first error: {first}", file=sys.stderr, flush=True)
        if self.over >= INVALID_PATIENCE:
            raise InvalidError(f"{INVALID_PATIENCE} steps in a row lost more than trainer.max_invalid_fraction="
                               f"{self.max_fraction:g} of their batch (step {step}: {invalid} of {total}: {why}; the "
                               f"first error: {first}); fix what fails, or raise trainer.max_invalid_fraction")
        return failed

    def finish(self) -> None:
        """At the end of the run: raise InvalidError when every step of it failed."""
        if self.steps and self.failed == self.steps:
            raise InvalidError(f"every one of the run's {self.steps} steps failed: no trajectory was valid, nothing "
                               f"was trained; the first error: {self.first_error} (each step's line and "
                               "metrics.jsonl count the reasons)")
