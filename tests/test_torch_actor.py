"""The torch actor on a real tiny llama: logprobs equal an unpadded forward of each row, the
update does not depend on the micro-batch size, the on-policy shortcut equals the explicit
old-logprob pass, SFT learns, and the export loads in transformers with the same logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from batches import advantages_for, make_batch
from engines.models import resolve_model
from engines.training.losses import LossConfig
from engines.training.config import ActorConfig
from engines.training.reference import TorchReference
from engines.training.actor import token_budget_rows
from engines.training.torch_actor import TorchActor


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(resolve_model("tiny-llama"))


def _actor(model: str, temperature: float = 1.0, **kw) -> TorchActor:
    return TorchActor(ActorConfig(**kw), model, temperature=temperature)


def _row_logprobs(module: torch.nn.Module, batch, i: int, temperature: float) -> torch.Tensor:
    """The plain way: one row, no padding, full logits, log_softmax."""
    p = batch.prompts.shape[1]
    attn = batch.attention_mask[i]
    ids = torch.cat([batch.prompts[i], batch.responses[i]])[attn.bool()]
    plen = int(attn[:p].sum())
    with torch.no_grad():
        logits = module(input_ids=ids[None]).logits[0].float() / temperature
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    return lp[plen - 1:]


def test_logprobs_equal_an_unpadded_forward(tiny):
    batch = make_batch(1000, n=6)
    actor = _actor(tiny, temperature=0.7, micro_batch_size=4)
    lp, ent = actor.compute_logprobs(batch)
    assert lp.shape == ent.shape == batch.responses.shape
    p = batch.prompts.shape[1]
    for i in range(len(batch)):
        r = int(batch.attention_mask[i, p:].sum())
        want = _row_logprobs(actor.module, batch, i, 0.7)
        assert torch.allclose(lp[i, :r], want, atol=1e-5), (i, (lp[i, :r] - want).abs().max())
        assert (lp[i, r:] == 0).all() and (ent[i, :r] > 0).all()
    ref = TorchReference(tiny, temperature=0.7, micro_batch_size=5).compute_logprobs(batch)
    assert torch.allclose(ref, lp, atol=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_update_does_not_depend_on_micro_batch_size(tiny, agg):
    """Row-count micro-batches of 1, 3 and 8 rows and token-budget ones (rows sorted by length, 3 to 5
    micro-batches here) give the same weights after a step, to fp32 summation order (1e-6): the
    loss is normalised by the mini-batch's denominator, however its rows are grouped."""
    batch = make_batch(1000, n=8)
    adv = advantages_for(batch)
    states = []
    for kw in ({"micro_batch_size": 1}, {"micro_batch_size": 3}, {"micro_batch_size": 8},
               {"max_tokens_per_micro_batch": 90}, {"max_tokens_per_micro_batch": 10}):
        actor = _actor(tiny, lr=1.0, grad_clip=1e9, **kw)
        # plain SGD: the weight change is the gradient itself (Adam's first step is ~lr * sign(g),
        # which turns float noise in near-zero gradient entries into full-size differences)
        actor.optimizer = torch.optim.SGD(actor.params, lr=1.0)
        old, _ = actor.compute_logprobs(batch)
        if states:  # logprobs come back in row order whatever the grouping
            assert torch.allclose(old, first_old, atol=1e-5)
        else:
            first_old = old
        m = actor.update(batch, adv, old, None, LossConfig(agg=agg))
        assert m["optimizer_steps"] == 1 and m["grad_norm"] > 0
        states.append({k: v.clone() for k, v in actor.module.state_dict().items()})
    base = states[0]
    init = _actor(tiny).module.state_dict()
    changed = [k for k in base if not torch.equal(base[k], init[k])]
    assert changed  # the step moved the weights
    for other in states[1:]:
        for k in base:
            assert torch.allclose(base[k], other[k], atol=1e-6), k


def test_token_budget_packs_longest_first_within_the_budget():
    plen, rlen = torch.tensor([5, 2, 8, 3, 1]), torch.tensor([10, 3, 30, 4, 2])
    parts = token_budget_rows(torch.arange(5), plen, rlen, budget=30)
    # 38 tokens: over the budget, alone; 15 + 7 cost 2 x (5 + 10) = 30; adding 5 would cost 45; 5 + 3 cost 10
    assert [p.tolist() for p in parts] == [[2], [0, 3], [1, 4]]
    assert sorted(torch.cat(parts).tolist()) == [0, 1, 2, 3, 4]
    assert token_budget_rows(torch.arange(0), plen, rlen, 30) == []


def test_on_policy_shortcut_equals_explicit_old_logprobs(tiny):
    batch = make_batch(1000, n=8)
    adv = advantages_for(batch)
    a, b = _actor(tiny, lr=1e-3, micro_batch_size=3), _actor(tiny, lr=1e-3, micro_batch_size=3)
    old, _ = a.compute_logprobs(batch)
    ma = a.update(batch, adv, old, None, LossConfig())
    mb = b.update(batch, adv, None, None, LossConfig())
    for (k, va), vb in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        assert torch.allclose(va, vb, atol=1e-7), k
    assert ma["pg_loss"] == pytest.approx(mb["pg_loss"], abs=1e-6)
    mask = batch.loss_mask.bool()
    gap = (batch.rollout_logprobs - old).abs()[mask]
    assert mb["drift_mean"] == pytest.approx(float(gap.mean()), rel=1e-5)
    assert mb["drift_max"] == pytest.approx(float(gap.max()), rel=1e-5)
    with pytest.raises(ValueError, match="one epoch over one mini-batch"):
        _actor(tiny, ppo_mini_batch_size=4).update(batch, adv, None, None, LossConfig())


def test_off_policy_correction_reports_weights_and_is_exact_on_policy(tiny):
    batch = make_batch(1000, n=8)
    adv = advantages_for(batch)
    own, _ = _actor(tiny).compute_logprobs(batch)
    mask = batch.loss_mask.bool()
    # stale-looking data (make_batch's rollout logprobs): the weights are the actor's own over
    # them; micro_batch_size=3 gives three micro-batches, so the max must not be averaged
    w = torch.exp(own - batch.rollout_logprobs)[mask]
    m = _actor(tiny, lr=1e-3, micro_batch_size=3).update(batch, adv, own, None, LossConfig(off_policy="tis"))
    assert m["is_weight_mean"] == pytest.approx(float(w.mean()), rel=1e-5)
    assert m["is_weight_max"] == pytest.approx(float(w.max()), rel=1e-5)
    assert m["rollout_kl"] == pytest.approx(float((w - 1 - w.log()).mean()), rel=1e-4) and m["is_masked_frac"] == 0.0

    # behaviour == proximal: every weight is exp(0) = 1 exactly, so tis is the plain update bit for bit
    same = dataclasses.replace(batch, rollout_logprobs=own.clone())
    a, b = _actor(tiny, lr=1e-3, micro_batch_size=3), _actor(tiny, lr=1e-3, micro_batch_size=3)
    ma = a.update(same, adv, own, None, LossConfig(off_policy="tis"))
    mb = b.update(same, adv, own, None, LossConfig())
    assert ma["is_weight_mean"] == ma["is_weight_max"] == 1.0 and ma["rollout_kl"] == 0.0
    assert ma["pg_loss"] == mb["pg_loss"] and mb["is_weight_mean"] == 1.0  # none reports the gap too
    for (k, va), vb in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        assert torch.equal(va, vb), k
    # on-policy shortcut: the proximal logprobs come from the update's own forward, which differs
    # from compute_logprobs' (other micro-batch widths, train mode) by fp32 noise; the test above
    # bounds that at 1e-5 per token, so every w is within ~1e-5 of 1
    mc = _actor(tiny, lr=1e-3, micro_batch_size=3).update(same, adv, None, None, LossConfig(off_policy="tis"))
    assert mc["is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and mc["is_weight_max"] == pytest.approx(1.0, abs=1e-5)
    assert mc["pg_loss"] == pytest.approx(mb["pg_loss"], abs=1e-6)


def test_ppo_epochs_and_mini_batches_take_several_steps(tiny):
    batch = make_batch(1000, n=8)
    actor = _actor(tiny, lr=1e-3, ppo_mini_batch_size=4, ppo_epochs=2, warmup_steps=2)
    old, _ = actor.compute_logprobs(batch)
    m = actor.update(batch, advantages_for(batch), old, None, LossConfig(clip_low=0.1, clip_high=0.1))
    assert m["optimizer_steps"] == 4
    assert actor.optimizer.defaults["fused"]  # one pass per tensor on this device (engines/training/actor.py adamw)
    assert m["lr"] == pytest.approx(5e-4)  # warm-up: step 1 of 2
    assert m["ratio_mean"] != pytest.approx(1.0, abs=1e-9)  # later mini-batches saw a changed policy


def test_sft_step_learns_and_matches_manual_cross_entropy(tiny):
    from transformers import AutoTokenizer

    from launch.data.arithmetic import arithmetic_rows
    from launch.data.sft import build_sft_examples, sft_batches

    tok = AutoTokenizer.from_pretrained(tiny)
    examples = build_sft_examples(arithmetic_rows(16, seed=3), tok)
    b = next(sft_batches(examples, 8, tok.eos_token_id, shuffle=False))
    actor = _actor(tiny, lr=1e-2, micro_batch_size=3)
    with torch.no_grad():
        logits = actor.module(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten())
    losses = [actor.sft_step(b["input_ids"], b["labels"], b["attention_mask"])["loss"] for _ in range(20)]
    assert losses[0] == pytest.approx(float(want), rel=1e-4)
    assert losses[-1] < 0.5 * losses[0]


def test_weights_state_and_export(tiny, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    actor = _actor(tiny, lr=1e-3)
    batch = make_batch(1000, n=4)
    actor.update(batch, advantages_for(batch), None, None, LossConfig())
    # engine-facing names: exactly the checkpoint's tensors, each once
    with safe_open(str(Path(tiny) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    sent = dict(actor.named_hf_weights())
    assert set(sent) == names
    # checkpoint state round trip, optimizer included
    state = actor.state_dict()
    other = _actor(tiny, lr=1e-3)
    other.load_state_dict(state)
    assert other.rl_steps == 1 and other.optimizer.state_dict()["state"].keys() == actor.optimizer.state_dict()["state"].keys()
    for k, v in actor.module.state_dict().items():
        assert torch.equal(v, other.module.state_dict()[k])
    # HF export loads in transformers and computes the same logits
    actor.save_hf(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = batch.input_ids[:, -10:]
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, actor.module(input_ids=ids).logits, atol=1e-6)


def test_trainable_selects_parameters(tiny):
    actor = _actor(tiny, trainable=[r"layers\.1\.", r"^model\.norm"])
    names = {n for n, p in actor.module.named_parameters() if p.requires_grad}
    assert names and all("layers.1." in n or n.startswith("model.norm") for n in names)
    assert sum(p.numel() for p in actor.params) == sum(p.numel() for n, p in actor.module.named_parameters() if n in names)
    with pytest.raises(ValueError, match=r"actor.trainable=\['nothing-like-this'\] matches no parameter"):
        _actor(tiny, trainable=["nothing-like-this"])


def test_attention_implementation_is_the_one_asked_for_and_scores_alike(tiny):
    """actor.attn_implementation=eager runs HF's eager attention: the same logprobs and update as the
    default (sdpa) within float32 rounding of a different summation order."""
    batch = make_batch(1000, n=6)
    default, eager = _actor(tiny, micro_batch_size=3), _actor(tiny, micro_batch_size=3, attn_implementation="eager")
    from engines.training.tree_attention import base_of  # (attended by runs where it packs, standing in for them)

    impl = lambda a: base_of(a.module.config._attn_implementation)  # noqa: E731
    assert impl(eager) == "eager" != impl(default)
    lp_d, _ = default.compute_logprobs(batch)
    lp_e, _ = eager.compute_logprobs(batch)
    assert torch.allclose(lp_d, lp_e, atol=1e-5)
    m_d = default.update(batch, advantages_for(batch), None, None, LossConfig())
    m_e = eager.update(batch, advantages_for(batch), None, None, LossConfig())
    assert m_d["loss"] == pytest.approx(m_e["loss"], rel=1e-4, abs=1e-6)
    for (name, a), (_, b) in zip(default.module.named_parameters(), eager.module.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    with pytest.raises(ValueError, match="actor.attn_implementation='flash' is not allowed"):
        ActorConfig(attn_implementation="flash")


def test_model_dtype_auto_is_bf16_where_the_device_multiplies_it_natively(tiny, monkeypatch, capsys, tmp_path):
    """`model.dtype=auto` (every run's default): bfloat16 autocast where the CPU has AMX or AVX-512 BF16
    (or the GPU supports bf16), float32 elsewhere; resolved and said once, before engines and actor
    are built from it; an actor given the result computes under bf16 autocast."""
    from launch.config import ConfigError, load_config, resolve_model_dtype
    from engines.training.config import native_bf16, resolve_dtype

    here = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
                or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    assert bool(native_bf16("cpu")) == here
    assert resolve_dtype("auto", "cpu")[0] == ("bfloat16" if here else "float32")
    assert resolve_dtype("float32", "cpu") == ("float32", "as configured")
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):  # a CPU without bf16 units
        monkeypatch.setattr(torch.cpu, probe, lambda: False, raising=False)
    assert resolve_dtype("auto", "cpu") == ("float32", "model.dtype=auto: float32 (no native bf16 matrix units on cpu)")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    own = tmp_path / "own.yaml"  # a config of the user's own that names no dtype: the default
    own.write_text("model:\n  path: tiny-llama\n")
    cfg = load_config(own, [])
    assert cfg.model.dtype == "auto" and load_config(None, ["model.path=tiny-llama"]).model.dtype == "auto"
    resolve_model_dtype(cfg, show=True)
    assert cfg.model.dtype == "bfloat16" and "AVX-512 BF16" in capsys.readouterr().out
    actor = TorchActor(ActorConfig(), tiny, dtype=cfg.model.dtype)
    with actor._autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(None, ["model.dtype=bf8"])
