"""Run under `torchrun --nproc-per-node 2` by test_lora.py: a LoRA actor sharded with FSDP2 over
gloo. Every rank sets the adapter to the same known values (`set_adapter`), then writes for the test
to compare with one unsharded process: logprobs with the adapter and with it off (the reference),
one SGD step's adapter (lr 1: the change is the gradient), the merged weights, a checkpoint round
trip of the adapter and its optimizer, and the adapter export.

    torchrun --nproc-per-node 2 tests/dist_lora.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batches import advantages_for, make_batch  # noqa: E402
from dist_exit import leave  # noqa: E402

from engines.training.config import ActorConfig, LoraConfig  # noqa: E402
from engines.training.losses import LossConfig  # noqa: E402
from engines.training.reference import AdapterOffReference  # noqa: E402
from engines.training.torch_actor import TorchActor  # noqa: E402

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def set_adapter(actor: TorchActor, seed: int = 3) -> None:
    """The same adapter values on every rank and in one process: each tensor drawn whole from a
    generator of its name, each rank keeping its dim-0 slice."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if actor.fsdp else (0, 1)
    with torch.no_grad():
        for name, p in actor.module.named_parameters():
            if ".lora_" not in name:
                continue
            g = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
            full = torch.randn(p.shape, generator=g) * 0.2
            local = p.to_local() if hasattr(p, "to_local") else p
            per = -(-full.shape[0] // world)
            local.copy_(full[rank * per:(rank + 1) * per])


def main() -> None:
    from parallel.mesh import init_distributed

    model, out = sys.argv[1], Path(sys.argv[2])
    rank, _ = init_distributed()
    torch.set_num_threads(1)
    batch = make_batch(1000, n=6)
    actor = TorchActor(ActorConfig(lr=1.0, micro_batch_size=2, grad_clip=1e9, sharding="fsdp", lora=LORA), model,
                       progress=False)
    assert actor.fsdp
    starts_at_base = [n for n, t in actor.named_sync_weights(True) if "lora_B" in n and torch.count_nonzero(t)]
    set_adapter(actor)
    actor.optimizer = torch.optim.SGD(actor.params, lr=1.0)
    lp, _ = actor.compute_logprobs(batch)
    base = AdapterOffReference(actor).compute_logprobs(batch)
    actor.update(batch, advantages_for(batch), None, None, LossConfig(agg="seq-mean-token-mean"))
    adapter = dict(actor.named_sync_weights(True))  # every rank gathers, rank 0 receives
    merged = dict(actor.named_hf_weights())
    state = actor.state_dict()
    torch.save(state, out / f"ckpt{rank}.pt")
    before = [p.to_local().clone() for p in actor.params]
    actor.update(batch, advantages_for(batch, seed=2), None, None, LossConfig())
    actor.load_state_dict(torch.load(out / f"ckpt{rank}.pt", weights_only=False))
    restored = all(torch.equal(p.to_local(), b) for p, b in zip(actor.params, before))
    actor.save_hf(out / "hf")
    if rank == 0:
        torch.save({"logprobs": lp, "base": base, "adapter": adapter, "merged": merged}, out / "lora.pt")
    info = {"restored": restored, "starts_at_base": not starts_at_base, "saved_keys": sorted(state["adapter"]),
            "whole_model_saved": "model" in state,
            "yielded": len(adapter)}
    (out / f"lora_rank{rank}.json").write_text(json.dumps(info))
    leave(rank)


if __name__ == "__main__":
    main()
