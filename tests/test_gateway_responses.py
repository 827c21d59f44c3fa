"""The gateway's OpenAI Responses API (`/v1/responses`): the real `openai` client (`responses.create`,
streamed and not, and the `responses.stream` helper) against an hf engine, token-exact against the
engine's request log; a function tool round continued with `previous_response_id`; OpenAI-shaped
refusals; and the OpenAI Agents SDK's default Responses path running a function tool, when
`openai-agents` is installed: on a scripted bus client (exact replies), and on an hf engine serving the
tool-calling tiny model, token-exact against the engine's request log."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
openai = pytest.importorskip("openai")

from agent.gateway import Gateway  # noqa: E402
from test_gateway import _with_gateway  # noqa: E402
from test_tool_agent import _server_log, _tokenizer, check_against_server  # noqa: E402
from test_tool_agent_states import ScriptedClient, tok  # noqa: E402,F401
from tool_model import SYSTEM, gsm8k_rows  # noqa: E402

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
CALCULATOR = {"type": "function", "name": "calculator", "description": "Evaluate an arithmetic expression.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}, "strict": True}


def test_string_input_streamed_and_not_is_token_exact(servers):
    srv = servers(1, backend="hf", model="tiny-llama")
    tokenizer = _tokenizer("tiny-llama")

    async def body(gw: Gateway):
        key = gw.open_session()
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as oa:
            plain = await oa.responses.create(model="switchyard", instructions="Answer briefly.",
                                              input="What is the capital of France?", max_output_tokens=12,
                                              temperature=1.0, extra_body={"seed": 7})
            events = [e async for e in await oa.responses.create(
                model="switchyard", input="Name a colour.", max_output_tokens=12, temperature=1.0, stream=True,
                extra_body={"seed": 7})]
        return gw.close_session(key), plain, events

    conv, plain, events = asyncio.run(_with_gateway(srv.addresses, tokenizer, body))
    sent = _server_log(srv.request_logs)
    assert len(conv.segments) == 2  # two conversations of one session
    for seg in conv.segments:
        check_against_server(seg.to_output(), sent)  # mask-1 tokens = what the engine sent, in order
    first, second = (sent[s.request_ids[0]] for s in conv.segments)
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.model == "switchyard"
    assert plain.usage.output_tokens == len(first["token_ids"]) and plain.usage.input_tokens == first["prompt_len"]
    assert plain.status == ("incomplete" if first["finish_reason"] == "length" else "completed")
    if plain.status == "incomplete":
        assert plain.incomplete_details.reason == "max_output_tokens"
    assert plain.output_text.strip() in tokenizer.decode(first["token_ids"])
    assert conv.segments[0].held[0] == {"role": "system", "content": "Answer briefly."}  # instructions
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{events[-1].response.status}" and kinds[-1] in ("response.completed",
                                                                                   "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.usage.output_tokens == len(second["token_ids"])
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.output_text and deltas.strip() in tokenizer.decode(second["token_ids"])
    message = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[2:-1] == message  # a seeded sample of a dozen tokens: text, no tool call


def test_a_function_tool_round_with_previous_response_id_is_one_trajectory(tok):  # noqa: F811
    client = ScriptedClient(tok, [CALL, "It is 5."])

    async def body():
        gw = Gateway(client, tok)
        await gw.start()
        try:
            key = gw.open_session()
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as oa:
                async with oa.responses.stream(model="switchyard", instructions="Use the calculator.",
                                               input=[{"role": "user", "content": "What is 2+3?"}],
                                               tools=[CALCULATOR]) as stream:
                    kinds = [e.type async for e in stream]
                    first = await stream.get_final_response()
                call = first.output[0]
                second = await oa.responses.create(
                    model="switchyard", instructions="Use the calculator.", previous_response_id=first.id,
                    tools=[CALCULATOR], input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
            return gw.close_session(key), kinds, first, second
        finally:
            await gw.stop()

    conv, kinds, first, second = asyncio.run(body())
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [o.type for o in first.output] == ["function_call"] and first.status == "completed"
    call = first.output[0]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "2+3"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert second.output_text == "It is 5." and second.previous_response_id == first.id
    assert len(conv.segments) == 1  # the follow-up continued the trajectory, not re-rendered it
    seg = conv.segments[0]
    out = seg.to_output()
    assert out.num_turns == 2 and [t["calls"] for t in seg.turns if t["kind"] == "tools"] == [1]
    p0, p1 = client.prompts
    reply = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    assert p1[:len(p0)] == p0 and p1[len(p0):len(p0) + len(reply)] == reply  # the engine's tokens, then the tool turn
    assert out.model_token_ids() == reply + tok.encode("It is 5.", add_special_tokens=False) + [tok.eos_token_id]
    assert [m["role"] for m in seg.held] == ["system", "user", "assistant", "tool", "assistant"]
    assert seg.held[3] == {"role": "tool", "content": "5", "tool_call_id": call.call_id, "name": "calculator"}


def test_refusals_are_openai_errors(tok):  # noqa: F811
    async def body():
        gw = Gateway(ScriptedClient(tok, ["ok"]), tok)
        await gw.start()
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as oa, \
                    openai.AsyncOpenAI(base_url=gw.base_url, api_key="other", max_retries=0) as other:
                ok = await oa.responses.create(model="switchyard", input="hi")
                assert ok.output_text == "ok"
                with pytest.raises(openai.BadRequestError, match="resp_nope") as e:
                    await oa.responses.create(model="switchyard", input="hi", previous_response_id="resp_nope")
                assert e.value.code == "previous_response_not_found"
                with pytest.raises(openai.BadRequestError, match="not found"):  # another session's response
                    await other.responses.create(model="switchyard", input="hi", previous_response_id=ok.id)
                with pytest.raises(openai.BadRequestError, match="tool type 'web_search'"):
                    await oa.responses.create(model="switchyard", input="hi", tools=[{"type": "web_search"}])
                with pytest.raises(openai.BadRequestError, match="text.format type 'grammar' is not supported") as e:
                    await oa.responses.create(model="switchyard", input="hi", text={"format": {"type": "grammar"}})
                assert e.value.param == "text.format"
                with pytest.raises(openai.BadRequestError, match="needs a `schema` object"):
                    await oa.responses.create(model="switchyard", input="hi", text={"format": {
                        "type": "json_schema", "name": "x"}})
                assert (await oa.responses.create(model="gpt-4", input="hi")).model == "switchyard"  # served, named
                with pytest.raises(openai.BadRequestError, match=r"text.verbosity is not supported.*name the served "
                                                                 r"model, Agent\(model='switchyard'\)"):
                    await oa.responses.create(model="gpt-5", input="hi", text={"verbosity": "low"})
                with pytest.raises(openai.BadRequestError, match="tool_choice='required' is not supported without"):
                    await oa.responses.create(model="switchyard", input="hi", tool_choice="required")
                with pytest.raises(openai.BadRequestError, match="reasoning.effort"):
                    await oa.responses.create(model="switchyard", input="hi", reasoning={"effort": "high"})
                with pytest.raises(openai.BadRequestError, match="conversation is not supported"):
                    await oa.responses.create(model="switchyard", input="hi", conversation="conv_1")
                with pytest.raises(openai.BadRequestError, match="item type 'item_reference'"):
                    await oa.responses.create(model="switchyard", input=[{"type": "item_reference", "id": "x"}])
                accepted = await oa.responses.create(  # options that change nothing are accepted
                    model="switchyard", input="hi", text={"format": {"type": "text"}}, truncation="disabled",
                    store=True, metadata={"run": "1"}, include=["reasoning.encrypted_content"], user="u",
                    parallel_tool_calls=True, tool_choice="auto", tools=[CALCULATOR])
                assert accepted.status == "completed" and accepted.metadata == {"run": "1"}
        finally:
            await gw.stop()

    asyncio.run(body())


def test_the_openai_agents_sdk_runs_a_function_tool_through_the_gateway(tok):  # noqa: F811
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        called.append(expression)
        return "5"

    async def run(gw: Gateway, stream: bool) -> tuple[Any, Any]:
        key = gw.open_session()
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        agent = agents.Agent(name="calc", instructions="Use the calculator.", tools=[calculator],
                             model=agents.OpenAIResponsesModel(model="switchyard", openai_client=client))
        if stream:
            result = agents.Runner.run_streamed(agent, "What is 2+3?")
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, "What is 2+3?")
        await client.close()
        return result.final_output, gw.close_session(key)

    async def body():
        gw = Gateway(ScriptedClient(tok, [CALL, "It is 5.", CALL, "It is 5."]), tok)
        await gw.start()
        try:
            return [await run(gw, stream) for stream in (False, True)]
        finally:
            await gw.stop()

    for final, conv in asyncio.run(body()):
        assert final == "It is 5."
        assert len(conv.segments) == 1  # the SDK resends the whole history: it continues the trajectory
        seg = conv.segments[0]
        assert seg.to_output().num_turns == 2 and [t["calls"] for t in seg.turns if t["kind"] == "tools"] == [1]
        assert [m["role"] for m in seg.held] == ["system", "user", "assistant", "tool", "assistant"]
    assert called == ["2+3", "2+3"]


def test_the_openai_agents_sdk_on_a_real_engine_is_token_exact(servers, tool_caller):  # noqa: F811
    """The Agents SDK's default model (`/v1/responses`) drives the tool-calling tiny model on an hf
    engine: function-tool rounds run, and every recorded trajectory holds exactly the engine's
    prompt and output tokens; the usage the SDK saw is the engine's too."""
    agents = pytest.importorskip("agents")
    from test_tool_agent import GSM8K

    from gateway_agent import _calc

    agents.set_tracing_disabled(True)
    srv = servers(1, backend="hf", model=str(tool_caller))
    tokenizer = _tokenizer(tool_caller)
    rows = gsm8k_rows(GSM8K / "test.jsonl", 4)
    called: list[str] = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        called.append(expression)
        return _calc(json.dumps({"expression": expression}))

    async def run(gw: Gateway, row: dict) -> tuple[Any, Any]:
        key = gw.open_session()
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0)
        # greedy: the calls the tiny model was taught, whichever machine trained it
        agent = agents.Agent(name="calc", instructions=SYSTEM, tools=[calculator],
                             model=agents.OpenAIResponsesModel(model="switchyard", openai_client=client),
                             model_settings=agents.ModelSettings(temperature=0.0, max_tokens=48))
        try:
            result = await agents.Runner.run(agent, row["prompt"][1]["content"], max_turns=3)
            responses = result.raw_responses
        except agents.exceptions.MaxTurnsExceeded as e:  # a model that keeps calling: its rounds still count
            responses = e.run_data.raw_responses if e.run_data is not None else []
        finally:
            await client.close()
        return responses, gw.close_session(key)

    async def body(gw: Gateway):
        two = asyncio.Semaphore(2)

        async def one(row: dict):
            async with two:
                return await run(gw, row)
        return await asyncio.gather(*(one(r) for r in rows))

    results = asyncio.run(_with_gateway(srv.addresses, tokenizer, body))
    sent = _server_log(srv.request_logs)
    assert called, "the tiny model made no function call through the SDK"  # a tool round really ran
    rounds = 0
    for responses, conv in results:
        assert len(conv.segments) == 1  # the SDK resends the history: one trajectory per run
        seg = conv.segments[0]
        out = seg.to_output()
        check_against_server(out, sent)  # prompt and output tokens are the engine's, exactly
        assert out.num_turns == len(responses) >= 1
        for r, rid in zip(responses, seg.request_ids):  # what the SDK was told is what the engine did
            assert r.usage.input_tokens == sent[rid]["prompt_len"]
            assert r.usage.output_tokens == len(sent[rid]["token_ids"])
        tools = [t for t in seg.turns if t["kind"] == "tools"]
        rounds += len(tools)
        assert [m["role"] for m in seg.held][:2] == ["system", "user"] and seg.held[0]["content"] == SYSTEM
        assert sum(m["role"] == "tool" for m in seg.held) == sum(t["calls"] for t in tools)
    assert rounds >= 1 and len(sent) == sum(len(c.segments[0].request_ids) for _, c in results)
