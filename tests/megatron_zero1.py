"""Run under `torchrun --nproc-per-node 4` by test_megatron.py: the Megatron actor at TP 2 x DP 2,
once with AdamW replicated over DP and once with its state sharded over DP
(`actor.sharding=optimizer`); the weights after one update and each rank's optimizer bytes are
written for the test to compare.

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


def run(model: str, sharding: str) -> tuple[dict[str, torch.Tensor], int, dict[str, float]]:
    actor = MegatronActor(ActorConfig(backend="megatron", tp=2, lr=1e-3, micro_batch_size=2, sharding=sharding),
                          model, progress=False)
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
    return weights, state, metrics


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    replicated, full_bytes, m1 = run(model, "none")
    sharded, shard_bytes, m2 = run(model, "optimizer")
    rank = dist.get_rank()
    if rank == 0:
        torch.save({"replicated": replicated, "sharded": sharded}, out / "zero1.pt")
    (out / f"zero1_rank{rank}.json").write_text(json.dumps({"full": full_bytes, "shard": shard_bytes,
                                                            "m_replicated": m1, "m_sharded": m2}))
    dist.barrier()


if __name__ == "__main__":
    main()
