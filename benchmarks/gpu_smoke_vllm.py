"""The GPU smoke suite's vLLM checks (benchmarks/gpu_smoke.py, part `vllm`): the project's VLLMEngine on
vLLM's CUDA build, next to the hf engine and the actor. Each needs CUDA and an importable vLLM (on the GPU
image, benchmarks/vllm_device_install.sh puts one on PYTHONPATH); elsewhere each says why it skipped.

  vllm_logprobs  bf16 greedy generations; each logprob against the actor's bf16 forward over the same tokens,
                 before any push, after a full push of other weights, and after a push where only the
                 first layer changed (partial training: vLLM still takes every tensor of a version)
  vllm_sleep     torch.cuda.mem_get_info around sleep(1), sleep(2) and wake: GB freed and taken back, the same
                 greedy tokens after waking (level 2 after the weights are pushed back)
  vllm_handle_route  an engine server process with the vllm engine; weights pushed as buckets it opens by CUDA
                 IPC handle: the route taken, GB/s, every tensor's digest as vLLM serves it against what was
                 sent (engines/weight_digest.py), the pushed model's logprobs
  vllm_preempt   a long generation aborted once it has produced tokens: it returns them, finish_reason 'abort'
  vllm_vs_hf     rollout tokens/s of VLLMEngine and HFEngine on the same batch, greedy, the same new tokens
  vllm_grpo_run  launch/train.py, 3 GRPO steps with a colocated vLLM engine (pushes by the run's own route)
  vllm_lora_run  the same with a LoRA actor (rank 8), 2 steps: each push the adapter alone
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gpu_smoke_lib import (BF16_LOGPROB_TOL, Ctx, Skip, checkpoint_tensors, chosen, engine_outputs, free_memory, gb,
                           load_model, perturbed_model, prompts, teacher_forced)
from gpu_smoke_runs import _steps, _train

GPU_SHARE = 0.35  # of the GPU's memory for vLLM's weights and KV cache: the actor's forward shares the card


def _needs_vllm(ctx: Ctx) -> None:
    if not ctx.cuda:
        raise Skip("needs CUDA: vLLM's CUDA build (the CPU engine runs in tests/test_vllm_engine.py)")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise Skip(f"vllm does not import ({e}): run benchmarks/vllm_device_install.sh first") from None


def _engine(ctx: Ctx, **kw: Any) -> Any:
    from engines.inference.vllm import VLLMEngine

    return VLLMEngine(ctx.model, dtype="bfloat16", gpu_memory_utilization=GPU_SHARE, max_model_len=1024, **kw)


async def _greedy(engine: Any, ps: list[list[int]], params: Any, tag: str) -> list[Any]:
    return list(await asyncio.gather(*[engine.generate(f"{tag}{i}", p, params) for i, p in enumerate(ps)]))


def _gap(ctx: Ctx, model: Any, ps: list[list[int]], outs: list[Any]) -> float:
    """The largest |engine logprob - model logprob| over every generated token."""
    return max(float((torch.tensor(o.logprobs) - chosen(teacher_forced(model, p, o.token_ids, ctx.device), o.token_ids))
                     .abs().max()) for p, o in zip(ps, outs))


def check_vllm_logprobs(ctx: Ctx) -> dict[str, Any]:
    """Engine logprobs against the bf16 actor before any push, after a full push, after a push of partial
    training (only the first layer's tensors changed)."""
    _needs_vllm(ctx)
    from engines.inference.base import SamplingParams

    ps = prompts(ctx, ctx.size(3, 6))
    params = SamplingParams(max_tokens=ctx.size(8, 32), temperature=0.0, ignore_eos=True)
    base = load_model(ctx, torch.bfloat16)
    other = perturbed_model(ctx).to(torch.bfloat16)
    other_state = {n: t.detach() for n, t in other.state_dict().items()}
    base_state = {n: t.detach() for n, t in base.state_dict().items()}
    first = [n for n in base_state if ".layers.0." in n]

    async def main() -> dict[str, Any]:
        engine = _engine(ctx)
        await engine.start()
        try:
            m: dict[str, Any] = {"prompts": len(ps), "max_tokens": params.max_tokens}
            m["before_gap"] = _gap(ctx, base, ps, await _greedy(engine, ps, params, "before"))
            await engine.update_weights(other_state.items())
            await engine.finish_weight_update()
            m["full_push_gap"] = _gap(ctx, other, ps, await _greedy(engine, ps, params, "full"))
            m["full_push_gap_to_old"] = _gap(ctx, base, ps, await _greedy(engine, ps, params, "full_old"))
            # partial training: the first layer trained, the rest frozen; the engine still takes every tensor
            mixed = perturbed_model(ctx).to(torch.bfloat16)
            mixed.load_state_dict({n: base_state[n] for n in first}, strict=False)
            await engine.update_weights((n, t.detach()) for n, t in mixed.state_dict().items())
            await engine.finish_weight_update()
            m["partial_push_changed_tensors"] = len(first)
            m["partial_push_gap"] = _gap(ctx, mixed, ps, await _greedy(engine, ps, params, "partial"))
            return m
        finally:
            await engine.close()

    m = asyncio.run(main())
    for key in ("before_gap", "full_push_gap", "partial_push_gap"):
        if not m[key] < BF16_LOGPROB_TOL:
            raise AssertionError(f"vLLM's logprobs differ from the actor's by {m[key]:.3g} at {key}: {m}")
    if not m["full_push_gap_to_old"] > m["full_push_gap"]:
        raise AssertionError(f"after a full push vLLM is no closer to the pushed weights than to the old ones: {m}")
    return m


def check_vllm_sleep(ctx: Ctx) -> dict[str, Any]:
    """Device memory freed by sleep(1) and sleep(2), taken back on wake; the same tokens after waking."""
    _needs_vllm(ctx)
    from engines.inference.base import SamplingParams

    prompt = prompts(ctx, 1)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    state = {n: t.to(torch.bfloat16) for n, t in checkpoint_tensors(ctx.model).items()}

    def free() -> int:
        free_memory(ctx)
        return torch.cuda.mem_get_info()[0]

    async def main() -> dict[str, Any]:
        engine = _engine(ctx)
        await engine.start()
        try:
            m: dict[str, Any] = {"weights_gb": gb(sum(t.numel() * t.element_size() for t in state.values()))}
            before = await engine.generate("before", prompt, params)
            for level in (1, 2):
                awake = free()
                await engine.sleep(level=level)
                asleep = free()
                await engine.wake()
                woken = free()
                if level == 2:  # level 2 discards the weights: push them back
                    await engine.update_weights(state.items())
                    await engine.finish_weight_update()
                after = await engine.generate(f"after{level}", prompt, params)
                m[f"level{level}_freed_gb"] = gb(asleep - awake)
                m[f"level{level}_taken_back_gb"] = gb(asleep - woken)
                m[f"level{level}_same_tokens"] = after.token_ids == before.token_ids
            return m
        finally:
            await engine.close()

    m = asyncio.run(main())
    for level in (1, 2):
        if m[f"level{level}_freed_gb"] < m["weights_gb"] or not m[f"level{level}_same_tokens"]:
            raise AssertionError(f"vLLM sleep(level={level}) freed {m[f'level{level}_freed_gb']} GB (the weights "
                                 f"alone are {m['weights_gb']} GB), or generated differently after wake: {m}")
    return m


def check_vllm_handle_route(ctx: Ctx) -> dict[str, Any]:
    """bf16 weights into a vllm engine server by CUDA IPC handle; vLLM's digests equal what was sent."""
    _needs_vllm(ctx)
    from engines.weight_digest import compare, digests
    from rollout.bus import protocol as P
    from rollout.bus.client import GenerateClient
    from rollout.bus.launcher import start_server_process
    from rollout.weights.bus import push_weights
    from rollout.weights.handle import HandleSlots

    tmp = Path(tempfile.mkdtemp(prefix="gsv-"))  # short: ipc socket paths are limited to ~107 bytes
    log = ctx.work / "vllm_handle_engine.log"
    slots = HandleSlots(ctx.torch_device)
    ps = prompts(ctx, ctx.size(2, 4))
    new = perturbed_model(ctx).to(torch.bfloat16)
    sent = {n: t.detach() for n, t in new.state_dict().items()}

    async def main() -> dict[str, Any]:
        async with GenerateClient([f"ipc://{tmp}/e0.sock"]) as client:
            await client.wait_ready(timeout_s=300)
            report = await push_weights(client, sent.items(), version=1, bucket_bytes=64 << 20, slots=slots)
            replies = await client.broadcast(P.WeightsDigest(), 120)
            sampling = {"max_tokens": ctx.size(6, 24), "temperature": 0, "ignore_eos": True}
            pushed = [await client.generate(p, sampling, session_id=f"pushed{i}") for i, p in enumerate(ps)]
            return {"report": report, "digest": replies[0], "pushed": pushed}

    options = {"dtype": "bfloat16", "gpu_memory_utilization": GPU_SHARE, "max_model_len": 1024}
    proc = start_server_process("vllm", ctx.model, f"ipc://{tmp}/e0.sock", "e0", options, log_file=log)
    try:
        r = asyncio.run(main())
    except BaseException:
        sys.stderr.write(log.read_text()[-3000:] if log.exists() else "")
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        slots.close()
        shutil.rmtree(tmp, ignore_errors=True)
    rep, d = r["report"], r["digest"]
    m: dict[str, Any] = {"path": rep.path, "buckets": rep.buckets, "gb": gb(rep.bytes), "push_s": round(rep.seconds, 3),
                         "gb_per_s": round(rep.bytes / 2**30 / max(rep.seconds, 1e-9), 3),
                         "digest_available": bool(getattr(d, "available", False))}
    if m["digest_available"]:
        held = {n: (float(v[0]), float(v[1])) for n, v in zip(d.names, d.values)}
        bad, compared = compare(digests(sent.items()), held, "bfloat16", tied=bool(new.config.tie_word_embeddings))
        m.update({"digest_compared": compared, "digest_mismatched": bad[:8]})
    m["pushed_logprob_gap"] = _gap(ctx, new, ps, r["pushed"])
    if rep.path != "handle" or not m["digest_available"] or m["digest_mismatched"] or not m["digest_compared"]:
        raise AssertionError(f"weights by CUDA IPC handle into vLLM: wrong route, no digest or a tensor differs: {m}")
    if not m["pushed_logprob_gap"] < BF16_LOGPROB_TOL:
        raise AssertionError(f"vLLM does not serve the pushed weights: {m}")
    return m


def check_vllm_preempt(ctx: Ctx) -> dict[str, Any]:
    """A generation aborted after its first tokens returns what it produced, finish_reason 'abort'."""
    _needs_vllm(ctx)
    from engines.inference.base import SamplingParams

    prompt = prompts(ctx, 1)[0]
    params = SamplingParams(max_tokens=1024 - len(prompt), temperature=0.0, ignore_eos=True)  # to max_model_len

    async def main() -> dict[str, Any]:
        engine = _engine(ctx)
        await engine.start()
        try:
            task = asyncio.create_task(engine.generate("long", prompt, params))
            deadline = time.monotonic() + 60
            while engine.stats().running < 1:  # the scheduler has it (its view is one step old)
                if task.done() or time.monotonic() > deadline:
                    raise AssertionError(f"the request was not scheduled within 60 s, or ended first: {task}")
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # some decode steps: eager decoding takes a few ms a token
            await engine.abort("long")
            out = await asyncio.wait_for(task, 30)
            return {"tokens": len(out.token_ids), "logprobs": len(out.logprobs), "finish_reason": out.finish_reason}
        finally:
            await engine.close()

    m = asyncio.run(main())
    if m["finish_reason"] != "abort" or not 0 < m["tokens"] < params.max_tokens or m["logprobs"] != m["tokens"]:
        raise AssertionError(f"an aborted generation did not return its tokens so far: {m}")
    return m


def check_vllm_vs_hf(ctx: Ctx) -> dict[str, Any]:
    """Rollout tokens/s of the vLLM and hf engines on the same prompts, greedy, the same new tokens each."""
    _needs_vllm(ctx)
    from engines.inference.base import SamplingParams

    ps = prompts(ctx, ctx.size(8, 64))
    params = SamplingParams(max_tokens=ctx.size(16, 128), temperature=0.0, ignore_eos=True)

    async def vllm_run() -> tuple[list[Any], float]:
        engine = _engine(ctx)
        await engine.start()
        try:
            await _greedy(engine, ps[:2], params, "warm")
            t0 = time.perf_counter()
            outs = await _greedy(engine, ps, params, "timed")
            return outs, time.perf_counter() - t0
        finally:
            await engine.close()

    outs, seconds = asyncio.run(vllm_run())
    tokens = sum(len(o.token_ids) for o in outs)
    free_memory(ctx)
    engine_outputs(ctx, "bfloat16", ps[:2], params, "warm")  # the hf engine's first-call costs out of the timing
    hf_outs, hf_seconds = engine_outputs(ctx, "bfloat16", ps, params, "timed")
    hf_tokens = sum(len(o.token_ids) for o in hf_outs)
    m = {"prompts": len(ps), "max_tokens": params.max_tokens, "vllm_tokens_per_s": round(tokens / seconds, 1),
         "hf_tokens_per_s": round(hf_tokens / hf_seconds, 1)}
    m["vllm_vs_hf"] = round(m["vllm_tokens_per_s"] / m["hf_tokens_per_s"], 2)
    if tokens != hf_tokens:
        raise AssertionError(f"the engines generated {tokens} and {hf_tokens} tokens for the same batch: {m}")
    return m


def check_vllm_grpo_run(ctx: Ctx) -> dict[str, Any]:
    """launch/train.py: 3 GRPO steps with a colocated vLLM engine; the weight route and GB/s of each push."""
    _needs_vllm(ctx)
    steps, wall, args = _train(ctx, "vllm_grpo_run", [f"rollout.engine_options.gpu_memory_utilization={GPU_SHARE}"],
                               3, engine="vllm")
    sync = sorted({k.split("sync/engines_")[1] for m in steps for k in m if k.startswith("sync/engines_")})
    rates = [round(m["sync/gb"] / m["time/sync_s"], 3) for m in steps if m.get("sync/gb") and m.get("time/sync_s")]
    return {**_steps(steps, wall, args), "rollout_s": [round(m["time/rollout_s"], 3) for m in steps],
            "reward": [m["rollout/reward_mean"] for m in steps], "weight_route": sync,
            "push_gb": steps[-1].get("sync/gb"), "push_gb_per_s": rates}


def check_vllm_lora_run(ctx: Ctx) -> dict[str, Any]:
    """launch/train.py with a LoRA actor and a colocated vLLM engine: 2 steps, each push the adapter alone."""
    _needs_vllm(ctx)
    steps, wall, args = _train(ctx, "vllm_lora_run", ["actor.lora={rank: 8}", "actor.trainable=[]",
                                                      f"rollout.engine_options.gpu_memory_utilization={GPU_SHARE}"],
                               2, engine="vllm")
    full = sum(t.numel() * t.element_size() for t in checkpoint_tensors(ctx.model).values()) // 2  # bf16
    sent = max(m.get("sync/gb") or 0.0 for m in steps) * 1e9
    out = {**_steps(steps, wall, args), "sync_gb": round(sent / 1e9, 6), "sync_fraction": round(sent / full, 5)}
    if not sent or sent >= 0.05 * full:
        raise AssertionError(f"a LoRA push into vLLM sent {sent / 1e9:.4g} GB, {sent / full:.1%} of the model "
                             f"(must be under 5%): {out}")
    return out


VLLM_CHECKS = {"vllm_logprobs": check_vllm_logprobs, "vllm_sleep": check_vllm_sleep,
               "vllm_handle_route": check_vllm_handle_route, "vllm_preempt": check_vllm_preempt,
               "vllm_vs_hf": check_vllm_vs_hf, "vllm_grpo_run": check_vllm_grpo_run,
               "vllm_lora_run": check_vllm_lora_run}
