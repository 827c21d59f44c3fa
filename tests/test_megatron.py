"""Megatron-core on CPU (gloo): HF <-> Megatron round trips are bit-identical at TP 1/2 and PP 1/2;
the live model at TP=1, TP=2 and PP=2 gives the HF model's logprobs, takes the same gradient step
as the torch actor, exports bit-identically, and after a weight sync a real engine's logprobs for
a sequence equal the updated actor's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core", reason="megatron-core is not installed (bash launch/install.sh installs it)")

from batches import advantages_for, make_batch  # noqa: E402
from engines.models import resolve_model  # noqa: E402
from engines.training.losses import LossConfig  # noqa: E402
from engines.training.config import ActorConfig  # noqa: E402
from engines.training.torch_actor import TorchActor  # noqa: E402
from parallel.reshard import DecoderLayout, hf_to_megatron, megatron_to_hf  # noqa: E402
from procs import pythonpath  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen2: QKV bias, untied lm_head, and a vocabulary (1000) that TP must pad."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    out = tmp_path_factory.mktemp("qwen-like")
    cfg = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, rope_theta=1e6)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)  # zero-initialised biases would hide a misplaced one
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(resolve_model("tiny-llama")).save_pretrained(out)
    return out


def _layout(path: Path) -> DecoderLayout:
    from transformers import AutoConfig

    return DecoderLayout.from_hf_config(AutoConfig.from_pretrained(path))


SPLITS = [(1, 1), (2, 1), (1, 2), (2, 2)]
# SmolLM2-135M has 9 attention heads in 3 key/value groups: Megatron's TP must divide 3
SMOLLM2_SPLITS = [(1, 1), (3, 1), (1, 2), (3, 2)]


@pytest.mark.parametrize("which, tp, pp", [(w, t, p) for w in ("tiny-llama", "qwen-like") for t, p in SPLITS]
                         + [("smollm2", t, p) for t, p in SMOLLM2_SPLITS])
def test_offline_round_trip_is_bit_identical(which: str, tp: int, pp: int, qwen_like: Path):
    path = {"tiny-llama": resolve_model("tiny-llama"), "qwen-like": qwen_like}.get(which)
    if which == "smollm2":
        path = resolve_model("smollm2-135m-instruct")
    state = load_file(str(Path(path) / "model.safetensors"))
    lay = _layout(Path(path))
    shards = {(r, s): hf_to_megatron(state.__getitem__, lay, r, tp, s, pp) for r in range(tp) for s in range(pp)}
    if tp > 1:  # really split: the shards differ and have the parallel shapes
        a, b = shards[(0, 0)], shards[(1, 0)]
        assert a["embedding.word_embeddings.weight"].shape[0] == lay.padded_vocab(tp) // tp
        assert not torch.equal(a["decoder.layers.0.self_attention.linear_qkv.weight"],
                               b["decoder.layers.0.self_attention.linear_qkv.weight"])
    back = megatron_to_hf(shards, lay, tp, pp)
    assert set(back) == set(state) - ({"lm_head.weight"} if lay.tied else set())
    for k, v in back.items():
        assert v.dtype == state[k].dtype and torch.equal(v, state[k]), k


def test_layout_errors_name_the_fix(qwen_like: Path):
    lay = _layout(qwen_like)
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide the model's query groups"):
        lay.check(4, 1)
    with pytest.raises(ValueError, match="pipeline parallel size 3 does not divide the model's 4 layers"):
        lay.check(1, 3)


def _run_worker(model: Path, out: Path, tp: int, pp: int, address: str) -> dict:
    n = tp * pp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           "tests/megatron_worker.py", str(model), str(out), str(tp), str(pp), address]
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out / "result.pt", weights_only=False)


@pytest.mark.parametrize("tp, pp, which", [(1, 1, "tiny-llama"), (2, 1, "tiny-llama"), (1, 2, "tiny-llama"),
                                           (2, 1, "qwen-like"), (1, 2, "qwen-like")])
def test_live_megatron_matches_hf_and_syncs_into_an_engine(tp, pp, which, qwen_like, servers, tmp_path):
    model = Path(resolve_model("tiny-llama")) if which == "tiny-llama" else qwen_like
    srv = servers(1, backend="hf", model=str(model))
    got = _run_worker(model, tmp_path, tp, pp, srv.addresses[0])
    assert f"TP {tp} x PP {pp}" in got["mesh"]
    # megatron-core's RNG tracker seeded as its layers expect (on CUDA a missing seed fails the first forward)
    for tp_rank, seeds, streams in got["rng"]:
        assert streams == ["data-parallel-rng", "expert-parallel-rng", "model-parallel-rng"], streams
        assert seeds == sorted({0, 1024, 2718 + tp_rank}), (tp_rank, seeds)

    # round trip through the live, sharded model: bit-identical
    state = load_file(str(model / "model.safetensors"))
    assert set(got["before"]) == set(state) - ({"lm_head.weight"} if _layout(model).tied else set())
    for k, v in got["before"].items():
        assert torch.equal(v, state[k]), k

    # numerics and the gradient step against the torch actor (plain HF model, same loss)
    batch = make_batch(1000, n=8)
    ref = TorchActor(ActorConfig(lr=1.0, grad_clip=1e9, micro_batch_size=3), str(model), temperature=0.8)
    lp, ent = ref.compute_logprobs(batch)
    assert torch.allclose(got["logprobs"], lp, atol=2e-5), (got["logprobs"] - lp).abs().max()
    assert torch.allclose(got["entropy"], ent, atol=1e-4), (got["entropy"] - ent).abs().max()
    ref.optimizer = torch.optim.SGD(ref.params, lr=1.0)
    m = ref.update(batch, advantages_for(batch), None, None, LossConfig(agg="seq-mean-token-mean"))
    for k, v in ref.named_hf_weights():
        assert torch.allclose(got["after"][k], v, atol=1e-5), (k, (got["after"][k] - v).abs().max())
    assert any(not torch.equal(got["after"][k], got["before"][k]) for k in got["before"])
    for key in ("pg_loss", "grad_norm", "drift_mean", "drift_max"):
        assert got["metrics"][key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), key

    # the engine took the update: its logprobs for the sequence it sampled are the updated
    # actor's, and not the old model's
    eng = got["engine"]
    assert eng["version"] == 1 and eng["weight_version"] == 1 and len(eng["tokens"]) > 0
    k = len(eng["tokens"])
    engine_lp = torch.tensor(eng["logprobs"])
    assert torch.allclose(engine_lp, eng["actor_after"][:k], atol=1e-4), (engine_lp - eng["actor_after"][:k]).abs().max()
    from agent.loop import AgentLoopOutput
    from engines.training.batch import pad_outputs

    probe = make_batch(1000, n=1, seed=5)
    prompt = probe.prompts[0][probe.attention_mask[0, :probe.prompts.shape[1]].bool()].tolist()
    seq = pad_outputs([AgentLoopOutput(prompt_ids=prompt, response_ids=eng["tokens"], response_mask=[1] * k,
                                       response_logprobs=eng["logprobs"], reward=0.0, num_turns=1,
                                       termination="stop")], 0, [0])
    old = TorchActor(ActorConfig(), str(model), temperature=0.8).compute_logprobs(seq)[0][0, :k]
    assert (engine_lp - old).abs().max() > 1e-2  # the step really changed what the engine computes

    # SFT: the same loss and the same step as the torch actor (ids clamped into the tiny vocabularies)
    from launch.data.arithmetic import arithmetic_rows
    from launch.data.sft import build_sft_examples, sft_batches

    b = next(sft_batches(build_sft_examples(arithmetic_rows(8, seed=3), ref_tok(model)), 8,
                         ref_tok(model).eos_token_id, shuffle=False))
    sft = ref.sft_step(b["input_ids"].clamp(max=999), b["labels"].clamp(max=999), b["attention_mask"])
    assert got["sft"]["loss"] == pytest.approx(sft["loss"], rel=1e-5)
    assert got["sft"]["grad_norm"] == pytest.approx(sft["grad_norm"], rel=1e-4)
    for k, v in ref.named_hf_weights():
        assert torch.allclose(got["after_sft"][k], v, atol=1e-5), k


def ref_tok(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tp, pp", [("float32", 2, 1), ("bfloat16", 1, 2)])
def test_trainer_with_megatron_runs_and_resumes(tmp_path: Path, dtype: str, tp: int, pp: int):
    """bfloat16: bf16 parameters with fp32 main weights and grads, which the checkpoint keeps; that
    run also resumes (the fp32 one would resume through the same code, without the main weights).
    It runs PP 2: the weight sync gathers the second stage's tensors to rank 0, whose dtypes (bf16
    weights, fp32 norms) are not the receiving stage's first tensor's (an H200 run failed there)."""
    out = tmp_path / "run"
    args = ["launch/train.py", "model.path=tiny-llama", "data.val_path=null", f"model.dtype={dtype}", "rollout.engine=hf",
            "data.prompts_per_step=2", "rollout.n=2",
            "rollout.max_tokens=24", "sft.steps=2", "sft.batch_size=4", "actor.backend=megatron", f"actor.tp={tp}", f"actor.pp={pp}",
            "actor.trainable=[]", "reference.backend=deepspeed", "algorithm.loss.kl_coef=0.01",
            f"trainer.output_dir={out}"]
    # the process group as a GPU run builds it, a backend per device type (gloo standing in for NCCL)
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "SWITCHYARD_PG_BACKEND": "cpu:gloo,cuda:gloo"}
    run = lambda steps: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args,
         f"trainer.steps={steps}"], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    first = run(2)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    assert f"TP {tp} x PP {pp} x DP 1" in first.stdout
    assert ("fp32 main weights" in first.stdout) == (dtype == "bfloat16")
    shard = torch.load(out / "checkpoints" / "step_000002" / "shard_rank0.pt", weights_only=False)
    assert getattr(torch, dtype) in {t.dtype for t in shard["model"].values() if isinstance(t, torch.Tensor)}
    assert all(m.dtype == torch.float32 for m in shard.get("masters", {}).values()) and bool(shard.get("masters")) == (
        dtype == "bfloat16")
    assert sorted(p.name for p in (out / "checkpoints" / "step_000002").iterdir()) == [
        "shard_rank0.pt", "shard_rank0.pt.sha256", "shard_rank1.pt", "shard_rank1.pt.sha256", "state.pt",
        "state.pt.sha256"]
    steps = [1, 2]
    if dtype == "bfloat16":
        second = run(3)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-6000:]
        assert "(step 2, data position (0, 4))" in second.stdout
        steps.append(3)
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == steps and [r["data/index"] for r in rows] == [2 * s for s in steps]
    # bf16: the engine runs the bf16 weights in bf16 too; what differs is the order of sums
    assert all(r["drift/mean"] < (1e-3 if dtype == "float32" else 3e-3) and r["kl_in_reward"] == r["kl_in_reward"]
               for r in rows)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "hf")


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M's own config (9 heads in 3 key/value groups, its 49152-token vocabulary, tied
    embeddings) with 2 of its 30 layers: every layer is sharded alike, so 2 check what 30 would."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    real = resolve_model("smollm2-135m-instruct")
    cfg = AutoConfig.from_pretrained(real)
    cfg.num_hidden_layers = 2
    torch.manual_seed(2)
    out = tmp_path_factory.mktemp("smollm2-shaped")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(real).save_pretrained(out)
    return out


@pytest.mark.slow
def test_smollm2_tp3_logprobs_match_hf(tmp_path, servers, smollm2_shaped):
    model = smollm2_shaped
    with pytest.raises(ValueError, match="tensor parallel size 2 does not divide the model's query groups"):
        _layout(model).check(2, 1)
    srv = servers(1, backend="hf", model=str(model))
    got = _run_worker(model, tmp_path, 3, 1, srv.addresses[0])
    batch = make_batch(1000, n=8)
    lp, _ = TorchActor(ActorConfig(micro_batch_size=3), str(model), temperature=0.8).compute_logprobs(batch)
    assert torch.allclose(got["logprobs"], lp, atol=1e-4), (got["logprobs"] - lp).abs().max()
    state = load_file(str(model / "model.safetensors"))
    for k, v in got["before"].items():
        assert torch.equal(v, state[k]), k


@pytest.mark.slow
def test_megatron_tp2_with_optimizer_sharded_over_dp2_matches_replicated(tmp_path: Path):
    """TP 2 x DP 2 (4 processes): AdamW state sharded over DP (each rank steps a range of every
    parameter, then all-gathers) gives the same weights after two steps as the replicated
    optimizer, and each rank holds about half the state; the same with bf16 parameters, fp32 main
    weights and fp32 main grads, whose update agrees with the fp32 run's."""
    model = resolve_model("tiny-llama")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "tests/megatron_zero1.py", str(model), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = torch.load(tmp_path / "zero1_0.pt")
    for k, v in got["replicated"].items():  # the same AdamW arithmetic on the same gradients: equal
        assert torch.allclose(got["sharded"][k], v, atol=1e-7), k
        # bf16 parameters, fp32 main weights and grads: sharding changes nothing in the arithmetic
        assert got["bf16"][k].dtype == torch.bfloat16 and torch.equal(got["bf16_sharded"][k], got["bf16"][k]), k
    # and the bf16 run's update is the fp32 run's: the two weight changes point the same way
    # (bf16 rounds each weight by up to 2^-9 of its size, ~1e-4 here, against changes of ~2e-3)
    w0 = load_file(str(model / "model.safetensors"))
    d32 = torch.cat([(v.float() - w0[k].float()).reshape(-1) for k, v in got["replicated"].items()])
    d16 = torch.cat([(got["bf16"][k].float() - w0[k].float()).reshape(-1) for k in got["replicated"]])
    assert torch.nn.functional.cosine_similarity(d32, d16, dim=0) > 0.99
    import json

    ranks = [json.loads((tmp_path / f"zero1_rank{r}.json").read_text()) for r in range(4)]
    for r in ranks:
        assert 0.45 * r["full"] <= r["shard"] <= 0.55 * r["full"], r  # AdamW moments: half per rank
        assert r["m_sharded"]["grad_norm"] == pytest.approx(r["m_replicated"]["grad_norm"], rel=1e-6)
        # bf16: moments and fp32 main weights (12 bytes per parameter) both halve when sharded
        assert 0.45 * r["bf16_full"] <= r["bf16_shard"] <= 0.55 * r["bf16_full"], r
        assert r["bf16_full"] == pytest.approx(1.5 * r["full"], rel=0.01), r
        low = r["m_bf16_sharded"]
        assert low["bf16_elements"] > 0.99 and low["masters_round_to_params"] and low["masters_finer"] > 0.9, low
        assert low["report_bytes_per_parameter"] == pytest.approx(2 + 4 + (8 + 4) / 2, rel=0.01), low
        assert low["grad_norm"] == pytest.approx(r["m_replicated"]["grad_norm"], rel=0.02)
