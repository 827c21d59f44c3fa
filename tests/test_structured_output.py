"""Structured output as each agent framework asks for it, through the gateway to a real hf engine:
the `openai` package's `response_format` json_object and `.parse()` with a pydantic model, LangChain's
`with_structured_output` by json_schema and by function calling, the Agents SDK's `output_type`
(Responses `text.format`), pydantic-ai's `output_type` (a forced `final_result` call) and its
`NativeOutput`. Each returns a valid object from the tiny tool-calling model, which was never taught
these schemas: the engine decodes under the constraint. Every session's trajectory is token-exact
against the engine's request log and says a constraint applied."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from agent.gateway import Gateway  # noqa: E402

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
MAX_TOKENS = 48


class Answer(pydantic.BaseModel):
    answer: int = pydantic.Field(ge=0, le=999)
    sure: bool


ASK = "What is 2+3? Reply in JSON."


async def _openai_parse(base_url: str, key: str) -> Any:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as oa:
        r = await oa.chat.completions.parse(model="switchyard", messages=[{"role": "user", "content": ASK}],
                                            response_format=Answer, max_tokens=MAX_TOKENS, temperature=0.0)
        return r.choices[0].message.parsed


async def _openai_json_object(base_url: str, key: str) -> Any:
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as oa:
        r = await oa.chat.completions.create(model="switchyard", messages=[{"role": "user", "content": ASK}],
                                             response_format={"type": "json_object"}, max_tokens=4 * MAX_TOKENS,
                                             temperature=0.0)
        assert r.choices[0].finish_reason == "stop", r.choices[0]  # any object: the budget may cut a long one
        return json.loads(r.choices[0].message.content)


def _langchain(method: str):
    async def run(base_url: str, key: str) -> Any:
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(model="switchyard", base_url=base_url, api_key=key, max_retries=0, temperature=0.0,
                         max_tokens=MAX_TOKENS)
        return await llm.with_structured_output(Answer, method=method).ainvoke(ASK)
    return run


async def _agents_sdk(base_url: str, key: str) -> Any:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    agent = Agent(name="answer", instructions="Answer.", output_type=Answer,
                  model=OpenAIResponsesModel(model="switchyard", openai_client=client),
                  model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0.0))
    try:
        return (await Runner.run(agent, ASK)).final_output
    finally:
        await client.close()


def _pydantic_ai(native: bool):
    async def run(base_url: str, key: str) -> Any:
        from pydantic_ai import Agent, NativeOutput
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        model = OpenAIChatModel("switchyard", provider=OpenAIProvider(base_url=base_url, api_key=key))
        agent = Agent(model, output_type=NativeOutput(Answer) if native else Answer, retries=0,
                      model_settings={"max_tokens": MAX_TOKENS, "temperature": 0.0})
        return (await agent.run(ASK)).output
    return run


FRAMEWORKS = {"openai .parse": _openai_parse, "openai json_object": _openai_json_object,
              "langchain json_schema": _langchain("json_schema"),
              "langchain function_calling": _langchain("function_calling"),
              "agents sdk output_type": _agents_sdk, "pydantic-ai output_type": _pydantic_ai(False),
              "pydantic-ai NativeOutput": _pydantic_ai(True)}


@pytest.mark.skipif(not (GSM8K / "train.jsonl").exists(), reason="the tool-calling model trains on GSM8K")
def test_every_frameworks_structured_output_is_a_valid_object_and_token_exact(servers, tool_caller):
    pytest.importorskip("langchain_openai")
    pytest.importorskip("agents")
    pytest.importorskip("pydantic_ai")
    from rollout.bus.client import GenerateClient
    from test_tool_agent import _server_log, _tokenizer

    srv = servers(1, backend="hf", model=str(tool_caller))

    async def body() -> dict[str, tuple[Any, Any]]:
        got: dict[str, tuple[Any, Any]] = {}
        async with GenerateClient(srv.addresses) as bus:
            await bus.wait_ready(timeout_s=300)
            gw = Gateway(bus, _tokenizer(tool_caller))
            await gw.start()
            try:
                for name, run in FRAMEWORKS.items():
                    key = gw.open_session()
                    try:
                        value = await run(gw.base_url, key)
                    except Exception as e:  # the others still run; the assertion below names it
                        value = e
                    got[name] = (value, gw.close_session(key))
            finally:
                await gw.stop()
        return got

    got = asyncio.run(body())
    failed = {n: repr(v) for n, (v, _) in got.items() if isinstance(v, Exception)}
    assert not failed, failed
    for name, (value, _) in got.items():
        if name == "openai json_object":
            assert isinstance(value, dict), (name, value)
        else:
            assert isinstance(value, Answer) and 0 <= value.answer <= 999, (name, value)
    sent = _server_log(srv.request_logs)
    for name, (_, conv) in got.items():
        assert conv is not None and conv.segments, name
        for seg in conv.segments:
            _token_exact(seg.to_output(), sent, name)
        turns = [t for seg in conv.segments for t in seg.turns]
        assert any(t.get("constraint") for t in turns), (name, turns)


def _token_exact(out: Any, sent: dict[str, dict[str, Any]], name: str) -> None:
    """Mask-1 tokens are the engine's, request by request, each request continuing the trajectory where
    it stood; mask-0 tokens (a forced call's opening, the template's glue) only between them."""
    out.check()
    pos = 0
    for rid in out.request_ids:
        while pos < len(out.response_mask) and out.response_mask[pos] == 0:
            pos += 1
        rec = sent[rid]
        assert rec["prompt_len"] == len(out.prompt_ids) + pos, (name, rid, "did not continue the trajectory")
        assert out.response_ids[pos:pos + len(rec["token_ids"])] == rec["token_ids"], (name, rid)
        assert out.response_mask[pos:pos + len(rec["token_ids"])] == [1] * len(rec["token_ids"]), (name, rid)
        pos += len(rec["token_ids"])
    assert all(m == 0 for m in out.response_mask[pos:]), name
    assert out.model_token_ids() == [t for rid in out.request_ids for t in sent[rid]["token_ids"]], name
