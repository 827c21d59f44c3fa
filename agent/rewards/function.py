"""A reward function of the user's own, named by path (`reward.function: my_reward.py:compute_score`
or `my_pkg.rewards:compute_score`), scoring every finished trajectory in place of the rule scorer.

Two signatures are taken:

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
        verl's: `solution_str` is the decoded response (every response token, tool turns included),
        `ground_truth` the row's `reward_model.ground_truth`, `extra_info` its `extra_info`.
    def score(trajectory) -> float | dict
        the whole trajectory (a parameter named `trajectory`): a dict with the row, the messages,
        the response text, termination, turns, tool calls and the loop's reward parts.

Either may be `async def`. A dict's `score` is the reward and its other numeric keys are logged as
reward parts (`function/<key>`); its `turn_rewards`, a list with a number per model turn (a run of
generated tokens) in order, are rewards of single turns: added to the score and credited to their
turns for the turn-level estimator (`algorithm.advantage=turn_grpo`). The built-in rule scorers
are a function of the same kind, `agent.rewards:compute_score`, to call from your own. The score is the
outcome in place of the rule scorer's (outcome.py; the loop's tool, interaction and shaping terms
stay), so rows whose ground truth is not a number reach it. A plain function runs in a thread of its own, or with `reward.processes`
> 0 in a pool of processes of its own (CPU-heavy scorers then never hold up the agent loops); every
call has a deadline (`reward.timeout_s`). A scorer that raises, hangs past its deadline or returns
something that is not a finite number fails only its trajectory: reward part 0, `function_error`
1, termination "error" (not trained on), the reason in the trajectory's `error`.

With `reward.batch_size` = N > 0 the function takes lists and returns a list, one score per
trajectory in the order given: `fn(data_sources, solution_strs, ground_truths, extra_infos)`, or
`fn(trajectories)` when its first parameter is named `trajectory` or `trajectories` (that name picks
the trajectory form with or without batching). The trajectories one agent worker finishes are
collected: a batch is sent when it holds N or `reward.batch_wait_s` after its first one arrived,
whichever comes first. Each trajectory keeps its own deadline, `reward.timeout_s` from when it was
handed in. A call that raises, runs past the deadline or returns a list of the wrong length fails
every trajectory of its batch; an element that is not a finite number (or a dict without `score`)
fails only its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import math
import multiprocessing
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from agent.rewards.model import RewardModelConfig
from agent.rewards import Outcome
from engines.config_checks import from_mapping


@dataclass
class RewardConfig:
    """The `reward:` section of the run config."""

    function: str | None = None  # "path/to/file.py:name" or "package.module:name"; None: the rule scorers
    timeout_s: float = 60.0  # per trajectory
    processes: int = 0  # > 0: a pool of this many processes per agent worker for a plain (sync) function
    batch_size: int = 0  # > 0: the function takes lists of up to this many trajectories; 0: one per call
    batch_wait_s: float = 0.05  # with batch_size > 0: how long a batch's first trajectory waits for more
    model: RewardModelConfig = field(default_factory=RewardModelConfig)  # a reward model or judge: model.py

    def __post_init__(self) -> None:
        if isinstance(self.model, Mapping):
            self.model = RewardModelConfig.from_mapping(self.model)
        if self.function is not None and self.model.path is not None:
            raise ValueError(f"reward.function={self.function!r} and reward.model.path={self.model.path!r} are both "
                             "set; a run scores with one of them: drop one (a function may call a model itself)")
        if self.function is not None and (not isinstance(self.function, str) or ":" not in self.function):
            raise ValueError(f"reward.function={self.function!r} must name a function as path/to/file.py:name or "
                             "package.module:name")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be > 0")
        if int(self.processes) < 0:
            raise ValueError(f"reward.processes={self.processes} must be >= 0 (0: a thread)")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 0:
            raise ValueError(f"reward.batch_size={self.batch_size!r} must be an integer >= 0 (0: one trajectory "
                             "per call; N: lists of up to N trajectories per call)")
        if isinstance(self.batch_wait_s, bool) or not isinstance(self.batch_wait_s, (int, float)) \
                or not self.batch_wait_s >= 0:
            raise ValueError(f"reward.batch_wait_s={self.batch_wait_s!r} must be a number of seconds >= 0")
        if self.batch_size > 0 and not self.batch_wait_s < self.timeout_s:
            raise ValueError(f"reward.batch_wait_s={self.batch_wait_s} must be below reward.timeout_s={self.timeout_s}"
                             " (a trajectory would time out waiting for its batch); lower it or raise the timeout")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> "RewardConfig":
        return from_mapping(cls, dict(d or {}), "reward")


def load_function(spec: str) -> Callable[..., Any]:
    """The function `spec` names; a ValueError that says what is wrong and what to write instead."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") or "/" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"reward.function={spec!r}: {path} is not a file")
        mod_name = f"switchyard_reward_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(mod_name, path)
            if loader is None or loader.loader is None:
                raise ValueError(f"reward.function={spec!r}: cannot load {path} as Python")
            module = importlib.util.module_from_spec(loader)
            sys.modules[mod_name] = module
            try:
                loader.loader.exec_module(module)
            except Exception as e:
                del sys.modules[mod_name]
                raise ValueError(f"reward.function={spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ValueError(f"reward.function={spec!r}: cannot import {where!r} ({e}); give a module on the "
                             "path or a file path") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward.function={spec!r}: {where} has no function {name!r}")
    return fn


def _first_parameter(fn: Callable[..., Any]) -> str:
    params = list(inspect.signature(fn).parameters)
    return params[0] if params else ""


def _call(spec: str, args: tuple[Any, ...]) -> Any:
    """In a pool process: load the function (once per process) and call it."""
    return load_function(spec)(*args)


def _in_thread(fn: Callable[..., Any], args: tuple[Any, ...]) -> "asyncio.Future[Any]":
    """`fn(*args)` on a daemon thread of its own: one that hangs past its deadline is left behind
    without keeping the process from exiting (a pool's threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            value, error = None, e

        def settle() -> None:
            if not fut.done():
                fut.set_result(value) if error is None else fut.set_exception(error)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is gone: nobody waits for this call any more
            pass

    threading.Thread(target=run, name="reward-fn", daemon=True).start()
    return fut


async def contained(awaitable: Any, who: str) -> Any:
    """Await user code with its BaseExceptions turned into a RuntimeError that names them: a SystemExit
    or KeyboardInterrupt that reached an asyncio task would be re-raised out of the event loop and
    stop the agent worker (every trajectory of the step then waits for its deadline). Cancellation
    passes through."""
    try:
        return await awaitable
    except (asyncio.CancelledError, Exception):
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, GeneratorExit from user code
        raise RuntimeError(f"{who} raised {type(e).__name__}({e!s:.200}); return a value or raise an Exception "
                           "instead") from None


def as_score(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, parts) from what a scorer returned; a ValueError when it is not a finite number."""
    parts: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(f"the reward function returned a dict without 'score' (keys {sorted(value)[:8]})")
        parts = {f"function/{k}": float(v) for k, v in value.items()
                 if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"the reward function returned {value!r:.80}; return a finite number or a dict with 'score'")
    return float(value), parts


def turn_ends(response_mask: Any) -> list[int]:
    """The response position after each model turn (each run of mask-1 tokens), in order."""
    mask = list(response_mask)
    return [i + 1 for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]


def as_turn_rewards(value: Any, out: Any) -> list[list[float]]:
    """[position, reward] pairs from a returned dict's `turn_rewards` (one number per model turn, in
    order; fewer is fine); a ValueError when they do not fit the trajectory."""
    given = value.get("turn_rewards") if isinstance(value, Mapping) else None
    if given is None:
        return []
    if isinstance(given, (str, bytes, Mapping)) or not hasattr(given, "__iter__"):
        raise ValueError(f"turn_rewards is {type(given).__name__}; return a list with one number per model turn")
    values = list(given)
    ends = turn_ends(out.response_mask)
    if len(values) > len(ends):
        raise ValueError(f"turn_rewards has {len(values)} entries but the trajectory has {len(ends)} model turns")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)) for v in values):
        raise ValueError(f"turn_rewards must be finite numbers, got {values!r:.80}")
    return [[end, float(v)] for end, v in zip(ends, values) if v]


def as_batch(value: Any, n: int) -> list[Any]:
    """The list a batch call returned, one element per trajectory; a ValueError when it is not one."""
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__") or not hasattr(value, "__iter__"):
        raise ValueError(f"the reward function returned {type(value).__name__} for a batch of {n}; with "
                         "reward.batch_size > 0 it returns a list with one score per trajectory, in order")
    values = value.tolist() if hasattr(value, "tolist") else list(value)
    if len(values) != n:
        raise ValueError(f"the reward function returned {len(values)} scores for a batch of {n}; return one "
                         "score per trajectory, in the order given")
    return values


class RewardFunction:
    """The run's reward function in one agent worker: `await score(row, out, tokenizer)`."""

    def __init__(self, cfg: RewardConfig) -> None:
        assert cfg.function is not None
        self.cfg, self.spec = cfg, cfg.function
        self.fn = load_function(cfg.function)  # a bad path fails at start-up, not mid-rollout
        first = _first_parameter(self.fn)
        self.trajectory_form = first in ("trajectory", "trajectories")
        if cfg.batch_size == 0 and first in ("trajectories", "data_sources"):
            raise ValueError(f"reward.function={cfg.function!r} takes {first!r}, a list, but reward.batch_size=0 "
                             "calls it once per trajectory; set reward.batch_size=N to call it with lists")
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self.pool: concurrent.futures.Executor | None = None
        if not self.is_async and cfg.processes > 0:
            self.pool = concurrent.futures.ProcessPoolExecutor(cfg.processes, multiprocessing.get_context("spawn"))
        # the batcher (batch_size > 0): (arguments, future, deadline) of the trajectories not yet sent
        self._pending: list[tuple[tuple[Any, ...], asyncio.Future[Any], float]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._batches: set[asyncio.Task[None]] = set()

    def arguments(self, row: Mapping[str, Any], out: Any, tokenizer: Any) -> tuple[Any, ...]:
        text = tokenizer.decode(list(out.response_ids), skip_special_tokens=True)
        if self.trajectory_form:
            return ({"row": dict(row), "messages": list(out.messages), "response_text": text,
                     "termination": out.termination, "num_turns": out.num_turns, "turns": list(out.turns),
                     "tool_calls": sum(int(t.get("tool_calls", 0)) for t in out.turns if isinstance(t, dict)),
                     "reward_parts": dict(out.reward_extra)},)
        rm = row.get("reward_model") if isinstance(row.get("reward_model"), Mapping) else {}
        return (row.get("data_source"), text, rm.get("ground_truth"), dict(row.get("extra_info") or {}))

    def _invoke(self, args: tuple[Any, ...]) -> Any:
        """An awaitable of `fn(*args)`: the coroutine, or the call in the pool or a thread; whatever
        it raises reaches the caller as an Exception (`contained`)."""
        if self.is_async:
            return contained(self.fn(*args), "the reward function")
        if self.pool is not None:
            return contained(asyncio.get_running_loop().run_in_executor(self.pool, _call, self.spec, args),
                             "the reward function")
        return contained(_in_thread(self.fn, args), "the reward function")

    def _submit(self, args: tuple[Any, ...]) -> "asyncio.Future[Any]":
        """A future of this trajectory's element of the batch it joins."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((args, fut, loop.time() + self.cfg.timeout_s))
        if len(self._pending) >= self.cfg.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.cfg.batch_wait_s, self._flush)
        return fut

    def _flush(self) -> None:
        """Send the pending trajectories (less those whose callers gave up) as one batch."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        items = [it for it in self._pending if not it[1].done()]
        self._pending = []
        if items:
            task = asyncio.get_running_loop().create_task(self._run_batch(items))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _run_batch(self, items: list[tuple[tuple[Any, ...], "asyncio.Future[Any]", float]]) -> None:
        futures = [fut for _, fut, _ in items]
        columns = tuple(list(col) for col in zip(*(args for args, _, _ in items)))  # one list per parameter
        try:
            left = max(deadline for _, _, deadline in items) - asyncio.get_running_loop().time()
            values = as_batch(await asyncio.wait_for(self._invoke(columns), max(left, 0.0)), len(items))
        except asyncio.CancelledError:
            error: BaseException = RuntimeError("the reward function's batch was cancelled (the worker closed)")
            for fut in futures:
                if not fut.done():
                    fut.set_exception(error)
            raise
        except Exception as e:  # noqa: BLE001 - every trajectory of the batch gets it
            for fut in futures:
                if not fut.done():
                    fut.set_exception(e)
            return
        for fut, value in zip(futures, values):
            if not fut.done():
                fut.set_result(value)

    async def score(self, row: Mapping[str, Any], out: Any, tokenizer: Any) -> Outcome:
        """The function's outcome for `out` (outcome.py adds it to the loop's parts)."""
        try:
            args = self.arguments(row, out, tokenizer)
            call = self._submit(args) if self.cfg.batch_size > 0 else self._invoke(args)
            value = await asyncio.wait_for(call, self.cfg.timeout_s)
            score, parts = as_score(value)
            per_turn = as_turn_rewards(value, out)
        except asyncio.TimeoutError:
            return Outcome(error=f"the reward function took longer than reward.timeout_s={self.cfg.timeout_s}")
        except Exception as e:  # noqa: BLE001 - a scorer's failure is its trajectory's, never the step's
            return Outcome(error=f"the reward function failed: {type(e).__name__}: {e}")
        if per_turn:  # rewards of single turns: added to the total and credited to their turns (turn_grpo)
            parts["function/turn_rewards"] = sum(r for _, r in per_turn)
            score += parts["function/turn_rewards"]
        return Outcome(score, parts, turn_rewards=per_turn)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self._batches):
            try:
                task.cancel()
            except RuntimeError:  # its loop is closed: nothing waits for it
                pass
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
