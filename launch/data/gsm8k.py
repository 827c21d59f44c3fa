"""GSM8K as tool_agent rows with the calculator.

GSM8K ships as jsonl records `{"question": ..., "answer": "...<<16-3-4=9>>9 ... #### 18"}`. Each
becomes a verl-format row whose system prompt teaches the hermes calculator call and the
`#### <answer>` ending the rule reward scores strictly. The solution is kept in
`extra_info.solution`, so SFT traces can be built from its `<<expr=value>>` annotations.

    python -m launch.data.gsm8k --input test.jsonl --output gsm8k_test.parquet
    python -m launch.data.gsm8k --input openai/gsm8k --split train --output train.jsonl   # needs `datasets` + hub
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from launch.data.rows import load_rows, save_rows, tool_row

HUB_ID = "openai/gsm8k"
DATA_SOURCE = "openai/gsm8k"
SPLITS = ("train", "test")

CALCULATOR_PROMPT = (
    "You are a math assistant with a calculator. To compute, reply with only a tool call:\n"
    "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12 + 3 * 4\"}}\n</tool_call>\n"
    "The result comes back in a tool message. Then answer in one sentence and end with the final "
    "number as \"#### <answer>\".")
SUBMIT_PROMPT = ("\nYou may also submit the final number with <tool_call>\n{\"name\": \"calc_gsm8k_reward\", "
                 "\"arguments\": {\"answer\": \"72\"}}\n</tool_call>")


def system_prompt(tools: Sequence[str] = ("calculator",)) -> str:
    """The system prompt for rows offering `tools`. Small chat templates (SmolLM2's) do not render
    tool schemas at all, so the prompt itself must show the exact call format."""
    unknown = set(tools) - {"calculator", "calc_gsm8k_reward"}
    if unknown:
        raise ValueError(f"no prompt for tools {sorted(unknown)}; GSM8K rows offer 'calculator' and optionally "
                         "'calc_gsm8k_reward'")
    return CALCULATOR_PROMPT + (SUBMIT_PROMPT if "calc_gsm8k_reward" in tools else "")


_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)


def ground_truth_of(answer: str) -> str:
    """The number after GSM8K's `####`, commas removed ("1,234" -> "1234")."""
    m = _FINAL.search(str(answer))
    if not m:
        raise ValueError(f"GSM8K answer has no '#### <number>' ending: {str(answer)[-80:]!r}; is this GSM8K data?")
    return m.group(1).replace(",", "").replace("$", "").strip()


def read_gsm8k(source: str, split: str = "test") -> list[dict[str, Any]]:
    """GSM8K records from a local file (.jsonl/.json/.parquet with question/answer columns), or
    from the hub when `source` is "openai/gsm8k", `datasets` is installed and the hub reachable."""
    path = Path(source).expanduser()
    if path.is_file():
        return load_rows(str(path))
    if source != HUB_ID:
        raise FileNotFoundError(f"GSM8K source {source!r} is not a file; pass a local GSM8K jsonl (lines of "
                                f"{{question, answer}}) or {HUB_ID!r} to download it with `datasets`")
    if split not in SPLITS:
        raise ValueError(f"GSM8K split {split!r}; allowed: {list(SPLITS)}")
    try:
        import datasets
    except ImportError:
        raise ImportError(f"loading {HUB_ID!r} from the hub needs the `datasets` package, which is not installed; "
                          "pass a local GSM8K jsonl path instead (or `pip install datasets`)") from None
    try:
        ds = datasets.load_dataset(HUB_ID, "main", split=split)
    except Exception as e:  # offline (HF_HUB_OFFLINE=1), no network, hub error
        raise RuntimeError(f"could not load {HUB_ID!r} split {split!r} from the hub ({type(e).__name__}: {e}); "
                           "pass a local GSM8K jsonl path instead") from e
    return [{"question": r["question"], "answer": r["answer"]} for r in ds]


def gsm8k_rows(records: Sequence[Mapping[str, Any]], split: str, tools: Sequence[str] = ("calculator",),
               interaction: str | None = None, data_source: str = DATA_SOURCE) -> list[dict[str, Any]]:
    """tool_agent rows for GSM8K records: ground truth from the `####` line, the full solution
    in extra_info, `interaction_kwargs` only when an interaction name is given."""
    system = system_prompt(tools)
    rows = []
    for i, r in enumerate(records):
        if not isinstance(r.get("question"), str) or not isinstance(r.get("answer"), str):
            raise ValueError(f"GSM8K record {i} needs string 'question' and 'answer' fields, got keys {sorted(r)}")
        try:
            gt = ground_truth_of(r["answer"])
        except ValueError as e:
            raise ValueError(f"GSM8K record {i}: {e}") from None
        rows.append(tool_row(data_source, system, r["question"], gt,
                             {"split": split, "index": i, "solution": r["answer"]}, tools, interaction))
    return rows


def _infer_split(source: str) -> str:
    stem = Path(source).stem.lower()
    return next((s for s in SPLITS if s in stem), "train")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m launch.data.gsm8k", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, help=f"a GSM8K .jsonl/.parquet file, or {HUB_ID} (needs `datasets`)")
    ap.add_argument("--output", required=True, help="rows file: .jsonl, .json or .parquet")
    ap.add_argument("--split", default=None, help="train|test (default: from the input file name, else train)")
    ap.add_argument("--limit", type=int, default=None, help="keep only the first N records")
    ap.add_argument("--tools", default="calculator", help="comma-separated: calculator[,calc_gsm8k_reward]")
    ap.add_argument("--interaction", default=None, help="interaction name for interaction_kwargs (e.g. gsm8k)")
    args = ap.parse_args(argv)
    split = args.split or _infer_split(args.input)
    try:
        records = read_gsm8k(args.input, split)[:args.limit]
        rows = gsm8k_rows(records, split, [t.strip() for t in args.tools.split(",") if t.strip()], args.interaction)
        out = save_rows(rows, args.output)
    except (OSError, ImportError, RuntimeError, ValueError) as e:
        ap.error(str(e))
    print(json.dumps({"rows": len(rows), "split": split, "output": str(out)}))


if __name__ == "__main__":
    main()
