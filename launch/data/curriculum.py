"""Curriculum: which rows a step trains on, easy first, by a schedule or by recent pass rates.

A `CurriculumStream` replaces the shuffled `RowStream` when `data.curriculum.mode` is not `off`.
Rows are ranked by a difficulty (`data.curriculum.difficulty`):

- `field:<key.path>`: a number in the row (`field:extra_info.difficulty`);
- `solution_steps`: the number of `<<expr=value>>` steps in `extra_info.solution` or `.answer`
  (GSM8K's calculator annotations; the arithmetic task writes them too);
- `solution_length`: the characters of that solution;
- a dotted path to your own `f(row) -> float`.

Modes:

- `stages`: the pool is the easiest `stages[i]` fraction of the rows during stage i, each stage
  lasting `stage_steps` steps (`stages: [0.3, 0.6, 1.0]`);
- `linear`: the pool grows from the easiest `start_fraction` to all rows over `ramp_steps` steps;
- `adaptive`: every row is in the pool until its recent pass rate (reward >= `pass_reward` over the
  last `window` samples, once it has that many) is 1 or 0, then it leaves: a prompt the policy always
  or never solves teaches GRPO nothing.

Within the pool the least-visited rows go first, ties in a seeded order, so every row of a stage is
seen before any repeats. Everything that decides the next row (steps taken, visits, pass history)
is in `state_dict()`, so a resumed run continues the schedule exactly where it was.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

MODES = ("off", "stages", "linear", "adaptive")
BUILTIN_SCORERS = ("solution_steps", "solution_length")


@dataclass
class CurriculumConfig:
    mode: str = "off"
    difficulty: str = "solution_steps"
    stages: list[float] = field(default_factory=lambda: [0.34, 0.67, 1.0])
    stage_steps: int = 10
    start_fraction: float = 0.25
    ramp_steps: int = 20
    window: int = 8
    pass_reward: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"data.curriculum.mode={self.mode!r} is not allowed; choose one of {list(MODES)}")
        fr = [float(x) for x in self.stages]
        if not fr or any(not 0 < x <= 1 for x in fr) or fr != sorted(fr) or fr[-1] != 1.0:
            raise ValueError(f"data.curriculum.stages={self.stages!r} must rise within (0, 1] and end at 1.0 "
                             "(fractions of the rows, easiest first)")
        self.stages = fr
        for name in ("stage_steps", "ramp_steps", "window"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"data.curriculum.{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.start_fraction <= 1:
            raise ValueError(f"data.curriculum.start_fraction={self.start_fraction} must be in (0, 1]")
        if self.mode != "off":
            scorer(self.difficulty)  # a bad scorer fails at start-up


def _solution(row: Mapping[str, Any]) -> str:
    extra = row.get("extra_info") or {}
    return str(extra.get("solution") or extra.get("answer") or "")


def _field(path: str) -> Callable[[Mapping[str, Any]], float]:
    def get(row: Mapping[str, Any]) -> float:
        value: Any = row
        for part in path.split("."):
            if not isinstance(value, Mapping) or part not in value:
                raise ValueError(f"row has no {path!r} for the curriculum's difficulty (missing {part!r}); add "
                                 "the field to every row or choose another data.curriculum.difficulty")
            value = value[part]
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"row's {path!r} is {value!r}, not a number") from None
    return get


def scorer(spec: str) -> Callable[[Mapping[str, Any]], float]:
    """The difficulty function `spec` names (see the module docstring)."""
    if spec.startswith("field:"):
        return _field(spec[len("field:"):])
    if spec == "solution_steps":
        return lambda row: float(len(re.findall(r"<<[^<>]*>>", _solution(row))))
    if spec == "solution_length":
        return lambda row: float(len(_solution(row)))
    if "." in spec:
        from agent.dotted import import_dotted

        fn = import_dotted(spec, "data.curriculum.difficulty")
        if not callable(fn):
            raise ValueError(f"data.curriculum.difficulty {spec!r} is not callable; give a function row -> float")
        return fn
    raise ValueError(f"data.curriculum.difficulty={spec!r} is not known; use field:<key.path>, "
                     f"{' or '.join(BUILTIN_SCORERS)}, or a dotted path to a function row -> float")


class CurriculumStream:
    """RowStream's interface (`next_batch`, `position`, `state_dict`) with a curriculum's order;
    `record(row, rewards)` feeds the adaptive mode each group's rewards."""

    def __init__(self, rows: Sequence[dict[str, Any]], cfg: CurriculumConfig, seed: int = 0) -> None:
        if not rows:
            raise ValueError("the curriculum needs at least one row; the dataset is empty")
        self.rows, self.cfg, self.seed = list(rows), cfg, int(seed)
        score = scorer(cfg.difficulty)
        self.difficulty = [score(r) for r in self.rows]
        tiebreak = list(range(len(self.rows)))
        random.Random(self.seed).shuffle(tiebreak)
        rank = {i: k for k, i in enumerate(tiebreak)}
        self.ranked = sorted(range(len(self.rows)), key=lambda i: (self.difficulty[i], rank[i]))  # easiest first
        self._tiebreak = rank
        self._index = {id(r): i for i, r in enumerate(self.rows)}
        self.steps = 0
        self.visits = [0] * len(self.rows)
        self.history: dict[int, list[float]] = {}
        self.retired: set[int] = set()
        self.last_pool = 0  # the size of the pool the last batch came from

    # ------------------------------------------------------------------ the schedule
    def fraction(self, step: int) -> float:
        c = self.cfg
        if c.mode == "stages":
            return c.stages[min(step // c.stage_steps, len(c.stages) - 1)]
        if c.mode == "linear":
            return min(1.0, c.start_fraction + (1.0 - c.start_fraction) * step / c.ramp_steps)
        return 1.0

    def pool(self) -> list[int]:
        """The row indices open at the current step, easiest first."""
        n = max(1, math.ceil(self.fraction(self.steps) * len(self.rows)))
        open_ = [i for i in self.ranked[:n] if i not in self.retired]
        if not open_:  # adaptive retired everything: start over rather than stall
            self.retired.clear()
            open_ = self.ranked[:n]
        return open_

    def next_batch(self, k: int) -> list[dict[str, Any]]:
        if int(k) < 1:
            raise ValueError(f"next_batch(k={k}): k must be >= 1")
        pool = self.pool()
        self.last_pool = len(pool)
        out: list[int] = []
        for _ in range(int(k)):
            i = min(pool, key=lambda j: (self.visits[j], self._tiebreak[j]))
            self.visits[i] += 1
            out.append(i)
        self.steps += 1
        return [self.rows[i] for i in out]

    def record(self, row: Mapping[str, Any], rewards: Sequence[float]) -> None:
        """Adaptive mode: a row's group rewards; it retires once its last `window` samples all
        passed or all failed."""
        i = self._index.get(id(row))
        if i is None or self.cfg.mode != "adaptive":
            return
        h = (self.history.get(i, []) + [1.0 if r >= self.cfg.pass_reward else 0.0 for r in rewards])[-self.cfg.window:]
        self.history[i] = h
        if len(h) >= self.cfg.window and sum(h) in (0.0, float(len(h))):
            self.retired.add(i)

    # ------------------------------------------------------------------ what a checkpoint keeps
    @property
    def position(self) -> tuple[int, int]:
        return 0, self.steps

    def stats(self, batch: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        d = [self.difficulty[self._index[id(r)]] for r in batch if id(r) in self._index]
        return {"data/difficulty_mean": sum(d) / max(1, len(d)), "data/difficulty_max": max(d, default=0.0),
                "data/pool": float(self.last_pool), "data/retired": float(len(self.retired))}

    def state_dict(self) -> dict[str, Any]:
        return {"curriculum": self.cfg.mode, "steps": self.steps, "visits": list(self.visits),
                "history": {str(i): h for i, h in self.history.items()}, "retired": sorted(self.retired),
                "seed": self.seed, "num_rows": len(self.rows)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, mine in (("num_rows", len(self.rows)), ("seed", self.seed), ("curriculum", self.cfg.mode)):
            if state.get(key) != mine:
                raise ValueError(f"data position was saved with {key}={state.get(key)!r} but this run has {key}={mine!r}; "
                                 "resume with the same dataset, data seed and curriculum, or start over (trainer.resume=fresh)")
        self.steps = int(state["steps"])
        self.visits = [int(v) for v in state["visits"]]
        self.history = {int(i): [float(x) for x in h] for i, h in state["history"].items()}
        self.retired = {int(i) for i in state["retired"]}
