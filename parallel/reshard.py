"""Weights between the HF layout (what engines load) and Megatron's tensor/pipeline-parallel layout.

Llama-family decoders (llama, qwen2, mistral: RMSNorm, SwiGLU, RoPE, GQA, optional QKV bias,
tied or untied embeddings). Per layer, with G query groups of Hq/G query heads of size d:

    HF                                        Megatron (TP rank r of T)
    q_proj [Hq*d, H], k_proj / v_proj [G*d, H]   linear_qkv [G/T * (Hq/G + 2) * d, H]: for each of the
                                               rank's groups, its query heads, then its key, then its value
    o_proj [H, Hq*d]                           linear_proj: columns split T ways (row-parallel)
    gate_proj / up_proj [F, H]                 linear_fc1 [2F/T, H] = [gate rows of r; up rows of r]
    down_proj [H, F]                           linear_fc2: columns split T ways
    embed_tokens / lm_head [V, H]              rows padded to Vp (a multiple of 128 * T), split T ways
    norms                                      replicated on every TP rank

Pipeline stage p of P holds layers [p*L/P, (p+1)*L/P) under local indices 0..L/P-1; the first
stage holds the embedding, the last the final norm and the output layer.

`hf_to_megatron` cuts one rank's shard out of HF tensors (loading reads only what the rank
needs). `iter_hf_weights` is the reverse for a live model: every rank runs it in lockstep, each HF
tensor is TP-gathered inside the stage that owns it and sent to one destination rank, so no rank
ever holds more than one full tensor besides its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

VOCAB_MULTIPLE = 128  # Megatron's make-vocab-size-divisible-by default


@dataclass(frozen=True)
class DecoderLayout:
    """The shapes that decide how tensors are cut; built from an HF config."""

    num_layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    norm_eps: float
    rope_theta: float
    max_positions: int

    @classmethod
    def from_hf_config(cls, cfg: object) -> "DecoderLayout":
        mt = getattr(cfg, "model_type", "?")
        if mt not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"model_type {mt!r} is not supported by the Megatron path; supported: llama, qwen2, "
                             "mistral (RMSNorm + SwiGLU + RoPE decoders)")
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        scaling = getattr(cfg, "rope_scaling", None)
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {scaling} is not supported by the Megatron path yet; use the torch actor")
        theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
        return cls(num_layers=int(cfg.num_hidden_layers), hidden=int(cfg.hidden_size), heads=heads,
                   groups=int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim=head_dim,
                   ffn=int(cfg.intermediate_size), vocab=int(cfg.vocab_size),
                   tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                   qkv_bias=bool(getattr(cfg, "attention_bias", False) or mt == "qwen2"),
                   norm_eps=float(cfg.rms_norm_eps), rope_theta=float(theta or 10000.0),
                   max_positions=int(getattr(cfg, "max_position_embeddings", 4096)))

    def padded_vocab(self, tp: int) -> int:
        m = VOCAB_MULTIPLE * tp
        return (self.vocab + m - 1) // m * m

    def check(self, tp: int, pp: int) -> None:
        for what, n in (("query groups (num_key_value_heads)", self.groups), ("attention heads", self.heads),
                        ("intermediate_size", self.ffn)):
            if n % tp:
                raise ValueError(f"tensor parallel size {tp} does not divide the model's {what} = {n}; choose a TP "
                                 "size that does")
        if self.num_layers % pp:
            raise ValueError(f"pipeline parallel size {pp} does not divide the model's {self.num_layers} layers")

    def stage_layers(self, pp_rank: int, pp: int) -> range:
        per = self.num_layers // pp
        return range(pp_rank * per, (pp_rank + 1) * per)


def tp_sharded(megatron_name: str) -> bool:
    """Whether a Megatron parameter is split over the TP ranks; only the norms are replicated."""
    return not megatron_name.endswith("layernorm.weight")


# ------------------------------------------------------------------ HF -> Megatron
def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: DecoderLayout, tp_rank: int, tp: int
             ) -> torch.Tensor:
    """One TP rank's linear_qkv weight (or bias) from HF q/k/v."""
    g, per = lay.groups, lay.heads // lay.groups
    rest = q.shape[1:]
    qg = q.reshape(g, per * lay.head_dim, *rest)
    kg, vg = k.reshape(g, lay.head_dim, *rest), v.reshape(g, lay.head_dim, *rest)
    fused = torch.cat([qg, kg, vg], dim=1)  # [g, (per + 2) * d, ...]
    mine = fused.chunk(tp, dim=0)[tp_rank]
    return mine.reshape(-1, *rest).contiguous()


def split_qkv(fused: torch.Tensor, lay: DecoderLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF q, k, v from a full (all TP ranks concatenated in order) linear_qkv weight or bias."""
    g, per, d = lay.groups, lay.heads // lay.groups, lay.head_dim
    rest = fused.shape[1:]
    x = fused.reshape(g, (per + 2) * d, *rest)
    q, k, v = x.split([per * d, d, d], dim=1)
    return (q.reshape(g * per * d, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(),
            v.reshape(g * d, *rest).contiguous())


def hf_to_megatron(get: Callable[[str], torch.Tensor], lay: DecoderLayout, tp_rank: int, tp: int, pp_rank: int,
                   pp: int) -> dict[str, torch.Tensor]:
    """The Megatron state of one (TP, PP) rank; `get(hf_name)` returns an HF tensor (e.g. from a
    safetensors file opened lazily, so only the tensors this rank needs are read)."""
    lay.check(tp, pp)
    out: dict[str, torch.Tensor] = {}
    vp = lay.padded_vocab(tp)
    vocab_shard = lambda t: _pad_rows(t, vp).chunk(tp, dim=0)[tp_rank].contiguous()  # noqa: E731
    col = lambda t: t.chunk(tp, dim=0)[tp_rank].contiguous()  # noqa: E731
    row = lambda t: t.chunk(tp, dim=1)[tp_rank].contiguous()  # noqa: E731
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = vocab_shard(get("model.embed_tokens.weight"))
    for local, g in enumerate(lay.stage_layers(pp_rank, pp)):
        src, dst = f"model.layers.{g}.", f"decoder.layers.{local}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = get(src + "input_layernorm.weight").clone()
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight"), lay, tp_rank, tp)
        if lay.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(
                get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias"), lay, tp_rank, tp)
        out[dst + "self_attention.linear_proj.weight"] = row(get(attn + "o_proj.weight"))
        out[dst + "pre_mlp_layernorm.weight"] = get(src + "post_attention_layernorm.weight").clone()
        mlp = src + "mlp."
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([col(get(mlp + "gate_proj.weight")),
                                                        col(get(mlp + "up_proj.weight"))])
        out[dst + "mlp.linear_fc2.weight"] = row(get(mlp + "down_proj.weight"))
    if last:
        out["decoder.final_layernorm.weight"] = get("model.norm.weight").clone()
        if not lay.tied:
            out["output_layer.weight"] = vocab_shard(get("lm_head.weight"))
        elif not first:  # tied, pipelined: the last stage keeps its own copy of the embedding
            out["output_layer.weight"] = vocab_shard(get("model.embed_tokens.weight"))
    return out


# ------------------------------------------------------------------ Megatron -> HF
@dataclass(frozen=True)
class HFTensorPlan:
    """One HF tensor of the export: its name and shape, the pipeline stage that owns it, and how
    to rebuild it from the full (TP-gathered) Megatron tensor it comes from."""

    name: str
    shape: tuple[int, ...]
    stage: int
    source: str  # Megatron name on the owning stage (local layer index)
    kind: str  # "replicated" | "vocab" | "col" | "row" | "qkv:q" | "qkv:k" | "qkv:v" | "fc1:gate" | "fc1:up"


def export_plan(lay: DecoderLayout, pp: int) -> list[HFTensorPlan]:
    """Every HF tensor of the checkpoint, in a fixed order all ranks agree on (tied lm_head left out)."""
    h, d, g = lay.hidden, lay.head_dim, lay.groups
    plan = [HFTensorPlan("model.embed_tokens.weight", (lay.vocab, h), 0, "embedding.word_embeddings.weight", "vocab")]
    for stage in range(pp):
        for local, i in enumerate(lay.stage_layers(stage, pp)):
            src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
            qkv = dst + "self_attention.linear_qkv."
            plan += [HFTensorPlan(src + "input_layernorm.weight", (h,), stage, dst + "input_layernorm.weight",
                                  "replicated"),
                     HFTensorPlan(src + "self_attn.q_proj.weight", (lay.heads * d, h), stage, qkv + "weight", "qkv:q"),
                     HFTensorPlan(src + "self_attn.k_proj.weight", (g * d, h), stage, qkv + "weight", "qkv:k"),
                     HFTensorPlan(src + "self_attn.v_proj.weight", (g * d, h), stage, qkv + "weight", "qkv:v")]
            if lay.qkv_bias:
                plan += [HFTensorPlan(src + "self_attn.q_proj.bias", (lay.heads * d,), stage, qkv + "bias", "qkv:q"),
                         HFTensorPlan(src + "self_attn.k_proj.bias", (g * d,), stage, qkv + "bias", "qkv:k"),
                         HFTensorPlan(src + "self_attn.v_proj.bias", (g * d,), stage, qkv + "bias", "qkv:v")]
            plan += [HFTensorPlan(src + "self_attn.o_proj.weight", (h, lay.heads * d), stage,
                                  dst + "self_attention.linear_proj.weight", "row"),
                     HFTensorPlan(src + "post_attention_layernorm.weight", (h,), stage,
                                  dst + "pre_mlp_layernorm.weight", "replicated"),
                     HFTensorPlan(src + "mlp.gate_proj.weight", (lay.ffn, h), stage, dst + "mlp.linear_fc1.weight",
                                  "fc1:gate"),
                     HFTensorPlan(src + "mlp.up_proj.weight", (lay.ffn, h), stage, dst + "mlp.linear_fc1.weight",
                                  "fc1:up"),
                     HFTensorPlan(src + "mlp.down_proj.weight", (h, lay.ffn), stage, dst + "mlp.linear_fc2.weight",
                                  "row")]
    plan.append(HFTensorPlan("model.norm.weight", (h,), pp - 1, "decoder.final_layernorm.weight", "replicated"))
    if not lay.tied:
        plan.append(HFTensorPlan("lm_head.weight", (lay.vocab, h), pp - 1, "output_layer.weight", "vocab"))
    return plan


def from_gathered(item: HFTensorPlan, shards: list[torch.Tensor], lay: DecoderLayout) -> torch.Tensor:
    """The HF tensor from the TP shards of its Megatron source (in TP-rank order)."""
    if item.kind == "replicated":
        return shards[0]
    if item.kind == "vocab":
        return torch.cat(shards)[:lay.vocab]
    if item.kind == "row":
        return torch.cat(shards, dim=1)
    if item.kind.startswith("qkv:"):
        q, k, v = split_qkv(torch.cat(shards), lay)
        return {"q": q, "k": k, "v": v}[item.kind[4:]]
    if item.kind.startswith("fc1:"):
        halves = [s.chunk(2, dim=0) for s in shards]
        part = 0 if item.kind == "fc1:gate" else 1
        return torch.cat([h[part] for h in halves])
    raise ValueError(f"unknown tensor kind {item.kind!r}")


def iter_megatron_to_hf(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], lay: DecoderLayout, tp: int,
                        pp: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors, one at a time, from every rank's shard held in one process, {(tp_rank, pp_rank):
    state}: the offline path (merging a saved Megatron checkpoint); a live model uses `iter_hf_weights`."""
    for item in export_plan(lay, pp):
        yield item.name, from_gathered(item, [shards[(r, item.stage)][item.source] for r in range(tp)], lay)


def megatron_to_hf(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], lay: DecoderLayout, tp: int,
                   pp: int) -> dict[str, torch.Tensor]:
    return dict(iter_megatron_to_hf(shards, lay, tp, pp))


def iter_hf_weights(local: Mapping[str, torch.Tensor], lay: DecoderLayout, tp_group: "dist.ProcessGroup | None",
                    tp_rank: int, tp: int, pp_rank: int, pp: int, stage_leader: Callable[[int], int],
                    dst: int, rank: int, skip: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the live model as HF tensors to global rank `dst`, in `export_plan` order.

    Every rank of the model-parallel group calls this and iterates it to the end in lockstep (it
    performs collectives). For each tensor, the TP ranks of the owning stage all-gather their
    shards, the stage's TP-rank-0 (`stage_leader(stage)`, a global rank) rebuilds the HF tensor
    and sends it to `dst`. Only `dst` yields anything. `skip=True` (data-parallel replicas other
    than the first) takes no part and yields nothing.
    """
    import torch.distributed as dist

    if skip:
        return
    for item in export_plan(lay, pp):
        mine = item.stage == pp_rank
        leader = stage_leader(item.stage)
        full = None
        if mine:
            shard = local[item.source].detach()
            if tp > 1 and item.kind != "replicated":
                parts = [torch.empty_like(shard) for _ in range(tp)]
                dist.all_gather(parts, shard.contiguous(), group=tp_group)
            else:
                parts = [shard]
            if tp_rank == 0:
                full = from_gathered(item, parts, lay).contiguous()
        if rank == dst:
            if full is None:  # owned by another stage: receive it
                dtype = next(iter(local.values())).dtype
                full = torch.empty(item.shape, dtype=dtype, device=next(iter(local.values())).device)
                dist.recv(full, src=leader)
            yield item.name, full
        elif rank == leader and full is not None:
            dist.send(full, dst=dst)

