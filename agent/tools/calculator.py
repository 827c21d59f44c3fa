"""Arithmetic for the model without `eval`: an `ast` walk over a whitelist of nodes, with limits
so a single call cannot burn the worker (`9**9**9`) — plus the GSM8K answer tool that scores it.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any, Callable

from agent.tools.base import BaseTool, ToolResponse

Number = int | float

_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message says which part and why."""


def safe_eval(expr: str, max_chars: int = 200, max_exponent: int = 1000, max_bits: int = 4096) -> Number:
    """Evaluate numbers, + - * / // % **, unary +/- and parentheses. Anything else (names,
    calls, attributes, subscripts, strings) is refused. `max_exponent` bounds `a ** b`;
    `max_bits` bounds every integer intermediate, so the work stays tiny whatever the input."""
    if not isinstance(expr, str):
        raise CalculatorError(f"expression must be a string, got {type(expr).__name__}")
    if len(expr) > max_chars:
        raise CalculatorError(f"expression is {len(expr)} characters; the limit is {max_chars}")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {expr!r} ({e.msg})") from None

    def check(value: Any) -> Number:
        if isinstance(value, int) and value.bit_length() > max_bits:
            raise CalculatorError(f"intermediate result exceeds {max_bits} bits; use smaller numbers")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError("result is not finite (overflow)")
        return value

    def walk(node: ast.AST) -> Number:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return check(_UNARY[type(node.op)](walk(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow):
                if abs(right) > max_exponent:
                    raise CalculatorError(f"exponent {right} is larger than the limit {max_exponent}")
                if isinstance(left, int) and isinstance(right, int) and right > 0 \
                        and left.bit_length() * right > max_bits:
                    raise CalculatorError(f"{left} ** {right} exceeds {max_bits} bits; use smaller numbers")
            try:
                return check(_BINOPS[type(node.op)](left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result overflows a float") from None
        raise CalculatorError(f"{type(node).__name__} is not allowed: {ast.unparse(node)!r}; only numbers, "
                              "+ - * / // % ** and parentheses are")

    return walk(tree)


class CalculatorTool(BaseTool):
    """`{"expression": "..."}` -> the value. Config: max_expression_chars, max_exponent, max_bits."""

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        expr = arguments.get("expression")
        try:
            value = safe_eval(expr, int(self.config.get("max_expression_chars", 200)),
                              int(self.config.get("max_exponent", 1000)), int(self.config.get("max_bits", 4096)))
        except CalculatorError as e:
            return ToolResponse(f"Error: {e}", success=False)
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)  # "12.0" reads worse to the model than "12"
        return ToolResponse(str(value))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_number(text: Any) -> float | None:
    """The last number in `text` after stripping commas and `$` (GSM8K style "#### 1,234"), else None."""
    found = _NUMBER.findall(str(text).replace(",", "").replace("$", ""))
    return float(found[-1]) if found else None


def calc_gsm8k_reward(answer: Any, ground_truth: Any) -> float:
    """1.0 when the answer's number equals the ground truth's, else 0.0."""
    got, want = parse_number(answer), parse_number(ground_truth)
    return 1.0 if got is not None and want is not None and math.isclose(got, want, abs_tol=1e-6) else 0.0


class Gsm8kTool(BaseTool):
    """The model submits `{"answer": "..."}`; the last submission is scored against the
    `ground_truth` passed to create(). The text tells the model whether it is right, as verl's
    gsm8k tool does, so it may retry within the trajectory."""

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        if "ground_truth" not in create_kwargs:
            raise ValueError(f"tool {self.name!r}: create() needs ground_truth=...; put it in the dataset row's "
                             f"extra_info.tools_kwargs.{self.name}.create_kwargs")
        iid = await super().create(instance_id, **create_kwargs)
        self.instances[iid]["answer"] = None
        return iid

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        state = self.state(instance_id)
        answer = str(arguments.get("answer", ""))
        state["answer"] = answer
        reward = calc_gsm8k_reward(answer, state["ground_truth"])
        return ToolResponse(f"Current parsed answer={answer!r} reward={reward}", metrics={"reward": reward})

    async def calc_reward(self, instance_id: str) -> float:
        state = self.state(instance_id)
        return calc_gsm8k_reward(state["answer"], state["ground_truth"]) if state["answer"] is not None else 0.0
