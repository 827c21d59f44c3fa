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
    from launch.data.rows import validate_rows

    if data.task == "arithmetic":
        from launch.data.arithmetic import ArithmeticConfig, arithmetic_rows

        acfg = ArithmeticConfig(max_value=data.max_operand, min_ops=data.num_ops, max_ops=data.num_ops)
        rows = arithmetic_rows(4096, "train", data.seed, acfg)
    else:
        rows = rows_from_source(str(data.train_path), "train")
    for r in rows:  # generated rows take data.agent_name; a rows file's own agent_name wins
        if data.task == "rows":
            r.setdefault("agent_name", data.agent_name)
        else:
            r["agent_name"] = data.agent_name
    validate_rows(rows, list(agent_names), set(tools), set(interactions))
    return rows


__all__ = ["rows_from_source", "training_rows"]
