"""Multi-process paths under torchrun with gloo: the actor's DDP update equals a single-process
update, the DeepSpeed ZeRO-3 reference holds a partition and computes the same logprobs, and
`torchrun --nproc-per-node 2 launch/train.py` runs GRPO steps end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batches import advantages_for, make_batch
from engines.models import resolve_model
from engines.training.losses import LossConfig
from engines.training.config import ActorConfig
from engines.training.reference import TorchReference
from engines.training.torch_actor import TorchActor
from procs import pythonpath

REPO = Path(__file__).resolve().parents[1]
needs_deepspeed = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, env={**os.environ, "DS_ACCELERATOR": "cpu"}).returncode != 0,
    reason="deepspeed is not installed (bash launch/install.sh installs it)")


def torchrun(args: list[str], timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    full = {**os.environ, "PYTHONPATH": pythonpath(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


@needs_deepspeed
def test_ddp_update_and_zero3_reference_match_one_process(tmp_path: Path):
    tiny = str(resolve_model("tiny-llama"))
    torchrun(["tests/dist_actor.py", tiny, str(tmp_path)])
    got = torch.load(tmp_path / "dist.pt")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["metrics"] == ranks[1]["metrics"]  # reduced over both ranks

    batch = make_batch(1000, n=7)
    actor = TorchActor(ActorConfig(lr=1.0, micro_batch_size=2, grad_clip=1e9), tiny)
    actor.optimizer = torch.optim.SGD(actor.params, lr=1.0)
    lp, ent = actor.compute_logprobs(batch)
    m = actor.update(batch, advantages_for(batch), None, None, LossConfig(agg="seq-mean-token-mean"))
    assert torch.allclose(got["logprobs"], lp, atol=1e-5) and torch.allclose(got["entropy"], ent, atol=1e-4)
    init = TorchActor(ActorConfig(), tiny).module.state_dict()
    for k, v in actor.module.state_dict().items():  # SGD with lr 1: the weight change is the gradient
        assert torch.allclose(got["params"][k], v, atol=1e-6), k
    assert any(not torch.equal(v, init[k]) for k, v in actor.module.state_dict().items())
    for key in ("pg_loss", "loss", "grad_norm", "drift_mean", "drift_max"):
        assert ranks[0]["metrics"][key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), key

    ref = TorchReference(tiny).compute_logprobs(batch)
    assert torch.allclose(got["ref_logprobs"], ref, atol=1e-5)

    # per-rank shards (group-aligned: 4 and 3 rows) give the very same update and logprobs
    assert [r["shard_rows"] for r in ranks] == [[0, 1, 2, 3], [4, 5, 6]]
    assert all(r["shard_equal"] and r["shard_global"] == 7 for r in ranks)
    assert all(r["shard_lp_matches"] and r["shard_ref_matches"] for r in ranks)
    assert ranks[0]["handoff"]["handoff/bytes_sent"] > 0 and ranks[1]["handoff"] == {}
    shard = torch.load(tmp_path / "shard.pt")
    for k, v in actor.module.state_dict().items():
        assert torch.allclose(shard["params"][k], v, atol=1e-6), k
    for key in ("pg_loss", "loss", "grad_norm", "drift_mean", "drift_max"):
        assert ranks[0]["shard_metrics"][key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), key
    for r in ranks:  # ZeRO-3: each rank holds about half of the parameters
        assert 0 < r["ref_local_numel"] <= 0.55 * r["total_numel"]


@pytest.mark.slow
@needs_deepspeed
def test_torchrun_two_ranks_runs_grpo_steps(tmp_path: Path):
    out = tmp_path / "run"
    proc = torchrun(["launch/train.py", "model.path=tiny-llama", "data.val_path=null", "rollout.engine=hf", "data.prompts_per_step=2",
                     "rollout.n=2", "rollout.max_tokens=24", "trainer.steps=2", "sft.steps=2", "sft.batch_size=4",
                     "reference.backend=deepspeed", "algorithm.loss.kl_coef=0.01", f"trainer.output_dir={out}"],
                    env={"HF_HUB_OFFLINE": "1"})
    assert "SUMMARY steps=2" in proc.stdout, proc.stdout[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["weight_version"] for r in rows] == [2, 3]  # v1 after SFT, then one per step
    assert [r["data/index"] for r in rows] == [2, 4]
    for r in rows:
        assert r["rollout/trajectories"] == 4 and r["actor/optimizer_steps"] == 1
        # KL in the reward needs the explicit old-logprob pass; the hf engine is fp32 like the actor
        assert r["drift/mean"] < 1e-3 and r["kl_in_reward"] == r["kl_in_reward"]  # finite
    assert (out / "hf" / "model.safetensors").exists() and (out / "reward_curve.png").exists()


def test_fsdp_actor_matches_one_process_and_holds_half_the_optimizer(tmp_path: Path):
    """FSDP2 over 2 gloo ranks: the same logprobs and SGD update as one process (fp32; tolerance
    1e-5/1e-6 as for DDP: only the order of the gradient sum differs), half the AdamW state per rank;
    packed by shared prefix, the same as one process unpacked, with fewer tokens computed."""
    tiny = str(resolve_model("tiny-llama"))
    torchrun(["tests/dist_fsdp.py", tiny, str(tmp_path)])
    got = torch.load(tmp_path / "fsdp.pt")
    ranks = [json.loads((tmp_path / f"fsdp_rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["metrics"] == ranks[1]["metrics"] and ranks[0]["yielded"] > 0 and ranks[1]["yielded"] == 0
    assert all(r["host_gather_equal"] for r in ranks)  # engines/training/fsdp.py gather_on_host

    batch = make_batch(1000, n=7)
    actor = TorchActor(ActorConfig(lr=1.0, micro_batch_size=1, grad_clip=1e9), tiny)
    actor.optimizer = torch.optim.SGD(actor.params, lr=1.0)
    lp, ent = actor.compute_logprobs(batch)
    m = actor.update(batch, advantages_for(batch), None, None, LossConfig(agg="seq-mean-token-mean"))
    assert torch.allclose(got["logprobs"], lp, atol=1e-5) and torch.allclose(got["entropy"], ent, atol=1e-4)
    mine = dict(actor.named_hf_weights())
    assert set(got["weights"]) == set(mine)
    for k, v in mine.items():  # SGD with lr 1: the weight change is the gradient
        assert torch.allclose(got["weights"][k], v, atol=1e-6), k
    for key in ("pg_loss", "loss", "grad_norm", "drift_mean", "drift_max"):
        assert ranks[0]["metrics"][key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), key

    whole = TorchActor(ActorConfig(lr=1e-3, micro_batch_size=2), tiny)
    whole.update(batch, advantages_for(batch), None, None, LossConfig())
    full_bytes = sum(t.numel() * t.element_size() for s in whole.optimizer.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor))
    for r in ranks:  # exp_avg and exp_avg_sq sharded: about half each (the step counters are per parameter)
        assert 0.45 * full_bytes <= r["optimizer_bytes"] <= 0.55 * full_bytes, (r["optimizer_bytes"], full_bytes)
        assert r["restored"]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # gathered tensor by tensor, loads in HF
    assert sum(p.numel() for p in exported.parameters()) == sum(p.numel() for p in whole.module.parameters())

    packed = torch.load(tmp_path / "fsdp_packed.pt")  # FSDP2 packed by shared prefix = one process unpacked
    shared = make_batch(1000, n=8, group=4, shared_prompts=True)
    plain = TorchActor(ActorConfig(lr=1.0, micro_batch_size=4, grad_clip=1e9, shared_prefix="off"), tiny)
    plain.optimizer = torch.optim.SGD(plain.params, lr=1.0)
    assert torch.allclose(packed["logprobs"], plain.compute_logprobs(shared)[0], atol=1e-5)
    pm = plain.update(shared, advantages_for(shared), None, None, LossConfig())
    assert packed["metrics"]["tokens_computed"] < pm["tokens_computed"]  # each group's prompt once
    assert packed["metrics"]["pg_loss"] == pytest.approx(pm["pg_loss"], rel=1e-4, abs=1e-6)
    for k, v in plain.named_hf_weights():
        assert torch.allclose(packed["weights"][k], v, atol=1e-6), k

    from dist_fsdp import critic_returns
    from engines.training.config import CriticConfig
    from engines.training.critic import Critic

    sharded = torch.load(tmp_path / "critic.pt")  # the critic under FSDP: its head read as zero, one SGD step alike
    critic = Critic(CriticConfig(micro_batch_size=2), ActorConfig(), tiny, progress=False)
    critic.optimizer = torch.optim.SGD(critic.params, lr=1.0)
    cm = critic.update_values(batch, critic_returns(batch), critic.compute_values(batch))
    assert torch.count_nonzero(sharded["start"]) == 0
    assert torch.allclose(sharded["after"], critic.compute_values(batch), atol=1e-5)
    assert torch.count_nonzero(sharded["after"]) > 0
    assert sharded["metrics"]["value_loss"] == pytest.approx(cm["value_loss"], rel=1e-5)


@pytest.mark.slow
@needs_deepspeed
def test_gpu_style_process_group_fsdp_bf16_runs_and_resumes(tmp_path: Path):
    """The process group as a GPU run builds it (a backend per device type: `cpu:gloo,cuda:<x>`,
    here x = gloo as CPU torch has no NCCL) carries every reduction of a real run: the FSDP actor
    in bf16, the ZeRO-3 reference with a KL penalty, the batch handoff, metrics; then a resume."""
    out = tmp_path / "run"
    args = ["launch/train.py", "model.path=tiny-llama", "data.val_path=null", "rollout.engine=hf", "data.prompts_per_step=2", "rollout.n=2",
            "rollout.max_tokens=24", "sft.steps=2", "sft.batch_size=4", "actor.sharding=fsdp", "model.dtype=bfloat16",
            "reference.backend=deepspeed", "algorithm.loss.kl_coef=0.01", f"trainer.output_dir={out}"]
    env = {"HF_HUB_OFFLINE": "1", "SWITCHYARD_PG_BACKEND": "cpu:gloo,cuda:gloo"}
    proc = torchrun([*args, "trainer.steps=2"], env=env)
    assert "SUMMARY steps=2" in proc.stdout and "sharding fsdp" in proc.stdout, proc.stdout[-3000:]
    assert sorted(p.name for p in (out / "checkpoints" / "step_000002").iterdir()) == [
        "shard_rank0.pt", "shard_rank0.pt.sha256", "shard_rank1.pt", "shard_rank1.pt.sha256", "state.pt",
        "state.pt.sha256"]  # each rank saves only its shards
    proc = torchrun([*args, "trainer.steps=3"], env=env)
    assert "resuming from" in proc.stdout and "SUMMARY steps=3" in proc.stdout, proc.stdout[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # bf16 engine vs bf16 FSDP compute: close, not equal
        assert r["drift/mean"] < 1e-3 and r["kl_in_reward"] == r["kl_in_reward"] and r["handoff/rows_local"] == 2
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "hf") is not None
