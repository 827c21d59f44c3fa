"""Every gateway route refuses a request field it would otherwise drop silently, with a 400 naming it
(one table per route: agent/gateway/fields.py); fields the real APIs define that the gateway cannot
honour are taken only when off, and ones that change nothing sampled are accepted. Real HTTP against
the real server; the bus client is scripted."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.gateway import Gateway  # noqa: E402
from test_tool_agent_states import ScriptedClient, tok  # noqa: E402,F401

ASK = [{"role": "user", "content": "hi"}]
MESSAGES = {"model": "switchyard", "max_tokens": 4, "messages": ASK}
COMPLETIONS = {"model": "switchyard", "prompt": "hi", "max_tokens": 2}
GENERATE = {"model": "switchyard", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}

REFUSED = [  # (route, body, the field the 400 names)
    ("/v1/messages", {**MESSAGES, "made_up_param": 1}, "made_up_param"),
    ("/v1/messages", {**MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ("/v1/messages", {**MESSAGES, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ("/v1/messages", {**MESSAGES, "container": "c1"}, "container"),
    ("/v1/messages", {**MESSAGES, "output_config": {"effort": "low"}}, "output_config.effort"),
    ("/v1/messages", {**MESSAGES, "output_config": {"made_up": 1}}, "output_config.made_up"),
    ("/v1/completions", {**COMPLETIONS, "made_up_param": 1}, "made_up_param"),
    ("/v1/responses", {"model": "switchyard", "input": "hi", "made_up_param": 1}, "made_up_param"),
    ("/v1/responses", {"model": "switchyard", "input": "hi", "conversation": "conv_1"}, "conversation"),
    ("/inference/v1/generate", {**GENERATE, "made_up_param": 1}, "made_up_param"),
    ("/inference/v1/generate", {**GENERATE, "sampling_params": {"max_tokens": 2, "made_up": 1}},
     "sampling_params.made_up"),
    ("/inference/v1/generate", {**GENERATE, "sampling_params": {"max_tokens": 2, "min_p": 0.2}},
     "sampling_params.min_p"),
]
ACCEPTED = [  # fields that change nothing sampled, or set to their "off" value
    ("/v1/messages", {**MESSAGES, "service_tier": "auto", "metadata": {"user_id": "u"}, "thinking": {"type": "disabled"},
                      "mcp_servers": [], "output_config": {"effort": "high"}}),
    ("/v1/completions", {**COMPLETIONS, "user": "u"}),
    ("/v1/responses", {"model": "switchyard", "input": "hi", "max_output_tokens": 4, "conversation": None,
                       "background": False, "made_up_but_unset": None, "store": True}),
    ("/inference/v1/generate", {**GENERATE, "request_id": "mine", "sampling_params": {
        "max_tokens": 2, "skip_special_tokens": False, "detokenize": False, "repetition_penalty": 1.0, "min_p": 0.0}}),
]


def test_every_route_refuses_fields_it_would_drop_naming_them(tok):  # noqa: F811
    async def body():
        client = ScriptedClient(tok, ["ok"])
        gw = Gateway(client, tok)
        await gw.start()
        root = gw.base_url.removesuffix("/v1")
        refused, accepted = [], []
        try:
            async with aiohttp.ClientSession() as s:
                for path, req, _ in REFUSED:
                    async with s.post(root + path, json=req) as r:
                        refused.append((r.status, await r.json()))
                sent_before = len(client.prompts)
                for path, req in ACCEPTED:
                    async with s.post(root + path, json=req) as r:
                        accepted.append((path, r.status, await r.text()))
        finally:
            await gw.stop()
        return refused, accepted, sent_before

    refused, accepted, sent_before = asyncio.run(body())
    assert sent_before == 0, "a refused request reached the engines"
    for (path, _, name), (status, reply) in zip(REFUSED, refused):
        err = reply["error"]
        message = err["message"]
        assert status == 400 and name in message, (path, name, status, reply)
        if path != "/v1/messages":  # OpenAI-shaped errors name the field as param too
            assert err["param"] == name, (path, err)
        else:
            assert reply["type"] == "error" and err["type"] == "invalid_request_error", reply
    for path, status, text in accepted:
        assert status == 200, (path, text)
