"""No test waits a fixed time and then asserts: on a loaded box the awaited thing comes later and the
test goes red. Tests wait for the condition with a deadline (tests/waiting.py). A fixed sleep stays
only as a window in which something must NOT happen, and says so on its line ("window")."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _fixed_sleep(stmt: ast.stmt) -> bool:
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    call = call.value if isinstance(call, ast.Await) else call
    if not isinstance(call, ast.Call) or not call.args:
        return False
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    arg = call.args[0]
    return name == "sleep" and isinstance(arg, ast.Constant) and isinstance(arg.value, (int, float)) and arg.value > 0


def _asserts(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def sleeps_then_asserts(source: str) -> list[int]:
    """Lines of fixed sleeps, outside any polling loop, followed within three statements by an
    assertion, whose line does not call itself a window."""
    lines, found = source.splitlines(), []

    def walk(body: list[ast.stmt], in_loop: bool) -> None:
        for i, stmt in enumerate(body):
            if (not in_loop and _fixed_sleep(stmt) and any(_asserts(s) for s in body[i + 1:i + 4])
                    and "window" not in lines[stmt.lineno - 1]):
                found.append(stmt.lineno)
            loop = in_loop or isinstance(stmt, (ast.For, ast.AsyncFor, ast.While))
            for block in ("body", "orelse", "finalbody"):
                sub = getattr(stmt, block, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                    walk(sub, loop)
            for handler in getattr(stmt, "handlers", []) or []:
                walk(handler.body, in_loop)

    walk(ast.parse(source).body, False)
    return found


def test_the_check_finds_a_sleep_then_an_assert():
    bad = ("import asyncio, time\n"
           "def test_a(x):\n    x.start()\n    time.sleep(0.5)\n    assert x.done\n"
           "async def test_b(x):\n    if x:\n        await asyncio.sleep(1)\n        y = x.state()\n        assert y\n"
           "def test_c(x):\n    while not x.done:\n        time.sleep(0.1)\n    assert x.ok\n"
           "def test_d(x):\n    time.sleep(0.2)  # a window in which nothing may start\n    assert not x.started\n")
    assert sleeps_then_asserts(bad) == [4, 8]


def test_no_test_sleeps_then_asserts():
    found = {f"{p.name}:{line}" for p in sorted(TESTS.glob("test_*.py")) for line in sleeps_then_asserts(p.read_text())}
    assert not found, (f"fixed sleeps followed by an assertion: {sorted(found)}; wait for the condition with a "
                       f"deadline (tests/waiting.py), or mark a window in which something must not happen")
