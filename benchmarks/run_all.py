"""Run every benchmark, each in its own process, and write benchmarks/RESULTS.md.

    python benchmarks/run_all.py            # quick: hf engines with a tiny llama, < 10 min on 2 cores
    python benchmarks/run_all.py --full     # vllm engines with SmolLM2-135M, full request counts

RESULTS.md holds the tables, the machine they came from, the commands and the date; the JSON of
each benchmark lies in benchmarks/results/. Absolute numbers are only comparable on the same
machine; the ratios are measured side by side within one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, machine  # noqa: E402


def run(cmd: list[str]) -> float:
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed with exit code {proc.returncode}")
    return time.perf_counter() - t0


def bus_section(r: dict[str, Any]) -> list[str]:
    p = r["params"]
    lines = ["## Bus vs Ray (transport only)", "",
             f"Echo engine, {p['prompt_tokens']}-token prompts, {p['reply_tokens']}-token replies; latency in ms.", "",
             "| concurrency | bus p50 | bus p99 | bus req/s | Ray p50 | Ray p99 | Ray req/s | p50 Ray/bus | req/s bus/Ray |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(r["bus"], key=int):
        b, y = r["bus"][c], r["ray"][c]
        lines.append(f"| {c} | {b['p50_ms']:.2f} | {b['p99_ms']:.2f} | {b['rps']:.0f} | {y['p50_ms']:.2f} | "
                     f"{y['p99_ms']:.2f} | {y['rps']:.0f} | {y['p50_ms'] / b['p50_ms']:.2f} | {b['rps'] / y['rps']:.2f} |")
    if r.get("floor_rounds"):
        lines += ["", "Against the floor: bare pyzmq with the same bytes and process layout and no protocol "
                      f"(`benchmarks/bare_zmq.py`), after Ray shut down, {p['floor_rounds']} alternating rounds of "
                      "(bus, bare) per level: medians, and the median of the per-round ratios.", "",
                  "| concurrency | bus p50 | bus req/s | bare p50 | bare req/s | bus p50 / bare p50 | "
                  "bus req/s / bare req/s |", "|---|---|---|---|---|---|---|"]
        for c in sorted(r["bare"], key=int):
            b, z, rat = r["bus_floor_rounds"][c], r["bare"][c], r["ratios"]
            lines.append(f"| {c} | {b['p50_ms']:.3f} | {b['rps']:.0f} | {z['p50_ms']:.3f} | {z['rps']:.0f} | "
                         f"{rat[f'p50_bus_over_bare_c{c}']:.2f} | {rat[f'rps_bus_of_bare_c{c}']:.2f} |")
    return lines


def tool_section(r: dict[str, Any]) -> list[str]:
    lines = ["## Rollout throughput vs tool latency", "",
             f"{r['backend']} engine, {r['model']} after {r['sft_steps']} SFT steps on calculator traces; "
             f"{r['trajectories']} GSM8K trajectories per cell, {r['concurrency']} in flight; tool_agent "
             f"{r['agent']}; sampling {r['sampling']}. Busy = fraction of the window with a request inside "
             "the engine.", "",
             "| tool latency (s) | async tok/s | async busy | sync tok/s | sync busy | sync generation phase | "
             "async / sync | ceiling (1 / sync busy) |", "|---|---|---|---|---|---|---|---|"]
    cells = {(x["mode"], x["latency_s"]): x for x in r["results"]}
    for lat in sorted({x["latency_s"] for x in r["results"]}):
        a, s = cells[("async", lat)], cells[("sync", lat)]
        lines.append(f"| {lat:g} | {a['tokens_per_s']:.1f} | {a['busy_fraction']:.2f} | {s['tokens_per_s']:.1f} | "
                     f"{s['busy_fraction']:.2f} | {s.get('gen_phase_s_mean', 0):.2f} s | "
                     f"{a['tokens_per_s'] / s['tokens_per_s']:.2f}x | {1 / max(s['busy_fraction'], 1e-9):.2f}x |")
    rat = r["ratios"]
    if "async_keep_1s" in rat:
        a0, a1, s1 = cells[("async", 0.0)], cells[("async", 1.0)], cells[("sync", 1.0)]
        lines += ["", f"At 1 s: the async loop keeps {rat['async_keep_1s']:.0%} of its 0 s throughput and runs "
                      f"{rat['async_vs_sync_1s']:.2f}x the synchronous rollout.",
                  *(["", f"What the async loop loses at 1 s is batch size, not busy time: busy {a1['busy_fraction']:.2f}, "
                          f"tokens per busy second {a0['tokens_per_busy_s']:.0f} -> {a1['tokens_per_busy_s']:.0f}, "
                          "because trajectories waiting on a tool are not generating and concurrency is held at "
                          f"{r['concurrency']} for both modes; more trajectories in flight lift it."]
                    if rat["async_keep_1s"] < 1 else []),
                  "", "What bounds the gain: a rollout beats the synchronous one only by filling the time the engine "
                      "sits idle in it, so at equal tokens per busy second the gain is at most 1 / (sync busy "
                      f"fraction) = {rat['sync_idle_ceiling_1s']:.2f}x at 1 s. The synchronous rollout at 1 s spent "
                      f"{s1['gen_s']:.1f} s in {s1['gen_phases']} generation phases (all live trajectories of a wave "
                      f"sent together, {s1['gen_phase_s_mean']:.2f} s each) and only {s1['tool_wait_s']:.1f} s waiting "
                      "on tools: these trajectories make about one tool round and then answer. A 3x gain needs the "
                      "engine idle two thirds of the synchronous run, i.e. tool rounds taking twice the generation "
                      "time: longer tools, more tool rounds per trajectory, or a faster engine (a GPU engine finishes "
                      "a phase like this in a fraction of a second)."]
    if r.get("longtail"):
        a, s = r["longtail"]
        lines += ["", "Long-tail workload (`benchmarks/async_workload.py`: 3 generations per trajectory, a tool call "
                      "between each with log-normal latency, median 1 s, p99 10 s), same trajectories and concurrency: "
                      f"async {a['tokens_per_s']:.1f} tok/s (busy {a['busy_fraction']:.2f}, {a['wall_s']:.0f} s) vs "
                      f"sync {s['tokens_per_s']:.1f} tok/s (busy {s['busy_fraction']:.2f}, {s['wall_s']:.0f} s): "
                      f"{a['tokens_per_s'] / s['tokens_per_s']:.2f}x (ceiling 1 / sync busy = "
                      f"{1 / max(s['busy_fraction'], 1e-9):.2f}x). Each synchronous wave waits for its slowest tool "
                      "chain, so the engine idles through the tail; the async loop is held back by concurrency "
                      f"instead (busy {a['busy_fraction']:.2f}: with {r['concurrency']} trajectories in flight, most "
                      "of them wait on a tool at any moment)."]
    if r.get("plot") and Path(r["plot"]).exists():  # beside RESULTS.md, committed with it
        shutil.copy(r["plot"], ROOT / "benchmarks" / "tool_latency.png")
        lines += ["", "![tokens/s against tool latency](tool_latency.png)"]
    return lines


def routing_section(r: dict[str, Any]) -> list[str]:
    lines = ["## Prefix-cache hits by routing policy", "",
             f"{r['backend']} engines, {r['model']}; {r['prompts']} GSM8K prompts x n = {r['n']} samples, "
             f"multi-turn tool_agent, {r['engines']} engines (the ideal: 1 engine). Hit rate = cached prompt "
             "tokens / prompt tokens as the engines report them.", "",
             "| policy | hit rate | vs single-engine ideal | per-engine hit rates |", "|---|---|---|---|"]
    ideal = r["results"][0]["hit_rate"]
    for x in r["results"]:
        lines.append(f"| {x['label']} | {x['hit_rate']:.3f} | {x['hit_rate'] / ideal:.2f} | "
                     + " ".join(f"{e['hit_rate']:.2f}" for e in x["engines"]) + " |")
    return lines


def weight_sync_section(r: dict[str, Any]) -> list[str]:
    lines = ["## Weight sync: every path vs memcpy", "",
             f"{r['model']} ({r['bytes'] / 1e9:.3f} GB of HF tensors; reshard from Megatron TP {r['tp']} x PP {r['pp']} "
             f"shards) on {r['device']}; median of {r['reps']} repetitions; {r['bucket_mb']} MiB buckets; _1/_2: "
             "into one or two engine processes.", "",
             "| path | GB/s | vs memcpy |", "|---|---|---|"]
    for k, v in r["gb_per_s"].items():
        lines.append(f"| {k} | {v:.2f} | {v / r['gb_per_s']['memcpy']:.3f} |")
    return lines


KEPT = ("## GPU smoke suite",)  # measured on other machines (benchmarks/gpu_smoke.sh): carried over, never rerun


def kept_sections(path: Path, headings: tuple[str, ...]) -> list[str]:
    """The sections of the existing RESULTS.md that start with one of `headings`, as they are."""
    if not path.exists():
        return []
    out: list[str] = []
    keep = False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            keep = line.startswith(headings)
        if keep:
            out.append(line)
    return out + ([""] if out else [])


def gateway_section(r: dict[str, Any]) -> list[str]:
    lines = ["## OpenAI gateway overhead", "",
             f"Echo engine, one chat of {r['prompt_tokens']} prompt tokens, {r['reply_tokens']}-token replies, a new "
             "session per request; `python -m agent.gateway` in its own process. HTTP: raw POSTs; openai: the "
             "`openai` package. Latency in ms; added = gateway p50 - bus p50.", "",
             "| concurrency | bus p50 | gateway HTTP p50 | gateway openai p50 | added HTTP | added openai | bus req/s "
             "| gateway HTTP req/s | gateway openai req/s |", "|---|---|---|---|---|---|---|---|---|"]
    for c in r["counts"]:
        x = r[str(c)]
        b, h, o = x["bus"], x["gateway_http"], x["gateway_openai"]
        lines.append(f"| {c} | {b['p50_ms']:.2f} | {h['p50_ms']:.2f} | {o['p50_ms']:.2f} | "
                     f"{h['p50_ms'] - b['p50_ms']:.2f} | {o['p50_ms'] - b['p50_ms']:.2f} | {b['req_s']:.0f} | "
                     f"{h['req_s']:.0f} | {o['req_s']:.0f} |")
    routes = {"gateway_responses": "responses (openai)", "gateway_messages": "messages (anthropic)"}
    if all(k in r[str(c)] for c in r["counts"] for k in routes):
        lines += ["", "The Responses route (`openai` package, `responses.create`) and the Messages route (`anthropic` "
                  "package, `messages.create`) in the same run:", "",
                  "| concurrency | route | p50 | added p50 vs bus | req/s |", "|---|---|---|---|---|"]
        for c in r["counts"]:
            x = r[str(c)]
            for key, label in routes.items():
                lines.append(f"| {c} | {label} | {x[key]['p50_ms']:.2f} | {x[key]['p50_ms'] - x['bus']['p50_ms']:.2f} "
                             f"| {x[key]['req_s']:.0f} |")
    return lines


def nodes_section(r: dict[str, Any]) -> list[str]:
    p = r["params"]
    lines = ["## Rollout across simulated nodes", "",
             f"`launch/train.py` under torchrun, {r['model']} on hf engines; each node a launcher pinned to "
             f"{p['cores_per_node']} core(s) with its own engine; {p['n']} samples per prompt, up to {p['max_tokens']} "
             f"tokens each; mean over steps 2-{p['steps']}. Tokens/s = tokens all engines generated / rollout wall time.", "",
             "| run | prompts/step | rollout s | tokens/s | vs 1 node (ideal 2x) | engine busy | token share |",
             "|---|---|---|---|---|---|---|"]
    one = r["nodes1"]["tokens_per_s"]
    for name in ("nodes1", "nodes2", "nodes2_same_engine_batch"):
        x = r[name]
        share = " / ".join(f"{v:.2f}" for v in x["token_share"].values())
        lines.append(f"| {x['nodes']} node(s){' (2x prompts)' if name.endswith('batch') else ''} | "
                     f"{x['prompts_per_step']} | {x['rollout_s']:.1f} | {x['tokens_per_s']:.0f} | "
                     f"{x['tokens_per_s'] / one:.2f} | {x['engine_busy_mean']:.2f} | {share} |")
    return lines


def async_rl_section(r: dict[str, Any]) -> list[str]:
    lines = ["## Asynchronous RL: steps per hour, sync vs staleness 1 and 2", "",
             f"`launch/train.py` on {r['model']} (hf engine), {r['prompts_per_step']} prompts x n = {r['n']} per step, "
             f"{r['rounds']} generations of up to {r['max_tokens']} tokens per trajectory with a tool call between each "
             f"(log-normal latency, median {r['tool_median_s']:g} s, p99 {r['tool_p99_s']:g} s), {r['steps']} steps "
             "per mode, the first step (start-up) left out; engine and trainer on separate cores where the box "
             "has two. Reward = share of even token ids (learnable from any start).", "",
             "| staleness | steps/h | vs sync | rollout wait (s) | update (s) | sync (s) | engine busy in update | "
             "mean staleness | stale groups redone | reward first 3 -> last 3 |", "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    for x in r["runs"]:
        lines.append(f"| {x['staleness']} | {x['steps_per_hour']:.0f} | {x['ratio_vs_sync']:.2f}x | {x['rollout_s']:.2f} | "
                     f"{x['update_s']:.2f} | {x['sync_s']:.2f} | {x['engine_busy_in_update']:.2f} | "
                     f"{x['staleness_mean']:.2f} | {x['dropped_stale_groups']:.0f} | {fmt(x['reward_first'])} -> "
                     f"{fmt(x['reward_last'])} |")
    lines += ["", f"Ideal for this box from the synchronous run's halves, (rollout + update + sync) / max(rollout, "
                  f"update + sync): {r['ideal_ratio']:.2f}x. The anchors report 2.35-2.67x (verl fully async, "
                  "Qwen2.5-Math-7B on 128 H20), 2.77x (AReaL) and up to 2.72x (ROLL, agentic) on GPU clusters, where "
                  "rollout and training run on separate devices.", "",
              "Why the asynchronous runs beat that ideal: it assumes each step still waits for its slowest trajectory. "
              "A synchronous step does, and the long tail (p99 10 s per tool call, 2 calls per trajectory, 16 "
              "trajectories per step) sets its rollout time; with staleness k the trainer takes the first finished "
              "groups and a straggler is trained in a later step, or dropped and generated again once a token of it "
              "is more than k versions old (the \"stale groups redone\" column: rollout work spent twice)."]
    if r["model"] == "tiny-llama":
        lines += ["", "The reward does not move in any mode here: tiny-llama is a random model whose next-token "
                      "distribution is spread over 49k ids, and 10 steps do not shift it; whether learning survives "
                      "staleness is shown by the CPU demo (README, \"Asynchronous RL\")."]
    return lines


def actor_memory_section(r: dict[str, Any]) -> list[str]:
    lines = ["## Actor memory per rank: DDP vs FSDP", "",
             f"The torch actor on {r['model']} under torchrun (gloo), two PPO updates; what each rank holds for weights, "
             "gradients and AdamW state, counted tensor by tensor, and its peak RSS (which includes the process's "
             "Python/torch baseline).", "",
             "| run | held per rank (MiB) | bytes per parameter | peak RSS per rank (MiB) |", "|---|---|---|---|"]
    for key, run in r["runs"].items():
        held = max(x["total_gb"] for x in run["per_rank"]) * 1024
        rss = " / ".join(f"{x['peak_rss_gb'] * 1024:.0f}" for x in run["per_rank"])
        lines.append(f"| {run['ranks']} rank(s), sharding {run['sharding']} | {held:.0f} | "
                     f"{r['bytes_per_parameter'][key]:.1f} | {rss} |")
    p = r["projection_gb"]
    lines += ["", "The same accounting (16 bytes per parameter: fp32 master 4, gradients 4, AdamW 8; sharded ones "
              "divided by DP; activations on top), projected in GiB per GPU:", "",
              "| model | DDP | FSDP DP 8 | FSDP DP 64 | Megatron bf16 + ZeRO-1, TP 1 x DP 8 | TP 8 x DP 8 |",
              "|---|---|---|---|---|---|"]
    for size in ("7", "70"):
        q = p[size]
        lines.append(f"| {size}B | {q['dp1_ddp']:.0f} | {q['dp8_fsdp']:.1f} | {q['dp64_fsdp']:.1f} | "
                     f"{q.get('megatron_bf16_tp1_dp8', float('nan')):.1f} | {q.get('megatron_bf16_tp8_dp8', float('nan')):.1f} |")
    lines += ["", "The Megatron columns: bf16 weights 2 + fp32 main grads 4 bytes per parameter of the TP shard, fp32 main "
              "weights and AdamW moments 12 divided by DP (`model.dtype=bfloat16`, `actor.sharding=optimizer`). What "
              "the anchors document for the same sizes (their repositories' docs and example scripts): verl's smallest "
              "full-parameter 7B GRPO is 2 x H800 with FSDP parameter and optimizer offload to CPU, its standard 7B "
              "recipes 8 GPUs without actor offload (FSDP, or Megatron TP 2 x PP 2); its 70B-class full-parameter "
              "GRPO needs 32 x H800 (or 32 x H20) with parameter and optimizer offload (docs/perf/device_tuning.rst). "
              "slime counts 18 bytes per parameter for Megatron training (bf16 weights 2, fp32 grads 4, fp32 master 4, "
              "Adam 8; its v0.1.0 release notes) and offloads Adam to the CPU for 32B dense models on one 8-GPU node "
              "(scripts/run-qwen3-32B.sh). switchyard has no CPU offload of weights or optimizer yet."]
    return lines


def micro_batches_section(r: dict[str, Any]) -> list[str]:
    f, b = r["runs"]["fixed"], r["runs"]["budget"]
    return ["## Actor update: row-count vs token-budget micro-batches", "",
            f"The torch actor on {r['model']}, one on-policy update of {r['trajectories']} trajectories shaped like the "
            f"CPU demo's (prompts 60-180 tokens, responses 10-120; {r['real_tokens']} real tokens), the two settings "
            f"alternating from one initial state ({r['pairs']} pairs). `fixed`: `actor.micro_batch_size=8`; `budget`: "
            f"`actor.max_tokens_per_micro_batch={r['budget_tokens']}` (8 rows of median length).", "",
            "| micro-batches | count | padded tokens | update s (median) | real tokens/s |", "|---|---|---|---|---|",
            f"| fixed, 8 rows | {f['micro_batches']} | {f['padded_tokens']} | {f['update_s_median']:.2f} | "
            f"{f['tokens_per_s']:.0f} |",
            f"| token budget | {b['micro_batches']} | {b['padded_tokens']} | {b['update_s_median']:.2f} | "
            f"{b['tokens_per_s']:.0f} |", "",
            f"Token budget vs fixed, median of the per-pair ratios of update time: **{r['budget_speedup_median']:.2f}x**.",
            "", f"Against this box's limit: one update is {r['limit']['update_gflop']:.0f} GFLOP of model arithmetic "
            "(6 x parameters x real tokens, plus causal attention); the matmul peak measured here (2048 x 2048 fp32, "
            f"{r['limit']['threads']} threads) is {r['limit']['matmul_peak_gflops']:.0f} GFLOP/s, so the update runs at "
            f"{r['limit']['fixed_fraction_of_peak']:.0%} of it with fixed micro-batches and "
            f"{r['limit']['budget_fraction_of_peak']:.0%} with the token budget."]


def host_memory_section(r: dict[str, Any]) -> list[str]:
    def row(k: str) -> str:
        return (f"| {k} | {r['update_s_median'][k]:.2f} | {r['fault_gib_median'][k]:.2f} | "
                f"{r['peak_rss_gib_median'][k]:.2f} |")

    return ["## Actor update: freed host memory retained or returned", "",
            f"`benchmarks/host_memory.py`: the torch actor on {r['model']} ({r['dtype']}, {r['attn']} attention), the "
            "CPU demo's batch of 32 trajectories, `actor.retain_freed_memory` on and off in alternating processes "
            f"({r['pairs']} pairs, {r['updates']} timed updates each after a warm-up; `parallel/host.py`).", "",
            "| retain | update s (median) | minor faults per update, GiB | peak RSS GiB |", "|---|---|---|---|",
            row("on"), row("off"), "",
            f"Retained vs returned, median of the per-pair ratios of update time: **{r['speedup_median']:.2f}x**."]


def update_dtype_section(r: dict[str, Any]) -> list[str]:
    lines = ["## Actor update: float32 vs bf16 autocast", "",
             "`benchmarks/update_dtype.py`: the torch actor's update on the CPU demo's batch shape (32 trajectories, "
             "prompts 60-180 tokens, responses 10-120, micro-batches of 8) in float32 and in bf16 autocast over fp32 "
             f"weights, alternating from one state ({r['pairs']} pairs after a warm-up update each). What multiplies "
             f"bf16 natively here: {r['native_bf16'] or 'nothing (`model.dtype=auto` keeps float32)'}.", "",
             "| model | parameters | fp32 update s (median) | bf16 update s (median) | fp32 / bf16, median of pairs |",
             "|---|---|---|---|---|"]
    for name, m in r["models"].items():
        fp32, bf16 = (statistics.median(m["update_s"][d]) for d in ("float32", "bfloat16"))
        lines.append(f"| {name} | {m['parameters'] / 1e6:.1f}M | {fp32:.2f} | {bf16:.2f} | "
                     f"**{m['fp32_over_bf16_median']:.2f}x** |")
    return lines


def vs_trl_section(r: dict[str, Any]) -> list[str]:
    w = r["workload"]
    lines = ["## switchyard vs TRL", "",
             f"`benchmarks/vs_trl.py`: single-turn GRPO on arithmetic word problems, {w['model']}, all parameters, "
             f"{w['prompts']} prompts x {w['n']} samples, {w['max_tokens']} new tokens, lr {w['lr']:g} constant, no KL, "
             f"clip 0.2 / 0.28, {w.get('dtype', 'float32')}, {w['steps']} steps per run; TRL {r['trl_version']} GRPOTrainer (transformers "
             f"generation) and switchyard run alternately, {r['rounds']} round(s); step time = median wall time "
             f"between step ends after the first {r['skip']} steps. Update / matmul peak: the update's model "
             f"arithmetic per second against a {w.get('dtype', 'float32')} 2048 x 2048 matmul on this box "
             f"({r.get('matmul_peak_gflops', 0):.0f} GFLOP/s).", "",
             "| round | system | s/step | steps/h | rollout s | update s | update / matmul peak | gen tok/s | peak RSS GiB | "
             "reward first -> last | vs TRL |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(label: str, x: dict[str, Any], ratio: float | None) -> str:
        rew = [v for v in x["reward"] if v is not None]
        gen = "-" if x["gen_tokens_per_s"] is None else f"{x['gen_tokens_per_s']:.0f}"
        frac = f"{x['update_fraction_of_peak']:.0%}" if "update_fraction_of_peak" in x else "-"
        return (f"| {label} | {x['system']} | {x['step_s']:.1f} | {x['steps_per_hour']:.0f} | {x['rollout_s']:.1f} | "
                f"{x['update_s']:.1f} | {frac} | {gen} | {x['peak_rss_gb']:.2f} | "
                f"{rew[0]:.2f} -> {rew[-1]:.2f} | {'' if ratio is None else f'{ratio:.2f}x'} |")

    for i, p in enumerate(r["pairs"]):
        lines += [row(str(i + 1), p["trl"], None), row(str(i + 1), p["switchyard"], p["ratio"])]
    lines += [row("after", x, x["ratio_vs_trl_median"]) for x in r["extra"]]
    lines += ["", f"switchyard / TRL steps per hour, median of the per-round ratios: **{r['ratio_median']:.2f}x** "
                  f"(rounds: {', '.join(f'{x:.2f}x' for x in r['ratios'])}); extra rows against TRL's median. "
                  "Rollout s of a staleness-1 row is the wait for the batch, not the generation."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--gsm8k-dir", default=None)
    ap.add_argument("--output", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = ap.parse_args()
    quick = [] if args.full else ["--quick"]
    gsm = ["--gsm8k-dir", args.gsm8k_dir] if args.gsm8k_dir else []
    commands = [["benchmarks/bus_vs_ray.py", *quick],
                ["benchmarks/tool_latency.py", *quick, *gsm],
                ["benchmarks/routing.py", *quick, *gsm],
                ["benchmarks/weight_sync.py", *quick],
                ["benchmarks/nodes.py", *quick],
                ["benchmarks/actor_memory.py", *quick],
                ["benchmarks/micro_batches.py", *quick],
                ["benchmarks/host_memory.py", *quick],
                ["benchmarks/update_dtype.py", *quick],
                ["benchmarks/async_rl.py", *quick],
                ["benchmarks/gateway_overhead.py", *quick],
                ["benchmarks/vs_trl.py", *quick]]
    t0 = time.perf_counter()
    seconds = [run(c) for c in commands]
    total = time.perf_counter() - t0
    load = lambda name: json.loads((RESULTS / f"{name}.json").read_text())  # noqa: E731
    info = machine()
    lines = ["# Benchmark results", "",
             f"Measured {info['date']} on: **{info['device']}** (Python {info['python']}, torch {info['torch']}). "
             "Absolute numbers hold for this machine only; ratios are measured side by side in one run.", "",
             f"Mode: {'full' if args.full else 'quick'}; all benchmarks took {total / 60:.1f} min. Commands:", "",
             "```bash", f"python benchmarks/run_all.py{' --full' if args.full else ''}"]
    lines += [f"python {' '.join(c)}   # {s:.0f} s" for c, s in zip(commands, seconds)] + ["```", ""]
    lines += bus_section(load("bus_vs_ray")) + [""] + tool_section(load("tool_latency")) + [""]
    lines += routing_section(load("routing")) + [""] + weight_sync_section(load("weight_sync")) + [""]
    lines += nodes_section(load("nodes")) + [""] + actor_memory_section(load("actor_memory")) + [""]
    lines += async_rl_section(load("async_rl")) + [""] + gateway_section(load("gateway_overhead")) + [""]
    lines += micro_batches_section(load("micro_batches")) + [""] + host_memory_section(load("host_memory")) + [""]
    lines += update_dtype_section(load("update_dtype")) + [""]
    lines += vs_trl_section(load("vs_trl")) + [""]
    lines += kept_sections(Path(args.output), KEPT)
    Path(args.output).write_text("\n".join(lines))
    print(f"\nwrote {args.output} ({total / 60:.1f} min)")


if __name__ == "__main__":
    main()
