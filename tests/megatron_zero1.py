"""Run under `torchrun --nproc-per-node 4` by test_megatron.py: the Megatron actor at TP 2 x DP 2,
with AdamW replicated over DP and with its state sharded over DP (`actor.sharding=optimizer`),
each in fp32 and with bf16 parameters (fp32 main weights and grads); the weights after two
updates, the fp32 main weights and each rank's optimizer bytes are written for the test to compare.

    torchrun --nproc-per-node 4 tests/megatron_zero1.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batches import advantages_for, make_batch  # noqa: E402

from engines.training.config import ActorConfig  # noqa: E402
from engines.training.losses import LossConfig  # noqa: E402
from engines.training.megatron_actor import MegatronActor  # noqa: E402


def run(model: str, sharding: str, dtype: str = "float32") -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
    actor = MegatronActor(ActorConfig(backend="megatron", tp=2, lr=1e-3, micro_batch_size=2, sharding=sharding),
                          model, dtype=dtype, progress=False)
    report = actor.memory_report()
    batch = make_batch(1000, n=8)
    metrics = {}
    for _ in range(2):  # the second step uses the first step's moments
        metrics = actor.update(batch, advantages_for(batch), None, None, LossConfig())
    weights = {k: v.clone() for k, v in actor.named_hf_weights()}
    if actor.zero is not None:
        state = actor.zero.state_bytes()  # the moments of this rank's ranges (fp32 weights are their own master)
    else:
        state = sum(t.numel() * t.element_size() for s in actor.optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
    metrics = {**metrics, **{f"report_{k}": v for k, v in report.items()},
               "param_dtype": str(actor.params[0].dtype)}
    low = [i for i, p in enumerate(actor.params) if p.dtype == torch.bfloat16]
    metrics["bf16_elements"] = sum(actor.params[i].numel() for i in low) / sum(p.numel() for p in actor.params)
    if low and actor.zero is not None:  # the fp32 main weights: the parameter is their rounding, and
        # they keep the part of the updates that bf16 cannot hold
        z = actor.zero
        mine = [(z.masters[i], actor.params[i].detach().reshape(-1)[z.ranges[i][0]:z.ranges[i][1]]) for i in low]
        metrics["masters_round_to_params"] = all(torch.equal(m.to(torch.bfloat16), p) for m, p in mine)
        metrics["masters_finer"] = sum(int((m != p.float()).sum()) for m, p in mine) / sum(m.numel() for m, _ in mine)
    return weights, state, metrics


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    replicated, full_bytes, m1 = run(model, "none")
    sharded, shard_bytes, m2 = run(model, "optimizer")
    # bf16 parameters with fp32 main weights and grads: whole on every rank, then sharded over DP
    low, low_bytes, m3 = run(model, "none", dtype="bfloat16")
    low_sharded, low_shard_bytes, m4 = run(model, "optimizer", dtype="bfloat16")
    rank = dist.get_rank()
    torch.save({"replicated": replicated, "sharded": sharded, "bf16": low, "bf16_sharded": low_sharded},
               out / f"zero1_{rank}.pt")
    (out / f"zero1_rank{rank}.json").write_text(json.dumps({
        "full": full_bytes, "shard": shard_bytes, "bf16_full": low_bytes, "bf16_shard": low_shard_bytes,
        "m_replicated": m1, "m_sharded": m2, "m_bf16": m3, "m_bf16_sharded": m4}))
    dist.barrier()


if __name__ == "__main__":
    main()
