"""launch/guards.py on its own: the drift guard's limits, warning and stop; the invalid guard's
counts, failed steps and the stop after batches stay mostly invalid. (Through launch/train.py:
tests/test_fidelity.py and tests/test_reward_function.py.)"""

from __future__ import annotations

import pytest
import torch

from launch.guards import INVALID_PATIENCE, DriftError, DriftGuard, InvalidError, InvalidGuard


class _Batch:
    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        self.valid = torch.tensor([not e for e in errors])
        self.is_shard = False

    def __len__(self) -> int:
        return len(self.errors)


def test_drift_past_the_dtype_limit_warns_naming_the_tensors_and_max_drift_stops(capsys):
    quiet = {"drift/mean": 5e-5, "drift/max": 1e-3}
    DriftGuard("float32").check(1, quiet, {})
    assert capsys.readouterr().err == "" and "drift/over_limit" not in quiet
    loud = {"drift/mean": 3e-3, "drift/max": 0.2}
    DriftGuard("float32").check(2, loud, {0: [("lm_head.weight", 0.4)]})
    err = capsys.readouterr().err
    assert "step 2: drift/mean=0.003" in err and "above 1e-04, the limit for float32" in err
    assert "engine 0: lm_head.weight" in err and loud["drift/over_limit"] == 1.0
    DriftGuard("bfloat16").check(3, {"drift/mean": 3e-3}, {})  # within bf16's limit
    assert capsys.readouterr().err == ""
    with pytest.raises(DriftError, match="trainer.max_drift=0.001 stops the run"):
        DriftGuard("float32", stop_at=1e-3).check(4, {"drift/mean": 3e-3}, {})


def test_invalid_trajectories_are_counted_a_step_with_none_valid_fails_and_a_run_of_them_stops(capsys):
    guard = InvalidGuard(0.5)
    m: dict = {}
    assert not guard.check(1, _Batch(["", "the reward function failed: ValueError: x", ""]), m)
    assert m["rollout/invalid"] == 1.0 and m["rollout/invalid_reason/reward_function_failed"] == 1.0
    assert "1 of 3 trajectories failed" in capsys.readouterr().err
    m = {}
    assert guard.check(2, _Batch(["engine_error: gone", "engine_error: gone"]), m) and m["step/failed"] == 1.0
    assert "step 2 failed: none of its 2 trajectories is valid (engine_error x2)" in capsys.readouterr().err
    guard.check(3, _Batch(["", ""]), {})  # a good step resets the count of bad steps in a row
    for step in range(4, 4 + INVALID_PATIENCE - 1):
        guard.check(step, _Batch(["tool: x", "tool: x", ""]), {})
    with pytest.raises(InvalidError, match="steps in a row lost more than trainer.max_invalid_fraction=0.5"):
        guard.check(9, _Batch(["tool: x", "tool: x", ""]), {})
    guard.finish()  # not every step failed
    every = InvalidGuard(1.0)
    every.check(1, _Batch(["x: y"]), {})
    with pytest.raises(InvalidError, match="every one of the run's 1 steps failed"):
        every.finish()
