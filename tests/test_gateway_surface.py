"""The gateway's surface beyond chat completions: unknown routes and methods answer with OpenAI-shaped
JSON, and a call to a tool the request did not declare is never returned as a tool call. The real
`openai` client against the real server; the bus client is scripted (the test is about the gateway)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
openai = pytest.importorskip("openai")

from agent.gateway import Gateway  # noqa: E402
from test_tool_agent_states import ScriptedClient, tok  # noqa: E402,F401

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def test_unknown_routes_and_methods_get_json_errors(tok):  # noqa: F811
    async def body():
        gw = Gateway(ScriptedClient(tok, ["ok"]), tok)
        await gw.start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(gw.base_url + "/embeddings", json={"model": "switchyard", "input": "hi"}) as r:
                    missing = (r.status, await r.json())
                async with s.get(gw.base_url + "/chat/completions") as r:
                    wrong = (r.status, await r.json())
            return missing, wrong
        finally:
            await gw.stop()

    (s1, b1), (s2, b2) = asyncio.run(body())
    assert s1 == 404 and b1["error"]["code"] == "not_found" and "/v1/embeddings" in b1["error"]["message"]
    assert s2 == 405 and b2["error"]["code"] == "method_not_allowed" and "POST" in b2["error"]["message"]


def test_a_call_to_an_undeclared_tool_stays_text(tok):  # noqa: F811
    async def body():
        gw = Gateway(ScriptedClient(tok, [CALL]), tok)
        await gw.start()
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as oa:
                ask = [{"role": "user", "content": "what is 2+3?"}]
                bare = await oa.chat.completions.create(model="switchyard", messages=ask)
                offered = await oa.chat.completions.create(model="switchyard", messages=ask, tools=[CALCULATOR])
            return bare, offered, gw.sessions["k"]
        finally:
            await gw.stop()

    bare, offered, conv = asyncio.run(body())
    assert bare.choices[0].message.tool_calls is None and bare.choices[0].finish_reason == "stop"
    assert '"calculator"' in bare.choices[0].message.content  # the model's text, as it wrote it
    call = offered.choices[0].message.tool_calls[0]
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2+3"}
    turns = [t for s in conv.segments for t in s.turns]
    assert any(t.get("undeclared_tools") == ["calculator"] for t in turns)  # the session says why


def test_a_gateway_session_counts_its_tool_rounds_in_the_rollout_metrics(tok):  # noqa: F811
    from engines.training.batch import pad_outputs

    async def body():
        gw = Gateway(ScriptedClient(tok, [CALL, "it is 5"]), tok)
        await gw.start()
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as oa:
                msgs: list = [{"role": "user", "content": "what is 2+3?"}]
                r = await oa.chat.completions.create(model="switchyard", messages=msgs, tools=[CALCULATOR])
                call = r.choices[0].message.tool_calls[0]
                msgs += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "5"}]
                await oa.chat.completions.create(model="switchyard", messages=msgs, tools=[CALCULATOR])
            return gw.sessions["k"]
        finally:
            await gw.stop()

    conv = asyncio.run(body())
    assert len(conv.segments) == 1  # the tool round continued the segment
    out = conv.segments[0].to_output()
    metrics = pad_outputs([out], 0, [0]).metrics()
    assert metrics["rollout/tool_calls"] == 1 and metrics["rollout/tool_failed"] == 0
