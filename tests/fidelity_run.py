"""One engine backend and one model through every training mode and every one-node weight route
that reaches it (tests/test_fidelity.py runs it in a process of its own).

    python tests/fidelity_run.py ENGINE MODEL_DIR OUT_DIR   # ENGINE: hf | vllm | hf_inproc | vllm_inproc
    two torchrun launchers (--nnodes 2) running it: the collective route across two simulated nodes

The run's own parts, built from a real config (`launch/setup.py`): the rollout plane with its
engine and agent workers, torch actors, `launch/algorithm.learn`. Modes in this order: LoRA (rank
8; adapter-only pushes where the engine applies adapters, merged weights otherwise), partial (the
last layer and the final norm train), full (every parameter, the embedding and a tied head with
it). The engine keeps its base across modes: LoRA goes first, and each later mode first pushes its
fresh actor's weights. Per (mode, route): 2 GRPO steps with rewards that vary (`compute_score`), a
push after each, then a third rollout whose engine logprobs are compared with the actor's on every
sampled token. Writes OUT_DIR/fidelity.json: one record per (mode, route).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODES = {
    "lora": ["actor.lora={rank: 8, alpha: 16}", "actor.trainable=[]"],
    "partial": ["actor.trainable=['model\\.layers\\.1\\.', 'model\\.norm\\.']"],
    "full": ["actor.trainable=[]"],
}


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A reward that varies between the samples of a group (so every step moves the weights)."""
    return (sum(map(ord, solution_str)) % 5) / 4


def _config(engine: str, model_dir: str, out: Path, mode: str):
    from launch.config import load_config

    return load_config(None, [
        f"model.path={model_dir}", f"rollout.engine={engine.removesuffix('_inproc')}",
        f"rollout.in_process={engine.endswith('_inproc')}", "rollout.n=4",
        "rollout.max_tokens=12", "data.agent_name=single_turn_agent", "data.prompts_per_step=2", "data.val_path=null",
        "sft.enabled=false", "actor.lr=2e-3", "actor.micro_batch_size=8", f"trainer.output_dir={out}",
        f"reward.function={Path(__file__).resolve()}:compute_score", *MODES[mode]])


def _moved(actor, before: dict) -> int:
    """How many of the actor's HF tensors changed since `before` (their digests)."""
    from engines.weight_digest import digests

    now = digests(actor.named_hf_weights())
    return sum(abs(now[n][0] - before[n][0]) > 1e-9 * max(1.0, before[n][1]) for n in before)


def main(engine: str, model_dir: str, out_dir: str) -> None:
    import torch

    from engines.training import make_actor
    from engines.weight_digest import digests
    from launch.algorithm import learn
    from launch.setup import setup
    from parallel.reduce import over_ranks

    out = Path(out_dir)
    cfg = _config(engine, model_dir, out, "lora")
    run = setup(cfg)
    plane, records = run.plane, []
    weights = plane.weights
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    # one node: shm (auto) and bus; two nodes (two launchers, a rank and an engine each): the collective
    routes = ["in_process"] if engine.endswith("_inproc") else ["auto", "bus"] if world == 1 else ["auto"]
    plane.start_engines(out)
    plane.start_workers()
    try:
        for mode in MODES:
            cfg = _config(engine, model_dir, out, mode)
            actor = run.actor if mode == "lora" else make_actor(cfg.actor, run.model_dir, cfg.model.dtype,
                                                                cfg.rollout.temperature, cfg.trainer.seed,
                                                                progress=False)
            plane.fleet.adapter_rank = cfg.actor.lora.rank if cfg.actor.lora is not None else 0
            before = digests(actor.named_hf_weights())
            for route in routes:
                plane.cfg.weight_path = route
                if weights.version:  # this mode's actor as it is now, whatever the engine served before
                    weights.publish(actor)
                for _ in range(2):
                    batch, _ = plane.generate(run.stream.next_batch(cfg.data.prompts_per_step), weights.version)
                    learn(batch, actor, None, cfg.algorithm, cfg.actor)
                    weights.publish(actor)
                sync = dict(weights.last_sync)
                batch, _ = plane.generate(run.stream.next_batch(cfg.data.prompts_per_step), weights.version)
                actor_lp = actor.compute_logprobs(batch)[0]
                mask = batch.loss_mask.bool()
                gap = (batch.rollout_logprobs - actor_lp).abs()[mask]
                # this rank's rows (its shard when several): sums and the maximum over every rank
                total, top = over_ranks([float(gap.sum()), float(gap.numel())],
                                        [float(gap.max()) if gap.numel() else 0.0])
                if run.rank != 0:
                    continue
                records.append({"engine": engine, "mode": mode, "route": weights.route(), "tokens": int(total[1]),
                                "drift_max": float(top[0]) if total[1] else None,
                                "drift_mean": float(total[0] / total[1]) if total[1] else None,
                                "rewards": sorted(set(batch.rewards[batch.valid].tolist())),
                                "adapter_push": weights.takes_adapters(), "moved": _moved(actor, before),
                                "verified": sync.get("sync/verified_tensors"),
                                "mismatched": sync.get("sync/mismatched_tensors"),
                                "mismatched_names": {str(e): [n for n, _ in b] for e, b in weights.mismatched.items()}})
                print(json.dumps(records[-1]), flush=True)
            if actor is not run.actor:
                del actor
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
        run.barrier()
    finally:
        plane.close()
    if run.rank == 0:
        (out / "fidelity.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
