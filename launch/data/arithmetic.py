"""A procedural arithmetic word-problem task: the CPU demo's default data, no download needed.

    "Mia has 23 stickers. She buys 17 more. Then she gives 9 away. How many stickers does she have now?"
    expression "23 + 17 - 9", ground truth "31"

Every number of the expression appears in the text in order and each step's wording names its
operation ("more" adds, "away" subtracts, "packs of" multiplies), so a 135M model can learn to
copy the expression into a calculator call: the task teaches tool use, not arithmetic. Rows have
the same format as GSM8K's (launch/data/gsm8k.py) with data_source "arithmetic", scored by the
last number in the reply.

Problems are a pure function of (seed, split, knobs). Train and test are disjoint by expression:
a hash of the expression decides its split, so no test expression is ever trained on, whatever
the sizes asked for.

    python -m launch.data.arithmetic --n 2000 --split train --output arithmetic_train.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from launch.data.gsm8k import system_prompt
from launch.data.rows import save_rows, tool_row

DATA_SOURCE = "arithmetic"
SPLITS = ("train", "test")

_PEOPLE = [("Mia", "she"), ("Liam", "he"), ("Ava", "she"), ("Noah", "he"), ("Zoe", "she"), ("Omar", "he"),
           ("Lena", "she"), ("Ravi", "he"), ("Sara", "she"), ("Tom", "he"), ("Nina", "she"), ("Ben", "he")]
_ITEMS = ["stickers", "marbles", "apples", "coins", "books", "pencils", "cards", "shells", "cookies", "beads"]
_ADD = ["{p} buys {x} more.", "{p} finds {x} more.", "{p} gets {x} more from a friend.", "{p} wins {x} more."]
_SUB = ["{p} gives {x} away.", "{p} loses {x} of them.", "{p} gives {x} of them away.", "{p} uses {x} of them."]
_ADD_PACKS = ["{p} buys {k} packs of {m} {item}.", "{p} gets {k} boxes of {m} {item}."]
_SUB_PACKS = ["{p} gives away {k} bags of {m} {item}.", "{p} sells {k} boxes of {m} {item}."]


@dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs. Operands are drawn from [min_value, max_value]; a problem has between
    min_ops and max_ops operators; with probability `packs_prob` a step is "k packs of m"
    (two operators, + or - k * m with k in [2, max_factor])."""

    min_value: int = 2
    max_value: int = 30
    min_ops: int = 2
    max_ops: int = 3
    packs_prob: float = 0.3
    max_factor: int = 5
    test_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not 0 <= self.min_value <= self.max_value:
            raise ValueError(f"arithmetic: need 0 <= min_value <= max_value, got {self.min_value}..{self.max_value}")
        if not 1 <= self.min_ops <= self.max_ops:
            raise ValueError(f"arithmetic: need 1 <= min_ops <= max_ops, got {self.min_ops}..{self.max_ops}")
        if not 0.0 <= self.packs_prob <= 1.0 or self.max_factor < 2:
            raise ValueError(f"arithmetic: packs_prob={self.packs_prob} must be in [0, 1] and max_factor="
                             f"{self.max_factor} >= 2")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"arithmetic: test_fraction={self.test_fraction} must be in (0, 1)")


@dataclass(frozen=True)
class Problem:
    text: str
    expression: str
    answer: int


def make_problem(rng: random.Random, cfg: ArithmeticConfig = ArithmeticConfig()) -> Problem:
    """One problem: a starting amount, then steps that each add or subtract (possibly k packs of
    m), never letting the amount go negative, so every sentence stays a sensible story."""
    name, pron = rng.choice(_PEOPLE)
    item = rng.choice(_ITEMS)
    total = rng.randint(max(cfg.min_value, 1), cfg.max_value)
    sentences, expr = [f"{name} has {total} {item}."], [str(total)]
    ops_left = rng.randint(cfg.min_ops, cfg.max_ops)
    while ops_left:
        subject = pron.capitalize() if len(sentences) == 1 else f"Then {pron}"
        packs = ops_left >= 2 and rng.random() < cfg.packs_prob
        if packs:
            k, m = rng.randint(2, cfg.max_factor), rng.randint(cfg.min_value, cfg.max_value)
            sub = k * m <= total and rng.random() < 0.5
            sentences.append(rng.choice(_SUB_PACKS if sub else _ADD_PACKS).format(p=subject, k=k, m=m, item=item))
            expr.append(f"{'-' if sub else '+'} {k} * {m}")
            total += -k * m if sub else k * m
            ops_left -= 2
            continue
        x = rng.randint(cfg.min_value, cfg.max_value)
        sub = x <= total and rng.random() < 0.5
        sentences.append(rng.choice(_SUB if sub else _ADD).format(p=subject, x=x))
        expr.append(f"{'-' if sub else '+'} {x}")
        total += -x if sub else x
        ops_left -= 1
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(" ".join(sentences), " ".join(expr), total)


def split_of(expression: str, test_fraction: float) -> str:
    """The split an expression belongs to: a stable hash, so splits never share an expression."""
    bucket = int(hashlib.sha256(expression.encode()).hexdigest()[:8], 16) / 0x100000000
    return "test" if bucket < test_fraction else "train"


def generate_problems(n: int, split: str = "train", seed: int = 0,
                      cfg: ArithmeticConfig = ArithmeticConfig()) -> list[Problem]:
    """`n` distinct problems of `split`, the same list for the same (n, split, seed, cfg)."""
    if split not in SPLITS:
        raise ValueError(f"arithmetic split {split!r}; allowed: {list(SPLITS)}")
    if n < 1:
        raise ValueError(f"arithmetic: n={n} must be >= 1")
    rng = random.Random(f"switchyard-arithmetic:{seed}:{split}")
    seen: set[str] = set()
    out: list[Problem] = []
    for _ in range(50 * n + 1000):
        p = make_problem(rng, cfg)
        if p.expression not in seen and split_of(p.expression, cfg.test_fraction) == split:
            seen.add(p.expression)
            out.append(p)
            if len(out) == n:
                return out
    raise ValueError(f"arithmetic: found only {len(out)} distinct {split} problems of the {n} asked for; widen "
                     f"min_value..max_value ({cfg.min_value}..{cfg.max_value}) or the number of ops, or ask for fewer")


def arithmetic_rows(n: int, split: str = "train", seed: int = 0, cfg: ArithmeticConfig = ArithmeticConfig(),
                    tools: Sequence[str] = ("calculator",), interaction: str | None = None) -> list[dict[str, Any]]:
    """tool_agent rows with the calculator. `extra_info.expression` is the generating expression
    and `extra_info.solution` a GSM8K-style solution (`<<expr=value>>`, `#### n`), so the SFT
    traces and any GSM8K tooling read both tasks the same way."""
    system = system_prompt(tools)
    rows = []
    for i, p in enumerate(generate_problems(n, split, seed, cfg)):
        compact = p.expression.replace(" ", "")
        solution = f"{p.expression} = <<{compact}={p.answer}>>{p.answer}\n#### {p.answer}"
        rows.append(tool_row(DATA_SOURCE, system, p.text, str(p.answer),
                             {"split": split, "index": i, "expression": p.expression, "solution": solution},
                             tools, interaction))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m launch.data.arithmetic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, required=True, help="number of problems")
    ap.add_argument("--split", default="train", choices=SPLITS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", required=True, help="rows file: .jsonl, .json or .parquet")
    for key, value in asdict(ArithmeticConfig()).items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    args = vars(ap.parse_args(argv))
    try:
        cfg = ArithmeticConfig(**{k: args[k] for k in asdict(ArithmeticConfig())})
        out = save_rows(arithmetic_rows(args["n"], args["split"], args["seed"], cfg), args["output"])
    except (OSError, ImportError, ValueError) as e:
        ap.error(str(e))
    print(json.dumps({"rows": args["n"], "split": args["split"], "output": str(out)}))


if __name__ == "__main__":
    main()
