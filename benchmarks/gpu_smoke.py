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
  shared_prefix the same update with actor.shared_prefix off and on (alternated) on groups sharing a prompt,
               at two shares of shared tokens: seconds of each, tokens computed, packed vs unpacked logprobs;
               on CUDA also packed under flex attention (the tree as a block mask)
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
  weight_sync_bench  benchmarks/weight_sync.py --quick on the GPU (every weight path beside a memcpy)
  vllm_logprobs, vllm_sleep, vllm_handle_route, vllm_preempt, vllm_vs_hf, vllm_grpo_run, vllm_lora_run
               the project's vLLM engine on vLLM's CUDA build (benchmarks/gpu_smoke_vllm.py says what each
               does; benchmarks/vllm_wheels.sh and vllm_device_install.sh bring vLLM to the GPU image)

Figures beside what the device measured in the same run (`limits`): the handle route's GB/s against the
device-to-device copy bandwidth, the FSDP2 and Megatron updates' FLOP/s (6 N T, a floor) against the
matmul rate in the dtype they train in, the hf engine's tokens/s against transformers' own generate on
the same batch. `--model-size 1b` builds a random 1.07B llama with --model's tokenizer on the device
first and runs the checks on it.

`--part 1|2|3|vllm` runs one of the parts (PARTS) that each fit a 10-minute device command; the whole suite does
not. Writes a JSON report (--out), rewritten after each check so a run cut off keeps what it measured,
and a last line `RESULT {...}` with the headline numbers; exits 1 if any check failed. A check that needs CUDA reports `skipped` with its reason on CPU.
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
from gpu_smoke_lib import (BF16_LOGPROB_TOL, SIZES, Ctx, Skip, build_model, checkpoint_tensors, chosen,  # noqa: E402
                           device_limits, engine_outputs, free_memory, gb, generate_rate, load_model, perturbed_model,
                           prompts, teacher_forced)

FP32_LOGPROB_TOL = 1e-3  # the engine's fp32 logprobs against a plain forward (measured ~1e-6 on CPU)


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


from gpu_smoke_actor import check_drift, check_fsdp_actor, check_shared_prefix  # noqa: E402
from gpu_smoke_runs import (check_ddp_two_ranks, check_deepspeed_ref, check_fsdp2_two_ranks,  # noqa: E402
                            check_grpo_run, check_lora_run, check_megatron_pp2, check_megatron_run,
                            check_megatron_tp2, check_megatron_zero1, check_recipes, check_reward_model,
                            check_weight_sync_bench)
from gpu_smoke_vllm import VLLM_CHECKS  # noqa: E402

CHECKS: dict[str, Callable[[Ctx], dict[str, Any]]] = {  # by value: a run cut off still reports the most
    "hf_engine": check_hf_engine, "sleep_wake": check_sleep_wake, "handle_route": check_handle_route,
    "fsdp_actor": check_fsdp_actor, "shared_prefix": check_shared_prefix, "drift": check_drift, "grpo_run": check_grpo_run,
    "megatron_run": check_megatron_run, "lora_run": check_lora_run, "deepspeed_ref": check_deepspeed_ref,
    "reward_model": check_reward_model, "fsdp2_two_ranks": check_fsdp2_two_ranks, "ddp_two_ranks": check_ddp_two_ranks,
    "megatron_tp2": check_megatron_tp2, "megatron_pp2": check_megatron_pp2, "megatron_zero1": check_megatron_zero1,
    "recipes": check_recipes, "weight_sync_bench": check_weight_sync_bench, **VLLM_CHECKS}

# the suite in parts, each one device command of under 10 minutes (on an H200 with --model-size 1b: part 1
# 8.6 min, 2026-11-27; part 2 6.2 min, 2026-11-28; part 3 not timed whole: recipes took ~50 s each there)
PARTS = {"1": ["hf_engine", "sleep_wake", "handle_route", "fsdp_actor", "shared_prefix", "drift", "grpo_run",
               "megatron_run", "lora_run", "deepspeed_ref"],
         "2": ["reward_model", "fsdp2_two_ranks", "ddp_two_ranks", "megatron_tp2", "megatron_pp2", "megatron_zero1"],
         "3": ["recipes", "weight_sync_bench"],
         "vllm": list(VLLM_CHECKS)}  # not yet timed on a GPU
assert sorted(sum(PARTS.values(), [])) == sorted(CHECKS), "every check in exactly one part"


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
            "shared_prefix_speedup": [p["speedup"] for p in get("shared_prefix", "points") or []],
            "shared_prefix_flex_speedup": [p.get("speedup_flex") for p in get("shared_prefix", "points") or []],
            "shared_prefix_fraction": [p["shared_fraction"] for p in get("shared_prefix", "points") or []],
            "drift_bf16_mean": get("drift", "engine_vs_actor_bf16_mean"),
            "drift_bf16_max": get("drift", "engine_vs_actor_bf16_max"),
            "grpo_step_s": round(sum(grpo_steps[1:]) / max(1, len(grpo_steps) - 1), 3) if grpo_steps else None,
            "grpo_reward": (get("grpo_run", "reward") or [None])[-1],
            "grpo_weight_route": get("grpo_run", "weight_route"),
            "megatron_update_s": (get("megatron_run", "update_s") or [None])[-1],
            "lora_sync_fraction": get("lora_run", "sync_fraction"),
            "deepspeed_ref_kl": (get("deepspeed_ref", "kl_in_reward") or [None])[-1],
            "vllm_logprob_gap": get("vllm_logprobs", "full_push_gap"), "vllm_vs_hf": get("vllm_vs_hf", "vllm_vs_hf"),
            "vllm_push_gb_per_s": get("vllm_grpo_run", "push_gb_per_s"), "seconds": report["seconds"]}


def report_of(args: argparse.Namespace, ctx: Ctx, model: str, checks: dict[str, Any], seconds: float,
              done: bool) -> dict[str, Any]:
    report = {"device": args.device, "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
              "torch": torch.__version__, "model": f"random {args.model_size} llama ({model}'s tokenizer)"
              if args.model_size else model, "limits": ctx.limits, "quick": args.quick, "checks": checks,
              "complete": done, "seconds": round(seconds, 1)}
    report["result"] = headline(report)
    return report


def write_report(out: Path, report: dict[str, Any]) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(out)


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
    ap.add_argument("--part", default="", choices=["", *PARTS],
                    help="one of the parts that each fit one device command of 10 minutes (PARTS); default all")
    ap.add_argument("--out", default=None, help="JSON report path (default: $OUT/gpu_smoke.json, else runs/gpu_smoke/)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: --device cuda but torch sees no CUDA device (torch "
              f"{torch.__version__}); run with --device cpu to check the suite itself", file=sys.stderr)
        return 2
    if args.part and args.only:
        ap.error("--part and --only each choose the checks; give one of them")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or PARTS.get(args.part) or list(CHECKS)
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
        checks: dict[str, Any] = {}
        for name in names:  # the report rewritten after each check: a run cut off keeps what it measured
            checks[name] = run_check(name, CHECKS[name], ctx)
            write_report(out, report_of(args, ctx, model, checks, time.perf_counter() - t0, done=False))
            for f in Path(work).glob("*.log"):  # the runs' logs beside it
                (out.parent / f.name).write_text(f.read_text(errors="replace"))
    report = report_of(args, ctx, model, checks, time.perf_counter() - t0, done=True)
    write_report(out, report)
    print(f"report: {out}", file=sys.stderr)
    print("RESULT " + json.dumps(report["result"], default=str), flush=True)
    return 1 if any(c["status"] == "failed" for c in checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
