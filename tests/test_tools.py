"""tools.yaml loading, the calculator and gsm8k tools, BM25 search and the per-trajectory lifecycle."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agent.tools import BaseTool, ToolConfigError, ToolResponse, build_tools, load_tools
from agent.tools.calculator import CalculatorError, CalculatorTool, Gsm8kTool, calc_gsm8k_reward, safe_eval
from agent.tools.search import BM25, SearchTool


def schema(name: str, **props: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in props.items()}, "required": list(props)}}}


GOOD_YAML = """
tools:
  - class_name: agent.tools.calculator.CalculatorTool
    config: {max_expression_chars: 100}
    tool_schema:
      type: function
      function: {name: calculator, description: arithmetic, parameters: {type: object, properties: {expression: {type: string}}}}
  - class_name: agent.tools.python_sandbox.PythonTool
    config: {timeout_s: 5, memory_mb: 512}
    tool_schema:
      type: function
      function: {name: python, description: run code, parameters: {type: object, properties: {code: {type: string}}}}
  - class_name: agent.tools.search.SearchTool
    config: {corpus: ["the cat sat on the mat", "dogs chase cats"]}
    tool_schema:
      type: function
      function: {name: search, description: bm25, parameters: {type: object, properties: {query: {type: string}}}}
"""


def test_load_good_yaml(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(GOOD_YAML)
    tools = load_tools(path)
    assert list(tools) == ["calculator", "python", "search"]
    assert [type(t).__name__ for t in tools.values()] == ["CalculatorTool", "PythonTool", "SearchTool"]
    assert tools["calculator"].config["max_expression_chars"] == 100
    assert tools["python"].tool_schema["function"]["description"] == "run code"


@pytest.mark.parametrize("entry, match", [
    ({"config": {}, "tool_schema": schema("x")}, r"tools\[0\] has no class_name"),
    ({"class_name": "agent.tools.nope.Tool", "tool_schema": schema("x")}, r"cannot import module 'agent.tools.nope'"),
    ({"class_name": "agent.tools.calculator.Nope", "tool_schema": schema("x")}, r"has no attribute 'Nope'"),
    ({"class_name": "json.JSONDecoder", "tool_schema": schema("x")}, r"'json.JSONDecoder' is neither a subclass of agent.tools.base.BaseTool nor a class with verl's tool methods"),
    ({"class_name": "agent.tools.calculator.CalculatorTool", "tool_schema": {"type": "function", "function": {}}},
     r"\(agent.tools.calculator.CalculatorTool\): tool_schema has no function name"),
    ({"class_name": "agent.tools.search.SearchTool", "tool_schema": schema("s")}, r"constructing tool 's' failed.*corpus"),
])
def test_bad_entries_name_the_problem(entry: dict[str, Any], match: str) -> None:
    with pytest.raises(ToolConfigError, match=match):
        build_tools([entry])


def test_duplicate_names_and_bad_files(tmp_path: Path) -> None:
    entry = {"class_name": "agent.tools.calculator.CalculatorTool", "tool_schema": schema("calc")}
    with pytest.raises(ToolConfigError, match=r"tools\[1\].*duplicate tool name 'calc'"):
        build_tools([entry, entry])
    with pytest.raises(ToolConfigError, match="does not exist"):
        load_tools(tmp_path / "missing.yaml")
    (tmp_path / "t.yaml").write_text("tool: []\n")
    with pytest.raises(ToolConfigError, match="top-level `tools:` list"):
        load_tools(tmp_path / "t.yaml")


@pytest.mark.parametrize("expr, value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-3 ** 2", -9), ("7 // 2", 3), ("7 % 4", 3), ("1 / 4", 0.25),
    ("2 ** 10", 1024), ("--5", 5), ("1_000 * 3", 3000), ("2.5 * 4", 10.0),
])
def test_calculator_values(expr: str, value: float) -> None:
    assert safe_eval(expr) == value


@pytest.mark.parametrize("expr, match", [
    ("__import__('os')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("(1).__class__", "Attribute is not allowed"), ("9 ** 9 ** 9", "exponent"), ("99 ** 1000", "bits"),
    ("'a' * 3", "Constant is not allowed"), ("1 / 0", "division by zero"), ("1 +", "not an arithmetic"),
    ("1" * 300, "characters; the limit is 200"), ("[1][0]", "not allowed"), ("1 if 1 else 2", "IfExp"),
])
def test_calculator_refusals(expr: str, match: str) -> None:
    with pytest.raises(CalculatorError, match=match):
        safe_eval(expr)


def test_calculator_tool_reports_errors_as_observations() -> None:
    tool = CalculatorTool({}, schema("calculator", expression="string"))

    async def go() -> tuple[ToolResponse, ToolResponse]:
        iid = await tool.create()
        ok, bad = await tool.execute(iid, {"expression": "48 / 2 + 6"}), await tool.execute(iid, {"expression": "os"})
        await tool.release(iid)
        return ok, bad
    ok, bad = asyncio.run(go())
    assert ok.text == "30" and ok.success
    assert not bad.success and bad.text.startswith("Error:")


def test_gsm8k_reward_parsing() -> None:
    assert calc_gsm8k_reward("$1,234", "1234") == 1.0
    assert calc_gsm8k_reward("#### 72", "72") == 1.0
    assert calc_gsm8k_reward("the answer is 18.0", "18") == 1.0
    assert calc_gsm8k_reward("17", "18") == 0.0
    assert calc_gsm8k_reward("no number", "18") == 0.0


def test_gsm8k_lifecycle() -> None:
    tool = Gsm8kTool({}, schema("calc_gsm8k_reward", answer="string"))
    assert tool.name == "calc_gsm8k_reward"

    async def go() -> None:
        a = await tool.create(ground_truth="72")
        b = await tool.create("traj-b", ground_truth="1,000")
        assert b == "traj-b" and a != b
        assert await tool.calc_reward(a) == 0.0  # nothing submitted yet
        r = await tool.execute(a, {"answer": "70"})
        assert "reward=0.0" in r.text and await tool.calc_reward(a) == 0.0
        await tool.execute(a, {"answer": "72"})  # a retry replaces the answer
        await tool.execute(b, {"answer": "$1,000"})
        assert await tool.calc_reward(a) == 1.0 and await tool.calc_reward(b) == 1.0
        await tool.release(a)
        await tool.release(a)  # idempotent: loops release in `finally`
        with pytest.raises(KeyError, match="call `await tool.create"):
            await tool.execute(a, {"answer": "72"})
        with pytest.raises(ValueError, match="already exists"):
            await tool.create("traj-b", ground_truth="1")
        with pytest.raises(ValueError, match="needs ground_truth"):
            await tool.create()
        await tool.release(b)
        assert tool.instances == {}
    asyncio.run(go())


def test_base_tool_defaults() -> None:
    tool = BaseTool({}, schema("noop"))

    async def go() -> None:
        iid = await tool.create(foo=1)
        assert tool.state(iid) == {"foo": 1} and await tool.calc_reward(iid) == 0.0
        with pytest.raises(NotImplementedError):
            await tool.execute(iid, {})
        await tool.release(iid)
    asyncio.run(go())
    with pytest.raises(ValueError, match="no function name"):
        BaseTool({}, {"type": "function"})


CORPUS = [
    {"id": "paris", "text": "Paris is the capital and largest city of France."},
    {"id": "berlin", "text": "Berlin is the capital of Germany. Berlin has many museums."},
    {"id": "france", "text": "France is a country in Western Europe with many regions."},
    {"id": "pasta", "text": "Pasta is a staple food of Italian cuisine."},
]


def test_bm25_ranking() -> None:
    index = BM25([d["text"] for d in CORPUS])
    top = index.top("capital France", 4)
    assert top[0][0] == 0  # matches both 'capital' and 'france'
    assert {i for i, _ in top[1:3]} == {1, 2}
    assert 3 not in {i for i, _ in top}  # no shared term, no score
    assert index.top("berlin", 1)[0][0] == 1
    assert index.top("zebra", 3) == []
    # a rarer term outweighs a common one: idf
    assert index.idf["pasta"] > index.idf["capital"] > 0


def test_search_tool_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in CORPUS) + "\n")
    tool = SearchTool({"corpus_path": str(path), "max_top_k": 2}, schema("search", query="string"))

    async def go() -> list[ToolResponse]:
        iid = await tool.create()
        try:
            return [await tool.execute(iid, {"query": "Italian food", "top_k": 5}),
                    await tool.execute(iid, {"query": "capital of Germany"}),
                    await tool.execute(iid, {"query": "quantum"}), await tool.execute(iid, {"query": ""})]
        finally:
            await tool.release(iid)
    food, germany, none, empty = asyncio.run(go())
    assert food.text.startswith("[1] (id=pasta)") and food.metrics["hits"] == 1
    assert germany.text.splitlines()[0].startswith("[1] (id=berlin)") and germany.metrics["hits"] == 2
    assert none.text.startswith("No passages") and not empty.success
    with pytest.raises(ValueError, match="does not exist"):
        SearchTool({"corpus_path": str(tmp_path / "nope.jsonl")}, schema("search"))


def test_function_tools_refuse_what_the_schema_cannot_say(tmp_path):
    import pytest

    from agent.tools import load_tools
    from agent.tools.functions import function_schema
    from agent.tools.registry import ToolConfigError

    def undocumented(x: int) -> int:
        return x

    def untyped(x):  # noqa: ANN001
        """Doubles."""
        return 2 * x

    def starred(*xs: int) -> int:
        """Sums."""
        return sum(xs)

    def optional(x: int | None = None, tags: list[str] | None = None) -> str:
        """Optional things."""
        return ""

    for fn, pattern in ((undocumented, "has no docstring"), (untyped, "has no type hint"),
                        (starred, "named arguments only")):
        with pytest.raises(ValueError, match=pattern):
            function_schema(fn)
    params = function_schema(optional)["function"]["parameters"]
    assert params["required"] == [] and params["properties"] == {
        "x": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}
    (tmp_path / "t.yaml").write_text("functions:\n  - {source: nowhere.py}\n")
    with pytest.raises(ToolConfigError, match=r"functions\[0\]: function tools file .*nowhere.py' does not exist"):
        load_tools(tmp_path / "t.yaml")
    (tmp_path / "f.py").write_text("def a(x: int) -> int:\n    'A.'\n    return x\n")
    (tmp_path / "t.yaml").write_text("functions:\n  - {source: f.py, names: [a, b]}\n")
    with pytest.raises(ToolConfigError, match=r"has no function\(s\) \['b'\]; it defines \['a'\]"):
        load_tools(tmp_path / "t.yaml")
