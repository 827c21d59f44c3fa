"""Run under `torchrun --nproc-per-node 2` by test_distributed.py: a DDP update of the torch
actor over gloo and the DeepSpeed ZeRO-3 reference, results written for the test to compare
with a single-process run.

    torchrun --nproc-per-node 2 tests/dist_actor.py MODEL_DIR OUT_DIR
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

from engines.training.losses import LossConfig  # noqa: E402
from engines.training.config import ActorConfig  # noqa: E402
from engines.training.reference import TorchReference, make_reference  # noqa: E402
from engines.training.torch_actor import TorchActor  # noqa: E402
from engines.training.batch import TENSOR_FIELDS, group_shards  # noqa: E402
from rollout.handoff import hand_out  # noqa: E402


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    vocab = 1000
    batch = make_batch(vocab, n=7)  # odd: ranks get 4 and 3 rows, different micro-batch counts
    adv = advantages_for(batch)

    actor = TorchActor(ActorConfig(lr=1.0, micro_batch_size=2, grad_clip=1e9), model)
    actor.optimizer = torch.optim.SGD(actor.params, lr=1.0)  # the weight change is the gradient itself
    lp, ent = actor.compute_logprobs(batch)
    metrics = actor.update(batch, adv, None, None, LossConfig(agg="seq-mean-token-mean"))

    ref = make_reference("deepspeed", model, micro_batch_size=2)
    ref_lp = ref.compute_logprobs(batch)
    total = sum(p.numel() for p in TorchReference(model).module.parameters())
    if rank == 0:
        torch.save({"params": {k: v.clone() for k, v in actor.module.state_dict().items()}, "logprobs": lp,
                    "entropy": ent, "ref_logprobs": ref_lp}, out / "dist.pt")
    # the same update from shards: each rank receives only its group-aligned rows, as tensors
    shard, cost = hand_out(batch if rank == 0 else None, [0, 1], rank)
    rows = group_shards(batch.group_index, world)[rank]
    expect = batch.shard(rows)
    same = all(torch.equal(getattr(shard, f), getattr(expect, f)) for f in TENSOR_FIELDS)
    sharded = TorchActor(ActorConfig(lr=1.0, micro_batch_size=2, grad_clip=1e9), model)
    sharded.optimizer = torch.optim.SGD(sharded.params, lr=1.0)
    shard_lp, _ = sharded.compute_logprobs(shard)
    shard_metrics = sharded.update(shard, adv[rows], None, None, LossConfig(agg="seq-mean-token-mean"))
    shard_ref = ref.compute_logprobs(shard)  # ZeRO-3 with 4 and 3 rows: forward counts kept in step
    if rank == 0:
        torch.save({"params": {k: v.clone() for k, v in sharded.module.state_dict().items()}}, out / "shard.pt")
    info = {"rank": rank, "world": world, "metrics": metrics, "ref_local_numel": ref.local_numel(),
            "total_numel": total, "shard_rows": rows.tolist(), "shard_equal": same, "shard_global": shard.global_size,
            "shard_metrics": shard_metrics, "handoff": cost,
            "shard_lp_matches": bool(torch.allclose(shard_lp, lp[rows], atol=1e-5)),
            "shard_ref_matches": bool(torch.allclose(shard_ref, ref_lp[rows], atol=1e-5))}
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
