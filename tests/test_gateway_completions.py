"""Prompts without a chat template: `/v1/completions` through the real `openai` client and the token
endpoint `/inference/v1/generate` (token ids in, token ids and logprobs out), each against an hf
engine and token-exact against its request log; a client that sends the growing token list of
a multi-turn conversation records one trajectory; refusals name the field."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
openai = pytest.importorskip("openai")

from agent.gateway import Gateway  # noqa: E402
from test_gateway import _with_gateway  # noqa: E402
from test_tool_agent import _server_log, _tokenizer, check_against_server  # noqa: E402


def test_completions_and_the_token_endpoint_are_token_exact(servers):
    import aiohttp

    srv = servers(1, backend="hf", model="tiny-llama")
    tokenizer = _tokenizer("tiny-llama")
    prompt = tokenizer("The capital of France is")["input_ids"]

    async def body(gw: Gateway):
        key = gw.open_session()
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as oa:
            text = await oa.completions.create(model="switchyard", prompt="The capital of France is", max_tokens=6,
                                               logprobs=1, temperature=1.0, seed=3)
            streamed = [c async for c in await oa.completions.create(
                model="switchyard", prompt=[[5, 6, 7, 8]], max_tokens=4, stream=True)]
            with pytest.raises(openai.BadRequestError, match="echo"):
                await oa.completions.create(model="switchyard", prompt="x", max_tokens=2, echo=True)
            with pytest.raises(openai.BadRequestError, match="n=2"):
                await oa.completions.create(model="switchyard", prompt="x", max_tokens=2, n=2)
        root = gw.base_url.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession() as http:
            turns, ids = [], list(prompt)
            for _ in range(2):  # a client that renders its own conversation: the token list only grows
                async with http.post(f"{root}/inference/v1/generate", headers=headers, json={
                        "model": "switchyard", "token_ids": ids,
                        "sampling_params": {"max_tokens": 5, "temperature": 1.0}}) as r:
                    assert r.status == 200, await r.text()
                    turns.append(await r.json())
                ids = ids + turns[-1]["choices"][0]["token_ids"] + tokenizer("\nAnd Italy's?")["input_ids"][1:]
            async with http.post(f"{root}/inference/v1/generate", headers=headers, json={
                    "token_ids": [1, 10 ** 9], "sampling_params": {"max_tokens": 2}}) as r:
                bad_vocab = (r.status, await r.json())
            async with http.post(f"{root}/inference/v1/generate", headers=headers, json={
                    "token_ids": "hello"}) as r:
                bad_ids = (r.status, await r.json())
            async with http.post(f"{root}/inference/v1/generate", headers=headers, json={
                    "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "logit_bias": {"500": 100},
                                                                "logprobs": 2}}) as r:
                forced = await r.json()
            other = {"Authorization": f"Bearer {gw.open_session()}"}  # verifiers' train client sends its stop ids
            async with http.post(f"{root}/inference/v1/generate", headers=other, json={
                    "token_ids": [4, 5, 6], "sampling_params": {"max_tokens": 3, "logit_bias": {"500": 100},
                                                                "stop_token_ids": [500], "logprobs": 1}}) as r:
                stopped = await r.json()
            async with http.post(f"{root}/inference/v1/generate", headers=other, json={
                    "token_ids": [4, 5, 6], "sampling_params": {"stop_token_ids": ["x"]}}) as r:
                bad_stop = (r.status, await r.json())
            async with http.get(f"{gw.base_url}/models") as r:
                card = (await r.json())["data"][0]
        forced_text = await oa_forced(gw, key)
        return (gw.close_session(key), text, streamed, turns, bad_vocab, bad_ids, forced, forced_text, stopped,
                bad_stop, card, gw.max_context)

    async def oa_forced(gw: Gateway, key: str):
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as oa:
            return await oa.completions.create(model="switchyard", prompt="Hi", max_tokens=3, logprobs=2,
                                               logit_bias={"500": 100})

    (conv, text, streamed, turns, bad_vocab, bad_ids, forced, forced_text, stopped, bad_stop, card,
     context) = asyncio.run(_with_gateway(srv.addresses, tokenizer, body))
    assert forced["choices"][0]["token_ids"] == [500, 500, 500]  # logit_bias reaches the engine on both routes
    assert all(len(c["top_logprobs"]) == 2 for c in forced["choices"][0]["logprobs"]["content"])
    assert forced_text.choices[0].text == tokenizer.decode([500] * 3, skip_special_tokens=True)
    assert all(len(alt) >= 1 for alt in forced_text.choices[0].logprobs.top_logprobs)
    sent = _server_log(srv.request_logs)
    assert stopped["choices"][0]["token_ids"] == [500] and stopped["choices"][0]["finish_reason"] == "stop"
    assert sent[stopped["request_id"]]["token_ids"] == [500]  # the engine's request id, as vLLM's answer has it
    assert bad_stop[0] == 400 and bad_stop[1]["error"]["param"] == "sampling_params.stop_token_ids"
    assert card["root"] == tokenizer.name_or_path and card["max_model_len"] == context  # what vLLM's card says
    raw = [s for s in conv.segments if getattr(s, "raw", False)]
    assert len(raw) == 5  # text, token list, the two-turn token conversation as one, and the two forced ones
    for seg in raw:
        check_against_server(seg.to_output(), sent)  # mask-1 tokens = what the engine sent, in order
    first = sent[raw[0].request_ids[0]]
    assert raw[0].traj.prompt_ids == prompt and text.usage.prompt_tokens == len(prompt)
    assert text.choices[0].logprobs.token_logprobs == pytest.approx([lp for lp in raw[0].traj.response_logprobs])
    assert text.choices[0].text == tokenizer.decode(first["token_ids"], skip_special_tokens=True)
    assert raw[1].traj.prompt_ids == [5, 6, 7, 8] and streamed[0].choices[0].text is not None
    conversation = raw[2]
    assert len(conversation.request_ids) == 2 and conversation.traj.prompt_ids == prompt
    for turn, rid in zip(turns, conversation.request_ids):
        choice = turn["choices"][0]
        assert choice["token_ids"] == sent[rid]["token_ids"]
        assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert conversation.traj.response_mask.count(0) == len(tokenizer("\nAnd Italy's?")["input_ids"]) - 1
    assert bad_vocab[0] == 400 and "outside the vocabulary" in bad_vocab[1]["error"]["message"]
    assert bad_ids[0] == 400 and bad_ids[1]["error"]["param"] == "token_ids"
