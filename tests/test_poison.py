"""Requests that would poison a batch fail alone: a live hf engine server runs 8 good requests
while malformed ones arrive among them; each malformed one gets its own error, naming the bad
value, and every good one completes. An echo engine caps a huge max_tokens at its context."""

from __future__ import annotations

import asyncio
import math

import pytest

from engines.inference.base import SamplingParams
from rollout.bus.client import GenerateClient, RequestFailed

GOOD = {"max_tokens": 16, "temperature": 1.0, "ignore_eos": True}
POISON = [  # (sampling, prompt, what the error must name)
    ({"temperature": 1e-45}, [5, 6, 7], "temperature"),
    ({"temperature": math.nan}, [5, 6, 7], "temperature"),
    ({"temperature": math.inf}, [5, 6, 7], "temperature"),
    ({"top_k": 1.5}, [5, 6, 7], "top_k"),
    ({"stop_token_ids": "ab"}, [5, 6, 7], "stop_token_ids"),
    ({"stop_token_ids": [-3]}, [5, 6, 7], "stop_token_ids"),
    ({"max_tokens": True}, [5, 6, 7], "max_tokens"),
    ({"top_p": math.nan}, [5, 6, 7], "top_p"),
    ({"seed": "x"}, [5, 6, 7], "seed"),
    ({}, [5, -2, 7], "-2"),
    ({}, [5, 10**8, 7], "vocabulary"),
]


def test_poisoned_requests_fail_alone_while_batch_mates_succeed(servers):
    srv = servers(1, backend="hf", model="tiny-llama")

    async def main():
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            good = [client.generate([1 + i, 2, 3, 4], GOOD) for i in range(8)]
            bad = [client.generate(prompt, {**GOOD, **sp}) for sp, prompt, _ in POISON]
            results = await asyncio.gather(*good, *bad, return_exceptions=True)
            after = await client.generate([9, 8, 7], GOOD)
            return results, after

    results, after = asyncio.run(main())
    for r in results[:8]:
        assert not isinstance(r, BaseException), r
        assert len(r.token_ids) == 16 and len(r.logprobs) == 16
    for r, (sp, _, name) in zip(results[8:], POISON):
        assert isinstance(r, RequestFailed), (sp, r)
        assert name in str(r), (sp, str(r))
    assert len(after.token_ids) == 16  # the engine serves on


def test_echo_engine_caps_max_tokens_at_its_context(servers):
    srv = servers(1, backend="echo", options={"max_model_len": 4096})

    async def main():
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=60)
            return await client.generate([1, 2, 3], {"max_tokens": 10**9})

    out = asyncio.run(main())
    assert len(out.token_ids) == 4096 - 3 and out.finish_reason == "length"


@pytest.mark.parametrize("field, value", [("temperature", 0), ("temperature", 0.7), ("top_k", 40), ("seed", 3),
                                          ("stop_token_ids", [2, 3]), ("top_p", 0.9)])
def test_ordinary_values_still_pass(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_a_failed_trajectory_never_sizes_the_batch():
    """A row the engine refused (a huge prompt) ends as an error: padded, it keeps one prompt token and
    no response, so the batch is as wide as its valid rows (not 1.7M tokens of causal mask)."""
    from agent.loop import AgentLoopOutput
    from engines.training.batch import pad_outputs

    ok = AgentLoopOutput(prompt_ids=[5, 6, 7], response_ids=[8, 9], response_mask=[1, 1], response_logprobs=[-1.0, -2.0],
                         reward=1.0, num_turns=1, termination="stop")
    huge = AgentLoopOutput.failed(list(range(100_000)), "engine_error: prompt of 100000 tokens exceeds the context")
    batch = pad_outputs([ok, huge], pad_id=0, group_index=[0, 1])
    assert batch.prompts.shape == (2, 3) and batch.responses.shape == (2, 2)
    assert batch.valid.tolist() == [True, False] and batch.prompt_lengths.tolist() == [3, 1]
    assert batch.errors[1].startswith("engine_error") and batch.loss_mask[1].sum() == 0
