"""HFEngine sleep levels: level 2 really gives the weights' memory back, and a reload restores them.

A colocated engine sleeps so the trainer can use the memory; if freeing only dropped Python
references while the allocator kept the pages, the trainer would not get them. So the CPU test
reads the process RSS, on a llama big enough (~55 MB of fp32 weights) that the drop stands far
above the few hundred kB of noise from Python objects and page rounding.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.inference.base import GenerateOutput, SamplingParams
from engines.inference.hf import HFEngine, _trim_host_heap
from engines.models import load_tokenizer

PROMPT = [300 + 7 * i for i in range(12)]
PARAMS = SamplingParams(max_tokens=12, temperature=0.7, seed=5, ignore_eos=True)
# what may be allocated between the two RSS reads besides the freed weights: new meta Parameter
# objects, the executor round trip, partial pages at tensor ends (< 4 KiB x 21 tensors), heap
# fragments malloc_trim cannot return; measured slack is far below this (see the assertion message)
RSS_TOLERANCE = 2 << 20


@pytest.fixture(scope="module")
def big_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama with a 49152 x 256 tied embedding (~55 MB fp32), saved with its tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = load_tokenizer("tiny-llama")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("big-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run(model: Path | str, body: Callable[[HFEngine], Awaitable[Any]], device: str = "cpu") -> Any:
    async def main() -> Any:
        engine = HFEngine(str(model), device=device)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.close()

    return asyncio.run(main())


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line in /proc/self/status")


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The saved tensors, as the trainer would send them (the tied lm_head is not stored)."""
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def assert_same(a: GenerateOutput, b: GenerateOutput) -> None:
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs  # bit-identical: the same weights, buffers and seed


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc (Linux)")
def test_level_2_frees_the_weights_and_a_full_reload_restores_them(big_llama: Path) -> None:
    """Two cycles: the first frees weights mapped from the checkpoint file, the second frees the
    heap memory update_weights() filled, which is what a colocated engine holds from then on and
    what stays in the process (malloc keeps it) unless the engine trims the heap."""

    async def cycle(engine: HFEngine, rid: str, m: dict[str, int]) -> GenerateOutput:
        out = await engine.generate(rid, PROMPT, PARAMS)  # reads every weight: all pages resident
        gc.collect()
        _trim_host_heap()  # so the drop below is the weights, not garbage left by loading and generating
        m[f"{rid}_awake"] = rss_bytes()
        await engine.sleep(level=2)
        gc.collect()
        m[f"{rid}_asleep"] = rss_bytes()
        assert engine.model.lm_head.weight.is_meta and not engine.weights_valid
        await engine.wake()
        assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied
        await engine.update_weights(checkpoint(big_llama).items())
        await engine.finish_weight_update()
        assert engine.weights_valid and not engine.stats().sleeping
        return out

    async def body(engine: HFEngine) -> tuple[list[GenerateOutput], dict[str, int]]:
        m = {"weights": weight_bytes(engine.model)}
        outs = [await cycle(engine, "first", m), await cycle(engine, "second", m)]
        return outs + [await engine.generate("third", PROMPT, PARAMS)], m

    outs, m = run(big_llama, body)
    report = ", ".join(f"{k}={v / 2**20:.2f} MiB" for k, v in m.items())
    for rid in ("first", "second"):
        assert m[f"{rid}_awake"] - m[f"{rid}_asleep"] >= m["weights"] - RSS_TOLERANCE, report
    assert m["second_awake"] - m["first_asleep"] >= m["weights"] - RSS_TOLERANCE, report  # the memory came back
    assert_same(outs[0], outs[1])
    assert_same(outs[0], outs[2])


def test_level_1_on_cpu_keeps_the_weights(big_llama: Path) -> None:
    async def body(engine: HFEngine) -> tuple[GenerateOutput, GenerateOutput]:
        before = await engine.generate("before", PROMPT, PARAMS)
        storage = engine.model.model.embed_tokens.weight.data_ptr()
        await engine.sleep(level=1)
        assert engine.stats().sleeping and engine.weights_valid
        await engine.wake()
        assert engine.model.model.embed_tokens.weight.data_ptr() == storage  # not moved, not reloaded
        return before, await engine.generate("after", PROMPT, PARAMS)

    assert_same(*run(big_llama, body))


def test_generation_is_refused_until_a_level_2_sleep_is_followed_by_a_commit() -> None:
    async def body(engine: HFEngine) -> None:
        state = {n: t.clone() for n, t in engine.model.state_dict().items()}
        running = asyncio.create_task(engine.generate("long", PROMPT, SamplingParams(max_tokens=500, ignore_eos=True)))
        while engine.stats().running == 0:
            await asyncio.sleep(0.01)
        await engine.sleep(level=2)
        cut = await asyncio.wait_for(running, 5)  # its cache needs the discarded weights: ended, not frozen
        assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < 500

        with pytest.raises(RuntimeError, match=r"sleep\(level=2\).*finish_weight_update"):
            await engine.generate("asleep", PROMPT, PARAMS)
        with pytest.raises(RuntimeError, match=r"call wake\(\) first"):  # meta tensors would swallow it
            await engine.update_weights(state.items())
        await engine.wake()
        with pytest.raises(RuntimeError, match=r"sleep\(level=2\)"):  # memory back, values undefined
            await engine.generate("woken", PROMPT, PARAMS)
        await engine.update_weights(state.items())
        await engine.finish_weight_update()
        assert len((await engine.generate("ok", PROMPT, PARAMS)).token_ids) == PARAMS.max_tokens
        with pytest.raises(ValueError, match="sleep level 3 is not one of"):
            await engine.sleep(level=3)
        assert not engine.stats().sleeping  # a refused level pauses nothing

    run("tiny-llama", body)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_level_2_frees_device_memory(big_llama: Path) -> None:
    async def body(engine: HFEngine) -> tuple[GenerateOutput, GenerateOutput]:
        before = await engine.generate("before", PROMPT, PARAMS)
        size, held = weight_bytes(engine.model), torch.cuda.memory_allocated()
        await engine.sleep(level=2)
        assert held - torch.cuda.memory_allocated() >= size
        await engine.wake()
        await engine.update_weights(checkpoint(big_llama).items())
        await engine.finish_weight_update()
        return before, await engine.generate("after", PROMPT, PARAMS)

    before, after = run(big_llama, body, device="cuda")
    assert before.token_ids == after.token_ids
    assert torch.allclose(torch.tensor(before.logprobs), torch.tensor(after.logprobs), atol=1e-5, rtol=0)
