"""SGLang behind the bus (GPU nodes only): exact ids and logprobs equal to transformers."""

import asyncio

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_sglang_through_the_bus_matches_transformers(servers):
    pytest.importorskip("sglang")
    import torch
    from transformers import AutoModelForCausalLM

    from engines.models import load_tokenizer, resolve_model
    from rollout.client import GenerateClient

    path = resolve_model("smollm2-135m-instruct")
    tok = load_tokenizer("smollm2-135m-instruct")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    srv = servers(1, backend="sglang", model="smollm2-135m-instruct",
                  options={"dtype": "float32", "mem_fraction_static": 0.3})

    async def main():
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=600)
            return await client.generate(prompt, {"max_tokens": 24, "temperature": 1.0, "seed": 0})

    r = asyncio.run(main())
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + r.token_ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
    assert (expected - torch.tensor(r.logprobs)).abs().max() < 1e-2  # GPU kernels, fp32
