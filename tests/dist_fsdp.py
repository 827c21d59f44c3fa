"""Run under `torchrun --nproc-per-node 2` by test_distributed.py: the torch actor sharded with
FSDP2 over gloo. Logprobs, one SGD update (the weight change is the gradient) and the weights
it exports are written for the test to compare with one unsharded process; so are the AdamW
state bytes each rank holds, a checkpoint round trip and a sharded HF export; and the critic
(`algorithm.advantage=gae`) sharded the same way: its values before and after one SGD step; and the
actor packed by shared prefix (`actor.shared_prefix=on`): its logprobs, update and tokens computed.

    torchrun --nproc-per-node 2 tests/dist_fsdp.py MODEL_DIR OUT_DIR
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
from dist_exit import leave  # noqa: E402

from engines.training.config import ActorConfig, CriticConfig  # noqa: E402
from engines.training.critic import Critic  # noqa: E402
from engines.training.fsdp import optimizer_bytes  # noqa: E402
from engines.training.losses import LossConfig  # noqa: E402
from engines.training.torch_actor import TorchActor  # noqa: E402
from parallel.mesh import init_distributed  # noqa: E402


def critic_returns(batch) -> torch.Tensor:
    return torch.where(batch.loss_mask.bool(), 1.0 + batch.rewards[:, None].expand(-1, batch.responses.shape[1]), 0.0)


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    rank, world = init_distributed()
    torch.set_num_threads(1)
    batch = make_batch(1000, n=7)  # ranks get 4 and 3 rows: with micro-batches of 1, rank 1 pads one pass
    adv = advantages_for(batch)
    cfg = ActorConfig(lr=1.0, micro_batch_size=1, grad_clip=1e9, sharding="fsdp")

    actor = TorchActor(cfg, model)
    assert actor.fsdp
    actor.optimizer = torch.optim.SGD(actor.params, lr=1.0)
    lp, ent = actor.compute_logprobs(batch)
    metrics = actor.update(batch, adv, None, None, LossConfig(agg="seq-mean-token-mean"))
    weights = dict(actor.named_hf_weights())  # every rank gathers, rank 0 receives
    # the gather through host memory (what a GPU whose CUDA tensors gloo carries takes) = DTensor's own
    from torch.distributed.tensor import Shard, distribute_tensor

    from engines.training.fsdp import gather_on_host

    mesh = actor.params[0].device_mesh
    odd = [torch.arange(14.0).reshape(7, 2), torch.tensor([[5.0, 6.0]])]  # pieces of 4 and 3 rows; of 1 and 0
    host_gather_equal = all(torch.equal(gather_on_host(t), t.full_tensor()) for t in actor.module.state_dict().values()
                            if hasattr(t, "full_tensor")) and all(
        torch.equal(gather_on_host(distribute_tensor(x, mesh, [Shard(0)])), x) for x in odd)
    if rank == 0:
        torch.save({"logprobs": lp, "entropy": ent, "weights": weights}, out / "fsdp.pt")

    adam = TorchActor(ActorConfig(lr=1e-3, micro_batch_size=2, sharding="fsdp"), model)
    adam.update(batch, adv, None, None, LossConfig())
    torch.save(adam.state_dict(), out / f"ckpt{rank}.pt")  # what the checkpointer writes, one file per rank
    before = [p.to_local().clone() for p in adam.params]
    adam.update(batch, adv, None, None, LossConfig())  # move away, then come back from the checkpoint
    adam.load_state_dict(torch.load(out / f"ckpt{rank}.pt", weights_only=False))
    restored = all(torch.equal(p.to_local(), b) for p, b in zip(adam.params, before))
    adam.update(batch, adv, None, None, LossConfig())  # the restored optimizer state steps again
    adam.save_hf(out / "hf")
    info = {"rank": rank, "world": world, "metrics": metrics, "optimizer_bytes": optimizer_bytes(adam.optimizer),
            "restored": restored, "local_numel": sum(p.to_local().numel() for p in adam.params),
            "yielded": len(weights), "host_gather_equal": host_gather_equal}
    critic = Critic(CriticConfig(micro_batch_size=2), ActorConfig(sharding="fsdp"), model, progress=False)
    assert critic.fsdp
    critic.optimizer = torch.optim.SGD(critic.params, lr=1.0)
    start = critic.compute_values(batch)
    cm = critic.update_values(batch, critic_returns(batch), start)
    if rank == 0:
        torch.save({"start": start, "after": critic.compute_values(batch), "metrics": cm}, out / "critic.pt")
    else:
        critic.compute_values(batch)  # collective: every rank takes part
    # packed (actor.shared_prefix=on): two groups of 4 that share their prompts, a group to a rank
    shared = make_batch(1000, n=8, group=4, shared_prompts=True)
    packed = TorchActor(ActorConfig(lr=1.0, micro_batch_size=4, grad_clip=1e9, sharding="fsdp", shared_prefix="on"), model)
    packed.optimizer = torch.optim.SGD(packed.params, lr=1.0)
    plp, _ = packed.compute_logprobs(shared)
    pm = packed.update(shared, advantages_for(shared), None, None, LossConfig())
    pweights = dict(packed.named_hf_weights())
    if rank == 0:
        torch.save({"logprobs": plp, "weights": pweights, "metrics": pm}, out / "fsdp_packed.pt")
    (out / f"fsdp_rank{rank}.json").write_text(json.dumps(info))
    leave(rank)


if __name__ == "__main__":
    main()
