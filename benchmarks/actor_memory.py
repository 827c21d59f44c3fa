"""Per-rank memory of the torch actor against data-parallel size and sharding, measured, and the
same accounting projected to 7B and 70B models.

    python benchmarks/actor_memory.py --quick    # tiny-llama
    python benchmarks/actor_memory.py            # SmolLM2-135M-Instruct

Each configuration runs under torchrun (gloo): build the actor, take two PPO updates on a fixed
synthetic batch, then every rank reports what it holds (weights as held, gradients, optimizer
state, counted tensor by tensor) and its peak resident memory. Runs: 1 rank; 2 ranks with DDP
(`actor.sharding=none`); 2 ranks with FSDP2 (`actor.sharding=fsdp`); and the same actor training a
LoRA adapter (`actor.lora`, rank 8 on every Linear layer) on 1 rank and with FSDP2 over 2, where
gradients and AdamW exist for the adapter only (fp32 here, so the frozen base still takes 4 bytes
per parameter; with `model.dtype=bfloat16` the unsharded LoRA actor holds it in bf16: 2).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, machine, result_line, write_result  # noqa: E402

GB = 2.0**30
RUNS = {"dp1": (1, "none"), "dp2_ddp": (2, "none"), "dp2_fsdp": (2, "fsdp"), "dp1_lora": (1, "none+lora"),
        "dp2_fsdp_lora": (2, "fsdp+lora")}
LORA_RANK = 16  # the projection's adapter: every Linear layer of the decoder at this rank
DEADLINE_S = {True: 75.0, False: 900.0}  # one torchrun configuration (--quick or not): it takes 3-10 s / minutes
COLLECTIVE_TIMEOUT_S = 90.0  # a stuck collective raises, naming itself...
STACKS_BEFORE_S = 25.0  # ...and every rank prints its threads' stacks this long before the deadline
# (hidden, intermediate, layers, key/value width) of the projected shapes: Llama-2-7B, Llama-3-70B
SHAPES = {7: (4096, 11008, 32, 4096), 70: (8192, 28672, 80, 1024)}


def _batch(vocab: int, n: int = 8, prompt: int = 64, response: int = 64) -> Any:
    import torch

    from agent.loop import AgentLoopOutput
    from engines.training.batch import pad_outputs

    g = torch.Generator().manual_seed(0)
    outs = []
    for i in range(n):
        ids = torch.randint(3, vocab, (prompt + response,), generator=g).tolist()
        outs.append(AgentLoopOutput(prompt_ids=ids[:prompt], response_ids=ids[prompt:], response_mask=[1] * response,
                                    response_logprobs=[-1.0] * response, reward=float(i % 2), num_turns=1,
                                    termination="stop"))
    return pad_outputs(outs, 0, [i // 4 for i in range(n)])


def worker(model: str, sharding: str, out: Path) -> None:
    """One rank: build, update twice, report."""
    import torch

    sys.path.insert(0, str(ROOT))
    from engines.training.config import ActorConfig, LoraConfig
    from engines.training.losses import LossConfig
    from engines.training.torch_actor import TorchActor
    from parallel.mesh import init_distributed

    faulthandler.dump_traceback_later(float(os.environ["STACKS_AFTER_S"]))  # a stuck rank shows where it is
    rank, world = init_distributed(timeout_s=COLLECTIVE_TIMEOUT_S)
    sharding, lora = sharding.split("+")[0], LoraConfig(rank=8) if sharding.endswith("+lora") else None
    actor = TorchActor(ActorConfig(lr=1e-5, micro_batch_size=2, sharding=sharding, lora=lora), model, progress=False)
    batch = _batch(int(actor.module.config.vocab_size))
    adv = (batch.rewards - 0.5)[:, None] * batch.response_mask
    for _ in range(2):
        actor.update(batch, adv, None, None, LossConfig())
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
    held = {"weights_gb": nbytes(actor.module.parameters()) / GB,
            "grads_gb": 4 * sum(local(p).numel() for p in actor.params) / GB,  # fp32 gradients while they live
            "optimizer_gb": nbytes(t for s in actor.optimizer.state.values() for t in s.values()
                                   if isinstance(t, torch.Tensor) and t.dim() > 0) / GB}
    held["total_gb"] = sum(held.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    report = {"rank": rank, "world": world, **held, "peak_rss_gb": peak,
              "parameters": float(sum(p.numel() for p in actor.module.parameters())),
              "predicted": actor.memory_report()}
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    if world > 1:  # nobody tears its group down while the other rank still talks (gloo aborts then)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def project(params: float, dp: int, sharded: bool) -> float:
    """GiB per rank for weights, gradients and AdamW by the accounting measured above: 16 bytes per
    parameter (fp32 master weights 4, fp32 gradients 4, AdamW moments 8), divided by DP when
    sharded. Activations and the one gathered layer FSDP holds at a time come on top."""
    return 16 * params / (dp if sharded else 1) / GB


def lora_parameters(size: int, rank: int = LORA_RANK) -> float:
    """Parameters of a LoRA adapter of `rank` on every Linear layer of the decoder (q, k, v, o,
    gate, up, down) of the `SHAPES[size]` model: rank x (in + out) per layer."""
    h, inter, layers, kv = SHAPES[size]
    return float(layers * rank * (2 * (h + h) + 2 * (h + kv) + 3 * (h + inter)))


def project_lora(params: float, size: int, dp: int, sharded: bool) -> float:
    """GiB per rank for a LoRA actor with `model.dtype=bfloat16`: the frozen base in bf16 (2 bytes
    per parameter; fp32 under FSDP, 4, divided by DP), the adapter with fp32 weights, gradients
    and AdamW (16 bytes per adapter parameter, divided by DP when sharded)."""
    adapter = lora_parameters(size)
    base = 4 * params / dp if sharded else 2 * params
    return (base + 16 * adapter / (dp if sharded else 1)) / GB


def project_megatron_bf16(params: float, dp: int, tp: int = 1) -> float:
    """GiB per rank for the Megatron actor with `model.dtype=bfloat16` and `actor.sharding=optimizer`
    (the accounting its test checks at TP 2 x DP 2): bf16 weights 2 and fp32 main grads 4 per
    parameter of its TP shard, fp32 main weights and AdamW moments 12 divided by DP."""
    return (2 + 4 + 12 / dp) * params / tp / GB


def _configuration(key: str, model: str, ranks: int, sharding: str, deadline_s: float) -> list[dict] | str:
    """One configuration under torchrun: each rank's report, or what it printed when it did not finish
    within `deadline_s` (its ranks are killed; their stacks, dumped by each rank before then, included)."""
    with tempfile.TemporaryDirectory(prefix="actor-mem-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(Path(__file__).resolve()), "--worker", model, sharding, tmp]
        env = child_env(OMP_NUM_THREADS="1", STACKS_AFTER_S=str(deadline_s - STACKS_BEFORE_S))
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            _end(proc)
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:  # a rank that outlived the kill keeps the pipes open
                stdout, stderr = "", "(the output could not be read: a rank still holds it)"
            stuck = f"{key}: no result within {deadline_s:.0f}s, its ranks killed:\n{stdout[-2000:]}\n{stderr[-6000:]}"
            print(stuck, flush=True)
            return stuck
        if proc.returncode != 0:
            raise SystemExit(f"{key} failed:\n{stdout[-2000:]}\n{stderr[-4000:]}")
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(ranks)]


def _end(proc: subprocess.Popen) -> None:
    """Stop torchrun and its ranks: TERM first (torchrun passes it to its ranks, and so does a process
    that only stands in for the real one, as under the test suite's warm starts), KILL what is left."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    for p in psutil.wait_procs(tree, timeout=15)[1]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=3, metavar=("MODEL", "SHARDING", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], Path(args.worker[2]))
        return
    from engines.models import resolve_model

    name = "tiny-llama" if args.quick else "smollm2-135m-instruct"
    model = str(resolve_model(name))
    report: dict[str, Any] = {"machine": machine(), "model": name, "runs": {}}
    for key, (ranks, sharding) in RUNS.items():
        ranks_out = _configuration(key, model, ranks, sharding, DEADLINE_S[args.quick])
        if isinstance(ranks_out, str):  # stuck: measured once more; the report keeps what it printed
            report.setdefault("stuck_runs", []).append({"run": key, "output": ranks_out})
            ranks_out = _configuration(key, model, ranks, sharding, DEADLINE_S[args.quick])
        if isinstance(ranks_out, str):
            raise SystemExit(f"{key} got stuck twice; the ranks' stacks are above")
        report["runs"][key] = {"ranks": ranks, "sharding": sharding, "per_rank": ranks_out}
        print(f"{key}: " + ", ".join(f"rank {r['rank']}: held {r['total_gb'] * 1024:.0f} MiB, peak RSS "
                                     f"{r['peak_rss_gb'] * 1024:.0f} MiB" for r in ranks_out), flush=True)
    params = report["runs"]["dp1"]["per_rank"][0]["parameters"]
    held = {k: max(r["total_gb"] for r in v["per_rank"]) for k, v in report["runs"].items()}
    report["held_ratio_fsdp_vs_dp1"] = held["dp2_fsdp"] / held["dp1"]
    report["held_ratio_ddp_vs_dp1"] = held["dp2_ddp"] / held["dp1"]
    report["held_ratio_lora_vs_dp1"] = held["dp1_lora"] / held["dp1"]
    report["held_ratio_fsdp_lora_vs_dp1"] = held["dp2_fsdp_lora"] / held["dp1"]
    report["bytes_per_parameter"] = {k: v * GB / params for k, v in held.items()}
    report["projection_gb"] = {f"{size}": {f"dp{dp}_{'fsdp' if s else 'ddp'}": project(size * 1e9, dp, s)
                                            for dp in (1, 8, 64) for s in (False, True) if s or dp == 1}
                               for size in (7, 70)}
    for size in (7, 70):
        report["projection_gb"][f"{size}"].update({f"megatron_bf16_tp{tp}_dp{dp}": project_megatron_bf16(size * 1e9, dp, tp)
                                                   for tp, dp in ((1, 8), (8, 8))})
        report["projection_gb"][f"{size}"].update({"lora_bf16_dp1": project_lora(size * 1e9, size, 1, False),
                                                   "lora_fsdp_dp8": project_lora(size * 1e9, size, 8, True)})
        report["projection_gb"][f"{size}"]["lora_adapter_parameters"] = lora_parameters(size)
    write_result("actor_memory", report, args.out)
    print(result_line({"fsdp_dp2_vs_dp1": report["held_ratio_fsdp_vs_dp1"],
                       "ddp_dp2_vs_dp1": report["held_ratio_ddp_vs_dp1"],
                       "lora_dp1_vs_dp1": report["held_ratio_lora_vs_dp1"],
                       "gb_7b_lora_bf16_dp1": report["projection_gb"]["7"]["lora_bf16_dp1"],
                       "gb_7b_fsdp_dp8": report["projection_gb"]["7"]["dp8_fsdp"],
                       "gb_70b_fsdp_dp64": report["projection_gb"]["70"]["dp64_fsdp"]}))


if __name__ == "__main__":
    main()
