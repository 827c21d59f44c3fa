"""Llama: RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, QKV bias when `attention_bias` is
set, tied or untied embeddings. The other llama-like families (qwen2, mistral) reuse this file and
change only what differs.

Per layer, with G query groups of Hq/G query heads of size d:

    HF                                           Megatron (TP rank r of T)
    q_proj [Hq*d, H], k_proj / v_proj [G*d, H]   linear_qkv [G/T * (Hq/G + 2) * d, H]: for each of the
                                                 rank's groups, its query heads, then its key, then its value
    o_proj [H, Hq*d]                             linear_proj: columns split T ways (row-parallel)
    gate_proj / up_proj [F, H]                   linear_fc1 [2F/T, H] = [gate rows of r; up rows of r]
    down_proj [H, F]                             linear_fc2: columns split T ways
    embed_tokens / lm_head [V, H]                rows padded to Vp (a multiple of 128 * T), split T ways
    norms                                        replicated on every TP rank
"""

from __future__ import annotations

from typing import Any

from parallel.families import Family, Layout, TensorRow


def read_layout(cfg: Any) -> dict[str, Any]:
    """The layout of a llama-like HF config. Scaled RoPE is refused rather than silently run as
    plain RoPE, which would give different logprobs than the engines."""
    heads = int(cfg.num_attention_heads)
    scaling = getattr(cfg, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"rope_scaling {scaling} is not supported by the Megatron path yet; use the torch actor")
    # transformers 5 moved rope_theta into rope_parameters
    theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    return dict(num_layers=int(cfg.num_hidden_layers), hidden=int(cfg.hidden_size), heads=heads,
                groups=int(getattr(cfg, "num_key_value_heads", None) or heads),
                head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
                ffn=int(cfg.intermediate_size), vocab=int(cfg.vocab_size),
                tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                qkv_bias=bool(getattr(cfg, "attention_bias", False)), norm_eps=float(cfg.rms_norm_eps),
                rope_theta=float(theta or 10000.0), max_positions=int(getattr(cfg, "max_position_embeddings", 4096)))


def transformer_flags(lay: Layout) -> dict[str, Any]:
    """What makes a megatron-core TransformerConfig compute a llama block: RMSNorm, SwiGLU, no
    biases but the optional QKV one."""
    import torch.nn.functional as F

    return dict(normalization="RMSNorm", layernorm_epsilon=lay.norm_eps, gated_linear_unit=True,
                activation_func=F.silu, add_bias_linear=False, add_qkv_bias=lay.qkv_bias)


def model_flags(lay: Layout) -> dict[str, Any]:
    """Rotary positions with the checkpoint's base."""
    return dict(position_embedding_type="rope", rotary_base=int(lay.rope_theta))


def layer_spec() -> Any:
    """megatron-core's local (no Transformer Engine) layer, which runs on CPU as well."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(normalization="RMSNorm")


_HF, _MG = "model.layers.{i}.", "decoder.layers.{i}."
_ATTN, _QKV = _HF + "self_attn.", _MG + "self_attention.linear_qkv."

TENSORS = (
    TensorRow("model.embed_tokens.weight", "embedding.word_embeddings.weight", "embedding", "vocab",
              ("vocab", "hidden")),
    TensorRow(_HF + "input_layernorm.weight", _MG + "input_layernorm.weight", "layer", "replicated", ("hidden",)),
    TensorRow(_ATTN + "q_proj.weight", _QKV + "weight", "layer", "qkv:q", ("q_width", "hidden")),
    TensorRow(_ATTN + "k_proj.weight", _QKV + "weight", "layer", "qkv:k", ("kv_width", "hidden")),
    TensorRow(_ATTN + "v_proj.weight", _QKV + "weight", "layer", "qkv:v", ("kv_width", "hidden")),
    TensorRow(_ATTN + "q_proj.bias", _QKV + "bias", "layer", "qkv:q", ("q_width",), when="qkv_bias"),
    TensorRow(_ATTN + "k_proj.bias", _QKV + "bias", "layer", "qkv:k", ("kv_width",), when="qkv_bias"),
    TensorRow(_ATTN + "v_proj.bias", _QKV + "bias", "layer", "qkv:v", ("kv_width",), when="qkv_bias"),
    TensorRow(_ATTN + "o_proj.weight", _MG + "self_attention.linear_proj.weight", "layer", "row",
              ("hidden", "q_width")),
    TensorRow(_HF + "post_attention_layernorm.weight", _MG + "pre_mlp_layernorm.weight", "layer", "replicated",
              ("hidden",)),
    TensorRow(_HF + "mlp.gate_proj.weight", _MG + "mlp.linear_fc1.weight", "layer", "fc1:gate", ("ffn", "hidden")),
    TensorRow(_HF + "mlp.up_proj.weight", _MG + "mlp.linear_fc1.weight", "layer", "fc1:up", ("ffn", "hidden")),
    TensorRow(_HF + "mlp.down_proj.weight", _MG + "mlp.linear_fc2.weight", "layer", "row", ("hidden", "ffn")),
    TensorRow("model.norm.weight", "decoder.final_layernorm.weight", "final", "replicated", ("hidden",)),
    TensorRow("lm_head.weight", "output_layer.weight", "final", "vocab", ("vocab", "hidden"),
              tied_to="model.embed_tokens.weight"),
)

FAMILY = Family(model_type="llama", read_layout=read_layout, transformer_flags=transformer_flags,
                model_flags=model_flags, layer_spec=layer_spec, tensors=TENSORS)
