"""The simulated engine's timing model: a full KV cache queues, a prefix hit skips prefill, a decode
step grows with the batch, and a reply is served through a real EngineServer socket.

Durations are read on the engine's own simulated clock and compared as ratios far from the
threshold, so a loaded box stretches both sides alike."""

from __future__ import annotations

import asyncio

import numpy as np

from engines.inference import make_engine
from engines.inference.base import SamplingParams
from engines.inference.sim import MODELS
from tests.waiting import until

FIXED = {"reply_median": 1000.0, "reply_p99": 2000.0}  # replies longer than max_tokens: every reply is max_tokens


async def _timed(engine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, object]:
    t0 = engine.sim_now()
    out = await engine.generate(rid, prompt, SamplingParams(max_tokens=max_tokens))
    return engine.sim_now() - t0, out


def _run(coro):
    return asyncio.run(coro)


def test_a_full_kv_cache_queues_the_next_request() -> None:
    async def case(kv_tokens: int) -> tuple[float, float, int]:
        e = make_engine("sim", "7b-h100", kv_tokens=kv_tokens, **FIXED)
        await e.start()
        a = asyncio.ensure_future(_timed(e, "a", list(range(100)), 50))
        b = asyncio.ensure_future(_timed(e, "b", list(range(1000, 1100)), 50))
        await until(lambda: e.stats().running + e.stats().waiting == 2, "both requests are in the engine")
        waiting = e.stats().waiting
        (ta, _), (tb, _) = await asyncio.gather(a, b)
        await e.close()
        return ta, tb, waiting

    ta, tb, waiting = _run(case(kv_tokens=200))  # room for one prompt of 100 + reply of 50
    assert waiting == 1 and tb > 1.6 * ta, (waiting, ta, tb)
    ta, tb, waiting = _run(case(kv_tokens=10_000))  # room for both: they decode in one batch
    assert waiting == 0 and tb < 1.4 * ta, (waiting, ta, tb)


def test_a_prefix_hit_skips_prefill_and_is_reported() -> None:
    async def case() -> tuple[float, float, int, int]:
        e = make_engine("sim", "7b-h100", time_scale=10.0, **FIXED)
        await e.start()
        prompt = list(np.random.default_rng(0).integers(0, 32000, 30_000))  # 1 simulated s of prefill
        # the card's own computing time (busy_sim_s), not the clock: a loaded box adds wall time to the
        # call's Python around a one-step decode, never to what the model says the card computed
        busy = e.stats().busy_sim_s
        _, out1 = await _timed(e, "a", prompt, 1)
        cold, busy = e.stats().busy_sim_s - busy, e.stats().busy_sim_s
        _, out2 = await _timed(e, "b", prompt, 1)
        warm = e.stats().busy_sim_s - busy
        await e.close()
        return cold, warm, out1.cached_prompt_tokens, out2.cached_prompt_tokens

    cold, warm, c1, c2 = _run(case())
    assert c1 == 0 and c2 == 30_000 - 1, (c1, c2)
    assert cold > 0.7 * 30_000 / MODELS["7b-h100"].prefill_tok_s and warm < cold / 4, (cold, warm)


def test_a_decode_step_grows_with_the_batch_and_replies_are_filled() -> None:
    async def case() -> tuple[float, list[float], object]:
        e = make_engine("sim", "7b-h100", time_scale=5.0, filler_id=7, suffixes=[[1, 2, 3]], **FIXED)
        await e.start()
        prompt = list(range(16_000))
        await _timed(e, "warm", prompt, 1)  # in the prefix cache from now on
        single, out = await _timed(e, "one", prompt, 100)
        batch = await asyncio.gather(*(_timed(e, f"b{i}", prompt, 100) for i in range(6)))
        await e.close()
        return single, [t for t, _ in batch], out

    single, batch, out = _run(case())
    # a step of six 16k-token contexts reads six times the KV cache: about 2.9x the step of one
    assert max(batch) > 1.8 * single, (single, batch)
    assert max(batch) < 6 * single, "six requests of one batch took as long as six in a row"
    assert list(out.token_ids[-3:]) == [1, 2, 3] and set(out.token_ids[:-3]) == {7} and len(out.token_ids) == 100
    assert np.all(np.asarray(out.logprobs) < 0) and out.finish_reason == "length"


def test_sim_engines_serve_through_real_servers() -> None:
    from rollout.bus.client import GenerateClient
    from rollout.bus.server import EngineServer

    async def case(tmp: str) -> tuple[list[int], dict]:
        servers = [EngineServer(make_engine("sim", "7b-h100", time_scale=50.0, **FIXED), f"ipc://{tmp}/s{i}.sock",
                                f"sim{i}") for i in range(3)]
        tasks = [asyncio.ensure_future(s.run()) for s in servers]
        for s in servers:
            await s.wait_bound()
        async with GenerateClient([f"ipc://{tmp}/s{i}.sock" for i in range(3)], policy="round_robin") as c:
            await c.wait_ready(timeout_s=30)
            outs = await asyncio.gather(*(c.generate(list(range(40)), {"max_tokens": 20}) for _ in range(6)))
            stats = [(await c.status(i)).stats for i in range(3)]
        for s in servers:
            s.stop()
        await asyncio.gather(*tasks)
        return [len(o.token_ids) for o in outs], stats

    import tempfile
    with tempfile.TemporaryDirectory(prefix="sy-sim-") as tmp:
        lengths, stats = _run(case(tmp))
    assert lengths == [20] * 6
    assert all(s["generated_tokens"] == 40 and s["busy_sim_s"] > 0 for s in stats), stats
