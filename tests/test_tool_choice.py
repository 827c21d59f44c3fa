"""`tool_choice` required and a named function force a call: the tool parser's call opening is
appended to the prompt as template tokens (mask 0, never the model's), the model writes the rest of
the call, and the recorded assistant message holds opening + generation, so a client that resends
the history continues the same segment. The real `openai` client against the real gateway, with a
scripted bus client (exact token bookkeeping) and with an hf engine running the tiny tool-calling
model; pydantic-ai's `output_type` (which sends tool_choice="required") when it is installed."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
openai = pytest.importorskip("openai")

from agent.chat import ChatEncoder  # noqa: E402
from agent.gateway import Gateway  # noqa: E402
from agent.parsers import ParseResult, ToolParser, get_tool_parser, known_parsers  # noqa: E402
from test_tool_agent_states import ScriptedClient, tok  # noqa: E402,F401

CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
ASK = [{"role": "user", "content": "what is 2+3?"}]
REQUIRED_REPLY = '{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
NAMED = {"type": "function", "function": {"name": "search"}}


class Recording(ScriptedClient):
    """The scripted client, keeping what it returned."""

    def __init__(self, tok: Any, replies: list[str]) -> None:  # noqa: F811
        super().__init__(tok, replies)
        self.results: list[Any] = []
        self.samplings: list[dict] = []

    async def generate(self, prompt_ids: Any, sampling: dict, **kw: Any):
        result = await super().generate(prompt_ids, sampling, **kw)
        self.results.append(result)
        self.samplings.append(dict(sampling))
        return result


def _ids(tok: Any, text: str) -> list[int]:  # noqa: F811
    return tok.encode(text, add_special_tokens=False)


async def _session(client: Any, tok: Any, talk, **kw: Any):  # noqa: F811
    gw = Gateway(client, tok, **kw)
    await gw.start()
    try:
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as oa:
            got = await talk(oa)
        return got, gw.sessions.get("k")
    finally:
        await gw.stop()


def test_required_forces_a_hermes_call_with_the_opening_as_template_tokens(tok):  # noqa: F811
    client = Recording(tok, [REQUIRED_REPLY])

    async def talk(oa):
        return await oa.chat.completions.create(model="switchyard", messages=ASK, tools=[CALCULATOR],
                                                tool_choice="required")

    r, conv = asyncio.run(_session(client, tok, talk))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2+3"}
    prefix = _ids(tok, "<tool_call>\n")
    rendered = ChatEncoder(tok, tools=[CALCULATOR]).initial(ASK)
    assert client.prompts[0] == rendered + prefix  # the engine continued after the opening
    engine = client.results[0]
    [seg] = conv.segments
    out = seg.to_output()
    assert out.prompt_ids == rendered
    assert out.response_ids == prefix + engine.token_ids
    assert out.response_mask == [0] * len(prefix) + [1] * len(engine.token_ids)
    assert out.response_logprobs == [0.0] * len(prefix) + list(engine.logprobs)
    assert out.model_token_ids() == engine.token_ids
    assert r.usage.completion_tokens == len(engine.token_ids)  # the opening is never counted as the model's
    assert r.usage.prompt_tokens == len(rendered) + len(prefix)
    assert seg.turns[-1]["forced_call"] == "required"


def test_a_named_function_forces_its_opening_and_its_name(tok):  # noqa: F811
    client = Recording(tok, [' {"query": "five"}}</tool_call>'])

    async def talk(oa):
        return await oa.chat.completions.create(model="switchyard", messages=ASK, tools=[CALCULATOR, SEARCH],
                                                tool_choice=NAMED, stream=True)

    async def streamed(oa):
        calls, finish = {}, None
        async for chunk in await talk(oa):
            for d in chunk.choices[0].delta.tool_calls or []:
                calls[d.index] = (d.function.name, d.function.arguments)
            finish = chunk.choices[0].finish_reason or finish
        return calls, finish

    (calls, finish), conv = asyncio.run(_session(client, tok, streamed))
    assert finish == "tool_calls" and list(calls.values()) == [("search", '{"query": "five"}')]
    prefix = _ids(tok, '<tool_call>\n{"name": "search", "arguments":')
    assert client.prompts[0][-len(prefix):] == prefix
    assert client.prompts[0][:-len(prefix)] == ChatEncoder(tok, tools=[CALCULATOR, SEARCH]).initial(ASK)
    out = conv.segments[0].to_output()
    assert out.response_mask == [0] * len(prefix) + [1] * len(client.results[0].token_ids)
    assert conv.segments[0].turns[-1]["forced_call"] == "search"
    # the engine is asked to write the rest of the call under the tool's schema, and to close it
    assert json.loads(client.samplings[0]["json_schema"]) == {"type": "object", **SEARCH["function"]["parameters"]}
    assert client.samplings[0]["json_suffix"] == "}\n</tool_call>"
    assert conv.segments[0].turns[-1]["constraint"] == "tool_call"


def test_required_constrains_to_one_call_of_a_declared_tool_and_parallel_false_keeps_the_first(tok):  # noqa: F811
    two = ('{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n<tool_call>\n'
           '{"name": "search", "arguments": {"query": "five"}}\n</tool_call>')
    client = Recording(tok, [two, "<tool_call>\n" + two])

    async def talk(oa):
        forced = await oa.chat.completions.create(model="switchyard", messages=ASK, tools=[CALCULATOR, SEARCH],
                                                  tool_choice="required")
        single = await oa.chat.completions.create(model="switchyard", messages=ASK, tools=[CALCULATOR, SEARCH],
                                                  parallel_tool_calls=False)
        both = await oa.chat.completions.create(model="switchyard", messages=ASK, tools=[CALCULATOR, SEARCH])
        return forced, single, both

    (forced, single, both), conv = asyncio.run(_session(client, tok, talk))
    schema = json.loads(client.samplings[0]["json_schema"])  # the call object: one of the declared tools
    assert [s["properties"]["name"] for s in schema["anyOf"]] == [{"const": "calculator"}, {"const": "search"}]
    assert client.samplings[0]["json_suffix"] == "\n</tool_call>" and "json_schema" not in client.samplings[1]
    assert len(forced.choices[0].message.tool_calls) == 2  # (a scripted engine ignores the constraint)
    assert [c.function.name for c in single.choices[0].message.tool_calls] == ["calculator"]
    assert len(both.choices[0].message.tool_calls) == 2
    dropped = [t.get("calls_dropped") for seg in conv.segments for t in seg.turns if t["kind"] == "generate"]
    assert sorted(dropped, key=str) == [1, None, None], dropped


def test_the_follow_up_with_the_tool_result_continues_the_same_segment(tok):  # noqa: F811
    client = Recording(tok, [REQUIRED_REPLY, ' {"query": "2+3"}}</tool_call>', "it is 5"])

    async def talk(oa):
        msgs: list = list(ASK)
        tools = [CALCULATOR, SEARCH]
        for choice in ("required", NAMED, "auto"):
            r = await oa.chat.completions.create(model="switchyard", messages=msgs, tools=tools, tool_choice=choice)
            msg = r.choices[0].message
            msgs.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls or []:
                msgs.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
        return msgs

    msgs, conv = asyncio.run(_session(client, tok, talk))
    assert [m.get("tool_calls", [{}])[0].get("function", {}).get("name") for m in msgs if m["role"] == "assistant"] \
        == ["calculator", "search", None] and msgs[-1]["content"] == "it is 5"
    [seg] = conv.segments  # one trajectory: the resent forced replies matched what was recorded
    out = seg.to_output()
    assert out.num_turns == 3
    full = out.prompt_ids + out.response_ids
    for prompt, result in zip(client.prompts, client.results):
        assert full[:len(prompt)] == prompt  # each request continued the trajectory where it stood
        assert full[len(prompt):len(prompt) + len(result.token_ids)] == result.token_ids
    assert out.model_token_ids() == [t for r in client.results for t in r.token_ids]
    named = _ids(tok, '<tool_call>\n{"name": "search", "arguments":')
    assert client.prompts[1][-len(named):] == named
    assert client.prompts[2][-len(named):] != named  # auto forces nothing


def test_a_forced_call_that_does_not_parse_is_returned_as_text_and_still_continues(tok):  # noqa: F811
    client = Recording(tok, [REQUIRED_REPLY, "sorry"])

    async def talk(oa):
        cut = await oa.chat.completions.create(model="switchyard", messages=ASK, tools=[CALCULATOR],
                                               tool_choice="required", max_tokens=4)
        again = ASK + [cut.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        await oa.chat.completions.create(model="switchyard", messages=again, tools=[CALCULATOR])
        return cut

    cut, conv = asyncio.run(_session(client, tok, talk))
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content == "<tool_call>\n" + tok.decode(client.results[0].token_ids)
    assert len(conv.segments) == 1 and conv.segments[0].to_output().num_turns == 2


def test_unsupported_tool_choices_get_a_400_naming_the_field(tok, monkeypatch):  # noqa: F811
    from agent.parsers import registry

    class NoOpening(ToolParser):  # a format of the user's own that does not say how a call opens
        def parse(self, text: str) -> ParseResult:
            return ParseResult(content=text)

    monkeypatch.setitem(registry._PARSERS, "no_opening_for_test", NoOpening)
    client = Recording(tok, ["ok"])

    async def talk(oa):
        errors = []
        for kw in (dict(tool_choice="required"),
                   dict(tool_choice={"type": "function", "function": {"name": "search"}}, tools=[CALCULATOR]),
                   dict(tool_choice="any", tools=[CALCULATOR]),
                   dict(tool_choice={"type": "function"}, tools=[CALCULATOR])):
            with pytest.raises(openai.BadRequestError) as e:
                await oa.chat.completions.create(model="switchyard", messages=ASK, **kw)
            errors.append(e.value)
        return errors

    errors, conv = asyncio.run(_session(client, tok, talk))
    assert all(e.param == "tool_choice" for e in errors)
    assert "tool_choice='required' is not supported without tools" in errors[0].message
    assert "'search', which is not among the request's tools ('calculator')" in errors[1].message
    assert "tool_choice='any' is not supported" in errors[2].message
    assert "tool_choice={'type': 'function'} is not supported" in errors[3].message

    for parser, choice in (("no_opening_for_test", "required"), ("deepseek", NAMED), ("mistral", NAMED)):
        async def refused(oa, choice=choice):
            with pytest.raises(openai.BadRequestError) as e:
                await oa.chat.completions.create(model="switchyard", messages=ASK, tools=[CALCULATOR, SEARCH],
                                                 tool_choice=choice)
            return e.value

        e, conv = asyncio.run(_session(client, tok, refused, tool_parser=parser))
        assert e.param == "tool_choice" and f"tool_parser {parser!r}" in e.message, e.message
        assert conv is None or not conv.segments  # refused before anything was recorded
    assert client.prompts == []  # nothing reached the engine


# a whole call in each format, the way its parser's docstring writes it; each opening must begin it
CALLS = {
    "hermes": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>',
    "llama3_json": '{"name": "calculator", "parameters": {"expression": "2+3"}}',
    "mistral": '[TOOL_CALLS]calculator[ARGS]{"expression": "2+3"}',
    "qwen3_coder": "<tool_call>\n<function=calculator>\n<parameter=expression>\n2+3\n</parameter>\n</function>\n"
                   "</tool_call>",
    "glm4": "<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>2+3</arg_value>\n</tool_call>",
    "seed_oss": "<seed:tool_call>\n<function=calculator>\n<parameter=expression>2+3</parameter>\n</function>\n"
                "</seed:tool_call>",
    "minimax": '<minimax:tool_call>\n<invoke name="calculator">\n<parameter name="expression">2+3</parameter>\n'
               "</invoke>\n</minimax:tool_call>",
    "deepseek_v4": '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="calculator">\n<｜DSML｜parameter name="expression" '
                   'string="true">2+3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
    "gpt-oss": '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "2+3"}'
               "<|call|>",
    "deepseek": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>calculator<｜tool▁sep｜>{"expression": "2+3"}'
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "kimi_k2": '<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:0<|tool_call_argument_begin|>'
               '{"expression": "2+3"}<|tool_call_end|><|tool_calls_section_end|>',
    "gemma": '<|tool_call>call:calculator{expression:<|"|>2+3<|"|>}<tool_call|>',
    "functiongemma": "<start_function_call>call:calculator{expression:<escape>2+3<escape>}<end_function_call>",
}
# (required, named calculator); None: not forced (their model versions write a named call differently)
OPENINGS = {
    "hermes": ("<tool_call>\n", '<tool_call>\n{"name": "calculator", "arguments":'),
    "llama3_json": ('{"name":', '{"name": "calculator", "parameters":'),
    "mistral": ("[TOOL_CALLS]", None),
    "qwen3_coder": ("<tool_call>\n", "<tool_call>\n<function=calculator>\n"),
    "glm4": ("<tool_call>", "<tool_call>calculator"),
    "seed_oss": ("<seed:tool_call>\n", "<seed:tool_call>\n<function=calculator>\n"),
    "minimax": ("<minimax:tool_call>\n", '<minimax:tool_call>\n<invoke name="calculator">\n'),
    "deepseek_v4": ("<｜DSML｜tool_calls>\n", '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="calculator">\n'),
    "gpt-oss": ("<|channel|>commentary to=functions",
                "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>"),
    "deepseek": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", None),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>",
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.calculator:"),
    "gemma": ("<|tool_call>call", "<|tool_call>call:calculator"),
    "functiongemma": ("<start_function_call>call", "<start_function_call>call:calculator"),
}
# pre-tokenizer patterns of the families' byte-level BPEs: BPE never merges across the pieces they cut,
# so an opening that ends where a piece ends encodes alone as it does inside the whole call
PRE_TOKENIZERS = {
    "cl100k (Llama 3, Qwen, DeepSeek, Kimi)": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                                              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "o200k (gpt-oss)": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                       r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                       r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# the formats' markers that are special (or added) tokens in their tokenizers: split out before pre-tokenizing
SPECIAL = (r"<\|[^<>]*?\|>|<｜[^<>]*?｜>|<\|[^<>|]*?>|<[^<>|]*?\|>|\[[A-Z_]+\]"
           r"|</?(?:tool_call|seed:tool_call|minimax:tool_call|arg_key|arg_value|start_function_call"
           r"|end_function_call|escape)>")


def _piece_ends(text: str, pattern: str) -> set[int]:
    """Where the pieces of `text` end once special markers are split out and the rest pre-tokenized."""
    import regex

    ends, at = set(), 0
    for chunk in regex.split(f"({SPECIAL})", text):
        if regex.fullmatch(SPECIAL, chunk):
            at += len(chunk)
            ends.add(at)
            continue
        for m in regex.finditer(pattern, chunk):
            ends.add(at + m.end())
        at += len(chunk)
    return ends


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_opening_begins_its_formats_call_on_a_token_boundary(name, tok):  # noqa: F811
    parser = get_tool_parser(name, {"calculator": CALCULATOR["function"]["parameters"]})
    full = CALLS[name]
    got = parser.parse(full)
    assert [(c.name, c.arguments) for c in got.calls] == [("calculator", {"expression": "2+3"})], got
    openings = [parser.call_prefix(None), parser.call_prefix("calculator")]
    assert tuple(openings) == OPENINGS[name]
    for prefix in filter(None, openings):
        assert full.startswith(prefix), (prefix, full)
        ids = _ids(tok, prefix)  # encoded alone, as the gateway does, it is how the whole call begins
        assert _ids(tok, full)[:len(ids)] == ids, (prefix, [tok.decode([i]) for i in _ids(tok, full)[:len(ids) + 2]])
        for family, pattern in PRE_TOKENIZERS.items():
            assert len(prefix) in _piece_ends(full, pattern), (family, prefix)
    if openings[1] is not None:
        assert parser.call_prefix('bad name"') is None or name in ("hermes", "llama3_json")


def test_every_built_in_parser_is_covered_and_the_base_forces_nothing():
    assert set(known_parsers()) == set(CALLS) == set(OPENINGS)
    assert ToolParser().call_prefix() is None and ToolParser().call_prefix("f") is None


GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


class _Proxy:
    """A real bus client that also keeps the prompts it sent."""

    def __init__(self, client: Any) -> None:
        self.client, self.prompts = client, []

    async def generate(self, prompt_ids: Any, sampling: dict, **kw: Any):
        self.prompts.append(list(prompt_ids))
        return await self.client.generate(prompt_ids, sampling, **kw)

    def end_session(self, session_id: str) -> None:
        self.client.end_session(session_id)


@pytest.mark.skipif(not (GSM8K / "train.jsonl").exists(), reason="the tool-calling model trains on GSM8K")
def test_a_real_engine_writes_the_forced_call_token_exactly(servers, tool_caller):
    from rollout.bus.client import GenerateClient
    from test_tool_agent import _server_log, _tokenizer
    from tool_model import gsm8k_rows

    srv = servers(1, backend="hf", model=str(tool_caller))
    tokenizer = _tokenizer(tool_caller)
    rows = gsm8k_rows(GSM8K / "test.jsonl", 2)

    async def body():
        async with GenerateClient(srv.addresses) as bus:
            await bus.wait_ready(timeout_s=300)
            proxy = _Proxy(bus)
            gw = Gateway(proxy, tokenizer)
            await gw.start()
            try:
                results = []
                for row, choice in zip(rows, ("required", {"type": "function", "function": {"name": "calculator"}})):
                    key = gw.open_session()
                    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as oa:
                        msgs = list(row["prompt"])
                        r = await oa.chat.completions.create(model="switchyard", messages=msgs, tools=[CALCULATOR],
                                                             tool_choice=choice, temperature=0.0, max_tokens=48)
                        msg = r.choices[0].message
                        msgs.append(msg.model_dump(exclude_none=True))
                        for call in msg.tool_calls or []:
                            msgs.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
                        if not msg.tool_calls:
                            msgs.append({"role": "user", "content": "go on"})
                        await oa.chat.completions.create(model="switchyard", messages=msgs, tools=[CALCULATOR],
                                                         temperature=0.0, max_tokens=16)
                    results.append((r, gw.close_session(key), proxy.prompts[-2]))
                return results
            finally:
                await gw.stop()

    results = asyncio.run(body())
    sent = _server_log(srv.request_logs)
    openings = ["<tool_call>\n", '<tool_call>\n{"name": "calculator", "arguments":']
    for (r, conv, prompt), opening in zip(results, openings):
        prefix = _ids(tokenizer, opening)
        assert prompt[-len(prefix):] == prefix
        [seg] = conv.segments  # the follow-up continued the forced turn's segment
        out = seg.to_output()
        out.check()
        assert out.num_turns == 2 and out.response_ids[:len(prefix)] == prefix
        pos = 0  # each request continued the trajectory where it stood; its tokens are the mask-1 ones
        for rid in out.request_ids:
            rec = sent[rid]
            while out.response_mask[pos] == 0:  # the forced opening first, then the template's glue
                pos += 1
            assert rec["prompt_len"] == len(out.prompt_ids) + pos
            assert out.response_ids[pos:pos + len(rec["token_ids"])] == rec["token_ids"]
            assert out.response_mask[pos:pos + len(rec["token_ids"])] == [1] * len(rec["token_ids"])
            pos += len(rec["token_ids"])
        assert pos == len(out.response_ids)
        assert out.model_token_ids() == [t for rid in out.request_ids for t in sent[rid]["token_ids"]]
    # the tiny model was taught this call: forced, it writes it through greedily
    calls = [c for r, _, _ in results for c in r.choices[0].message.tool_calls or []]
    assert calls and all(c.function.name == "calculator" and "expression" in json.loads(c.function.arguments)
                         for c in calls), [r.choices[0].message for r, _, _ in results]


def test_pydantic_ai_output_type_gets_its_int_through_a_forced_call(tok):  # noqa: F811
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    client = Recording(tok, ['{"name": "final_result", "arguments": {"response": 5}}</tool_call>'])

    async def body():
        gw = Gateway(client, tok)
        await gw.start()
        try:
            model = OpenAIChatModel("switchyard", provider=OpenAIProvider(base_url=gw.base_url, api_key="k"))
            result = await Agent(model, output_type=int).run("what is 2+3?")
            return result.output, gw.sessions["k"]
        finally:
            await gw.stop()

    output, conv = asyncio.run(body())
    assert output == 5 and type(output) is int
    assert conv.segments[0].turns[-1]["forced_call"] == "required"  # pydantic-ai asked for a call
    assert client.prompts[0][-len(_ids(tok, "<tool_call>\n")):] == _ids(tok, "<tool_call>\n")
