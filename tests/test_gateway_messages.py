"""Anthropic's Messages API on the gateway (`/v1/messages`): the real `anthropic` SDK against the real
server. A plain round trip (streaming and not) against an hf engine is token-exact against the
engine's request log; a tool round (scripted client: the test is about the gateway) records one
continuous trajectory, the same tokens as the chat route records for the same conversation; bad
requests get Anthropic-shaped errors the SDK raises as its own exception classes."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from agent.gateway import Gateway  # noqa: E402
from test_tool_agent import _server_log, check_against_server  # noqa: E402
from test_tool_agent_states import ScriptedClient, tok  # noqa: E402,F401

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
CALCULATOR = {"name": "calculator", "description": "Evaluates arithmetic.", "input_schema": SCHEMA}
CHAT_CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic.",
                                                    "parameters": SCHEMA}}
SYSTEM = "You answer arithmetic questions."


def _client(gw: Gateway, key: str) -> Any:
    """The SDK appends /v1/messages to its base URL: the gateway's base URL without /v1."""
    base = gw.base_url.removesuffix("/v1").replace("0.0.0.0", "127.0.0.1")
    return anthropic.AsyncAnthropic(base_url=base, api_key=key, max_retries=0)


def test_plain_messages_streaming_and_not_are_token_exact(servers, tok):  # noqa: F811
    from rollout.bus.client import GenerateClient

    srv = servers(1, backend="hf", model="tiny-llama")

    async def talk(gw: Gateway, stream: bool):
        key = gw.open_session()
        history: list = [{"role": "user", "content": "Say something."}]
        replies = []
        async with _client(gw, key) as client:
            for follow_up in ("And more?", None):
                ask = dict(model="switchyard", system=SYSTEM, messages=history, max_tokens=8,
                           extra_body={"temperature": 1.0, "top_k": 50})
                if stream:
                    async with client.messages.stream(**ask) as s:
                        msg = await s.get_final_message()
                else:
                    msg = await client.messages.create(**ask)
                replies.append(msg)
                history = history + [msg.to_param()] + ([{"role": "user", "content": [
                    {"type": "text", "text": follow_up}]}] if follow_up else [])
        return gw.close_session(key), replies

    async def body():
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            gw = Gateway(client, tok)
            await gw.start()
            try:
                return [await talk(gw, stream) for stream in (False, True)]
            finally:
                await gw.stop()

    results = asyncio.run(body())
    sent = _server_log(srv.request_logs)
    for conv, replies in results:
        assert len(conv.segments) == 1  # the second request continued the first's trajectory
        out = conv.segments[0].to_output()
        assert out.num_turns == 2
        check_against_server(out, sent)  # mask-1 tokens = what the engine sent, in order
        for msg, rid in zip(replies, out.request_ids):
            rec = sent[rid]
            assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
            assert msg.model == "switchyard" and msg.stop_sequence is None
            assert msg.usage.output_tokens == len(rec["token_ids"]) and msg.usage.input_tokens == rec["prompt_len"]
            assert msg.stop_reason == ("max_tokens" if rec["finish_reason"] == "length" else "end_turn")
            assert all(b.type == "text" for b in msg.content)
            assert "".join(b.text for b in msg.content).strip() in tok.decode(rec["token_ids"])


class _Recording(ScriptedClient):
    """A scripted client that keeps the sampling parameters each request reached the engine with."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.sampling: list[dict] = []

    async def generate(self, prompt_ids: Any, sampling: dict, **kw: Any):
        self.sampling.append(dict(sampling))
        return await super().generate(prompt_ids, sampling, **kw)


async def _anthropic_tool_round(gw: Gateway, key: str, stream: bool, is_error: bool = False) -> list:
    async with _client(gw, key) as client:
        history: list = [{"role": "user", "content": "what is 2+3?"}]
        ask = dict(model="switchyard", system=[{"type": "text", "text": SYSTEM}], max_tokens=64, tools=[CALCULATOR],
                   tool_choice={"type": "auto"}, metadata={"user_id": "u1"},
                   extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
        msgs = []
        for _ in range(2):
            if stream:
                async with client.messages.stream(messages=history, **ask) as s:
                    msg = await s.get_final_message()
            else:
                msg = await client.messages.create(messages=history, **ask)
            msgs.append(msg)
            uses = [b for b in msg.content if b.type == "tool_use"]
            history = history + [msg.to_param(), {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": [{"type": "text", "text": "5"}],
                 **({"is_error": True} if is_error else {})} for u in uses]}]
        return msgs


def test_a_tool_round_is_one_trajectory_recorded_as_chat_records_it(tok):  # noqa: F811
    async def body():
        client = _Recording(tok, [CALL, "it is 5"] * 4)
        gw = Gateway(client, tok)
        await gw.start()
        try:
            plain = await _anthropic_tool_round(gw, "plain", stream=False)
            streamed = await _anthropic_tool_round(gw, "streamed", stream=True)
            failed = await _anthropic_tool_round(gw, "failed", stream=False, is_error=True)
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="chat", max_retries=0) as oa:
                msgs: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what is 2+3?"}]
                r = await oa.chat.completions.create(model="switchyard", messages=msgs, tools=[CHAT_CALCULATOR],
                                                     max_tokens=64)
                call = r.choices[0].message.tool_calls[0]
                msgs += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "5"}]
                await oa.chat.completions.create(model="switchyard", messages=msgs, tools=[CHAT_CALCULATOR],
                                                 max_tokens=64)
            return plain, streamed, failed, gw.sessions, client
        finally:
            await gw.stop()

    plain, streamed, failed, sessions, client = asyncio.run(body())
    for first, second in (plain, streamed):
        [use] = first.content
        assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "calculator"
        assert use.input == {"expression": "2+3"} and first.stop_reason == "tool_use"
        assert [(b.type, b.text) for b in second.content] == [("text", "it is 5")]
        assert second.stop_reason == "end_turn"
    chat = sessions["chat"].segments[0].to_output()
    for key in ("plain", "streamed"):
        conv = sessions[key]
        assert len(conv.segments) == 1  # the tool round continued the segment
        out = conv.segments[0].to_output()
        assert out.num_turns == 2
        assert [t for t in out.turns if t["kind"] == "tools"] == [
            {"kind": "tools", "calls": 1, "failed": 0, "recorded_by": "gateway"}]
        # the same conversation through the chat route: the same tokens, mask and logprobs
        assert (out.prompt_ids, out.response_ids, out.response_mask, out.response_logprobs) == (
            chat.prompt_ids, chat.response_ids, chat.response_mask, chat.response_logprobs)
    assert client.prompts[1][:len(client.prompts[0])] == client.prompts[0]  # continued, not re-rendered
    assert client.sampling[0] == {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "max_tokens": 64}
    bad = sessions["failed"].segments[0]
    assert [t["failed"] for t in bad.turns if t["kind"] == "tools"] == [1]  # is_error counts as a failed call
    assert bad.held[3] == {"role": "tool", "tool_call_id": failed[0].content[0].id, "content": "Error: 5"}


class _SlowClient(ScriptedClient):
    async def generate(self, prompt_ids: Any, sampling: dict, **kw: Any):
        await asyncio.sleep(0.5)
        return await super().generate(prompt_ids, sampling, **kw)


def test_bad_requests_get_anthropic_errors(tok):  # noqa: F811
    ok = [{"role": "user", "content": "hi"}]

    async def body():
        gw = Gateway(_SlowClient(tok, ["ok"]), tok, max_inflight=1)
        await gw.start()
        far = Gateway(ScriptedClient(tok, ["ok"]), tok, host="0.0.0.0", api_keys=["secret"])
        await far.start()
        try:
            async with _client(gw, "k") as client:
                with pytest.raises(anthropic.BadRequestError, match="max_tokens is required"):  # the SDK insists on it
                    await client.post("/v1/messages", body={"model": "switchyard", "messages": ok},
                                      cast_to=anthropic.types.Message)
                cases = [
                    (dict(stop_sequences=["\n"]), "stop_sequences is not supported"),
                    (dict(tool_choice={"type": "any"}), r"tool_choice='required' is not supported without tools"),
                    (dict(messages=ok + [{"role": "assistant", "content": "The answer is"}]), "prefill"),
                    (dict(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
                     r"messages\[0\].content\[0\]: content block type 'document' is not supported"),
                    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
                        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]), "takes none"),
                    (dict(extra_body={"top_k": 0}), "top_k=0 must be a positive integer"),
                    (dict(output_config={"format": {"type": "json_object"}}), "output_config.format must be"),
                ]
                for kw, match in cases:
                    ask = {"model": "switchyard", "messages": ok, "max_tokens": 8, **kw}
                    with pytest.raises(anthropic.BadRequestError, match=match) as e:
                        await client.messages.create(**ask)
                    assert e.value.body["type"] == "error", e.value.body
                    assert e.value.body["error"]["type"] == "invalid_request_error"
                with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):  # a stream is refused up front
                    async with client.messages.stream(model="switchyard", messages=ok, max_tokens=8,
                                                      stop_sequences=["x"]) as s:
                        await s.get_final_message()
                slow = [client.messages.create(model="switchyard", messages=ok, max_tokens=8) for _ in range(2)]
                got = await asyncio.gather(*slow, return_exceptions=True)
                limited = [g for g in got if isinstance(g, anthropic.RateLimitError)]
                assert len(limited) == 1 and limited[0].body["error"]["type"] == "rate_limit_error", got
            async with _client(far, "wrong") as client:
                with pytest.raises(anthropic.AuthenticationError, match="unknown API key") as e:
                    await client.messages.create(model="switchyard", messages=ok, max_tokens=8)
                assert e.value.body["error"]["type"] == "authentication_error"
            async with _client(far, "secret") as client:
                msg = await client.messages.create(model="switchyard", messages=ok, max_tokens=8)
                assert [b.text for b in msg.content] == ["ok"]
            url = far.base_url.replace("0.0.0.0", "127.0.0.1") + "/messages"
            async with aiohttp.ClientSession() as s:  # the key as older SDKs send it: x-api-key
                ask = {"model": "switchyard", "messages": ok, "max_tokens": 8}
                async with s.post(url, json=ask, headers={"x-api-key": "secret"}) as r:
                    keyed = (r.status, await r.json())
                async with s.post(url, json=ask, headers={"x-api-key": "wrong"}) as r:
                    wrong = (r.status, await r.json())
            return keyed, wrong, set(far.sessions)
        finally:
            await gw.stop()
            await far.stop()

    (s1, b1), (s2, b2), far_sessions = asyncio.run(body())
    assert s1 == 200 and b1["content"] == [{"type": "text", "text": "ok"}] and "secret" in far_sessions
    assert s2 == 401 and b2["type"] == "error" and b2["error"]["type"] == "authentication_error"
    assert "x-api-key" in b2["error"]["message"]
