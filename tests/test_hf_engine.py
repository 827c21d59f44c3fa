"""HFEngine on the tiny llama: batching, exact logprobs, stops, abort, weight updates.

Every logprob the engine returns is checked against a plain transformers forward pass over
prompt + response, because that is what the actor recomputes during training.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import pytest
import torch

from engines.inference import make_engine
from engines.inference.base import Engine, GenerateOutput, SamplingParams
from engines.inference.hf import HFEngine
from engines.models import load_tokenizer, resolve_model, tiny_llama
from waiting import until

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def reference() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model(MODEL)).eval()


def with_engine(body: Callable[[HFEngine], Awaitable[Any]], **options: Any) -> Any:
    """Start an engine, run `body` on it inside one event loop, always close it."""

    async def main() -> Any:
        engine = make_engine("hf", model=MODEL, **options)
        assert isinstance(engine, HFEngine) and isinstance(engine, Engine)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.close()

    return asyncio.run(main())


def teacher_forced_logprobs(model: Any, prompt: list[int], out: GenerateOutput, temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)


def prompt_of(n: int, start: int = 300) -> list[int]:
    return [start + 7 * i for i in range(n)]


def assert_logprobs_match(model: Any, prompt: list[int], out: GenerateOutput, temperature: float) -> None:
    assert len(out.token_ids) == len(out.logprobs) > 0
    expected = teacher_forced_logprobs(model, prompt, out, temperature)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0), (out.logprobs, expected)


@pytest.mark.parametrize("max_batch_size", [64, 5])
def test_concurrent_requests_finish_with_exact_logprobs(reference: Any, max_batch_size: int) -> None:
    """16 requests of mixed lengths and params; with 5 slots rows join the batch as others leave."""
    cases = []
    for i in range(16):
        params = SamplingParams(max_tokens=3 + (5 * i) % 23, temperature=[0.0, 0.7, 1.0, 1.3][i % 4],
                                top_k=[-1, 50][i % 2], top_p=[1.0, 0.9][(i // 2) % 2], seed=i, ignore_eos=True)
        cases.append((prompt_of(1 + (7 * i) % 40, start=200 + i), params))

    async def body(engine: HFEngine) -> list[GenerateOutput]:
        outs = await asyncio.gather(*[engine.generate(f"r{i}", p, sp) for i, (p, sp) in enumerate(cases)])
        stats = engine.stats()
        assert (stats.waiting, stats.running) == (0, 0)
        assert stats.generated_tokens == sum(len(o.token_ids) for o in outs)
        assert stats.prompt_tokens == sum(len(p) for p, _ in cases)
        return outs

    outs = with_engine(body, max_batch_size=max_batch_size)
    for (prompt, params), out in zip(cases, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == params.max_tokens
        assert_logprobs_match(reference, prompt, out, params.temperature)


def test_greedy_and_seeded_sampling_do_not_depend_on_the_batch() -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    prompt = prompt_of(9)

    async def body(engine: HFEngine) -> None:
        alone = await engine.generate("a", prompt, greedy)
        crowd = await asyncio.gather(engine.generate("b", prompt, greedy),
                                     *[engine.generate(f"x{i}", prompt_of(3 + 11 * i), seeded) for i in range(4)])
        assert crowd[0].token_ids == alone.token_ids
        s1 = await engine.generate("s1", prompt, seeded)
        s2, _ = await asyncio.gather(engine.generate("s2", prompt, seeded), engine.generate("y", prompt_of(30), greedy))
        assert s1.token_ids == s2.token_ids
        other = await engine.generate("s3", prompt, SamplingParams(max_tokens=12, seed=8, ignore_eos=True))
        assert other.token_ids != s1.token_ids

    with_engine(body)


def test_top_k_and_top_p_truncate_sampling(reference: Any) -> None:
    prompt = prompt_of(10)

    async def body(engine: HFEngine) -> list[GenerateOutput]:
        runs = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                SamplingParams(max_tokens=20, temperature=1.0, top_k=1, seed=1, ignore_eos=True),
                SamplingParams(max_tokens=20, temperature=1.0, top_p=1e-6, seed=2, ignore_eos=True),
                SamplingParams(max_tokens=40, temperature=2.0, top_k=3, seed=3, ignore_eos=True)]
        return await asyncio.gather(*[engine.generate(f"r{i}", prompt, p) for i, p in enumerate(runs)])

    greedy, top1, tiny_p, top3 = with_engine(body)
    assert top1.token_ids == tiny_p.token_ids == greedy.token_ids
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + top3.token_ids])).logits[0, len(prompt) - 1:-1]
    ranks = (logits > logits.gather(1, torch.tensor(top3.token_ids)[:, None])).sum(1)
    assert ranks.max() < 3 and ranks.min() == 0 and len(set(ranks.tolist())) > 1


def test_stop_token_ids_and_eos() -> None:
    prompt = prompt_of(6)

    async def body(engine: HFEngine) -> None:
        assert engine.eos_ids == {load_tokenizer(MODEL).eos_token_id}
        full = await engine.generate("full", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        stop_at = full.token_ids[4]
        cut = full.token_ids.index(stop_at) + 1
        out = await engine.generate("stop", prompt, SamplingParams(max_tokens=10, temperature=0,
                                                                   stop_token_ids=[stop_at]))
        assert (out.token_ids, out.finish_reason) == (full.token_ids[:cut], "stop")
        engine.eos_ids = {full.token_ids[0]}  # make the model's first greedy token its eos
        eos = await engine.generate("eos", prompt, SamplingParams(max_tokens=10, temperature=0))
        assert (eos.token_ids, eos.finish_reason) == (full.token_ids[:1], "stop")
        ignored = await engine.generate("ign", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        assert ignored.token_ids == full.token_ids and ignored.finish_reason == "length"

    with_engine(body)


def test_abort_running_pending_and_not_yet_arrived() -> None:
    long = SamplingParams(max_tokens=1500, ignore_eos=True)

    async def body(engine: HFEngine) -> None:
        running = asyncio.create_task(engine.generate("run", prompt_of(4), long))
        pending = asyncio.create_task(engine.generate("wait", prompt_of(5), long))
        # max_batch_size=1: the second waits for a slot
        await until(lambda: engine.stats().running == 1 and engine.stats().waiting == 1, "one runs, one waits")
        # tokens count while their request runs (a load report that moves), not only when it ends
        await until(lambda: engine.stats().generated_tokens > 0, "the running request's tokens are counted")
        await engine.abort("wait")
        out = await asyncio.wait_for(pending, 5)
        assert (out.token_ids, out.logprobs, out.finish_reason) == ([], [], "abort")
        await engine.abort("run")
        out = await asyncio.wait_for(running, 5)
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) == len(out.logprobs) < long.max_tokens
        assert engine.stats().generated_tokens == len(out.token_ids)  # each token once, none for the aborted wait
        await engine.abort("later")  # the abort can overtake its generate on the bus
        out = await engine.generate("later", prompt_of(4), long)
        assert (out.token_ids, out.finish_reason) == ([], "abort")
        assert engine.stats().running == 0 and engine.stats().waiting == 0
        gone = asyncio.create_task(engine.generate("gone", prompt_of(4), long))  # the caller is cancelled
        await until(lambda: engine.stats().running == 1, "the request runs")
        gone.cancel()
        out = await asyncio.wait_for(engine.generate("next", prompt_of(4), SamplingParams(max_tokens=3)), 5)
        assert len(out.token_ids) == 3  # the cancelled row freed the only slot

    with_engine(body, max_batch_size=1)


def test_event_loop_stays_responsive_during_generation() -> None:
    async def body(engine: HFEngine) -> None:
        ticks = 0
        task = asyncio.create_task(engine.generate("r", prompt_of(8), SamplingParams(max_tokens=200, ignore_eos=True)))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.001)
        assert len((await task).token_ids) == 200
        assert ticks > 20  # the loop kept running while the worker thread generated

    with_engine(body)


def test_update_weights_loads_another_model_exactly() -> None:
    other = tiny_llama(load_tokenizer(MODEL), seed=1)
    prompt, params = prompt_of(12), SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True)

    async def body(engine: HFEngine) -> tuple[GenerateOutput, GenerateOutput]:
        before = await engine.generate("before", prompt, params)
        state = other.state_dict()
        names = list(state)
        await engine.update_weights((n, state[n]) for n in names[: len(names) // 2])  # two buckets
        await engine.update_weights((n, state[n]) for n in names[len(names) // 2:])
        return before, await engine.generate("after", prompt, params)

    before, after = with_engine(body)
    assert_logprobs_match(other, prompt, after, params.temperature)
    assert after.logprobs != before.logprobs


def test_tied_lm_head_update_moves_the_embedding_too(reference: Any) -> None:
    new = torch.randn_like(reference.lm_head.weight) * 0.02

    async def body(engine: HFEngine) -> None:
        await engine.update_weights([("lm_head.weight", new)])
        assert torch.equal(engine.model.model.embed_tokens.weight, new)

    with_engine(body)


def test_bad_weights_are_refused_by_name_and_leave_the_model_intact(reference: Any) -> None:
    good = ("model.norm.weight", torch.full_like(reference.model.norm.weight, 3.0))
    wrong_shape = ("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))
    wrong_dtype = ("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64, dtype=torch.bfloat16))
    unknown = ("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))

    async def body(engine: HFEngine) -> None:
        for bad, words in [(wrong_shape, "shape (3, 3)"), (wrong_dtype, "has dtype bfloat16, this engine holds float32: the trainer sends its model.dtype"), (unknown, "unknown")]:
            with pytest.raises(ValueError) as err:
                await engine.update_weights([good, bad])
            assert repr(bad[0]) in str(err.value) and words in str(err.value)
        assert torch.equal(engine.model.model.norm.weight, reference.model.norm.weight)

    with_engine(body)


def test_prefix_reuse_counter_models_a_block_cache() -> None:
    shared = prompt_of(40)

    async def body(engine: HFEngine) -> list[int]:
        params = SamplingParams(max_tokens=2)
        first = await engine.generate("a", shared, params)
        same = await engine.generate("b", shared, params)
        branch = await engine.generate("c", shared[:20] + [5] * 20, params)
        assert engine.stats().cached_prompt_tokens == 32 + 16
        return [first.cached_prompt_tokens, same.cached_prompt_tokens, branch.cached_prompt_tokens]

    assert with_engine(body) == [0, 32, 16]


def test_sleep_pauses_and_wake_resumes() -> None:
    async def body(engine: HFEngine) -> None:
        await engine.sleep()
        assert engine.stats().sleeping
        task = asyncio.create_task(engine.generate("r", prompt_of(4), SamplingParams(max_tokens=4)))
        await until(lambda: engine.stats().waiting == 1, "the request is queued")
        await asyncio.sleep(0.1)  # a window in which the sleeping engine must not run it
        assert not task.done() and engine.stats().waiting == 1
        await engine.wake()
        assert len((await asyncio.wait_for(task, 5)).token_ids) > 0 and not engine.stats().sleeping

    with_engine(body)


def test_bad_requests_name_the_problem() -> None:
    async def body(engine: HFEngine) -> None:
        with pytest.raises(ValueError, match="empty"):
            await engine.generate("e", [], SamplingParams())
        with pytest.raises(ValueError, match=r"\[49152\] are outside the vocabulary"):
            await engine.generate("v", [1, 49152], SamplingParams())
        with pytest.raises(ValueError, match="2048"):
            await engine.generate("l", [1] * 2048, SamplingParams())
        running = asyncio.create_task(engine.generate("dup", [1, 2], SamplingParams(max_tokens=50)))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="'dup' is already running"):
            await engine.generate("dup", [1, 2], SamplingParams())
        await running

    with_engine(body)
    with pytest.raises(ValueError, match="dtype='int8'"):
        HFEngine(MODEL, dtype="int8")


@pytest.mark.slow
def test_smollm2_answers_a_chat_prompt() -> None:
    tok = load_tokenizer("smollm2-135m-instruct")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False).input_ids

    async def main() -> GenerateOutput:
        engine = HFEngine("smollm2-135m-instruct")
        await engine.start()
        try:
            return await engine.generate("q", ids, SamplingParams(max_tokens=30, temperature=0))
        finally:
            await engine.close()

    out = asyncio.run(main())
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
    assert "Paris" in tok.decode(out.token_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logprobs_and_sleep_wake(reference: Any) -> None:
    prompt, params = prompt_of(12), SamplingParams(max_tokens=16, temperature=0.7, seed=0, ignore_eos=True)

    async def body(engine: HFEngine) -> GenerateOutput:
        await engine.sleep()
        assert engine.model.device.type == "cpu"
        await engine.wake()
        assert engine.model.device.type == "cuda"
        return await engine.generate("r", prompt, params)

    out = with_engine(body, device="cuda")
    expected = teacher_forced_logprobs(reference, prompt, out, params.temperature)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-3, rtol=0)
