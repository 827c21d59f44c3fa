"""Forced tool calls on the Responses and Messages routes, as on chat: `tool_choice` {type: function,
name} (Responses) and {type: tool, name} / {type: any} (Anthropic) put the parser's call opening
after the generation prompt as template tokens, the engine writes the rest, and the reply is the
call. Scripted bus client: the tests are about the gateway."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from agent.gateway import Gateway  # noqa: E402
from test_gateway_messages import CALCULATOR as ANTHROPIC_CALCULATOR, _client  # noqa: E402
from test_gateway_responses import CALCULATOR  # noqa: E402
from test_tool_agent_states import ScriptedClient, tok  # noqa: E402,F401

REST = ' {"expression": "2+3"}}\n</tool_call>'  # what the model writes after the named opening
OPENING = '<tool_call>\n{"name": "calculator", "arguments":'


class Recording(ScriptedClient):
    """Keeps each request's sampling too."""

    sampling: list[dict] = []

    async def generate(self, prompt_ids, sampling, *args, **kwargs):  # type: ignore[override]
        self.sampling = [*self.sampling, dict(sampling)]
        return await super().generate(prompt_ids, sampling, *args, **kwargs)


def test_the_responses_and_messages_routes_force_a_named_call(tok):  # noqa: F811
    client = Recording(tok, [REST, REST, '{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'])

    async def body():
        gw = Gateway(client, tok)
        await gw.start()
        try:
            key = gw.open_session()
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as oa:
                r = await oa.responses.create(model="switchyard", input="What is 2+3?", tools=[CALCULATOR],
                                              tool_choice={"type": "function", "name": "calculator"},
                                              top_logprobs=3, include=["message.output_text.logprobs"])
            async with _client(gw, key) as an:
                m = await an.messages.create(model="switchyard", max_tokens=32, tools=[ANTHROPIC_CALCULATOR],
                                             messages=[{"role": "user", "content": "2+3?"}],
                                             tool_choice={"type": "tool", "name": "calculator"})
                anyone = await an.messages.create(model="switchyard", max_tokens=32, tools=[ANTHROPIC_CALCULATOR],
                                                  messages=[{"role": "user", "content": "1+1?"}],
                                                  tool_choice={"type": "any"})
            return r, m, anyone, gw.close_session(key)
        finally:
            await gw.stop()

    r, m, anyone, conv = asyncio.run(body())
    calls = [item for item in r.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [("calculator", '{"expression": "2+3"}')]
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "calculator", {"expression": "2+3"})]
    assert m.stop_reason == "tool_use" and anyone.content[-1].input == {"expression": "1+1"}
    assert client.sampling[0].get("top_logprobs") == 3  # the Responses route asks the engine for alternatives
    opening = tok.encode(OPENING, add_special_tokens=False)
    for prompt in client.prompts[:2]:  # the prompt the engine got ends with the opening
        assert list(prompt[-len(opening):]) == opening
    for seg in conv.segments[:2]:  # the opening is template (mask 0), the reply the engine's (mask 1)
        out, rest = seg.to_output(), tok.encode(REST, add_special_tokens=False)
        assert out.model_token_ids() == rest + [tok.eos_token_id]  # the scripted engine closes its turn
