"""Validation: what the policy does on held-out rows, during training and for a saved model.

Held-out rows (`data.val_path`) run through the run's own agent loops, tools, interactions, reward
and engines (the AgentLoopManager that makes the training batches) with the `val` section's
sampling: greedy and one sample by default. Their trajectories come back to the caller, never to a
training batch, also while asynchronous rollout runs on beside them. Metrics, per data source and
over all rows (`val/...` without a source):

    val/<source>/accuracy            samples whose reward >= val.pass_threshold
    val/<source>/reward_mean         mean reward (mean@n)
    val/<source>/pass@k              n > 1: rows with a passing sample among k of the n (unbiased estimate)
    val/<source>/tool_calls_per_trajectory, tool_success (successful calls / calls), num_turns_mean,
    val/<source>/response_length_mean (tokens), termination/<reason> (fraction of samples)

Every sample is written to `output_dir/val/<name>.jsonl` (row number and id, the conversation,
the reply as decoded, reward and its parts, termination, tool calls), so the failures can be read.
`launch/train.py` validates at step 0 and every `trainer.val_every` steps; `launch/evaluate.py`
runs the same on a saved model.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

ALL = ""  # the metrics over every row: val/accuracy, not val/<source>/accuracy


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of `k` samples, drawn without replacement from `n` of which `c`
    pass, passes: 1 - C(n-c, k) / C(n, k) (the unbiased estimator of pass@k from n >= k samples)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """The k of pass@k reported for n samples: 1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def _tool_turns(o: Any) -> list[Mapping[str, Any]]:
    return [t for t in o.turns if t.get("kind") == "tools"]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: Sequence[Mapping[str, Any]], outputs: Sequence[Any], n: int, threshold: float
              ) -> dict[str, float]:
    """`val/...` metrics of `outputs` (row i's n samples at i*n .. i*n+n-1), overall and per data source."""
    if len(outputs) != len(rows) * n:
        raise ValueError(f"{len(outputs)} validation samples for {len(rows)} rows x n={n}")
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        by_source[str(row.get("data_source") or "unknown")].append(i)
    out: dict[str, float] = {}
    for source, idx in [(ALL, list(range(len(rows)))), *sorted(by_source.items())]:
        prefix = "val/" + (f"{source}/" if source else "")
        out.update({prefix + k: v for k, v in _group([outputs[i * n:(i + 1) * n] for i in idx], threshold).items()})
    return out


def _group(samples_by_row: Sequence[Sequence[Any]], threshold: float) -> dict[str, float]:
    """The numbers of some rows' samples (every row with the same n)."""
    samples = [o for row in samples_by_row for o in row]
    n = len(samples_by_row[0])
    passed = [float(o.reward) >= threshold for o in samples]
    calls = [sum(int(t.get("calls", 0)) for t in _tool_turns(o)) for o in samples]
    failed = sum(int(t.get("failed", 0)) for o in samples for t in _tool_turns(o))
    m = {"rows": float(len(samples_by_row)), "accuracy": _mean([float(x) for x in passed]),
         "reward_mean": _mean([float(o.reward) for o in samples]),
         "tool_calls_per_trajectory": _mean([float(c) for c in calls]),
         "num_turns_mean": _mean([float(o.num_turns) for o in samples]),
         "response_length_mean": _mean([float(len(o.response_ids)) for o in samples])}
    if sum(calls):
        m["tool_success"] = 1.0 - failed / sum(calls)
    for reason in sorted({o.termination for o in samples}):
        m[f"termination/{reason}"] = sum(o.termination == reason for o in samples) / len(samples)
    if n > 1:
        counts = [sum(passed[r * n:(r + 1) * n]) for r in range(len(samples_by_row))]
        m[f"mean@{n}"] = m["reward_mean"]
        for k in ks_for(n):
            m[f"pass@{k}"] = _mean([pass_at_k(n, c, k) for c in counts])
    return m


def records(rows: Sequence[Mapping[str, Any]], outputs: Sequence[Any], n: int, threshold: float,
            decode: Any = None) -> list[dict[str, Any]]:
    """One JSON-able record per sample: what a user reads to see why a sample failed."""
    from launch.data.rows import row_uid

    out = []
    for i, row in enumerate(rows):
        rm = row.get("reward_model") if isinstance(row.get("reward_model"), Mapping) else {}
        for j in range(n):
            o = outputs[i * n + j]
            tools = _tool_turns(o)
            out.append({
                "row": i, "row_uid": row.get("uid") or row_uid(row), "sample": j, "data_source": row.get("data_source"),
                "ground_truth": rm.get("ground_truth"), "reward": float(o.reward),
                "passed": float(o.reward) >= threshold, "reward_parts": dict(o.reward_extra),
                "termination": o.termination, "error": o.error or None, "num_turns": o.num_turns,
                "tool_calls": sum(int(t.get("calls", 0)) for t in tools),
                "tool_failures": sum(int(t.get("failed", 0)) for t in tools),
                "tool_parse_errors": sum(int(t.get("parse_errors", 0)) for t in tools),
                "response_tokens": len(o.response_ids), "weight_versions": list(o.weight_versions),
                "messages": o.messages,
                "response": decode(o.response_ids) if decode is not None else None})
    return out


class Validator:
    """Rank 0's validation: the held-out rows, their sampling and where the records go."""

    def __init__(self, rows: Sequence[dict[str, Any]], cfg: Any, max_tokens: int, output_dir: Path | None,
                 tokenizer: Any = None) -> None:
        self.rows, self.cfg, self.output_dir = list(rows), cfg, output_dir
        self.sampling = {"temperature": float(cfg.temperature), "top_p": float(cfg.top_p), "max_tokens": int(max_tokens)}
        self.tokenizer = tokenizer

    def due(self, step: int, last_step: int, every: int) -> bool:
        """Whether `step` is validated: every `every` steps (0: none between) and the last one."""
        return step == last_step or (every > 0 and step % every == 0)

    def run(self, plane: Any, name: str, version: int) -> dict[str, Any]:
        """Validate on `plane`'s engines and workers with weights no older than `version`; the
        metrics, with the weight versions the samples ran on and the time it took."""
        t0 = time.perf_counter()
        outputs = plane.validate(self.rows, self.sampling, int(self.cfg.n), version, float(self.cfg.timeout_s))
        seconds = time.perf_counter() - t0
        m: dict[str, Any] = summarize(self.rows, outputs, int(self.cfg.n), float(self.cfg.pass_threshold))
        versions = [v for o in outputs for v in o.weight_versions]
        m.update({"val/weight_version": float(version), "val/time_s": seconds, "val/samples": float(len(outputs))})
        if versions:
            m.update({"val/weight_version_min": float(min(versions)), "val/weight_version_max": float(max(versions))})
        if self.cfg.records and self.output_dir is not None:
            decode = None
            if self.tokenizer is not None:
                decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
            write_records(self.output_dir / "val" / f"{name}.jsonl",
                          records(self.rows, outputs, int(self.cfg.n), float(self.cfg.pass_threshold), decode))
        return m


def validator_for(cfg: Any, run: Any) -> Validator:
    """Rank 0 of a training run with held-out rows: its Validator."""
    from engines.models import load_tokenizer

    return Validator(run.val_rows, cfg.val, cfg.rollout.max_tokens, Path(cfg.trainer.output_dir),
                     load_tokenizer(run.model_dir))


def validate_step(validator: Any, plane: Any, step: int, version: int) -> dict[str, Any]:
    """Rank 0: validate the weights of `version` after `step` steps; its records go to val/step_N.jsonl."""
    metrics = validator.run(plane, f"step_{step}", version)
    print(describe(metrics, f"validation after step {step}"), flush=True)
    return metrics


def validate_before_training(validator: Any, logger: Any, plane: Any, cfg: Any, start: int) -> None:
    """Rank 0 of a fresh run with `trainer.val_before_train`: the base weights validated and logged as
    step 0, once (not again after a kill during step 1)."""
    from launch.metrics import VAL_KEY

    if validator is not None and cfg.trainer.val_before_train and start == 0 and not logger.logged(0, VAL_KEY):
        logger.log(0, validate_step(validator, plane, 0, plane.version), console=(VAL_KEY,))


def write_records(path: Path, recs: Sequence[Mapping[str, Any]]) -> Path:
    """Write the records whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def describe(m: Mapping[str, Any], label: str) -> str:
    """One console line: overall accuracy and reward, pass@k, each source's accuracy, the time."""
    sources = sorted(k[len("val/"):-len("/accuracy")] for k in m
                     if k.startswith("val/") and k.endswith("/accuracy") and k != "val/accuracy")
    parts = [f"{label}: accuracy={m['val/accuracy']:.4g} reward_mean={m['val/reward_mean']:.4g} on "
             f"{int(m['val/rows'])} held-out rows x {int(m['val/samples'] // max(1, m['val/rows']))} sample(s)"]
    parts += [f"{k[len('val/'):]}={m[k]:.4g}" for k in sorted(m) if k.startswith("val/pass@")]
    if len(sources) > 1:
        parts += [f"{s}={m[f'val/{s}/accuracy']:.4g}" for s in sources]
    parts.append(f"tool_calls={m['val/tool_calls_per_trajectory']:.3g} weights v{int(m['val/weight_version'])} "
                 f"({m['val/time_s']:.1f} s)")
    return " ".join(parts)


def table(m: Mapping[str, Any]) -> str:
    """The metrics as a table: one line per data source and one for all rows, with rows, accuracy,
    reward, pass@k (when n > 1), mean turns and tool calls per trajectory."""
    sources = sorted(k[len("val/"):-len("/rows")] for k in m if k.startswith("val/") and k.endswith("/rows")
                     and k != "val/rows")
    passes = sorted({k.rsplit("/", 1)[-1] for k in m if k.startswith("val/") and "/pass@" in f"/{k.split('/', 1)[1]}"},
                    key=lambda k: int(k.split("@")[1]))
    cols = ["rows", "accuracy", "reward_mean", *passes, "num_turns_mean", "tool_calls_per_trajectory"]
    heads = ["data source", "rows", "accuracy", "reward", *passes, "turns", "tool calls"]
    lines = []
    for name, prefix in [*((s, f"val/{s}/") for s in sources), ("all", "val/")]:
        cells = [name]
        for c in cols:
            v = m.get(prefix + c)
            cells.append("-" if v is None else str(int(v)) if c == "rows" else f"{v:.3f}")
        lines.append(cells)
    widths = [max(len(str(r[i])) for r in [heads, *lines]) for i in range(len(heads))]
    fmt = lambda r: "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(heads), fmt(["-" * w for w in widths]), *map(fmt, lines)])
