"""Tool-call formats beyond hermes/llama3_json: mistral, qwen3_coder, glm4, gpt-oss, deepseek, kimi_k2,
gemma, functiongemma (seed_oss, minimax, deepseek_v4: test_parser_formats_more.py); the registry (aliases,
dotted paths); and a 10k-mutation fuzz of every parser."""

from __future__ import annotations

import json
import random

import pytest

from agent.parsers import ParseResult, ToolCall, ToolParser, get_tool_parser, known_parsers

SCHEMAS = {"python": {"type": "object", "properties": {"code": {"type": "string"}, "timeout": {"type": "integer"}}},
           "weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "units": {"type": "array"}, "exact": {"type": "boolean"}}}}
CODE = 'print("</tool_call>")\nprint("</parameter>")\nprint("<tool_call>")'

# ------------------------------------------------------------------ mistral

def test_mistral_v13_v11_and_pre_v11_forms() -> None:
    p = get_tool_parser("mistral")
    r = p.parse('Sure. [TOOL_CALLS]weather[ARGS]{"city": "Paris"}[TOOL_CALLS]calc[CALL_ID]a1B2c3D4e[ARGS]{"e": "1+1"}')
    assert r.calls == [ToolCall("weather", {"city": "Paris"}), ToolCall("calc", {"e": "1+1"})]
    assert r.errors == [] and r.content == "Sure."
    r = p.parse('[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": "{}"}]')
    assert r.calls == [ToolCall("a", {"x": 1}), ToolCall("b", {})] and r.errors == []
    r = p.parse('[TOOL_CALLS]python[ARGS]' + json.dumps({"code": "print('[TOOL_CALLS]x[ARGS]{}')"}))
    assert r.calls == [ToolCall("python", {"code": "print('[TOOL_CALLS]x[ARGS]{}')"})] and r.errors == []


def test_mistral_malformed_and_truncated() -> None:
    p = get_tool_parser("mistral")
    r = p.parse('[TOOL_CALLS]calc[ARGS]{"e": "1+')
    assert r.calls == [] and "bad JSON" in r.errors[0] and "'calc'" in r.errors[0]
    r = p.parse('[TOOL_CALLS]calc{"x": 1}[TOOL_CALLS]ok[ARGS]{}')
    assert r.calls == [ToolCall("ok", {})] and "no [ARGS]" in r.errors[0]
    r = p.parse("[TOOL_CALLS][]")
    assert r.calls == [] and "empty list" in r.errors[0]
    r = p.parse('[TOOL_CALLS]calc[ARGS][1, 2]')
    assert "must be a JSON object, got list" in r.errors[0]

# ------------------------------------------------------------------ qwen3_coder

def _qwen(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_values_typed_by_schema_and_tags_in_code_are_data() -> None:
    p = get_tool_parser("qwen3_coder", SCHEMAS)
    text = "I will run it.\n" + _qwen("python", code=CODE, timeout="5") + "\n" + _qwen("weather", city="42", days="3",
                                                                                      units='["c", "f"]', exact="True")
    r = p.parse(text)
    assert r.errors == [] and r.content == "I will run it."
    assert r.calls == [ToolCall("python", {"code": CODE, "timeout": 5}),
                       ToolCall("weather", {"city": "42", "days": 3, "units": ["c", "f"], "exact": True})]
    # without a schema a value stays text unless it is a JSON object or array
    r = get_tool_parser("qwen3_coder").parse(_qwen("other", n="3", o='{"a": 1}'))
    assert r.calls == [ToolCall("other", {"n": "3", "o": {"a": 1}})]
    # a value of the wrong type stays a string, for the tool's own validation to report
    assert get_tool_parser("qwen3_coder", SCHEMAS).parse(_qwen("python", timeout="soon")).calls[0].arguments == \
        {"timeout": "soon"}


def test_qwen3_coder_malformed_and_truncated() -> None:
    p = get_tool_parser("qwen3_coder")
    r = p.parse("<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\n")  # cut by the length limit
    assert r.calls == [] and "not closed by </parameter>" in r.errors[0]
    r = p.parse("<tool_call>\n<function=a>\n</function>\n" + _qwen("b", x="1"))   # no </tool_call>, then a good one
    assert r.calls == [ToolCall("b", {"x": "1"})] and "no </tool_call> after </function>" in r.errors[0]
    r = p.parse('<tool_call>{"name": "hermes_style"}</tool_call> tail')
    assert r.calls == [] and "expected <function=NAME>" in r.errors[0] and r.content == "tail"
    r = p.parse("<tool_call>\n<function=f>\n<oops>\n</function>\n</tool_call>")
    assert "expected <parameter=KEY> or </function>" in r.errors[0]
    assert "stray </tool_call>" in p.parse("text </tool_call>").errors[0]

# ------------------------------------------------------------------ glm4

def test_glm4_45_and_47_layouts() -> None:
    p = get_tool_parser("glm4", SCHEMAS)
    r = p.parse("Checking.\n<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    assert r.calls == [ToolCall("weather", {"city": "Beijing", "days": 3})] and r.errors == []
    assert r.content == "Checking."
    r = p.parse("<tool_call>now</tool_call><tool_call>python<arg_key>code</arg_key><arg_value>" + CODE +
                "</arg_value></tool_call>")
    assert r.calls == [ToolCall("now", {}), ToolCall("python", {"code": CODE})] and r.errors == []


def test_glm4_malformed_and_truncated() -> None:
    p = get_tool_parser("glm4")
    r = p.parse("<tool_call>f<arg_key>x</arg_key><arg_value>1")
    assert r.calls == [] and "not closed by </arg_value>" in r.errors[0]
    r = p.parse("<tool_call>f<arg_key>x</arg_key>1</tool_call><tool_call>g</tool_call>")
    assert r.calls == [ToolCall("g", {})] and "not followed by <arg_value>" in r.errors[0]
    r = p.parse("<tool_call><arg_key>x</arg_key></tool_call>")
    assert "expected the tool name" in r.errors[0]

# ------------------------------------------------------------------ gpt-oss (harmony)

def test_gpt_oss_call_final_answer_and_recipient_before_channel() -> None:
    p = get_tool_parser("gpt-oss")
    r = p.parse("<|channel|>analysis<|message|>Need the calculator.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.calc <|constrain|>json<|message|>{"expression": "2+2"}<|call|>')
    assert r.calls == [ToolCall("calc", {"expression": "2+2"})] and r.errors == [] and r.content == ""
    r = p.parse("<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>"
                "The answer is 4.<|return|>")
    assert r.calls == [] and r.errors == [] and r.content == "The answer is 4."
    # the engine may cut the stop token; the recipient may sit in the header before the channel;
    # the markers inside a JSON string are data
    r = p.parse('<|start|>assistant to=functions.python<|channel|>commentary json<|message|>'
                + json.dumps({"code": "print('<|call|>')"}))
    assert r.calls == [ToolCall("python", {"code": "print('<|call|>')"})] and r.errors == []
    assert p.parse("plain text, no harmony") == ParseResult("plain text, no harmony", [], [])


def test_gpt_oss_malformed_and_truncated() -> None:
    p = get_tool_parser("gpt-oss")
    r = p.parse('<|channel|>commentary to=functions.calc <|constrain|>json<|message|>{"expression": "2+')
    assert r.calls == [] and "not one JSON object" in r.errors[0]
    r = p.parse("<|channel|>commentary to=functions.calc <|constrain|>json")   # cut inside the header
    assert r.calls == [] and "header was cut off" in r.errors[0]
    r = p.parse("<|channel|>final<|message|>4<|call|>")
    assert r.content == "4" and "without a recipient" in r.errors[0]

# ------------------------------------------------------------------ deepseek

DS = {k: f"<｜{v}｜>" for k, v in {"begin": "tool▁calls▁begin", "end": "tool▁calls▁end", "cb": "tool▁call▁begin",
                                  "ce": "tool▁call▁end", "sep": "tool▁sep"}.items()}


def _ds_v3(name: str, args: dict) -> str:
    return f"{DS['cb']}function{DS['sep']}{name}\n```json\n{json.dumps(args)}\n```{DS['ce']}"


def _ds_v31(name: str, args: dict) -> str:
    return f"{DS['cb']}{name}{DS['sep']}{json.dumps(args)}{DS['ce']}"


def test_deepseek_v3_and_v31() -> None:
    p = get_tool_parser("deepseek")
    r = p.parse("Let me.\n" + DS["begin"] + _ds_v3("weather", {"city": "Tokyo"}) + _ds_v3("python", {"code": "```" + CODE})
                + DS["end"])
    assert r.calls == [ToolCall("weather", {"city": "Tokyo"}), ToolCall("python", {"code": "```" + CODE})]
    assert r.errors == [] and r.content == "Let me."
    r = get_tool_parser("deepseek_v31").parse(DS["begin"] + _ds_v31("python", {"code": DS["ce"] + DS["end"]})
                                              + _ds_v31("now", {}) + DS["end"] + " after")
    assert r.calls == [ToolCall("python", {"code": DS["ce"] + DS["end"]}), ToolCall("now", {})]
    assert r.errors == [] and r.content == "after"


def test_deepseek_malformed_and_truncated() -> None:
    p = get_tool_parser("deepseek")
    r = p.parse(DS["begin"] + _ds_v31("a", {}) + f"{DS['cb']}b{DS['sep']}" + '{"x": ')
    assert r.calls == [ToolCall("a", {})] and "tool call 1" in r.errors[0] and "not one JSON object" in r.errors[0]
    r = p.parse(DS["begin"] + _ds_v31("a", {"x": 1}))
    assert r.calls == [ToolCall("a", {"x": 1})] and "unclosed" in r.errors[0]
    r = p.parse(DS["begin"] + f"{DS['cb']}function{DS['sep']}f {{}}{DS['ce']}" + DS["end"])
    assert r.calls == [] and "```json fence" in r.errors[0]
    r = p.parse(DS["begin"] + f"{DS['cb']}nosep{{}}{DS['ce']}" + DS["end"])
    assert "no " + DS["sep"] in r.errors[0]
    assert "no calls" in p.parse(DS["begin"] + DS["end"]).errors[0]

# ------------------------------------------------------------------ kimi_k2

KIMI = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>", "<|tool_call_end|>")


def _kimi(call_id: str, args: dict) -> str:
    return f"{KIMI[2]}{call_id}{KIMI[3]}{json.dumps(args)}{KIMI[4]}"


def test_kimi_k2_calls_and_ids() -> None:
    p = get_tool_parser("kimi_k2")
    r = p.parse("ok " + KIMI[0] + _kimi("functions.weather:0", {"city": "Beijing"})
                + _kimi("functions.python:1", {"code": KIMI[4] + KIMI[1]}) + _kimi("plain_name", {}) + KIMI[1])
    assert r.calls == [ToolCall("weather", {"city": "Beijing"}), ToolCall("python", {"code": KIMI[4] + KIMI[1]}),
                       ToolCall("plain_name", {})]
    assert r.errors == [] and r.content == "ok"


def test_kimi_k2_malformed_and_truncated() -> None:
    p = get_tool_parser("kimi_k2")
    r = p.parse(KIMI[0] + _kimi("functions.a:0", {}) + f"{KIMI[2]}functions.b:1{KIMI[3]}" + '{"x": [')
    assert r.calls == [ToolCall("a", {})] and "not one JSON object" in r.errors[0]
    r = p.parse(KIMI[0] + "garbage" + KIMI[1] + " tail")
    assert r.calls == [] and "expected <|tool_call_begin|>" in r.errors[0] and r.content == "tail"

# ------------------------------------------------------------------ gemma / functiongemma

def test_gemma4_values_and_nested_arguments() -> None:
    q = '<|"|>'
    text = (f"Let me look. <|tool_call>call:weather{{city:{q}Berlin <tool_call|>{q},days:3,exact:true,"
            f"units:[{q}c{q},{q}f{q}],o:{{k:null,n:-1.5e2}}}}<tool_call|><|tool_call>call:now{{}}<tool_call|> done")
    r = get_tool_parser("gemma").parse(text)
    assert r.calls == [ToolCall("weather", {"city": "Berlin <tool_call|>", "days": 3, "exact": True,
                                            "units": ["c", "f"], "o": {"k": None, "n": -150.0}}), ToolCall("now", {})]
    assert r.errors == [] and r.content == "Let me look.  done"
    r = get_tool_parser("functiongemma").parse("<start_function_call>call:get{loc:<escape>London, UK<escape>}"
                                               "<end_function_call>")
    assert r.calls == [ToolCall("get", {"loc": "London, UK"})] and r.errors == []


def test_gemma4_malformed_and_truncated() -> None:
    p = get_tool_parser("gemma")
    r = p.parse('<|tool_call>call:f{a:<|"|>unfinished')
    assert r.calls == [] and "not closed" in r.errors[0]
    r = p.parse("<|tool_call>call:f{a:1}<|tool_call>call:g{}<tool_call|>")
    assert r.calls == [] and "expected '<tool_call|>'" in r.errors[0]
    r = p.parse("<|tool_call>call:f{a:1,}<tool_call|><|tool_call>call:g{}<tool_call|>")
    assert r.calls == [ToolCall("g", {})] and len(r.errors) == 1
    r = p.parse("<|tool_call>call:{a:1}<tool_call|>")
    assert "expected call:NAME" in r.errors[0]
    assert "nested deeper" in p.parse("<|tool_call>call:f{a:" + "[" * 100 + "]" * 100 + "}<tool_call|>").errors[0]

# ------------------------------------------------------------------ registry

class UpperParser(ToolParser):
    """A user's own format: `CALL name` lines."""

    def parse(self, text: str) -> ParseResult:
        calls = [ToolCall(line[5:].strip(), {}) for line in text.splitlines() if line.startswith("CALL ")]
        return ParseResult(content="", calls=calls)


def test_registry_aliases_dotted_paths_and_errors() -> None:
    assert set(known_parsers()) >= {"hermes", "llama3_json", "mistral", "qwen3_coder", "gpt-oss", "deepseek",
                                    "glm4", "kimi_k2", "gemma"}
    assert get_tool_parser("gpt_oss").name == "gpt-oss" and get_tool_parser("glm45").name == "glm4"
    parser = get_tool_parser(f"{__name__}.UpperParser")
    assert parser.parse("CALL now").calls == [ToolCall("now", {})]
    with pytest.raises(ValueError, match="not a ToolParser"):
        get_tool_parser("json.JSONDecoder")
    with pytest.raises(ValueError, match="cannot import module"):
        get_tool_parser("no_such_pkg.Parser")

# ------------------------------------------------------------------ fuzz

VALID: dict[str, list[str]] = {
    "hermes": ['a <tool_call>\n{"name": "calc", "arguments": {"e": "1+1", "s": "</tool_call>"}}\n</tool_call> b'],
    "llama3_json": ['<|python_tag|>{"name": "a", "parameters": {"x": [1, {"y": "}"}]}}; {"name": "b", "parameters": {}}'],
    "mistral": ['x[TOOL_CALLS]calc[ARGS]{"e": "1"}[TOOL_CALLS]f[CALL_ID]abc[ARGS]{}',
                '[TOOL_CALLS][{"name": "a", "arguments": {"k": [1]}}]'],
    "qwen3_coder": ["t\n" + _qwen("python", code=CODE, timeout="5") + _qwen("now")],
    "glm4": ["<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>B</arg_value>\n</tool_call><tool_call>n</tool_call>"],
    "gpt-oss": ["<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary to=functions.c "
                '<|constrain|>json<|message|>{"e": "<|end|>"}<|call|>',
                "<|channel|>final<|message|>The answer is 4.<|return|>"],
    "deepseek": [DS["begin"] + _ds_v3("w", {"c": "T"}) + _ds_v31("p", {"x": [1, "```"]}) + DS["end"]],
    "kimi_k2": [KIMI[0] + _kimi("functions.w:0", {"c": "B"}) + _kimi("functions.p:1", {}) + KIMI[1]],
    "gemma": ['<|tool_call>call:w{c:<|"|>B<|"|>,n:[1,{k:true}]}<tool_call|>'],
    "functiongemma": ["<start_function_call>call:g{loc:<escape>L<escape>,n:2}<end_function_call>"],
    "seed_oss": ["t\n<seed:tool_call>\n<function=python>\n<parameter=code>\n" + CODE + "\n</parameter>\n<parameter="
                 "timeout>5</parameter>\n</function>\n<function=now>\n</function>\n</seed:tool_call>"],
    "minimax": ['a<minimax:tool_call>\n<invoke name="weather">\n<parameter name="city">B</parameter>\n<parameter '
                'name="units">["c"]</parameter>\n</invoke>\n<invoke name="now">\n</invoke>\n</minimax:tool_call>'],
    "deepseek_v4": ['a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="weather">\n<｜DSML｜parameter name="city" string='
                    '"true">B</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
                    '</｜DSML｜invoke>\n<｜DSML｜invoke name="now">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'],
}


def _mutate(rng: random.Random, text: str, pieces: list[str]) -> str:
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(text) + 1)
        j = min(len(text), i + rng.randint(1, 12))
        op = rng.randrange(5)
        if op == 0:
            text = text[:i] + text[j:]                       # delete a span
        elif op == 1:
            text = text[:i] + rng.choice(pieces) + text[i:]  # insert markup or a JSON character
        elif op == 2:
            text = text[:i]                                  # truncate (the length limit)
        elif op == 3:
            text = text[:j] + text[i:j] + text[j:]           # duplicate a span
        else:
            text = text[:i] + chr(rng.randrange(32, 0x2600)) + text[i + 1:]  # replace a character
    return text


def test_every_parser_survives_10k_mutations_and_reports_each_marked_call() -> None:
    """No exception escapes any parser; every result is calls and/or errors with the right types; and
    whenever the format's call marker is in the text, the model gets calls or an error back."""
    assert set(VALID) == set(known_parsers())
    common = ["{", "}", "[", "]", '"', ":", ",", "\n", " ", "\\", "null", "```", "json"]
    for name, texts in VALID.items():
        parser = get_tool_parser(name, SCHEMAS)
        for text in texts:
            r = parser.parse(text)
            assert not r.errors and (r.calls or "final" in text), (name, r)
        markup = sorted({m for t in texts for m in _markup_of(t)})
        rng = random.Random(name)
        for _ in range(10_000):
            text = _mutate(rng, rng.choice(texts), common + markup)
            try:
                r = parser.parse(text)
            except Exception as e:  # noqa: BLE001 - the point of the test
                raise AssertionError(f"{name} raised {e!r} on {text!r}") from e
            assert isinstance(r, ParseResult) and isinstance(r.content, str)
            assert all(isinstance(c, ToolCall) and isinstance(c.name, str) and c.name.strip() == c.name != ""
                       and isinstance(c.arguments, dict) for c in r.calls), (name, text, r)
            assert all(isinstance(e, str) and e for e in r.errors), (name, text, r)
            if any(m in text for m in parser.markers):
                assert r.calls or r.errors, (name, text, r)


def _markup_of(text: str) -> list[str]:
    """The tags and special tokens in a valid example: <...>, [...] words and <｜...｜> markers."""
    import re
    return (re.findall(r"<[|｜/]?[A-Za-z_=▁|\"]+[|｜]?>|\[[A-Z_]+\]|<[a-z_]+=|</[a-z_]+>", text)
            + re.findall(r"</?(?:[a-z]+:tool_call|｜DSML｜\w+)>?|<(?:invoke|parameter) name=| string=", text))


def test_tool_agent_gives_its_parser_the_tools_schemas() -> None:
    """The loop builds its parser with the loaded tools' parameter schemas, so a raw-text format's
    integer argument reaches the tool as an int (and a dotted-path parser is accepted in config)."""
    from agent.loop import AgentContext
    from agent.tool_agent import ToolAgentLoop
    from agent.tools.calculator import CalculatorTool

    schema = {"type": "function", "function": {"name": "python", "parameters": SCHEMAS["python"]}}
    ctx = AgentContext(client=None, tokenizer=None, tools={"python": CalculatorTool({}, schema)},
                       config={"tool_parser": "qwen3_coder"})
    loop = ToolAgentLoop(ctx)
    assert loop.parser.parse(_qwen("python", code="1", timeout="7")).calls == [
        ToolCall("python", {"code": "1", "timeout": 7})]
    ctx = AgentContext(client=None, tokenizer=None, config={"tool_parser": f"{__name__}.UpperParser"})
    assert isinstance(ToolAgentLoop(ctx).parser, UpperParser)
