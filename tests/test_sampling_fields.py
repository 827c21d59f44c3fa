"""OpenAI's `logit_bias`, `presence_penalty`, `frequency_penalty` and `top_logprobs`, honoured end to end:
the logits adjustment on hand-made logits, the bus carrying them both ways, and the real `openai` client
against the gateway on a real hf engine (tiny-llama: random weights, so greedy decoding repeats one token,
which is what makes the penalties visible). Bad values are 400s naming the field.

Semantics checked here: the returned logprobs are of the distribution the token was drawn from (the
adjusted logits' log_softmax(. / T), as vLLM reports them): the behaviour probabilities the trainer's
off-policy correction needs; top_logprobs are of that same distribution, so a banned token is not
among the alternatives and a forced one has probability ~1. vLLM's mapping of the same fields:
tests/test_vllm_engine.py (on the engine that file starts once)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engines.inference.base import SamplingParams
from engines.inference.sampling import adjust, sample
from rollout.bus import protocol as P


# ------------------------------------------------------------------ the logits adjustment, by hand

def test_adjust_adds_the_bias_and_penalises_generated_tokens_per_row() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0],
                           [0.0, 1.0, 2.0, 3.0, 4.0],
                           [5.0, 5.0, 5.0, 5.0, 5.0]])
    params = [SamplingParams(logit_bias={"1": 3.0, 4: -2.5}),
              SamplingParams(presence_penalty=0.5, frequency_penalty=1.0),
              SamplingParams()]
    generated = [[1, 1, 4], [2, 2, 3, 2], [0, 0, 0]]  # row 0 has no penalty, row 2 nothing at all
    out = adjust(logits, params, generated)
    expected = torch.tensor([[0.0, 4.0, 2.0, 3.0, 1.5],
                             [0.0, 1.0, 2.0 - 0.5 - 3.0, 3.0 - 0.5 - 1.0, 4.0],
                             [5.0, 5.0, 5.0, 5.0, 5.0]])
    assert torch.equal(out, expected), out
    assert torch.equal(logits[0], torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]))  # the input is not modified
    two = logits[:2]
    nothing = [SamplingParams(), SamplingParams(frequency_penalty=2.0)]  # a penalty with nothing generated yet
    assert adjust(two, nothing, [[], []]) is two  # no copy when no row adjusts anything


def test_sample_draws_from_the_adjusted_logits_and_reports_their_logprobs() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0, logit_bias={3: -100}, top_logprobs=2),  # greedy, argmax banned
              SamplingParams(temperature=0.5, logit_bias={2: 100}, top_logprobs=3)]  # forced token 2
    gens = [torch.Generator().manual_seed(0) for _ in params]
    tokens, logprobs, tops = sample(logits, params, gens, [[], []])
    assert tokens.tolist() == [2, 2]
    steered = logits + torch.tensor([[0.0, 0.0, 0.0, -100.0], [0.0, 0.0, 100.0, 0.0]])
    drawn = torch.log_softmax(steered / torch.tensor([[1.0], [0.5]]), -1)  # greedy rows: T = 1
    assert torch.allclose(logprobs, drawn[[0, 1], [2, 2]])  # what the token was drawn from
    assert logprobs[1] > -1e-6 and not torch.allclose(logprobs, torch.log_softmax(logits, -1)[[0, 1], [2, 2]])
    assert tops[0][0] == [2, 1] and tops[1][0] == [2, 0, 1]  # the banned token gone, the forced one first
    assert tops[0][1] == pytest.approx(drawn[0, [2, 1]].tolist())
    assert tops[1][1] == pytest.approx(drawn[1, [2, 0, 1]].tolist(), abs=1e-5)
    _, _, none = sample(logits, [SamplingParams(), SamplingParams()], gens)
    assert none == [None, None]


@pytest.mark.parametrize("field,value,match", [
    ("frequency_penalty", 5, "frequency_penalty=5 must be in"), ("presence_penalty", -2.5, "presence_penalty"),
    ("presence_penalty", float("nan"), "presence_penalty"), ("logit_bias", {"abc": 1}, "logit_bias key 'abc'"),
    ("logit_bias", {"7": 101}, "logit_bias"), ("logit_bias", [1, 2], "logit_bias"),
    ("top_logprobs", 50, "top_logprobs=50"), ("top_logprobs", 1.5, "top_logprobs"),
    ("json_suffix", "}", "json_suffix='}' needs a json_schema"), ("json_suffix", 3, "json_suffix=3 must be text"),
    ("json_calls", '[["<a>", {}, ""]]', "json_calls=.* needs a json_schema"), ("json_calls", 7, "json_calls=7 must be text"),
    ("json_calls", ("{}", '[["<a>", {}, ""]]', "}"), "with json_suffix='}'"),
    ("json_calls", ("{}", "[oops"), "json_calls is not valid JSON"), ("json_calls", ("{}", "[]"), "non-empty list"),
    ("json_calls", ("{}", '[["", {}, ""]]'), r"json_calls\[0\]=.* must be \[opening"),
    ("json_calls", ("{}", '[["<a>", 3, ""]]'), r"json_calls\[0\]")])
def test_bad_values_fail_naming_the_field(field: str, value: Any, match: str) -> None:
    if isinstance(value, tuple):  # (json_schema, json_calls[, json_suffix]): the calls beside a schema
        value = dict(zip(("json_schema", "json_calls", "json_suffix"), value))
    else:
        value = {field: value}
    with pytest.raises(ValueError, match=match):
        SamplingParams(**value)


def test_the_fields_cross_the_bus_both_ways() -> None:
    sp = SamplingParams(logit_bias={5: -100.0, 17: 2.5}, frequency_penalty=0.5, presence_penalty=-1.0, top_logprobs=3,
                        json_schema='{"type": "object"}', json_calls='[["<tool_call>", {"type": "object"}, "</tool_call>"]]')
    sent = P.decode(P.Generate(rid="g", prompt_ids=np.array([1, 2], np.int32), sampling=sp.to_dict()).encode())
    assert SamplingParams.from_dict(sent.sampling) == sp  # msgpack maps take string keys: ids go as "5"
    res = P.Result(rid="r", token_ids=[4, 9], logprobs=[-0.1, -0.2], top_ids=[[4, 1, 2], [9, 4, 1]],
                   top_logprobs=[[-0.1, -3.0, -4.0], [-0.2, -2.0, -5.0]])
    back = P.decode(res.encode())
    assert back.top_ids.tolist() == [[4, 1, 2], [9, 4, 1]] and back.top_logprobs.dtype == np.float32
    assert P.decode(P.Result(rid="e", top_ids=[], top_logprobs=[]).encode()).top_ids.shape == (0, 0)
    assert P.decode(P.Result(rid="n", token_ids=[4], logprobs=[-0.1]).encode()).top_ids is None
    with pytest.raises(P.ProtocolError, match="top_ids"):
        P.Result(rid="x", token_ids=[4, 9], logprobs=[-0.1, -0.2], top_ids=[[4]], top_logprobs=[[-0.1]])


# ------------------------------------------------------------------ a real engine, the bus and the gateway

try:
    import openai
except ImportError:  # the unit tests above still run
    openai = None
QUESTION = [{"role": "user", "content": "Write a few words, please."}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    """One hf engine server on tiny-llama for the module (its request log tells the exact token ids)."""
    from conftest import Servers

    srv = Servers(tmp_path_factory.mktemp("sf")).start(1, backend="hf", model="tiny-llama")
    try:
        yield srv
    finally:
        srv.stop()


def last_ids(srv: Any) -> list[int]:
    """The token ids of the engine's latest reply, from its request log."""
    return json.loads(Path(srv.request_logs[0]).read_text().splitlines()[-1])["token_ids"]


def with_gateway(srv: Any, body: Any) -> Any:
    from agent.gateway import Gateway
    from engines.models import load_tokenizer
    from rollout.bus.client import GenerateClient

    if openai is None:
        pytest.skip("needs the openai client")

    async def main() -> Any:
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            gw = Gateway(client, load_tokenizer("tiny-llama"))
            await gw.start()
            try:
                async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="sk-local", max_retries=0) as oa:
                    return await body(oa, client)
            finally:
                await gw.stop()

    return asyncio.run(main())


def test_bus_returns_top_logprobs_and_refuses_bad_values(engine) -> None:
    from rollout.bus.client import RequestFailed

    async def body(oa: Any, client: Any) -> None:
        prompt = [1, 300, 307, 314, 321]
        out = await client.generate(prompt, {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                                             "top_logprobs": 4})
        assert len(out.top_ids) == len(out.top_logprobs) == len(out.token_ids) == 6
        for tok, lp, ids, lps in zip(out.token_ids, out.logprobs, out.top_ids, out.top_logprobs):
            assert len(ids) == 4 and ids[0] == tok and lps[0] == pytest.approx(lp, abs=1e-6)  # greedy: the top one
            assert lps == sorted(lps, reverse=True) and all(v <= 0 for v in lps)
        plain = await client.generate(prompt, {"max_tokens": 2, "temperature": 0.0})
        assert plain.top_ids is None and plain.top_logprobs is None
        with pytest.raises(RequestFailed, match="frequency_penalty=5"):
            await client.generate(prompt, {"max_tokens": 2, "frequency_penalty": 5})
        with pytest.raises(RequestFailed, match=r"logit_bias token ids \[10000000\] are outside the vocabulary"):
            await client.generate(prompt, {"max_tokens": 2, "logit_bias": {"10000000": 1.0}})

    with_gateway(engine, body)


def test_json_schema_constrains_the_hf_engine_and_its_logprobs_are_the_constrained_ones(engine) -> None:
    """A random tiny model writes JSON that matches the schema only because the grammar (xgrammar)
    forbids every other token; each recorded logprob is of the constrained distribution, so a token
    the grammar forces (a quote, a brace) reports ~0, which the unconstrained model would not."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    from engines.models import load_tokenizer

    tok = load_tokenizer("tiny-llama")

    async def body(oa: Any, client: Any) -> None:
        prompt = [1, 300, 307, 314, 321]
        for seed in range(3):
            out = await client.generate(prompt, {"max_tokens": 60, "temperature": 1.0, "seed": seed,
                                                 "json_schema": json.dumps(schema)})
            text = tok.decode(out.token_ids, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), schema)  # whole and valid, however unlikely for this model
            assert out.finish_reason == "stop" and max(out.logprobs) > -1e-3  # a forced token: logprob ~0
        free = await client.generate(prompt, {"max_tokens": 20, "temperature": 1.0, "seed": 0})
        assert max(free.logprobs) < -1.0  # unconstrained, the random model is nowhere near sure of a token
        from rollout.bus.client import RequestFailed

        with pytest.raises(RequestFailed, match="json_schema is not valid JSON"):
            await client.generate(prompt, {"max_tokens": 2, "json_schema": "{nope"})

    with_gateway(engine, body)


def test_openai_logit_bias_bans_and_forces_tokens(engine) -> None:
    async def body(oa: Any, client: Any) -> None:
        ask = dict(model="switchyard", messages=QUESTION, max_tokens=12, temperature=0.0)
        await oa.chat.completions.create(**ask)
        greedy = last_ids(engine)
        first = greedy[0]
        r = await oa.chat.completions.create(**ask, logit_bias={str(first): -100})
        banned = last_ids(engine)
        assert banned and first not in banned, (first, banned)
        assert r.choices[0].message.content is not None
        forced_id = next(t for t in range(1000, 2000) if t not in greedy)
        r = await oa.chat.completions.create(**{**ask, "temperature": 1.0}, logit_bias={str(forced_id): 100},
                                             logprobs=True)
        assert last_ids(engine) == [forced_id] * 12
        # the returned logprobs are the biased sampler's, what the tokens were drawn from: ~0 for a forced token
        assert all(c.logprob > -1e-3 for c in r.choices[0].logprobs.content)

    with_gateway(engine, body)


def test_openai_presence_and_frequency_penalties_stop_repeats(engine) -> None:
    async def body(oa: Any, client: Any) -> None:
        ask = dict(model="switchyard", messages=QUESTION, max_tokens=20, temperature=0.0)
        await oa.chat.completions.create(**ask)
        base = last_ids(engine)
        assert len(set(base)) < len(base), base  # greedy tiny-llama repeats itself: the test can fail
        await oa.chat.completions.create(**ask, presence_penalty=2.0, frequency_penalty=2.0)
        penalised = last_ids(engine)
        assert len(penalised) >= 10 and len(set(penalised)) == len(penalised), penalised
        await oa.chat.completions.create(**ask, presence_penalty=2.0)  # presence alone does it too
        assert len(set(last_ids(engine))) == len(last_ids(engine))

    with_gateway(engine, body)


def test_openai_top_logprobs(engine) -> None:
    async def body(oa: Any, client: Any) -> None:
        ask = dict(model="switchyard", messages=QUESTION, max_tokens=10, temperature=0.0, logprobs=True)
        await oa.chat.completions.create(**ask)
        first = last_ids(engine)[0]
        # greedy with the policy's favourite banned: the sampled token is the second best and leads the
        # alternatives, and the banned one is not among them (the distribution drawn from, as the logprobs are)
        r = await oa.chat.completions.create(**ask, top_logprobs=3, logit_bias={str(first): -100})
        content = r.choices[0].logprobs.content
        assert len(content) == len(last_ids(engine)) == 10
        from engines.models import load_tokenizer
        banned = load_tokenizer("tiny-llama").decode([first])
        assert content[0].top_logprobs[0].token == content[0].token != banned
        assert all(a.token != banned or a.logprob < -50 for c in content for a in c.top_logprobs)
        for c in content:
            alts = c.top_logprobs
            assert len(alts) == 3
            assert [a.logprob for a in alts] == sorted((a.logprob for a in alts), reverse=True)
            assert all(a.logprob <= 0 and math.isfinite(a.logprob) for a in alts)
            same = [a for a in alts if a.token == c.token]
            assert same, (c.token, [a.token for a in alts])  # greedy on a one-token ban: among the top 3
            assert same[0].logprob == pytest.approx(c.logprob, abs=1e-6)
        plain = await oa.chat.completions.create(**ask)
        assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)

    with_gateway(engine, body)


@pytest.mark.parametrize("extra,param", [
    (dict(frequency_penalty=5), "frequency_penalty"), (dict(presence_penalty="high"), "presence_penalty"),
    (dict(logit_bias={"abc": 1}), "logit_bias"), (dict(logit_bias={"5": 500}), "logit_bias"),
    (dict(logit_bias={"99999999": 1}), "logit_bias"), (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"), (dict(parallel_tool_calls="once"), "parallel_tool_calls")])
def test_openai_bad_values_are_400s_naming_the_field(engine, extra: dict, param: str) -> None:
    async def body(oa: Any, client: Any) -> None:
        with pytest.raises(openai.BadRequestError, match=param) as e:
            await oa.chat.completions.create(model="switchyard", messages=QUESTION, max_tokens=2, **extra)
        assert e.value.param == param and e.value.body["type"] == "invalid_request_error", e.value.body

    with_gateway(engine, body)
