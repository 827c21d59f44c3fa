"""An output schema beside tools offered (tool_choice auto or unset): the engine decodes under the
union of the schema's compact JSON and one call per declared tool in the parser's format
(`SamplingParams.json_calls`, engines/inference/grammar.py), so the model chooses between a call and
the final answer and nothing is forced. The grammar itself against a real tokenizer, the gateway's
vetting of the union (a scripted bus client nothing may reach), then chat, Responses and Messages
against an hf engine serving the tiny tool-calling model: each reply a valid call or a valid object,
every recorded model token the engine's, each turn naming the constraint it was drawn under."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.gateway import Gateway  # noqa: E402
from conftest import GSM8K  # noqa: E402
from test_tool_agent_states import ScriptedClient, tok  # noqa: E402,F401

CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
# no free strings: once the reply opens as the answer, no token but the schema's may follow
VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}, "score": {"type": "integer",
                                                                                           "minimum": 0, "maximum": 9}},
           "required": ["verdict", "score"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}


def _calls(*tools: dict) -> str:
    """The `json_calls` the gateway builds for hermes and these tools."""
    from agent.parsers import get_tool_parser

    parser = get_tool_parser("hermes", {t["function"]["name"]: t["function"]["parameters"] for t in tools})
    return json.dumps([[parser.call_prefix(n), *parser.call_constraint(n)] for n in parser.tools])


def test_the_union_takes_a_declared_call_or_the_answer_and_nothing_else(tok):  # noqa: F811
    from engines.inference.grammar import Grammars, ebnf

    grammars = Grammars(tok, len(tok), {tok.eos_token_id})
    schema, calls = json.dumps(VERDICT), _calls(CALCULATOR, SEARCH)

    def takes(text: str) -> bool:
        m = grammars.matcher(schema, "", calls)
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) \
            and m.accept_token(tok.eos_token_id) and m.is_terminated()

    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    assert takes(call) and takes(call.replace("calculator", "search").replace("expression", "query"))
    assert takes('{"verdict": "yes", "score": 7}')
    for bad in ('{"verdict": "maybe", "score": 7}', '{"verdict": "yes"}',  # off the schema
                call.replace("calculator", "weather"),  # an undeclared tool
                call.replace('"expression"', '"expr"'),  # arguments off the tool's parameters
                call.removesuffix("\n</tool_call>"),  # an unclosed call
                '<tool_call>\n{"name": "calculator"}\n</tool_call>', "yes"):
        assert not takes(bad), bad
    from xgrammar import Grammar

    Grammar.from_ebnf(ebnf(schema, "", calls))  # what vLLM and SGLang are sent reads back as a grammar


def test_the_union_is_vetted_before_any_engine_and_a_parser_without_a_grammar_call_is_refused(tok):  # noqa: F811
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": "a("}}, "required": ["q"]}}}
    huge_tool = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100} for i in range(12_000)}}}}

    async def body(parser: str, **kw: Any) -> tuple[int, str, int, Any]:
        client = ScriptedClient(tok, ['{"verdict": "yes", "score": 1}'])
        gw = Gateway(client, tok, tool_parser=parser, max_schema_kb=1024)
        await gw.start()
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as oa:
                try:
                    await oa.chat.completions.create(model="switchyard", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=8, response_format=FORMAT, **kw)
                    return 200, "", len(client.prompts), None
                except openai.APIStatusError as e:
                    return e.status_code, str(e), len(client.prompts), (e.body or {}).get("param")
        finally:
            await gw.stop()

    status, said, sent, param = asyncio.run(body("hermes", tools=[CALCULATOR, bad_tool]))
    assert (status, sent, param) == (400, 0, "tools") and "beside the output schema" in said and "Regex" in said, said
    status, said, sent, param = asyncio.run(body("hermes", tools=[huge_tool]))
    assert (status, sent) == (413, 0) and "max_schema_kb" in said, said
    status, said, sent, param = asyncio.run(body("qwen3_coder", tools=[CALCULATOR]))
    assert (status, sent) == (400, 0) and "qwen3_coder" in said and "tool_choice=none" in said, said
    assert asyncio.run(body("hermes", tools=[CALCULATOR], tool_choice="none"))[0] == 200  # the schema alone


@pytest.mark.skipif(not (GSM8K / "train.jsonl").exists(), reason="the tool-calling model trains on GSM8K")
def test_chat_responses_and_messages_decode_a_call_or_the_answer_token_exactly(servers, tool_caller):
    import jsonschema

    from rollout.bus.client import GenerateClient
    from test_tool_agent import _server_log, _tokenizer
    from tool_model import SYSTEM

    srv = servers(1, backend="hf", model=str(tool_caller))
    tokenizer = _tokenizer(tool_caller)
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 17 * 23? Use the calculator."}]
    brace = tokenizer.encode('{"', add_special_tokens=False)
    assert len(brace) == 1  # the answer's first token; a call opens with `<`

    async def body() -> tuple[dict[str, Any], dict[str, Any]]:
        got: dict[str, Any] = {}
        async with GenerateClient(srv.addresses) as bus:
            await bus.wait_ready(timeout_s=300)
            gw = Gateway(bus, tokenizer)
            await gw.start()
            try:
                common = dict(model="switchyard", messages=ask, tools=[CALCULATOR], response_format=FORMAT,
                              temperature=0.0, max_tokens=48)
                for case, extra in (("call", {}), ("answer", {"logit_bias": {str(brace[0]): 100}}),
                                    ("required", {"tool_choice": "required"})):
                    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=gw.open_session(case),
                                                  max_retries=0) as oa:
                        got[case] = (await oa.chat.completions.create(**common, **extra)).choices[0]
                async with aiohttp.ClientSession() as s:
                    async with s.post(gw.base_url + "/responses", headers={"X-Session-Id": gw.open_session("resp")},
                                      json={"model": "switchyard", "instructions": SYSTEM, "input": ask[1]["content"],
                                            "tools": [{"type": "function", **CALCULATOR["function"]}],
                                            "temperature": 0.0, "max_output_tokens": 48, "text": {"format": {
                                                "type": "json_schema", "name": "verdict", "schema": VERDICT}}}) as r:
                        got["resp"] = (r.status, await r.json())
                    async with s.post(gw.base_url + "/messages", headers={"x-api-key": gw.open_session("msg")},
                                      json={"model": "switchyard", "system": SYSTEM, "messages": [ask[1]],
                                            "tools": [{"name": "calculator",
                                                       "input_schema": CALCULATOR["function"]["parameters"]}],
                                            "temperature": 0.0, "max_tokens": 48,
                                            "output_config": {"format": {"type": "json_schema", "schema": VERDICT}}}) as r:
                        got["msg"] = (r.status, await r.json())
                return got, {case: gw.close_session(case) for case in ("call", "answer", "required", "resp", "msg")}
            finally:
                await gw.stop()

    got, sessions = asyncio.run(body())
    call = got["call"]  # the model was taught to call the calculator first, and chooses to
    assert call.finish_reason == "tool_calls" and call.message.content is None, call
    [c] = call.message.tool_calls
    assert c.function.name == "calculator" and isinstance(json.loads(c.function.arguments)["expression"], str)
    answer = got["answer"]  # the answer's first token made likelier: the same request answers under the schema
    assert answer.finish_reason == "stop" and not answer.message.tool_calls, answer
    jsonschema.validate(json.loads(answer.message.content), VERDICT)
    [forced] = got["required"].message.tool_calls  # required still forces a call (its opening is context)
    assert forced.function.name == "calculator"
    status, resp = got["resp"]
    assert status == 200, resp
    [item] = resp["output"]
    assert (item["type"], item["name"]) == ("function_call", "calculator"), item
    status, msg = got["msg"]
    assert status == 200 and msg["stop_reason"] == "tool_use", msg
    assert [(b["type"], b["name"]) for b in msg["content"]] == [("tool_use", "calculator")], msg
    sent = _server_log(srv.request_logs)
    for case, conv in sessions.items():
        [seg] = conv.segments
        out = seg.to_output()
        out.check()
        assert out.model_token_ids() == [t for rid in out.request_ids for t in sent[rid]["token_ids"]], case
        [turn] = [t for t in seg.turns if t["kind"] == "generate"]
        if case == "required":
            assert (turn["constraint"], turn["forced_call"]) == ("tool_call", "required"), turn
            assert 0 in out.response_mask, "the forced opening is context"
        else:  # nothing forced: every response token is the model's
            assert turn["constraint"] == "tool_call_or_json_schema" and "forced_call" not in turn, turn
            assert set(out.response_mask) == {1}, case


def test_a_reply_that_opens_with_a_call_is_the_call_and_any_other_the_answer(tok):  # noqa: F811
    """llama3_json: a call and the answer both open with `{`; the reply is a call only when it opens
    with a declared call's opening, so an answer is never read as a malformed call. A forced call
    with an output schema still vets the schema (a 400 naming its fault)."""
    replies = ['{"name": "calculator", "parameters": {"expression": "1+1"}}', '{"verdict": "yes", "score": 3}']

    async def body() -> tuple[list[Any], Any, list[dict], Any]:
        client = ScriptedClient(tok, replies)
        samplings: list[dict] = []
        generate = client.generate

        async def keep(prompt_ids: Any, sampling: dict, **kw: Any) -> Any:
            samplings.append(dict(sampling))
            return await generate(prompt_ids, sampling, **kw)

        client.generate = keep
        gw = Gateway(client, tok, tool_parser="llama3_json")
        await gw.start()
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as oa:
                got = [(await oa.chat.completions.create(
                    model="switchyard", messages=[{"role": "user", "content": "hi"}], tools=[CALCULATOR],
                    response_format=FORMAT, max_tokens=32)).choices[0].message for _ in replies]
                try:
                    await oa.chat.completions.create(
                        model="switchyard", messages=[{"role": "user", "content": "hi"}], tools=[CALCULATOR],
                        tool_choice="required", max_tokens=32, response_format={
                            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
                    refused = None
                except openai.BadRequestError as e:
                    refused = e
            return got, gw.sessions.get("k"), samplings, refused
        finally:
            await gw.stop()

    (call, answer), conv, samplings, refused = asyncio.run(body())
    [c] = call.tool_calls
    assert (c.function.name, json.loads(c.function.arguments)) == ("calculator", {"expression": "1+1"})
    assert not answer.tool_calls and json.loads(answer.content) == {"verdict": "yes", "score": 3}
    assert json.loads(samplings[0]["json_calls"]) == [['{"name": "calculator", "parameters":',
                                                       CALCULATOR["function"]["parameters"], "}"]]
    assert refused is not None and "Unsupported type" in str(refused) and len(samplings) == 2
    assert [t["constraint"] for seg in conv.segments for t in seg.turns if t["kind"] == "generate"] == [
        "tool_call_or_json_schema"] * 2
