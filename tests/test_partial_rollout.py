"""Partial rollout: a preempting weight update stops a running generation, which the client
continues on the new weights from the tokens it already has (real hf engine server, tiny llama)."""

from __future__ import annotations

import asyncio

import torch
from transformers import AutoModelForCausalLM

from engines.models import load_tokenizer, resolve_model, tiny_llama
from rollout.bus.client import GenerateClient
from rollout.weights.bus import push_weights
from waiting import until


def _logprobs(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """Teacher-forced log p(ids[i] | prompt + ids[:i]) at temperature 1."""
    with torch.no_grad():
        x = torch.tensor([prompt + ids])
        logp = torch.log_softmax(model(x).logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(-1, torch.tensor(ids)[:, None])[:, 0]


def test_a_preempted_generation_continues_on_the_new_weights_with_its_first_segment_unchanged(servers):
    srv = servers(1, backend="hf", model="tiny-llama")
    old = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-llama")).eval()  # what the engine loaded
    new = tiny_llama(load_tokenizer("tiny-llama"), seed=7).eval()
    prompt = list(range(100, 140))
    sampling = {"max_tokens": 1500, "temperature": 1.0, "ignore_eos": True, "seed": 3}

    async def main():
        async with GenerateClient(srv.addresses) as agent, GenerateClient(srv.addresses) as trainer:
            await agent.wait_ready(timeout_s=300)
            await trainer.wait_ready(timeout_s=300)
            base = (await trainer.status(0)).stats["generated_tokens"]

            async def some_tokens_on_the_old_weights() -> bool:
                stats = (await trainer.status(0)).stats  # counted while the request runs
                return stats["running"] == 1 and stats["generated_tokens"] >= base + 8

            running = asyncio.create_task(agent.generate(prompt, sampling, session_id="s0"))
            await until(some_tokens_on_the_old_weights, "the request has some tokens on the old weights", 120)
            report = await push_weights(trainer, new.state_dict().items(), version=1, preempt=True)
            assert not running.done()  # the update did not wait for the generation to finish
            result = await running
            return report, result, (await trainer.status(0)).stats

    report, result, stats = asyncio.run(main())
    assert report.version == 1 and stats["preemptions"] == 1
    assert result.preemptions == 1 and result.finish_reason == "length" and len(result.token_ids) == 1500
    (v0, n0), (v1, n1) = result.segments
    assert (v0, v1) == (0, 1) and n0 > 0 and n1 > 0 and n0 + n1 == 1500 and result.weight_version == 0
    got = torch.tensor(result.logprobs)
    # the first segment is exactly what the old weights produced: its logprobs are the old model's
    # (hf engine vs transformers on the same weights: ~1e-6 here, 1e-4 allows for kernel order)
    assert torch.allclose(got[:n0], _logprobs(old, prompt, result.token_ids[:n0]), atol=1e-4)
    # the second continues from those tokens on the new weights, not the old ones
    tail_new = _logprobs(new, prompt, result.token_ids)[n0:]
    tail_old = _logprobs(old, prompt, result.token_ids)[n0:]
    assert torch.allclose(got[n0:], tail_new, atol=1e-4)
    assert (got[n0:] - tail_old).abs().max() > 0.1
