"""GSM8K answer extraction and the rule reward built on it.

GSM8K solutions end with `#### <number>`; a policy prompted to follow that format is scored
`strict`ly (only the number after the last `####` counts), which also rewards the format. A
policy that answers in free text is scored `flexible`ly (the last number it wrote). Answers are
compared as exact decimals, so "72", "72.0", "$72" and "#### 72" are the same answer and no
float rounding can turn a wrong answer right.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

METHODS = ("strict", "flexible")

# A number as people write it: 1234, 1,234, 1,234.50, 0.5 — commas only in groups of three, so
# a list like "3,4,5" reads as three numbers, not 345.
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)"
# strict: what follows the last "####": optional sign and "$" (either order), then the number
_STRICT = re.compile(rf"\s*(-)?\s*\$?\s*(-)?\s*({_NUM})")
# flexible: every number in the text; a "-" counts as a sign only when it does not follow a word
# or digit, so "pages 3-5" ends in 5, not -5
_FLEXIBLE = re.compile(rf"((?<!\w)-)?(?:\$(-)?)?({_NUM})")
# a ground truth given as a bare string must be exactly one number
_BARE = re.compile(rf"\s*(-)?\s*\$?\s*(-)?\s*({_NUM})\s*")


def _join(match: re.Match[str]) -> str:
    sign = "-" if match.group(1) or match.group(2) else ""
    return sign + match.group(3).replace(",", "")


def extract_answer(text: str, method: str = "strict") -> str | None:
    """The model's final answer as a plain number string ("-1234.5"), or None if it gave none.

    strict: the number right after the last `####` (GSM8K's own format); flexible: the last
    number anywhere. Commas and `$` are dropped so the result parses as a number.
    """
    if method not in METHODS:
        raise ValueError(f"unknown answer extraction method {method!r}; use one of {list(METHODS)}")
    text = str(text)
    if method == "strict":
        if "####" not in text:
            return None
        m = _STRICT.match(text.rsplit("####", 1)[1])
        return _join(m) if m else None
    last = None
    for last in _FLEXIBLE.finditer(text):
        pass
    return _join(last) if last else None


def to_number(value: Any) -> Decimal:
    """A ground truth as an exact decimal: 72, 72.0, "72", "1,234", "$5", "#### 72" or a full GSM8K
    solution ending in "#### 72". Anything else is a dataset bug, so it raises instead of scoring 0."""
    if isinstance(value, Decimal):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = Decimal(str(value))
        except InvalidOperation:
            number = Decimal("NaN")
        if not number.is_finite():
            raise ValueError(f"ground truth {value!r} is not a finite number; fix reward_model.ground_truth")
        return number
    if isinstance(value, str):
        if "####" in value:
            found = extract_answer(value, "strict")
        else:
            m = _BARE.fullmatch(value)
            found = _join(m) if m else None
        if found is not None:
            return Decimal(found)
    raise ValueError(f"ground truth {value!r} is not a number; expected e.g. 72, '72', '1,234' or '#### 72' "
                     "in reward_model.ground_truth (or register a scorer for this data_source)")


def gsm8k_reward(text: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                 score: float = 1.0) -> float:
    """`score` for the right number, `format_score` for a readable but wrong one, 0.0 for none.

    A small `format_score` lets early training reward the `####` format before answers are right.
    """
    want = to_number(ground_truth)
    got = extract_answer(text, method)
    if got is None:
        return 0.0
    return float(score) if Decimal(got) == want else float(format_score)
