"""Each model family file drives HF -> Megatron -> HF bit-identically: tiny configs of every
supported model_type (with their quirks: qwen2's implied QKV bias, mistral's explicit head_dim,
tied embeddings) are cut into TP/PP shards and merged back; an unknown model_type is refused
with the list of supported families and what to do."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from parallel.families import family_for, supported_families
from parallel.reshard import DecoderLayout, export_plan, hf_to_megatron, megatron_to_hf

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)

CASES = {  # case -> (model_type, config overrides)
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"head_dim": 32}),  # head_dim != hidden / heads
}


def _config(model_type: str, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[model_type]
    return cls(**{"tie_word_embeddings": False, **TINY, **overrides})


def _hf_state(cfg: Any) -> dict[str, torch.Tensor]:
    """Random tensors under the names and shapes of the real HF model (as saved: no tied lm_head)."""
    from transformers import AutoModelForCausalLM

    shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2)])
@pytest.mark.parametrize("case", list(CASES))
def test_family_round_trip_is_bit_identical(case: str, tp: int, pp: int):
    model_type, overrides = CASES[case]
    cfg = _config(model_type, overrides)
    state = _hf_state(cfg)
    lay = DecoderLayout.from_hf_config(cfg)
    assert lay.family.model_type == model_type
    if model_type == "qwen2":  # no attention_bias switch, yet its checkpoints carry the biases
        assert lay.qkv_bias and "model.layers.0.self_attn.q_proj.bias" in state
    assert lay.family.transformer_flags(lay)["add_qkv_bias"] == ("model.layers.0.self_attn.k_proj.bias" in state)

    # the table's shapes are the HF model's, and it covers every tensor
    assert {p.name: p.shape for p in export_plan(lay, pp)} == {k: tuple(v.shape) for k, v in state.items()}

    shards, read = {}, {}
    for r in range(tp):
        for s in range(pp):
            read[(r, s)] = names = set()
            shards[(r, s)] = hf_to_megatron(lambda n, names=names: names.add(n) or state[n], lay, r, tp, s, pp)
    if pp > 1:  # a stage reads only its own layers
        assert not any(".layers.1." in n for n in read[(0, 0)]) and not any(".layers.0." in n for n in read[(0, 1)])
    if tp > 1:  # really split: padded vocabulary rows, grouped q/k/v heads, different shards
        d = lay.head_dim
        first, last = shards[(0, 0)], shards[(0, pp - 1)]
        assert first["embedding.word_embeddings.weight"].shape == (lay.padded_vocab(tp) // tp, lay.hidden)
        qkv = first["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape == (lay.groups // tp * (lay.heads // lay.groups + 2) * d, lay.hidden)
        assert not torch.equal(qkv, shards[(1, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"])
        if lay.tied:  # the pipelined last stage keeps its own copy of the embedding
            assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    back = megatron_to_hf(shards, lay, tp, pp)
    assert set(back) == set(state)
    for k, v in back.items():
        assert v.dtype == state[k].dtype and torch.equal(v, state[k]), k


def test_every_family_file_is_found_by_its_model_type():
    assert supported_families() == ["llama", "mistral", "qwen2"]
    for model_type in supported_families():
        assert family_for(model_type).model_type == model_type


def test_unknown_model_type_names_the_supported_families_and_the_fix():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported by the Megatron path; supported: "
                                         r"llama, mistral, qwen2\. Use the torch actor, or add "
                                         r"parallel/families/gpt2\.py"):
        DecoderLayout.from_hf_config(GPT2Config(n_layer=2))
    for bad in ("__init__", "../llama", ""):
        with pytest.raises(ValueError, match="is not supported by the Megatron path"):
            family_for(bad)
