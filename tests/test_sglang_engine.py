"""SGLang (GPU nodes only): ids and logprobs equal to a transformers forward, directly and through the bus.

Tolerance 1e-2: fp32 on both sides, but GPU kernels (FlashInfer attention, cuBLAS split-K)
sum in other orders than transformers; a wrong temperature or position moves logprobs by 0.1+.
"""

import asyncio

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

TOL = 1e-2


def _chat_prompt() -> list[int]:
    from engines.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    return tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]


def _reference_logprobs(prompt: list[int], response: list[int], temperature: float):
    import torch
    from transformers import AutoModelForCausalLM

    from engines.models import resolve_model

    ref = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_sglang_engine_generates_with_transformers_logprobs():
    pytest.importorskip("sglang")
    import torch

    from engines.inference.base import SamplingParams
    from engines.inference.sglang import SGLangEngine

    prompt = _chat_prompt()
    engine = SGLangEngine("smollm2-135m-instruct", dtype="float32", mem_fraction_static=0.3)

    async def main():
        await engine.start()
        try:
            sampled = await engine.generate("s0", prompt, SamplingParams(max_tokens=24, temperature=0.7))
            capped = await engine.generate("s1", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
            return sampled, capped, engine.stats()
        finally:
            await engine.close()

    sampled, capped, stats = asyncio.run(main())
    assert 0 < len(sampled.token_ids) == len(sampled.logprobs) <= 24
    assert sampled.finish_reason in ("stop", "length")
    assert capped.finish_reason == "length" and len(capped.token_ids) == 3
    assert stats.running == 0 and stats.generated_tokens == len(sampled.token_ids) + 3
    diff = (_reference_logprobs(prompt, sampled.token_ids, 0.7) - torch.tensor(sampled.logprobs)).abs().max()
    print(f"max |logprob diff| sglang vs transformers: {diff.item():.2e}")
    assert diff < TOL


def test_sglang_through_the_bus_matches_transformers(servers):
    pytest.importorskip("sglang")
    import torch

    from rollout.bus.client import GenerateClient

    prompt = _chat_prompt()
    srv = servers(1, backend="sglang", model="smollm2-135m-instruct",
                  options={"dtype": "float32", "mem_fraction_static": 0.3})

    async def main():
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=600)
            return await client.generate(prompt, {"max_tokens": 24, "temperature": 1.0, "seed": 0})

    r = asyncio.run(main())
    assert len(r.token_ids) == len(r.logprobs) > 0
    assert (_reference_logprobs(prompt, r.token_ids, 1.0) - torch.tensor(r.logprobs)).abs().max() < TOL
