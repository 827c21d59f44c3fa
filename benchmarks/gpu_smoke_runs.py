"""The GPU smoke suite's checks that run the project's own scripts (benchmarks/gpu_smoke.py lists them
all): `launch/train.py` for a few GRPO steps per backend and placement, as one process or two ranks
on the one GPU, each recipe shrunk to one GPU (each reads the run's metrics.jsonl), and the
weight-sync benchmark's CUDA form."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common import child_env
from gpu_smoke_lib import Ctx, Skip, checkpoint_tensors, device_limits, gb, prompts, update_flops

REPO = Path(__file__).resolve().parents[1]


def _train(ctx: Ctx, tag: str, extra: list[str], steps: int, ranks: int = 1, config: str | None = None,
           model: str | None = None, engine: str = "hf") -> tuple[list[dict[str, Any]], float, list[str]]:
    """launch/train.py (`config` if given) for `steps` GRPO steps with the hf engine on the model (bf16 on
    the GPU, where the engine shares the actor's device: weights by CUDA IPC handle); its metrics.jsonl
    steps, wall seconds, args. `ranks` > 1: torchrun with that many ranks on the one GPU
    (SWITCHYARD_RANKS_PER_GPU; gloo for CUDA tensors, since NCCL refuses two ranks on one device) and
    the engine in a process of its own beside them (placement cpu, on the GPU by its device option)."""
    out_dir = ctx.work / tag
    args = [f"model.path={model or ctx.model}", f"rollout.engine={engine}", f"trainer.steps={steps}", "sft.enabled=false",
            "data.val_path=null", f"data.prompts_per_step={ctx.size(2, 8)}", f"rollout.n={ctx.size(2, 4)}",
            f"rollout.max_tokens={ctx.size(16, 128)}", f"trainer.output_dir={out_dir}", "trainer.resume=fresh",
            "trainer.export_hf=false", f"trainer.save_every={steps}", *extra]  # one checkpoint: 13 GB at 1B
    # bf16 on the GPU; on a CPU float32 whatever it multiplies natively, so drift is checked at fp32's resolution
    args += ["model.dtype=bfloat16"] if ctx.cuda else ["model.dtype=float32"]
    if ctx.cuda and engine == "hf":
        args += ["rollout.engine_options.device=cuda"]
    env = child_env()
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
    shutil.rmtree(out_dir, ignore_errors=True)  # its checkpoint (weights, AdamW): the next run needs the disk
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
    # $SMOKE_RECIPES: a glob of the recipes to run (a rerun of the ones that failed), all by default
    for recipe in sorted((REPO / "launch" / "configs" / "recipes").glob(os.environ.get("SMOKE_RECIPES") or "*.yaml")):
        cfg = yaml.safe_load(recipe.read_text())
        engine = (cfg.get("rollout") or {}).get("engine", "vllm")
        actor = cfg.get("actor") or {}
        staleness = min(1, int((cfg.get("rollout") or {}).get("staleness", 0)))
        # rollout that runs on during the update needs engines of their own: on a one-GPU machine, its cores
        placement = "cpu" if staleness and torch.cuda.device_count() < 2 else "auto"
        extra = [f"rollout.placement={placement}", "rollout.num_engines=1", "rollout.engine_options={}", "actor.tp=1",
                 "actor.pp=1", "actor.micro_batch_size=4", "actor.ppo_mini_batch_size=0", "actor.trainable=[]",
                 f"rollout.staleness={staleness}",
                 "actor.sharding=" + ("none" if actor.get("backend", "torch") == "torch" else "optimizer")]
        if placement == "cpu":
            extra.append("rollout.engine_options.device=cuda")  # the engine's process on the GPU beside the trainer
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
                                if engine in RECIPE_SWAPS else engine, "placement": placement, **_steps(steps, wall, [])}
            out[recipe.stem].pop("args", None)
        except Exception as e:  # one recipe's failure never hides the others'
            out[recipe.stem] = {"status": "failed", "error": f"{type(e).__name__}: {e}"[-2000:]}
        out[recipe.stem]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[gpu_smoke] recipes: {recipe.stem}: {out[recipe.stem]['status']}", file=sys.stderr, flush=True)
    if not out:
        raise AssertionError(f"no recipe in launch/configs/recipes matches SMOKE_RECIPES={os.environ['SMOKE_RECIPES']!r}")
    failed = [k for k, v in out.items() if v["status"] == "failed"]
    if failed:
        raise AssertionError(f"recipes failed on one GPU: {failed}: {json.dumps(out, default=str)[:3000]}")
    return out


def check_weight_sync_bench(ctx: Ctx) -> dict[str, Any]:
    """benchmarks/weight_sync.py --quick on the GPU: every weight path's GB/s beside a device memcpy of
    the same bytes, in one run (its CUDA buffers and timing)."""
    if not ctx.cuda:
        raise Skip("its CPU form runs in CI (tests/test_benchmarks.py::test_weight_sync_small_run); this check is "
                   "its CUDA branch")
    out = ctx.work / "weight_sync.json"
    log = ctx.work / "weight_sync_bench.log"
    env = child_env()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "benchmarks/weight_sync.py", "--quick", "--model", ctx.model, "--out",
                               str(out)], cwd=REPO,
                              env=env, stdout=f, stderr=subprocess.STDOUT, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"benchmarks/weight_sync.py exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    report = json.loads(out.read_text())
    return {"report": {k: v for k, v in report.items() if k not in ("machine",)}}
