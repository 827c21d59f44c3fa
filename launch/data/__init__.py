"""Training data: verl-format rows (rows.py), the GSM8K converter (gsm8k.py), the built-in
arithmetic task (arithmetic.py) and the tool-call SFT traces for the warm-up (sft.py).

`rows_from_source` is what a config's data source string means, so the trainer has one call:
"arithmetic" (generated), "openai/gsm8k" (hub, needs `datasets`), or a file of verl rows or of
raw GSM8K records. Submodules are imported inside it, not here, so `python -m launch.data.gsm8k`
runs its module once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from launch.data.arithmetic import ArithmeticConfig


def rows_from_source(source: str, split: str = "train", n: int | None = None, seed: int = 0,
                     tools: Sequence[str] = ("calculator",), arithmetic: "ArithmeticConfig | None" = None
                     ) -> list[dict[str, Any]]:
    """Rows for a data source: "arithmetic" makes `n` (default 1000) problems of `split`;
    "openai/gsm8k" or a file of raw GSM8K records (question/answer) is converted; any other file
    is loaded as verl rows, unchanged. `n` caps the number of rows of files too."""
    from launch.data.arithmetic import ArithmeticConfig, arithmetic_rows
    from launch.data.gsm8k import HUB_ID, gsm8k_rows, read_gsm8k
    from launch.data.rows import load_rows

    if source == "arithmetic":
        return arithmetic_rows(1000 if n is None else n, split, seed, arithmetic or ArithmeticConfig(), tools)
    records = read_gsm8k(source, split) if source == HUB_ID else load_rows(source)
    if records and "prompt" not in records[0] and {"question", "answer"} <= set(records[0]):
        records = gsm8k_rows(records, split, tools)
    return records if n is None else records[:n]


def training_rows(data: Any, agent_names: Sequence[str], tools: Sequence[str], interactions: Sequence[str]
                  ) -> list[dict[str, Any]]:
    """The rows a run trains on, for the `data:` config section, each checked against the loops,
    tools and interactions the run has (a bad row fails here, before any model loads)."""
    source = _source(data, "train")
    rows = rows_from_source(source, "train", 4096 if source == "arithmetic" else None, data.seed,
                            arithmetic=_arithmetic_config(data))
    return _checked(rows, data, agent_names, tools, interactions)


def validation_rows(data: Any, max_rows: int | None, agent_names: Sequence[str], tools: Sequence[str],
                    interactions: Sequence[str]) -> list[dict[str, Any]]:
    """The held-out rows of `data.val_path` (at most `max_rows`): "test" is the task's own test
    split (arithmetic: `max_rows` or 200 problems with the training knobs, disjoint from training
    by expression; gsm8k: the hub's test split), anything else a file as `rows_from_source` reads
    it. Checked like the training rows."""
    source = _source(data, "test")
    rows = rows_from_source(source, "test", (max_rows or 200) if source == "arithmetic" else max_rows, data.seed,
                            arithmetic=_arithmetic_config(data))
    if not rows:
        raise ValueError(f"data.val_path={data.val_path!r} holds no rows")
    return _checked(rows, data, agent_names, tools, interactions)


def _source(data: Any, split: str) -> str:
    """What `rows_from_source` reads for `split` of the `data:` section: the task's own rows (the
    arithmetic generator or `train_path`; for validation when `val_path` is "test"), or `val_path`."""
    if split == "train" or data.val_path == "test":
        return "arithmetic" if data.task == "arithmetic" else str(data.train_path)
    return str(data.val_path)


def _arithmetic_config(data: Any) -> "ArithmeticConfig":
    from launch.data.arithmetic import ArithmeticConfig

    return ArithmeticConfig(max_value=data.max_operand, min_ops=data.num_ops, max_ops=data.num_ops)


def _checked(rows: list[dict[str, Any]], data: Any, agent_names: Sequence[str], tools: Sequence[str],
             interactions: Sequence[str]) -> list[dict[str, Any]]:
    from launch.data.rows import row_uid, validate_rows

    for r in rows:  # generated rows take data.agent_name; a rows file's own agent_name wins
        r.setdefault("uid", row_uid(r))  # the row's id in metrics and validation records
        if data.task == "rows":
            r.setdefault("agent_name", data.agent_name)
        else:
            r["agent_name"] = data.agent_name
    validate_rows(rows, list(agent_names), set(tools), set(interactions))
    return rows


__all__ = ["rows_from_source", "training_rows", "validation_rows"]
