"""The GPU smoke suite: the paths written for CUDA that one GPU can run, each timed and caught on its own.

    bash benchmarks/gpu_smoke.sh                  # on the GPU machine (installs what is missing, picks the model)
    python benchmarks/gpu_smoke.py --device cpu --model tiny-llama --quick    # the same checks here (CI)

  hf_engine    HFEngine in fp32 and bf16: greedy generations; their logprobs against transformers' own
               forward over the same tokens in the same dtype (max |diff|; fp32 must stay under 1e-3)
  sleep_wake   torch.cuda.mem_get_info around sleep(1), sleep(2) and wake: GB freed and taken back, and
               the same generation after a reload (CUDA only: on CPU RSS is tests/test_hf_sleep.py's)
  handle_route an engine server process with the hf engine; weights pushed as buckets it opens by memory
               handle (CUDA IPC on a GPU; torch's file-backed shared memory on CPU, the same code): its
               logprobs then equal the pushed model's, and a bucket with one flipped byte is refused
  fsdp_actor   the torch actor sharded with FSDP2 (fully_shard over a one-rank group: TorchActor shards only
               when world > 1, so the suite takes its FSDP2 branch by hand), bf16 compute, fp32 masters:
               two update steps; loss, grad norm, step seconds, peak memory
  drift        the bf16 engine's sampled tokens and logprobs against the bf16 FSDP2 actor's (and fp32's)
  grpo_run     launch/train.py, 3 GRPO steps with the hf engine on the model; metrics.jsonl parsed
  megatron_run the same with the Megatron actor (TP 1), 2 steps (needs megatron-core; skipped without)
  lora_run     the same with a LoRA actor (rank 8), 2 steps: each push the adapter alone, < 5% of the model
  deepspeed_ref the same with a KL term to a DeepSpeed ZeRO-3 reference, 2 steps (skipped without deepspeed)
  reward_model a scalar reward model on the hf_reward engine parked on the host while asleep (GB freed, same
               scores after waking); a judged launch/train.py run, the judge pinned by reward.model.devices
  fsdp2_two_ranks, ddp_two_ranks, megatron_tp2, megatron_pp2, megatron_zero1
               torchrun with 2 ranks on the one GPU (SWITCHYARD_RANKS_PER_GPU=2; gloo carries CUDA tensors, as
               NCCL refuses two ranks on one device), 2 GRPO steps each on --model (CPU: tests/test_distributed.py
               and tests/test_megatron.py run them in CI)
  recipes      each recipe of launch/configs/recipes shrunk to one GPU and the suite's model, 2 steps
               (vLLM/SGLang, absent from the image, replaced by hf and said so)

Figures beside what the device measured in the same run (`limits`): the handle route's GB/s against the
device-to-device copy bandwidth, the FSDP2 and Megatron updates' FLOP/s (6 N T, a floor) against the
matmul rate in the dtype they train in, the hf engine's tokens/s against transformers' own generate on
the same batch. `--model-size 1b` builds a random 1.07B llama with --model's tokenizer on the device
first and runs the checks on it.

Writes a JSON report (--out) and a last line `RESULT {...}` with the headline numbers; exits 1 if any
check failed. A check that needs CUDA reports `skipped` with its reason on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_smoke_lib import (SIZES, Ctx, Skip, build_model, checkpoint_tensors, chosen, device_limits,  # noqa: E402
                           engine_outputs, free_memory, fsdp2_actor, gb, generate_rate, load_model, one_rank_group, pad_id,
                           perturbed_model, prompts, rollout_batch, teacher_forced, update_flops)

FP32_LOGPROB_TOL = 1e-3  # the engine's fp32 logprobs against a plain forward (measured ~1e-6 on CPU)
BF16_LOGPROB_TOL = 1.0  # bf16 differs by kernel and batch shape; past 1 nat the weights or the math are wrong
DRIFT_MEAN_TOL = 0.1  # mean |engine - actor| in bf16; a stale or garbled weight load is several nats


# --------------------------------------------------------------------------- checks


def check_hf_engine(ctx: Ctx) -> dict[str, Any]:
    """Greedy generations in fp32 and bf16, each logprob against transformers' forward in that dtype."""
    from engines.inference.base import SamplingParams

    ps = prompts(ctx, ctx.size(3, 6))
    params = SamplingParams(max_tokens=ctx.size(8, 48), temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"prompts": len(ps), "max_tokens": params.max_tokens}
    for dtype, tdtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        outs, seconds = engine_outputs(ctx, dtype, ps, params, dtype)
        ref = load_model(ctx, tdtype)
        diffs, agree, total = [], 0, 0
        for p, o in zip(ps, outs):
            logp = teacher_forced(ref, p, o.token_ids, ctx.device)
            want = chosen(logp, o.token_ids)
            diffs.append((torch.tensor(o.logprobs) - want).abs())
            agree += int((logp.argmax(-1) == torch.tensor(o.token_ids)).sum())
            total += len(o.token_ids)
        if dtype == "bfloat16":  # the engine's rate beside transformers' generate on the same batch
            out["bf16_generate_tokens_per_s"] = round(generate_rate(ctx, ref, ps, params.max_tokens), 1)
        del ref
        free_memory(ctx)
        d = torch.cat(diffs)
        key = "fp32" if dtype == "float32" else "bf16"
        out.update({f"{key}_max_abs_diff": float(d.max()), f"{key}_mean_abs_diff": float(d.mean()),
                    f"{key}_greedy_agreement": agree / total, f"{key}_tokens_per_s": round(total / seconds, 1)})
    if not out["fp32_max_abs_diff"] < FP32_LOGPROB_TOL:
        raise AssertionError(f"fp32 engine logprobs differ from transformers' by {out['fp32_max_abs_diff']:.3g} "
                             f"(> {FP32_LOGPROB_TOL}): {out}")
    if not out["bf16_max_abs_diff"] < BF16_LOGPROB_TOL:
        raise AssertionError(f"bf16 engine logprobs differ from transformers' by {out['bf16_max_abs_diff']:.3g}: {out}")
    out["bf16_engine_vs_generate"] = round(out["bf16_tokens_per_s"] / out["bf16_generate_tokens_per_s"], 3)
    if out["fp32_greedy_agreement"] < 0.95:
        raise AssertionError(f"the fp32 engine's greedy tokens are not the forward's argmax: {out}")
    return out


def check_sleep_wake(ctx: Ctx) -> dict[str, Any]:
    """Device memory freed by sleep(1) (weights to host) and sleep(2) (weights discarded), back on wake."""
    if not ctx.cuda:
        raise Skip("needs CUDA: torch.cuda.mem_get_info (the CPU RSS form is tests/test_hf_sleep.py)")
    from engines.inference.base import SamplingParams
    from engines.inference.hf import HFEngine

    prompt = prompts(ctx, 1)[0]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    state = checkpoint_tensors(ctx.model)

    def free() -> int:
        free_memory(ctx)
        return torch.cuda.mem_get_info()[0]

    async def main() -> dict[str, Any]:
        engine = HFEngine(ctx.model, device="cuda", dtype="float32")
        await engine.start()
        try:
            m: dict[str, Any] = {"weights_gb": gb(sum(p.numel() * p.element_size() for p in engine.model.parameters()))}
            before = await engine.generate("before", prompt, params)
            for level in (1, 2):
                awake = free()
                await engine.sleep(level=level)
                asleep = free()
                await engine.wake()
                woken = free()
                if level == 2:
                    await engine.update_weights((n, t.to(engine.dtype)) for n, t in state.items())
                    await engine.finish_weight_update()
                after = await engine.generate(f"after{level}", prompt, params)
                m[f"level{level}_freed_gb"] = gb(asleep - awake)
                m[f"level{level}_taken_back_gb"] = gb(asleep - woken)
                m[f"level{level}_same_tokens"] = after.token_ids == before.token_ids
                m[f"level{level}_logprob_gap"] = max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs))
            return m
        finally:
            await engine.close()

    m = asyncio.run(main())
    for level in (1, 2):
        if m[f"level{level}_freed_gb"] < 0.9 * m["weights_gb"] or not m[f"level{level}_same_tokens"]:
            raise AssertionError(f"sleep(level={level}) freed {m[f'level{level}_freed_gb']} GB of "
                                 f"{m['weights_gb']} GB of weights, or generated differently after wake: {m}")
    return m


def check_handle_route(ctx: Ctx) -> dict[str, Any]:
    """Weights into an engine server process by memory handle; a flipped byte is refused."""
    from rollout.bus import protocol as P
    from rollout.bus.client import GenerateClient, RequestFailed
    from rollout.bus.launcher import start_server_process
    from rollout.weights.bus import push_weights
    from rollout.weights.codec import slot_bucket
    from rollout.weights.handle import HandleSlots

    tmp = Path(tempfile.mkdtemp(prefix="gs-"))  # short: ipc socket paths are limited to ~107 bytes
    log = ctx.work / "handle_engine.log"
    slots = HandleSlots(ctx.torch_device)
    ps = prompts(ctx, ctx.size(2, 4))
    sampling = {"max_tokens": ctx.size(6, 24), "temperature": 0, "ignore_eos": True}
    new: Any = None

    async def greedy(client: Any, tag: str) -> list[Any]:
        return [await client.generate(p, sampling, session_id=f"{tag}{i}") for i, p in enumerate(ps)]

    async def main() -> dict[str, Any]:
        async with GenerateClient([f"ipc://{tmp}/e0.sock"]) as client:
            await client.wait_ready(timeout_s=ctx.size(120, 300))
            base = await greedy(client, "base")
            report = await push_weights(client, new.state_dict().items(), version=1,
                                        bucket_bytes=ctx.size(1 << 20, 64 << 20), slots=slots)
            pushed = await greedy(client, "pushed")
            await client.broadcast(P.WeightsBegin(weight_version=2))
            name, small = min(new.state_dict().items(), key=lambda kv: kv[1].numel())
            bucket = slot_bucket(slots, 0, [(name, torch.zeros_like(small))], 2, 0)
            slots.buffer(0, bucket.ref["total"])[5] ^= 1  # one byte flipped after the checksum was taken
            refused = ""
            try:
                await client.broadcast(bucket)
            except RequestFailed as e:
                refused = str(e)
            await client.broadcast(P.WeightsCommit(weight_version=2, num_buckets=0))  # nothing loaded: resume
            return {"report": report, "base": base, "pushed": pushed, "refused": refused,
                    "after": await greedy(client, "after")}

    options = {"device": ctx.device, "dtype": "float32"}
    proc = start_server_process("hf", ctx.model, f"ipc://{tmp}/e0.sock", "e0", options, log_file=log)
    try:
        new = perturbed_model(ctx)  # built while the server loads
        r = asyncio.run(main())
    except BaseException:
        sys.stderr.write(log.read_text()[-3000:] if log.exists() else "")
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        slots.close()
        shutil.rmtree(tmp, ignore_errors=True)
    gap_new, gap_base = 0.0, 0.0
    for p, reply, b in zip(ps, r["pushed"], r["base"]):
        want = chosen(teacher_forced(new, p, reply.token_ids, ctx.device), reply.token_ids)
        gap_new = max(gap_new, float((torch.tensor(reply.logprobs) - want).abs().max()))
        gap_base = max(gap_base, float((torch.tensor(b.logprobs) - torch.tensor(reply.logprobs)).abs().max())
                       if b.token_ids == reply.token_ids else float("inf"))
    rep = r["report"]
    m = {"handle": "cuda ipc" if ctx.cuda else "cpu (file-backed shared memory; CUDA IPC needs CUDA)",
         "path": rep.path, "buckets": rep.buckets, "gb": gb(rep.bytes), "push_s": round(rep.seconds, 3),
         "gb_per_s": round(rep.bytes / 2**30 / max(rep.seconds, 1e-9), 3), "pushed_logprob_gap": gap_new,
         "copy_gb_per_s": device_limits(ctx)["copy_gb_per_s"],
         "of_copy": round(rep.bytes / 1e9 / max(rep.seconds, 1e-9) / device_limits(ctx)["copy_gb_per_s"], 4),
         "changed_from_base": gap_base if gap_base != float("inf") else "tokens changed",
         "flipped_byte_refused": "failed its checksum" in r["refused"],
         "refused_bucket_left_weights": [(x.token_ids, x.logprobs) for x in r["after"]]
         == [(x.token_ids, x.logprobs) for x in r["pushed"]] and all(x.weight_version == 2 for x in r["after"]),
         "weight_version": r["pushed"][0].weight_version}
    if rep.path != "handle" or m["weight_version"] != 1 or not gap_new < FP32_LOGPROB_TOL <= gap_base / 10:
        raise AssertionError(f"the engine does not serve the pushed weights: {m}")
    if not m["flipped_byte_refused"] or not m["refused_bucket_left_weights"]:
        raise AssertionError(f"a bucket with a flipped byte was not refused cleanly ({r['refused']!r}): {m}")
    return m


def check_fsdp_actor(ctx: Ctx) -> dict[str, Any]:
    """Two FSDP2 bf16 update steps on a synthetic batch of the model's vocabulary."""
    from engines.training.losses import LossConfig

    rows, plen, rlen = ctx.size(4, 16), ctx.size(12, 128), ctx.size(20, 384)
    g = torch.Generator().manual_seed(0)
    with one_rank_group(ctx):
        actor = fsdp2_actor(ctx, "bfloat16", lr=1e-5, micro_batch_size=ctx.size(2, 8))
        vocab = actor.module.config.get_text_config().vocab_size
        data = [(torch.randint(3, vocab, (plen,), generator=g).tolist(),
                 torch.randint(3, vocab, (rlen,), generator=g).tolist(), [-1.0] * rlen) for _ in range(rows)]
        batch = rollout_batch(data, pad_id(ctx), group=2)
        adv = torch.randn(rows, generator=g)[:, None] * batch.response_mask
        first = next(p for p in actor.params if p.dim() == 2)
        before = first.to_local().detach().clone()
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
        steps = []
        for _ in range(2):
            t0 = time.perf_counter()
            m = actor.update(batch, adv, None, None, LossConfig())
            if ctx.cuda:
                torch.cuda.synchronize()
            steps.append(time.perf_counter() - t0)
        exported = sum(t.numel() for _, t in actor.named_hf_weights())
        tflops = update_flops(exported, rows * (plen + rlen)) / steps[1] / 1e12
        peak = device_limits(ctx)["matmul_tflops"]
        out = {"tflops": round(tflops, 4), "matmul_tflops": peak, "of_peak": round(tflops / peak, 4),"sharded": type(actor.module).__name__, "rows": rows, "tokens_per_row": plen + rlen,
               "loss": m["loss"], "pg_loss": m["pg_loss"], "grad_norm": m["grad_norm"],
               "step_s_first": round(steps[0], 3), "step_s": round(steps[1], 3),
               "peak_gb": gb(torch.cuda.max_memory_allocated()) if ctx.cuda else None,
               "actor_memory_gb": round(actor.memory_report()["total_gb"], 4), "exported_params": exported,
               "weights_moved": not torch.equal(before, first.to_local().detach())}
    del actor
    free_memory(ctx)
    if not (out["grad_norm"] > 0 and torch.isfinite(torch.tensor([out["loss"], out["grad_norm"]])).all()):
        raise AssertionError(f"the FSDP2 update gave no finite gradient: {out}")
    if not out["weights_moved"] or "FSDP" not in out["sharded"]:
        raise AssertionError(f"the update did not move the sharded weights: {out}")
    return out


def check_drift(ctx: Ctx) -> dict[str, Any]:
    """The bf16 engine's sampled tokens scored by the bf16 FSDP2 actor (and by fp32 transformers)."""
    from engines.inference.base import SamplingParams

    group = 2
    ps = [p for p in prompts(ctx, ctx.size(2, 6)) for _ in range(group)]
    params = SamplingParams(max_tokens=ctx.size(16, 96), temperature=1.0, ignore_eos=True)  # the engine's seeded stream
    outs, _ = engine_outputs(ctx, "bfloat16", ps, params, "drift")
    free_memory(ctx)
    batch = rollout_batch([(p, o.token_ids, o.logprobs) for p, o in zip(ps, outs)], pad_id(ctx), group)
    mask = batch.loss_mask.bool()
    with one_rank_group(ctx):
        actor = fsdp2_actor(ctx, "bfloat16", micro_batch_size=ctx.size(2, 8))
        lp, _ = actor.compute_logprobs(batch)
        del actor
    free_memory(ctx)
    ref = load_model(ctx, torch.float32)
    exact = torch.cat([chosen(teacher_forced(ref, p, o.token_ids, ctx.device), o.token_ids) for p, o in zip(ps, outs)])
    del ref
    free_memory(ctx)
    gap = (batch.rollout_logprobs - lp).abs()[mask]
    engine = torch.tensor([x for o in outs for x in o.logprobs])
    out = {"tokens": int(mask.sum()), "engine_vs_actor_bf16_mean": float(gap.mean()),
           "engine_vs_actor_bf16_max": float(gap.max()),
           "engine_bf16_vs_fp32_mean": float((engine - exact).abs().mean()),
           "actor_bf16_vs_fp32_mean": float((lp[mask] - exact).abs().mean())}
    if not out["engine_vs_actor_bf16_mean"] < DRIFT_MEAN_TOL:
        raise AssertionError(f"engine and actor disagree by {out['engine_vs_actor_bf16_mean']:.3g} nats a token "
                             f"on average (> {DRIFT_MEAN_TOL}): {out}")
    return out


def _train(ctx: Ctx, tag: str, extra: list[str], steps: int, ranks: int = 1, config: str | None = None,
           model: str | None = None) -> tuple[list[dict[str, Any]], float, list[str]]:
    """launch/train.py (`config` if given) for `steps` GRPO steps with the hf engine on the model (bf16 on
    the GPU, where the engine shares the actor's device: weights by CUDA IPC handle); its metrics.jsonl
    steps, wall seconds, args. `ranks` > 1: torchrun with that many ranks on the one GPU
    (SWITCHYARD_RANKS_PER_GPU; gloo for CUDA tensors, since NCCL refuses two ranks on one device) and
    the engine in a process of its own beside them (placement cpu, on the GPU by its device option)."""
    out_dir = ctx.work / tag
    args = [f"model.path={model or ctx.model}", "rollout.engine=hf", f"trainer.steps={steps}", "sft.enabled=false",
            "data.val_path=null", f"data.prompts_per_step={ctx.size(2, 8)}", f"rollout.n={ctx.size(2, 4)}",
            f"rollout.max_tokens={ctx.size(16, 128)}", f"trainer.output_dir={out_dir}", "trainer.resume=false",
            "trainer.export_hf=false", *extra]
    if ctx.cuda:
        args += ["model.dtype=bfloat16", "rollout.engine_options.device=cuda"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    cmd = [sys.executable, "launch/train.py", *([config] if config else []), *args]
    if ranks > 1:
        args += ["rollout.placement=cpu"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "launch/train.py", *([config] if config else []), *args]
        env.update(SWITCHYARD_RANKS_PER_GPU=str(ranks), SWITCHYARD_PG_BACKEND="cpu:gloo,cuda:gloo")
    log = ctx.work / f"{tag}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=ctx.size(240, 420))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise AssertionError(f"launch/train.py exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    got = [m for m in rows if m.get("step", 0) > 0]
    if [m["step"] for m in got] != list(range(1, steps + 1)):
        raise AssertionError(f"metrics.jsonl has steps {[m.get('step') for m in rows]}, expected 1..{steps}")
    return got, wall, args


def _steps(got: list[dict[str, Any]], wall: float, args: list[str]) -> dict[str, Any]:
    return {"wall_s": round(wall, 1), "step_s": [round(m["time/step_s"], 3) for m in got],
            "update_s": [round(m["time/update_s"], 3) for m in got], "drift_mean": [m.get("drift/mean") for m in got],
            "mismatched_tensors": [m.get("sync/mismatched_tensors") for m in got], "args": args}


def _update_rate(ctx: Ctx, got: list[dict[str, Any]]) -> dict[str, Any]:
    """The last step's update as FLOP/s (6 N T over the tokens it read) and as a fraction of the measured
    matmul rate; a small batch of short rows, so a floor, not the backend's best."""
    params = sum(t.numel() for t in checkpoint_tensors(ctx.model).values())
    last = got[-1]
    tflops = update_flops(params, int(last.get("rollout/tokens") or 0)) / max(last["time/update_s"], 1e-9) / 1e12
    peak = device_limits(ctx)["matmul_tflops"]
    return {"update_tflops": round(tflops, 4), "matmul_tflops": peak, "update_of_peak": round(tflops / peak, 4)}


def check_grpo_run(ctx: Ctx) -> dict[str, Any]:
    """launch/train.py: 3 GRPO steps with the hf engine; step seconds and reward from metrics.jsonl."""
    steps, wall, args = _train(ctx, "grpo_run", [], 3)
    sync = sorted({k.split("sync/engines_")[1] for m in steps for k in m if k.startswith("sync/engines_")})
    return {**_steps(steps, wall, args), "rollout_s": [round(m["time/rollout_s"], 3) for m in steps],
            "reward": [m["rollout/reward_mean"] for m in steps], "weight_route": sync,
            "full_sync_gb": steps[-1].get("sync/gb")}


def check_megatron_run(ctx: Ctx) -> dict[str, Any]:
    """launch/train.py with the Megatron actor (TP 1): the path that failed at its first forward on CUDA
    (its RNG tracker unseeded); 2 GRPO steps, their update seconds and drift."""
    _needs_megatron()
    steps, wall, args = _train(ctx, "megatron_run", ["actor.backend=megatron", "actor.trainable=[]",
                                                     "actor.gradient_checkpointing=false"], 2)
    return {**_steps(steps, wall, args), **_update_rate(ctx, steps)}


def check_lora_run(ctx: Ctx) -> dict[str, Any]:
    """launch/train.py with a LoRA actor (rank 8): every push is the adapter alone (colocated engines keep
    their base asleep), so `sync/gb` is a few percent of the model's bytes at most."""
    steps, wall, args = _train(ctx, "lora_run", ["actor.lora={rank: 8}", "actor.trainable=[]"], 2)
    full = sum(t.numel() * t.element_size() for t in checkpoint_tensors(ctx.model).values())
    if ctx.cuda:
        full //= 2  # what a bf16 engine is sent: the checkpoint's fp32 halved
    sent = max(m.get("sync/gb") or 0.0 for m in steps) * 1e9
    out = {**_steps(steps, wall, args), "sync_gb": round(sent / 1e9, 6), "model_gb": round(full / 1e9, 4),
           "sync_fraction": round(sent / full, 5)}
    if not sent or sent >= 0.05 * full:
        raise AssertionError(f"a LoRA push sent {sent / 1e9:.4g} GB, {sent / full:.1%} of the model's "
                             f"{full / 1e9:.4g} GB (must be under 5%): {out}")
    return out


def check_deepspeed_ref(ctx: Ctx) -> dict[str, Any]:
    """launch/train.py with a KL term whose reference is DeepSpeed ZeRO-3 (`reference.backend=deepspeed`),
    2 GRPO steps; on CPU DeepSpeed's CPU accelerator (its collectives compiled on first use)."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise Skip(f"deepspeed is not importable ({e}); install it (pip install deepspeed) to run this check")
    steps, wall, args = _train(ctx, "deepspeed_ref", ["reference.backend=deepspeed", "algorithm.loss.kl_coef=0.01",
                                                      "actor.trainable=[]"], 2)
    return {**_steps(steps, wall, args), "kl_in_reward": [m.get("kl_in_reward") for m in steps]}


def check_reward_model(ctx: Ctx) -> dict[str, Any]:
    """The reward model's engines on a GPU: a one-output sequence classifier built from the model (its
    head seeded) scored by the hf_reward engine on the device, parked on the host while asleep (device
    memory freed, the same scores after waking); then launch/train.py judged by the model itself as an
    hf engine pinned to GPU 0 by `reward.model.devices`, 2 steps, every trajectory scored."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from engines.inference.base import SamplingParams
    from engines.inference.hf_reward import HFRewardEngine

    if not ctx.cuda:
        raise Skip("needs CUDA: parking on the host frees device memory; on CPU the scalar engine runs in CI "
                   "(tests/test_reward_model_engine.py) and a judged GRPO step (tests/test_reward_model.py)")
    path = ctx.work / "scalar-rm"
    cfg = AutoConfig.from_pretrained(ctx.model, num_labels=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_pretrained(ctx.model, config=cfg, torch_dtype=torch.bfloat16) \
            .save_pretrained(str(path))
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(ctx.model).save_pretrained(str(path))
    ps = prompts(ctx, 4)

    async def scores_and_memory() -> dict[str, Any]:
        engine = HFRewardEngine(str(path), device="cuda", dtype="bfloat16")
        await engine.start()
        try:
            async def score(tag: str) -> list[float]:
                outs = [await engine.generate(f"{tag}{i}", p, SamplingParams(max_tokens=1)) for i, p in enumerate(ps)]
                return [o.score for o in outs]
            before = await score("a")
            free0 = torch.cuda.mem_get_info()[0]
            await engine.sleep(1)
            free1 = torch.cuda.mem_get_info()[0]
            await engine.wake()
            after = await score("b")
            return {"scores": before, "same_after_wake": before == after, "parked_freed_gb": gb(free1 - free0)}
        finally:
            await engine.close()

    out = asyncio.run(scores_and_memory())
    if not out["same_after_wake"] or out["parked_freed_gb"] <= 0:
        raise AssertionError(f"the parked reward model freed nothing or scored differently after waking: {out}")
    judge = f"reward.model={{path: {ctx.small_model}, kind: judge, devices: [0], max_tokens: 8}}"
    steps, wall, args = _train(ctx, "reward_model", [judge], 2, model=ctx.small_model)
    invalid = [m.get("rollout/invalid") for m in steps]
    if any(invalid):
        raise AssertionError(f"judged trajectories failed to score ({invalid} invalid per step); see reward_model.log")
    return {**out, **_steps(steps, wall, args), "invalid": invalid}


TWO_RANKS_ON_CPU = ("two ranks on CPU run in CI as tests/test_distributed.py (DDP, FSDP2) and tests/test_megatron.py "
                    "(TP 2, PP 2, ZeRO-1 over 2 DP ranks) over gloo; this check is the same run on one GPU")


def _two_ranks(ctx: Ctx, tag: str, extra: list[str]) -> dict[str, Any]:
    if not ctx.cuda:
        raise Skip(TWO_RANKS_ON_CPU)
    steps, wall, args = _train(ctx, tag, extra, 2, ranks=2, model=ctx.small_model)
    return {**_steps(steps, wall, args), "pg_backend": "cpu:gloo,cuda:gloo (NCCL refuses two ranks on one GPU)"}


def _needs_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise Skip(f"megatron-core is not importable ({e}); benchmarks/gpu_wheels.sh carries its wheel")


def check_fsdp2_two_ranks(ctx: Ctx) -> dict[str, Any]:
    """torchrun, 2 ranks on the one GPU: the torch actor sharded by FSDP2, 2 GRPO steps."""
    return _two_ranks(ctx, "fsdp2_two_ranks", ["actor.sharding=fsdp", "actor.trainable=[]"])


def check_ddp_two_ranks(ctx: Ctx) -> dict[str, Any]:
    """torchrun, 2 ranks on the one GPU: the torch actor replicated (DDP), 2 GRPO steps."""
    return _two_ranks(ctx, "ddp_two_ranks", ["actor.sharding=none", "actor.trainable=[]"])


def check_megatron_tp2(ctx: Ctx) -> dict[str, Any]:
    """torchrun, 2 ranks on the one GPU: Megatron TP 2, 2 GRPO steps."""
    _needs_megatron()
    return _two_ranks(ctx, "megatron_tp2", ["actor.backend=megatron", "actor.tp=2", "actor.trainable=[]",
                                            "actor.gradient_checkpointing=false"])


def check_megatron_pp2(ctx: Ctx) -> dict[str, Any]:
    """torchrun, 2 ranks on the one GPU: Megatron PP 2, 2 GRPO steps."""
    _needs_megatron()
    return _two_ranks(ctx, "megatron_pp2", ["actor.backend=megatron", "actor.pp=2", "actor.trainable=[]",
                                            "actor.gradient_checkpointing=false"])


def check_megatron_zero1(ctx: Ctx) -> dict[str, Any]:
    """torchrun, 2 ranks on the one GPU: Megatron DP 2 with its ZeRO-1 optimizer, 2 GRPO steps."""
    _needs_megatron()
    return _two_ranks(ctx, "megatron_zero1", ["actor.backend=megatron", "actor.sharding=optimizer",
                                              "actor.trainable=[]", "actor.gradient_checkpointing=false"])


RECIPE_SWAPS = {"vllm": "hf", "sglang": "hf"}  # engines the GPU image lacks
GSM8K_TRAIN = [Path(p) for p in filter(None, [os.environ.get("SMOKE_GSM8K")])] + [
    REPO / "data" / "gsm8k" / "train.jsonl", REPO / "shared" / "data" / "gsm8k" / "train.jsonl",
    REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"]


def check_recipes(ctx: Ctx) -> dict[str, Any]:
    """Each recipe shrunk to one GPU and the suite's model: its own placement, actor, reference and
    algorithm choices, 2 GRPO steps; an engine the image lacks replaced by hf (said in the result);
    TP/PP/DP and multi-node layouts folded to one rank. Each recipe timed and caught on its own."""
    import yaml

    if not ctx.cuda:
        raise Skip("the recipes are GPU layouts (colocated vLLM, FSDP2 over 8 GPUs, Megatron TP 2, Slurm); on CPU "
                   "their plans are checked in CI (tests/test_plan.py) and the demo's own run (tests/test_train.py)")
    out: dict[str, Any] = {}
    for recipe in sorted((REPO / "launch" / "configs" / "recipes").glob("*.yaml")):
        cfg = yaml.safe_load(recipe.read_text())
        engine = (cfg.get("rollout") or {}).get("engine", "vllm")
        actor = cfg.get("actor") or {}
        extra = ["rollout.placement=auto", "rollout.num_engines=1", "rollout.engine_options={}", "actor.tp=1",
                 "actor.pp=1", "actor.micro_batch_size=4", "actor.ppo_mini_batch_size=0", "actor.trainable=[]",
                 "rollout.staleness=" + str(min(1, int((cfg.get("rollout") or {}).get("staleness", 0)))),
                 "actor.sharding=" + ("none" if actor.get("backend", "torch") == "torch" else "optimizer")]
        train = (cfg.get("data") or {}).get("train_path")
        if train and not (REPO / train).is_file():
            found = next((f for f in GSM8K_TRAIN if f.is_file()), None)
            if found is None:
                out[recipe.stem] = {"status": "skipped", "reason": f"its data {train} is not here (the recipe's "
                                    "header says how to make it; or set SMOKE_GSM8K to a GSM8K train.jsonl)"}
                continue
            extra.append(f"data.train_path={found}")
        t0 = time.perf_counter()
        try:
            steps, wall, _ = _train(ctx, f"recipe_{recipe.stem}", extra, 2, config=str(recipe))
            out[recipe.stem] = {"status": "ok", "engine": f"hf (the recipe's {engine} is not in the image)"
                                if engine in RECIPE_SWAPS else engine, **_steps(steps, wall, [])}
            out[recipe.stem].pop("args", None)
        except Exception as e:  # one recipe's failure never hides the others'
            out[recipe.stem] = {"status": "failed", "error": f"{type(e).__name__}: {e}"[-2000:]}
        out[recipe.stem]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[gpu_smoke] recipes: {recipe.stem}: {out[recipe.stem]['status']}", file=sys.stderr, flush=True)
    failed = [k for k, v in out.items() if v["status"] == "failed"]
    if failed:
        raise AssertionError(f"recipes failed on one GPU: {failed}: {json.dumps(out, default=str)[:3000]}")
    return out


CHECKS: dict[str, Callable[[Ctx], dict[str, Any]]] = {  # by value: a run cut off still reports the most
    "hf_engine": check_hf_engine, "sleep_wake": check_sleep_wake, "handle_route": check_handle_route,
    "fsdp_actor": check_fsdp_actor, "drift": check_drift, "grpo_run": check_grpo_run,
    "megatron_run": check_megatron_run, "lora_run": check_lora_run, "deepspeed_ref": check_deepspeed_ref,
    "reward_model": check_reward_model, "fsdp2_two_ranks": check_fsdp2_two_ranks, "ddp_two_ranks": check_ddp_two_ranks,
    "megatron_tp2": check_megatron_tp2, "megatron_pp2": check_megatron_pp2, "megatron_zero1": check_megatron_zero1,
    "recipes": check_recipes}


def run_check(name: str, fn: Callable[[Ctx], dict[str, Any]], ctx: Ctx) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        res: dict[str, Any] = {"status": "ok", **fn(ctx)}
    except Skip as e:
        res = {"status": "skipped", "reason": str(e)}
    except Exception as e:  # one check's failure never stops the others
        res = {"status": "failed", "error": f"{type(e).__name__}: {e}"[:4000],
               "traceback": traceback.format_exc()[-4000:]}
    finally:
        free_memory(ctx)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    brief = {k: v for k, v in res.items() if k not in ("traceback", "args")}
    print(f"[gpu_smoke] {name}: {json.dumps(brief, default=str)[:1500]}", file=sys.stderr, flush=True)
    return res


def headline(report: dict[str, Any]) -> dict[str, Any]:
    c = report["checks"]

    def get(check: str, key: str) -> Any:
        return c.get(check, {}).get(key)

    grpo_steps = get("grpo_run", "step_s") or []
    model = report["model"]
    return {"device": report["device"], "gpu": report["gpu"], "model": model if model.startswith("random") else Path(model).name,
            **{s: sum(r["status"] == s for r in c.values()) for s in ("ok", "failed", "skipped")},
            "hf_fp32_max_diff": get("hf_engine", "fp32_max_abs_diff"),
            "hf_bf16_max_diff": get("hf_engine", "bf16_max_abs_diff"),
            "sleep_l1_freed_gb": get("sleep_wake", "level1_freed_gb"),
            "sleep_l2_freed_gb": get("sleep_wake", "level2_freed_gb"),
            "handle_gb_per_s": get("handle_route", "gb_per_s"), "copy_gb_per_s": get("handle_route", "copy_gb_per_s"),
            "hf_engine_vs_generate": get("hf_engine", "bf16_engine_vs_generate"),
            "fsdp_of_peak": get("fsdp_actor", "of_peak"), "megatron_of_peak": get("megatron_run", "update_of_peak"),
            "matmul_tflops": (report.get("limits") or {}).get("matmul_tflops"),
            "handle_flip_refused": get("handle_route", "flipped_byte_refused"),
            "fsdp_step_s": get("fsdp_actor", "step_s"), "fsdp_peak_gb": get("fsdp_actor", "peak_gb"),
            "fsdp_grad_norm": get("fsdp_actor", "grad_norm"),
            "drift_bf16_mean": get("drift", "engine_vs_actor_bf16_mean"),
            "drift_bf16_max": get("drift", "engine_vs_actor_bf16_max"),
            "grpo_step_s": round(sum(grpo_steps[1:]) / max(1, len(grpo_steps) - 1), 3) if grpo_steps else None,
            "grpo_reward": (get("grpo_run", "reward") or [None])[-1],
            "grpo_weight_route": get("grpo_run", "weight_route"),
            "megatron_update_s": (get("megatron_run", "update_s") or [None])[-1],
            "lora_sync_fraction": get("lora_run", "sync_fraction"),
            "deepspeed_ref_kl": (get("deepspeed_ref", "kl_in_reward") or [None])[-1], "seconds": report["seconds"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=os.environ.get("SMOKE_MODEL", "tiny-llama"),
                    help="a local HF model directory or a built-in name (engines/models.py)")
    ap.add_argument("--model-size", default=None, choices=sorted(SIZES),
                    help="build a llama of this size with random weights and --model's tokenizer on the device, and "
                         "run the checks on it (1b: 1.07B parameters); the two-rank checks keep --model")
    ap.add_argument("--quick", action="store_true", help="small batches and few tokens (the CPU test)")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(CHECKS)}")
    ap.add_argument("--out", default=None, help="JSON report path (default: $OUT/gpu_smoke.json, else runs/gpu_smoke/)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: --device cuda but torch sees no CUDA device (torch "
              f"{torch.__version__}); run with --device cpu to check the suite itself", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        ap.error(f"unknown checks {unknown}; choose from {list(CHECKS)}")
    from engines.models import resolve_model

    model = str(resolve_model(args.model))
    out = Path(args.out or Path(os.environ.get("OUT", REPO / "runs" / "gpu_smoke")) / "gpu_smoke.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as work:
        ctx = Ctx(args.device, model, args.quick, Path(work))
        if args.model_size:
            t1 = time.perf_counter()
            ctx.small, ctx.model = model, str(build_model(args.model_size, model, Path(work) / f"llama-{args.model_size}",
                                                          args.device))
            print(f"[gpu_smoke] built a random {args.model_size} llama in {time.perf_counter() - t1:.1f} s",
                  file=sys.stderr, flush=True)
        checks = {name: run_check(name, CHECKS[name], ctx) for name in names}
        for name in ("handle_route", "grpo_run", "megatron_run", "lora_run", "deepspeed_ref", "reward_model",
                     "fsdp2_two_ranks",
                     "ddp_two_ranks", "megatron_tp2", "megatron_pp2", "megatron_zero1", "recipe_"):  # logs beside it
            for f in Path(work).glob(f"{name}*.log"):
                (out.parent / f.name).write_text(f.read_text())
    report = {"device": args.device, "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
              "torch": torch.__version__, "model": f"random {args.model_size} llama ({model}'s tokenizer)"
              if args.model_size else model, "limits": ctx.limits, "quick": args.quick, "checks": checks,
              "seconds": round(time.perf_counter() - t0, 1)}
    report["result"] = headline(report)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"report: {out}", file=sys.stderr)
    print("RESULT " + json.dumps(report["result"], default=str), flush=True)
    return 1 if any(c["status"] == "failed" for c in checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
