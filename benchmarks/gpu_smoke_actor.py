"""The GPU smoke suite's checks of the training actor in one process (benchmarks/gpu_smoke.py lists them
all): a FSDP2 bf16 update, the same update with `actor.shared_prefix` off and on, and the bf16 engine's
sampled tokens scored by the bf16 FSDP2 actor (drift)."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from gpu_smoke_lib import (BF16_LOGPROB_TOL, Ctx, chosen, device_limits, engine_outputs, free_memory, fsdp2_actor, gb, load_model,
                           one_rank_group, pad_id, prompts, rollout_batch, teacher_forced, update_flops)

DRIFT_MEAN_TOL = 0.1  # mean |engine - actor| in bf16; a stale or garbled weight load is several nats


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


def use(actor: Any, mode: str) -> None:
    """`check_shared_prefix`'s modes: `actor.shared_prefix` and the attention kernel."""
    actor.cfg.shared_prefix = "off" if mode == "off" else "on"
    actor.module.set_attn_implementation("flex_attention" if mode == "flex" else "sdpa")


def check_shared_prefix(ctx: Ctx) -> dict[str, Any]:
    """The FSDP2 bf16 update with `actor.shared_prefix` off and on, alternated, on groups that share their
    prompt, at two shares of shared tokens: the logprobs of the two agree, and the seconds of each."""
    from engines.training.losses import LossConfig

    group = ctx.size(4, 8)
    points = [(ctx.size(24, 1024), ctx.size(8, 128)), (ctx.size(8, 256), ctx.size(16, 256))]  # (prompt, response)
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"group": group, "points": []}
    # off: padded rows, sdpa; on: packed, sdpa with the tree mask; flex (CUDA: torch has no flex backward on
    # CPU): packed, flex attention with the tree as a block mask
    modes = ("off", "on", "flex") if ctx.cuda else ("off", "on")
    with one_rank_group(ctx):
        actor = fsdp2_actor(ctx, "bfloat16", lr=1e-7, micro_batch_size=group)  # a micro-batch is one group
        vocab = actor.module.config.get_text_config().vocab_size
        for plen, rlen in points:
            data = []
            for _ in range(2):  # two groups, each one prompt and `group` responses
                prompt = torch.randint(3, vocab, (plen,), generator=g).tolist()
                data += [(prompt, torch.randint(3, vocab, (rlen,), generator=g).tolist(), [-1.0] * rlen)
                         for _ in range(group)]
            batch = rollout_batch(data, pad_id(ctx), group)
            adv = torch.randn(len(data), generator=g)[:, None] * batch.response_mask
            mask = batch.loss_mask.bool()
            lp, seconds, tokens = {}, {m: [] for m in modes}, {}
            for mode in modes:
                use(actor, mode)
                lp[mode] = actor.compute_logprobs(batch)[0]
                tokens[mode] = sum(mb.tokens for mb in actor._micro_batches(batch, actor._rows_of(batch)))
            for _ in range(ctx.size(2, 3)):  # alternated; the first round warms every path (flex compiles)
                for mode in modes:
                    use(actor, mode)
                    t0 = time.perf_counter()
                    actor.update(batch, adv, None, None, LossConfig())
                    if ctx.cuda:
                        torch.cuda.synchronize()
                    seconds[mode].append(time.perf_counter() - t0)
            best = {m: min(seconds[m][1:]) for m in modes}
            point = {"prompt": plen, "response": rlen, "shared_fraction": round(1 - tokens["on"] / tokens["off"], 4),
                     "tokens_off": tokens["off"], "tokens_on": tokens["on"],
                     "update_s_off": round(best["off"], 4), "update_s_on": round(best["on"], 4),
                     "speedup": round(best["off"] / best["on"], 3),
                     "logprob_max_diff": float((lp["on"] - lp["off"]).abs()[mask].max())}
            if "flex" in modes:
                point.update(update_s_flex=round(best["flex"], 4), speedup_flex=round(best["off"] / best["flex"], 3),
                             logprob_max_diff_flex=float((lp["flex"] - lp["off"]).abs()[mask].max()))
            out["points"].append(point)
            print(f"[gpu_smoke] shared_prefix point: {point}", file=sys.stderr, flush=True)
        use(actor, "off")
        del actor
    free_memory(ctx)
    worst = max(max(p["logprob_max_diff"], p.get("logprob_max_diff_flex", 0.0)) for p in out["points"])
    if not worst < BF16_LOGPROB_TOL:
        raise AssertionError(f"packed and unpacked logprobs differ by {worst:.3g} nats in bf16: {out}")
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
