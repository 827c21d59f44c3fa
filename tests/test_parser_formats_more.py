"""Tool-call formats with a block of invokes: seed_oss (Seed-OSS), minimax (MiniMax-M2) and deepseek_v4
(DeepSeek V4's DSML), and the deepseek parser's error on DSML. The 10k-mutation fuzz of every registered
parser (these included) is in test_parser_formats.py."""

from __future__ import annotations

import json

from agent.parsers import ToolCall, get_tool_parser, known_parsers

SCHEMAS = {"python": {"type": "object", "properties": {"code": {"type": "string"}, "timeout": {"type": "integer"}}},
           "weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "units": {"type": "array"}, "exact": {"type": "boolean"},
                                                        "scale": {"type": "number"}, "o": {"type": "object"}}}}
WEATHER = {"city": "42", "days": 3, "units": ["c", "f"], "exact": True, "scale": 1.5, "o": {"k": None}}
RAW = {"city": "42", "days": "3", "units": '["c", "f"]', "exact": "true", "scale": "1.5", "o": '{"k": null}'}


def test_registered_names_and_alias() -> None:
    assert {"seed_oss", "minimax", "deepseek_v4"} <= set(known_parsers())
    assert get_tool_parser("minimax_m2").name == "minimax"

# ------------------------------------------------------------------ seed_oss

def _seed_fn(name: str, **params: str) -> str:
    return f"<function={name}>\n" + "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in params.items()) \
        + "</function>"


def _seed(*fns: str) -> str:
    return "<seed:tool_call>\n" + "\n".join(fns) + "\n</seed:tool_call>"


def test_seed_oss_calls_typed_by_schema() -> None:
    p = get_tool_parser("seed_oss", SCHEMAS)
    code = 'print("</parameter>")\nprint("</function></seed:tool_call>")'
    r = p.parse("Let me check.\n" + _seed(_seed_fn("weather", **RAW)) + "\n"
                + _seed(_seed_fn("python", code="\n" + code + "\n", timeout="5"), _seed_fn("now")) + "\nDone.")
    assert r.errors == [] and r.content == "Let me check.\n\n\nDone."
    assert r.calls == [ToolCall("weather", WEATHER), ToolCall("python", {"code": code, "timeout": 5}),
                       ToolCall("now", {})]


def test_seed_oss_malformed_and_truncated() -> None:
    p = get_tool_parser("seed_oss", SCHEMAS)
    r = p.parse("<seed:tool_call>\n<function=python>\n<parameter=code>print(1)")        # cut by the length limit
    assert r.calls == [] and "not closed by </parameter>" in r.errors[0]
    r = p.parse("<seed:tool_call>\n<function=a>\n<oops>\n</function>\n" + _seed_fn("b", x="1") + "\n</seed:tool_call>")
    assert r.calls == [ToolCall("b", {"x": "1"})] and "expected <parameter=KEY> or </function>" in r.errors[0]
    r = p.parse("<seed:tool_call>\n<function=>\n</function>\n</seed:tool_call> tail")
    assert r.calls == [] and "bad call tag" in r.errors[0] and r.content == "tail"
    r = p.parse(_seed(_seed_fn("a")).removesuffix("\n</seed:tool_call>"))                # a whole call, block cut
    assert r.calls == [ToolCall("a", {})] and "unclosed <seed:tool_call>" in r.errors[0]
    assert "no call between" in p.parse("<seed:tool_call></seed:tool_call>").errors[0]

# ------------------------------------------------------------------ minimax

def _invoke(name: str, **params: str) -> str:
    return f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items()) \
        + "</invoke>"


def _minimax(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "\n".join(invokes) + "\n</minimax:tool_call>"


def test_minimax_calls_typed_by_schema() -> None:
    p = get_tool_parser("minimax", SCHEMAS)
    code = 'print("</parameter>")\nprint("</invoke></minimax:tool_call>")'
    r = p.parse("<think>plan</think>\nSearching." + _minimax(_invoke("weather", **RAW), _invoke("python", code=code))
                + " after")
    assert r.errors == [] and r.content == "<think>plan</think>\nSearching. after"
    assert r.calls == [ToolCall("weather", WEATHER), ToolCall("python", {"code": code})]
    r = p.parse(_minimax("<invoke name='now'></invoke>", '<invoke name=python><parameter name=timeout>7</parameter></invoke>'))
    assert r.calls == [ToolCall("now", {}), ToolCall("python", {"timeout": 7})] and r.errors == []


def test_minimax_malformed_and_truncated() -> None:
    p = get_tool_parser("minimax", SCHEMAS)
    r = p.parse(_minimax(_invoke("a")) + '<minimax:tool_call>\n<invoke name="b">\n<parameter name="x">1')
    assert r.calls == [ToolCall("a", {})] and len(r.errors) == 1 and "not closed by </parameter>" in r.errors[0]
    r = p.parse(_minimax("<invoke>\n</invoke>", '<invoke name="b" oops>\n</invoke>', _invoke("c", k="v")))
    assert r.calls == [ToolCall("c", {"k": "v"})] and len(r.errors) == 2
    assert all("bad call tag" in e for e in r.errors)
    r = p.parse(_minimax('<invoke name="a">\n<parameter>1</parameter>\n</invoke>'))
    assert r.calls == [] and "bad parameter tag" in r.errors[0]
    r = p.parse("<minimax:tool_call>\nweather(city='x')\n</minimax:tool_call> tail")
    assert r.calls == [] and 'expected <invoke name="NAME">' in r.errors[0] and r.content == "tail"
    assert "stray </minimax:tool_call>" in p.parse("text </minimax:tool_call>").errors[0]

# ------------------------------------------------------------------ deepseek_v4 (DSML)

DSML_SAMPLE = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
               'Tokyo</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


def _dsml_invoke(name: str, **params: tuple[str, str]) -> str:
    return (f'<｜DSML｜invoke name="{name}">\n' + "".join(
        f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>\n' for k, (v, s) in params.items())
        + "</｜DSML｜invoke>")


def _dsml(*invokes: str) -> str:
    return "\n\n<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


def test_deepseek_v4_the_documented_sample() -> None:
    r = get_tool_parser("deepseek_v4").parse(DSML_SAMPLE)
    assert r.calls == [ToolCall("get_weather", {"city": "Tokyo"})] and r.errors == [] and r.content == ""


def test_deepseek_v4_string_and_json_values() -> None:
    p = get_tool_parser("deepseek_v4", SCHEMAS)
    code = 'print("</｜DSML｜parameter>")\n  x = 1\n'
    r = p.parse("I will look." + _dsml(
        _dsml_invoke("weather", city=("42", "true"), days=("3", "false"), units=('["c", "f"]', "false"),
                     exact=("true", "false"), scale=("1.5", "false"), o=('{"k": null}', "false")),
        _dsml_invoke("python", code=(code, "true"), timeout=("5", "false")), _dsml_invoke("now")) + "\nThanks.")
    assert r.errors == [] and r.content == "I will look.\n\n\nThanks."
    assert r.calls == [ToolCall("weather", WEATHER), ToolCall("python", {"code": code, "timeout": 5}),
                       ToolCall("now", {})]
    # string="true" keeps a value raw even where the schema says integer; JSON needs no schema
    r = get_tool_parser("deepseek_v4").parse(_dsml(_dsml_invoke("f", n=("7", "true"), xs=("[1, 2]", "false"))))
    assert r.calls == [ToolCall("f", {"n": "7", "xs": [1, 2]})]


def test_deepseek_v4_malformed_and_truncated() -> None:
    p = get_tool_parser("deepseek_v4", SCHEMAS)
    r = p.parse(_dsml(_dsml_invoke("a")).removesuffix("\n</｜DSML｜tool_calls>")
                + '\n<｜DSML｜invoke name="b">\n<｜DSML｜parameter name="x" string="true">hal')
    assert r.calls == [ToolCall("a", {})] and len(r.errors) == 1 and "not closed" in r.errors[0]
    r = p.parse(_dsml('<｜DSML｜invoke>\n</｜DSML｜invoke>', _dsml_invoke("b", k=("v", "true"))))
    assert r.calls == [ToolCall("b", {"k": "v"})] and "bad call tag" in r.errors[0]
    r = p.parse('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="a">\n</｜DSML｜tool_calls>')
    assert r.calls == [] and "expected <｜DSML｜parameter" in r.errors[0]
    assert "no call between" in p.parse("<｜DSML｜tool_calls></｜DSML｜tool_calls>").errors[0]


def test_deepseek_parser_reports_dsml_instead_of_dropping_it() -> None:
    for name in ("deepseek", "deepseek_v31"):
        r = get_tool_parser(name).parse("Checking. " + DSML_SAMPLE)
        assert r.calls == [] and len(r.errors) == 1 and "deepseek_v4" in r.errors[0]
    # DSML text inside a V3.1 call's JSON argument is data, not an error
    args = {"code": DSML_SAMPLE}
    r = get_tool_parser("deepseek").parse("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>python<｜tool▁sep｜>"
                                          + json.dumps(args, ensure_ascii=False) + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert r.calls == [ToolCall("python", args)] and r.errors == []
