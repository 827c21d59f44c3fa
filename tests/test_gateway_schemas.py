"""Output schemas vetted at the gateway before any engine sees them (agent/gateway/schemas.py), and a
schema that takes long to compile holding up no other client, at the gateway or on the hf engine
(engines/inference/grammar.py). The first tests drive the real server over HTTP with a scripted bus
client (nothing may reach it); the last runs a real hf engine server on the tiny model."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.gateway import Gateway  # noqa: E402
from test_tool_agent_states import ScriptedClient, tok  # noqa: E402,F401

ASK = [{"role": "user", "content": "Give me an object."}]


def nested(depth: int, leaf: str = "string") -> dict:
    """An object schema nested `depth` deep: its grammar's conversion grows fast with the depth."""
    schema: dict = {"type": leaf}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema, "b": {"type": "integer"}}, "required": ["a"]}
    return schema


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_schema_faults_size_and_max_tokens_are_refused_before_any_engine(tok):  # noqa: F811
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "pattern": "a("}}, "required": ["q"]}}}
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                             for i in range(40_000)}}  # ~4.6 MB

    async def body():
        client = ScriptedClient(tok, ['{"a": "x"}'])
        gw = Gateway(client, tok)
        await gw.start()
        got = {}
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k") as oa:  # it retries 500s, not 400s
                async def ask(key, **kw):
                    t0 = time.perf_counter()
                    try:
                        await oa.chat.completions.create(model="switchyard", messages=ASK, max_tokens=4, **kw)
                        got[key] = (200, "", time.perf_counter() - t0)
                    except openai.APIStatusError as e:
                        got[key] = (e.status_code, str(e), time.perf_counter() - t0)

                await ask("nonsense", response_format=fmt({"type": "nonsense"}))
                await ask("regex", response_format=fmt({"type": "string", "pattern": "(unclosed"}))
                await ask("tool", tools=[tool], tool_choice="required")
                await ask("huge", response_format=fmt(huge))
                await ask("endless", extra_body={"max_tokens": 10**9})
                await ask("over_room", extra_body={"max_tokens": 2040})
                sent_before = len(client.prompts)
                await ask("fine", response_format=fmt({"type": "object", "properties": {"a": {"type": "string"}}}))
            async with aiohttp.ClientSession() as s:  # the other routes reach the same check
                async with s.post(gw.base_url + "/messages", json={
                        "model": "switchyard", "max_tokens": 4, "messages": ASK,
                        "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}) as r:
                    got["messages"] = (r.status, await r.text(), 0.0)
                async with s.post(gw.base_url + "/completions", json={
                        "model": "switchyard", "prompt": "hi", "max_tokens": 10**9}) as r:
                    got["completions"] = (r.status, await r.text(), 0.0)
        finally:
            await gw.stop()
        return got, sent_before, gw.schemas.counts

    got, sent_before, counts = asyncio.run(body())
    assert sent_before == 0, f"{sent_before} refused requests reached the engine"
    assert got["nonsense"][0] == 400 and 'Unsupported type "nonsense"' in got["nonsense"][1], got["nonsense"]
    assert got["nonsense"][2] < 5, "a 400 is answered at once (a 500 is retried twice by the openai client)"
    assert got["regex"][0] == 400 and "Regex parsing error" in got["regex"][1], got["regex"]
    assert got["tool"][0] == 400 and "forced call" in got["tool"][1] and "Regex" in got["tool"][1], got["tool"]
    assert got["huge"][0] == 413 and "max_schema_kb" in got["huge"][1], got["huge"][:2]
    assert got["endless"][0] == 400 and "context of 2048" in got["endless"][1], got["endless"]
    assert got["over_room"][0] == 400 and "ask for at most" in got["over_room"][1], got["over_room"]
    assert got["fine"][0] == 200, got["fine"]
    assert got["messages"][0] == 400 and "Unsupported type" in got["messages"][1], got["messages"]
    assert got["completions"][0] == 400 and "max_tokens asks for" in got["completions"][1], got["completions"]
    assert counts["schemas_refused"] >= 4, counts


def test_a_schema_over_the_grammar_budget_is_refused_naming_it(tok):  # noqa: F811
    """The budget is far below the heavy schema's conversion time, measured here; the resend is
    refused from the cache at once."""
    from engines.inference.grammar import grammar

    heavy = json.dumps(nested(60))
    grammar(json.dumps(nested(1)))
    t0 = time.perf_counter()
    grammar(heavy)
    compile_s = time.perf_counter() - t0
    budget = compile_s / 20

    async def body():
        client = ScriptedClient(tok, ["{}"])
        gw = Gateway(client, tok, grammar_budget_s=budget)
        await gw.start()
        out = []
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as oa:
                for _ in range(2):
                    t0 = time.perf_counter()
                    with pytest.raises(openai.BadRequestError) as e:
                        await oa.chat.completions.create(model="switchyard", messages=ASK, max_tokens=4,
                                                         response_format={"type": "json_schema", "json_schema": {
                                                             "name": "x", "schema": json.loads(heavy)}})
                    out.append((str(e.value), time.perf_counter() - t0))
        finally:
            await gw.stop()
        return out, len(client.prompts)

    out, sent = asyncio.run(body())
    assert sent == 0
    for message, _ in out:
        assert "grammar_budget_s" in message and "rollout.agent.openai_agent.grammar_budget_s" in message, message
    assert out[1][1] < compile_s, f"the resend took {out[1][1]:.2f}s (compile {compile_s:.2f}s): not from the cache"


def test_a_heavy_schema_holds_up_no_other_client(servers):
    """One client's schema whose conversion takes ~compile_s (measured here) is in flight, first at
    the gateway's check and then on the hf engine, while other clients' trivial schemas are each
    answered in well under that time."""
    from engines.inference.grammar import grammar
    from engines.models import load_tokenizer
    from rollout.bus.client import GenerateClient

    heavy = nested(120)
    grammar(json.dumps(nested(1)))  # xgrammar loaded: the time below is the conversion's own
    t0 = time.perf_counter()
    grammar(json.dumps(heavy))
    compile_s = time.perf_counter() - t0
    srv = servers(1, backend="hf", model="tiny-llama")

    async def body():
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            gw = Gateway(client, load_tokenizer("tiny-llama"), grammar_budget_s=60)
            await gw.start()
            try:
                async with aiohttp.ClientSession() as s:
                    async def chat(who: str, schema: dict) -> tuple[int, float]:
                        t0 = time.perf_counter()
                        async with s.post(gw.base_url + "/chat/completions", headers={"X-Session-Id": who}, json={
                                "model": "switchyard", "messages": ASK, "max_tokens": 3, "temperature": 0,
                                "response_format": fmt(schema)}) as r:
                            assert r.status == 200, await r.text()
                        return r.status, time.perf_counter() - t0

                    await chat("warm", {"type": "integer"})  # the engine's tokenizer info, built once
                    _, alone = await chat("alone", {"type": "object", "properties": {"z": {"type": "boolean"}}})
                    slow = asyncio.create_task(chat("heavy", heavy))
                    deadline = time.monotonic() + 30
                    while not gw.schemas._running and time.monotonic() < deadline:  # the gateway converts it
                        await asyncio.sleep(0.005)
                    _, at_gateway = await chat("b1", {"type": "object", "properties": {"x": {"type": "boolean"}}})
                    running = [not slow.done()]
                    while gw.schemas._running and time.monotonic() < deadline:  # now the engine compiles it
                        await asyncio.sleep(0.005)
                    await asyncio.sleep(compile_s / 10)
                    _, on_engine = await chat("b2", {"type": "object", "properties": {"y": {"type": "boolean"}}})
                    running.append(not slow.done())
                    _, heavy_s = await slow
                    return at_gateway, on_engine, running, heavy_s, alone
            finally:
                await gw.stop()

    at_gateway, on_engine, running, heavy_s, alone = asyncio.run(body())
    print(f"compile {compile_s:.2f}s, trivial at the gateway {at_gateway:.2f}s, on the engine {on_engine:.2f}s, "
          f"heavy {heavy_s:.2f}s, a trivial one alone {alone:.2f}s")
    # the order, not the seconds: a loaded box slows both alike; a trivial schema queued behind the heavy
    # one could only finish after it
    for where, took, ahead in (("gateway", at_gateway, running[0]), ("engine", on_engine, running[1])):
        assert ahead, (
            f"a trivial schema took {took:.2f}s while the heavy one compiled on the {where} (its conversion alone "
            f"takes {compile_s:.2f}s) and {'finished' if ahead else 'waited behind it: it finished after'} the heavy one")
