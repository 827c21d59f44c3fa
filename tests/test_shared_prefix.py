"""Shared-prefix packing (engines/training/prefix.py): a micro-batch packed as a prefix tree gives
the logprobs, entropies and per-parameter gradients of the unpacked one (fp32 within 1e-5; bf16
within the tolerance justified below), on ragged rows: prompts of different lengths, groups of 1
and several, multi-turn rows sharing earlier turns, identical rows, a row that is a prefix of
another; in eager and sdpa attention and on a model with tied embeddings."""

from __future__ import annotations

import pytest
import torch

from agent.loop import AgentLoopOutput
from engines.training.batch import pad_outputs
from engines.training.hf_model import micro_logprobs
from engines.training.prefix import computed_tokens, layout, shared_micro_batch
from engines.training.tree_attention import PrefixTree


def _model(attn: str, tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation(attn)
    return model


def _out(prompt: list[int], response: list[int]) -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=prompt, response_ids=response, response_mask=[1] * len(response),
                           response_logprobs=[0.0] * len(response), reward=0.0, num_turns=1, termination="stop")


def _ragged_batch(order: list[int] | None = None):
    g = torch.Generator().manual_seed(1)
    r = lambda n: torch.randint(3, 97, (n,), generator=g).tolist()  # noqa: E731
    p1, p2, p3 = r(7), r(12), r(3)
    turn = r(5)  # a first reply and tool output several rows of group 3 share
    outs = [_out(p1, r(4)), _out(p1, r(9)), _out(p1, r(1)),  # a group of 3, ragged replies
            _out(p2, r(6)),  # a group of 1, a longer prompt
            _out(p3, turn + r(4)), _out(p3, turn + r(7)), _out(p3, turn[:3]),  # shared turns; one a prefix
            _out(p1, [5, 6, 7]), _out(p1, [5, 6, 7])]  # identical rows
    groups = [0, 0, 0, 1, 2, 2, 2, 3, 3]
    order = order or list(range(len(outs)))
    return pad_outputs([outs[i] for i in order], 0, [groups[i] for i in order])


def test_the_layout_computes_each_shared_prefix_once():
    seqs = [torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 3, 9, 9]), torch.tensor([7, 8]), torch.tensor([1, 2])]
    paths, size = layout(seqs)
    assert size == 4 + 2 + 2 + 0
    assert paths[1].tolist() == [0, 1, 2, 4, 5] and paths[2].tolist() == [6, 7] and paths[3].tolist() == [0, 1]
    # attention by runs (engines/training/tree_attention.py): each row's own tokens against its ancestors and
    # themselves; the last row adds nothing of its own
    tree = PrefixTree.from_paths(paths)
    assert tree.runs == [(0, 4, []), (4, 6, [(0, 3)]), (6, 8, [])]
    assert tree.pairs() == 4 * 4 + 2 * 5 + 2 * 2 < size * size
    assert tree.mask(1, torch.device("cpu")).tolist() == [[True, True, True, True, False], [True] * 5]
    batch = _ragged_batch()
    rows = torch.arange(len(batch))
    unshared = int((batch.prompt_lengths + batch.response_lengths).sum())
    assert computed_tokens(batch, rows) < unshared - 20  # the prompts and the shared turn once each


@pytest.mark.parametrize("kernel", ["mask", "runs", "runs_sdpa"])
@pytest.mark.parametrize("attn,tied", [("eager", False), ("sdpa", True)])
def test_packed_logprobs_and_gradients_equal_the_unpacked_ones_in_fp32(attn: str, tied: bool, kernel: str, monkeypatch):
    """The dense packed mask, and attention by runs (actor.packed_attention=runs, tree_attention.py),
    through its scores kernel (every eager model; sdpa ones on CPU) and through sdpa (sdpa ones on GPUs)."""
    from engines.training import tree_attention

    runs = []  # by runs: the packed forward attends by runs (not the dense mask), in every layer
    for name in ("_run_sdpa", "_run_scores"):
        real = getattr(tree_attention, name)
        monkeypatch.setattr(tree_attention, name, lambda *a, real=real, name=name: runs.append(name) or real(*a))
    if kernel == "runs_sdpa":
        monkeypatch.setattr(tree_attention, "_by_scores", lambda base, device: False)
    model = _model(attn, tied)
    if kernel != "mask":
        assert tree_attention.install(model) and tree_attention.by_runs(model)
    batch = _ragged_batch()
    rows = torch.tensor([3, 0, 4, 1, 5, 2, 6, 7, 8])  # groups interleaved, as a shuffled mini-batch has them
    got = {}
    for name, mb in (("plain", batch.micro_batch(rows)), ("packed", shared_micro_batch(batch, rows))):
        model.zero_grad()
        lp, ent = micro_logprobs(model, mb, temperature=0.7, want_entropy=True)
        weights = torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)  # a loss that weighs every token differently
        ((lp * weights).sum() + 0.1 * ent.sum()).backward()
        got[name] = (lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp0, ent0, g0), (lp1, ent1, g1) = got["plain"], got["packed"]
    tree = shared_micro_batch(batch, rows).prefix_tree
    buckets = tree.plan(torch.device("cpu")).buckets  # runs of similar length batched: one kernel call each
    assert len(buckets) < len(tree.runs) and sum(b.rows for b in buckets) == len(tree.runs)
    assert len(runs) == (len(buckets) * model.config.num_hidden_layers if kernel != "mask" else 0)
    assert set(runs) <= {"_run_sdpa" if kernel == "runs_sdpa" else "_run_scores"}
    mask = batch.micro_batch(rows).target_mask
    assert lp0.shape == lp1.shape and (lp1[~mask] == 0).all()
    assert torch.allclose(lp0, lp1, atol=1e-5, rtol=0), (lp0 - lp1).abs().max()
    assert torch.allclose(ent0, ent1, atol=1e-5, rtol=0), (ent0 - ent1).abs().max()
    for n in g0:
        scale = max(1.0, float(g0[n].abs().max()))
        assert torch.allclose(g0[n], g1[n], atol=1e-5 * scale, rtol=0), (n, (g0[n] - g1[n]).abs().max())


def test_flex_attention_takes_the_packed_mask_as_a_block_mask():
    """Flex attention (`actor.attn_implementation=flex_attention`, for GPUs: its kernel skips the
    blocks a query never sees) over the packed rows' block mask equals sdpa over the dense mask. The
    model-level check and its timing are the GPU smoke suite's `shared_prefix`: torch has no flex
    backward on CPU, and the actor says so."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from engines.training.config import ActorConfig
    from engines.training.prefix import flex_block_mask
    from engines.training.torch_actor import TorchActor

    batch = _ragged_batch()
    mb = shared_micro_batch(batch, torch.tensor([3, 0, 4, 1, 5, 2, 6, 7, 8]))
    n = mb.input_ids.shape[1]
    q, k, v = torch.randn(3, 1, 2, n, 8, generator=torch.Generator().manual_seed(2)).unbind(0)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mb.attention_mask)
    got = flex_attention(q, k, v, block_mask=flex_block_mask(mb.attention_mask))
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    with pytest.raises(ValueError, match=r"flex_attention.*CUDA.*sdpa"):
        TorchActor(ActorConfig(attn_implementation="flex_attention"), "tiny-llama", device=torch.device("cpu"))


def test_packed_bf16_stays_within_bf16_rounding_of_fp32():
    """bf16 autocast: packed and unpacked each differ from fp32 by bf16 rounding (8 bits of
    mantissa, ~4e-3 relative per op); the packed one must be no further from fp32 than the
    unpacked one plus that rounding."""
    model = _model("sdpa", False)
    batch = _ragged_batch()
    rows = torch.arange(len(batch))
    ref, _ = micro_logprobs(model, batch.micro_batch(rows), 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, _ = micro_logprobs(model, batch.micro_batch(rows), 1.0)
        packed, _ = micro_logprobs(model, shared_micro_batch(batch, rows), 1.0)
    e_plain, e_packed = (plain.float() - ref).abs().max(), (packed.float() - ref).abs().max()
    assert e_packed <= e_plain + 0.05 and e_packed < 0.1, (e_plain, e_packed)


@pytest.mark.parametrize("kw", [{"micro_batch_size": 3}, {"max_tokens_per_micro_batch": 60}])
def test_the_actor_learns_the_same_with_shared_prefix_on_off_and_auto(kw):
    """The torch actor's old-logprob pass and one update, with actor.shared_prefix off, on and auto,
    on GRPO groups that share their prompts: the same logprobs (1e-5) and the same weights after
    the step (1e-6, plain SGD as in test_torch_actor), micro-batches by rows or by token budget."""
    from batches import advantages_for, make_batch
    from engines.models import resolve_model
    from engines.training.config import ActorConfig
    from engines.training.losses import LossConfig
    from engines.training.torch_actor import TorchActor

    tiny = str(resolve_model("tiny-llama"))
    batch = make_batch(1000, n=8, group=4, shared_prompts=True, prompt=30)
    adv = advantages_for(batch)
    got, computed = {}, {}
    for mode in ("off", "on", "auto", "on_runs"):  # on: the dense mask; auto: the default attention (by runs)
        runs = mode in ("auto", "on_runs")
        attention = {"on": {"packed_attention": "mask"}, "on_runs": {"packed_attention": "runs"}}.get(mode, {})
        actor = TorchActor(ActorConfig(shared_prefix=mode.removesuffix("_runs"), lr=1.0, grad_clip=1e9,
                                       **attention, **kw), tiny)
        from engines.training.tree_attention import by_runs

        assert by_runs(actor.module) == runs == actor.by_runs, mode
        actor.optimizer = torch.optim.SGD(actor.params, lr=1.0)
        micro = actor._micro_batches(batch, torch.arange(len(batch)))
        packed = [mb.target_at is not None for mb in micro]
        if mode == "on":
            micro_on = micro
        assert all(packed) if mode.startswith("on") else not any(packed) if mode == "off" else True, (mode, packed)
        old, ent = actor.compute_logprobs(batch)
        m = actor.update(batch, adv, old, None, LossConfig())
        got[mode] = (old, ent, {k: v.clone() for k, v in actor.module.state_dict().items()})
        computed[mode] = m["tokens_computed"]
    # the update counts what its forwards computed: every real token unpacked, each shared prompt once packed
    assert computed["off"] == float(batch.prompt_lengths.sum() + batch.response_lengths.sum()), computed
    assert computed["on"] == float(sum(mb.tokens for mb in micro_on)) <= computed["off"], computed
    assert computed["on"] < computed["off"] or "max_tokens_per_micro_batch" in kw, computed  # (a budget of 60: one row each)
    base_lp, base_ent, base = got["off"]
    for mode in ("on", "auto", "on_runs"):
        lp, ent, state = got[mode]
        assert torch.allclose(lp, base_lp, atol=1e-5) and torch.allclose(ent, base_ent, atol=1e-5), mode
        for k in base:
            assert torch.allclose(base[k], state[k], atol=1e-6), (mode, k, (base[k] - state[k]).abs().max())
    assert not all(torch.equal(base[k], v) for k, v in TorchActor(ActorConfig(), tiny).module.state_dict().items())
    from engines.training.reference import TorchReference

    mixed = _ragged_batch([3, 0, 4, 1, 5, 2, 6, 7, 8])  # groups interleaved: packed in another order
    want = TorchReference(tiny, micro_batch_size=3).compute_logprobs(mixed)
    for mode in ("on", "auto"):  # the reference packs as the actor does, rows back in their order
        got_ref = TorchReference(tiny, micro_batch_size=3, shared_prefix=mode).compute_logprobs(mixed)
        assert torch.allclose(got_ref, want, atol=1e-5), mode


def test_packed_attention_runs_needs_sdpa_or_eager():
    from engines.training.config import ActorConfig

    with pytest.raises(ValueError, match="packed_attention=runs stands in for sdpa or eager"):
        ActorConfig(packed_attention="runs", attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="packed_attention='dense' is not allowed"):
        ActorConfig(packed_attention="dense")


def test_the_critic_values_the_same_packed():
    """A critic (the torch actor's machinery with a value head; its own critic.shared_prefix) gives
    the same values packed, and the same value-head weights after an update."""
    from batches import make_batch
    from engines.models import resolve_model
    from engines.training.config import ActorConfig, CriticConfig
    from engines.training.critic import Critic

    tiny = str(resolve_model("tiny-llama"))
    batch = make_batch(1000, n=8, group=4, shared_prompts=True, prompt=30)
    returns = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(3)) * batch.response_mask
    got = []
    for mode in ("off", "on"):
        critic = Critic(CriticConfig(shared_prefix=mode, micro_batch_size=3), ActorConfig(), tiny)
        assert critic.cfg.shared_prefix == mode
        with torch.no_grad():  # a head that is not zero, so the values depend on the hidden states
            critic.module.lm_head.weight.normal_(generator=torch.Generator().manual_seed(4))
        values = critic.compute_values(batch)
        critic.update_values(batch, returns, values)
        got.append((values, critic.module.lm_head.weight.detach().clone()))
    assert torch.allclose(got[0][0], got[1][0], atol=1e-5) and got[0][0].abs().sum() > 0
    assert torch.allclose(got[0][1], got[1][1], atol=1e-6)


def test_auto_asks_a_gpu_for_a_larger_saving_than_a_cpu():
    """`auto` packs where the FLOP count saves MIN_SAVING of the device type: a group of 2 sharing a prompt
    as long as each reply saves about a quarter, enough on a CPU, not on a GPU (where the packed rows lose
    sdpa's fused causal kernels: measured on an H200). Only the decision is asked of the device."""
    from engines.training.prefix import MIN_SAVING, micro_batch, min_saving

    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 97, (20,), generator=g).tolist()
    batch = pad_outputs([_out(prompt, torch.randint(3, 97, (20,), generator=g).tolist()) for _ in range(2)], 0, [0, 0])
    rows = torch.arange(2)
    padded = batch.micro_batch(rows)
    assert min_saving("cpu") == MIN_SAVING["cpu"] < 0.25 < MIN_SAVING["cuda"] == min_saving(torch.device("cuda", 0))
    assert micro_batch(batch, rows, "auto", 0.0, torch.device("cpu")).tokens == 60 < padded.tokens  # packed
    assert micro_batch(batch, rows, "auto", 0.0, torch.device("cuda", 0)).tokens == padded.tokens  # not packed
    assert micro_batch(batch, rows, "on", 0.0, torch.device("cuda", 0)).tokens == 60  # `on` packs everywhere


def test_auto_is_the_default_and_off_where_the_actor_takes_no_packed_mask():
    """`auto` by default; the Megatron actor and flash_attention_2 take no packed mask, so there auto is off
    and `on` is refused naming the fix."""
    from engines.training.config import ActorConfig, CriticConfig

    assert ActorConfig().shared_prefix == "auto" and CriticConfig().shared_prefix == "auto"
    assert ActorConfig(backend="megatron", trainable=[], gradient_checkpointing=False).shared_prefix == "off"
    assert ActorConfig(attn_implementation="flash_attention_2").shared_prefix == "off"
    with pytest.raises(ValueError, match="actor.shared_prefix=on is an option of the torch actor"):
        ActorConfig(backend="megatron", shared_prefix="on", trainable=[], gradient_checkpointing=False)
    from launch.config import load_config

    for word, mode in (("off", "off"), ("on", "on"), ("auto", "auto")):  # YAML reads bare on/off as booleans
        cfg = load_config(None, [f"actor.shared_prefix={word}", f"critic.shared_prefix={word}"])
        assert cfg.actor.shared_prefix == cfg.critic.shared_prefix == mode

