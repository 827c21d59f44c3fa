"""Weights between the HF layout (what engines load) and Megatron's tensor/pipeline-parallel layout.

What a model family's tensors are called and how each one is split is stated once, in its file
under `parallel/families/` (one per HF model_type: llama, qwen2, mistral): a table of rows (HF
name, Megatron name, pipeline part, TP kind, HF shape). This module is the family-independent
machinery that reads such a table in both directions. The kinds (TP rank r of T):

    replicated    the same on every rank (norms)
    vocab         rows padded to Vp (a multiple of 128 * T), then split T ways (embedding, output layer)
    col / row     split T ways along dim 0 / dim 1
    qkv:q|k|v     fused into one tensor by query group (`fuse_qkv`)
    fc1:gate|up   fused as [gate rows of r; up rows of r]

Pipeline stage p of P holds layers [p*L/P, (p+1)*L/P) under local indices 0..L/P-1; the first
stage holds the "embedding" rows, the last the "final" ones. With tied embeddings the output
layer is not in the checkpoint; a pipelined last stage keeps its own copy of the embedding.

`hf_to_megatron` cuts one rank's shard out of HF tensors (loading reads only what the rank
needs). `iter_hf_weights` is the reverse for a live model: every rank runs it in lockstep, each HF
tensor is TP-gathered inside the stage that owns it and sent to one destination rank, so no rank
ever holds more than one full tensor besides its own shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch

from parallel.families import Family, TensorRow, family_for
from parallel.mesh import recv_tensor, send_tensor

if TYPE_CHECKING:
    import torch.distributed as dist

VOCAB_MULTIPLE = 128  # Megatron's make-vocab-size-divisible-by default


@dataclass(frozen=True)
class DecoderLayout:
    """The shapes that decide how tensors are cut; built from an HF config."""

    model_type: str  # names the family file in parallel/families/
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
    def from_hf_config(cls, cfg: Any) -> "DecoderLayout":
        """The layout as the config's family reads it; an unsupported model_type is refused here,
        before any weights are touched."""
        mt = getattr(cfg, "model_type", "?")
        return cls(model_type=mt, **family_for(mt).read_layout(cfg))

    @property
    def family(self) -> Family:
        """The family file that names this layout's tensors and builds it in megatron-core."""
        return family_for(self.model_type)

    @property
    def q_width(self) -> int:
        """Rows of q_proj (and columns of o_proj): the family tables give shapes in these units."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.groups * self.head_dim

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


def stage_tensors(lay: DecoderLayout, stage: int, pp: int) -> Iterator[tuple[TensorRow, str, str]]:
    """(table row, HF name, Megatron name) of every tensor pipeline stage `stage` holds, in the
    family table's order layer by layer: the one order both directions agree on."""
    rows = [r for r in lay.family.tensors if not r.when or getattr(lay, r.when)]
    if stage == 0:
        yield from ((r, r.hf, r.megatron) for r in rows if r.part == "embedding")
    for local, i in enumerate(lay.stage_layers(stage, pp)):
        yield from ((r, r.hf.format(i=i), r.megatron.format(i=local)) for r in rows if r.part == "layer")
    if stage == pp - 1:
        yield from ((r, r.hf, r.megatron) for r in rows if r.part == "final")


def _cut(members: dict[str, str], get: Callable[[str], torch.Tensor], lay: DecoderLayout, tp_rank: int,
         tp: int) -> torch.Tensor:
    """One TP rank's shard of a Megatron tensor from its HF sources, {kind: HF name}."""
    col = lambda t: t.chunk(tp, dim=0)[tp_rank].contiguous()  # noqa: E731
    if set(members) == {"qkv:q", "qkv:k", "qkv:v"}:
        return fuse_qkv(get(members["qkv:q"]), get(members["qkv:k"]), get(members["qkv:v"]), lay, tp_rank, tp)
    if set(members) == {"fc1:gate", "fc1:up"}:
        return torch.cat([col(get(members["fc1:gate"])), col(get(members["fc1:up"]))])
    if len(members) != 1:
        raise ValueError(f"HF tensors {members} share one Megatron tensor but are neither q/k/v nor gate/up")
    ((kind, name),) = members.items()
    t = get(name)
    if kind == "replicated":
        return t.clone()
    if kind == "vocab":
        return _pad_rows(t, lay.padded_vocab(tp)).chunk(tp, dim=0)[tp_rank].contiguous()
    if kind == "col":
        return col(t)
    if kind == "row":
        return t.chunk(tp, dim=1)[tp_rank].contiguous()
    raise ValueError(f"HF tensor {name!r} has kind {kind!r}, which takes part in a fused tensor; its partners are "
                     "missing from the family table")


def hf_to_megatron(get: Callable[[str], torch.Tensor], lay: DecoderLayout, tp_rank: int, tp: int, pp_rank: int,
                   pp: int) -> dict[str, torch.Tensor]:
    """The Megatron state of one (TP, PP) rank; `get(hf_name)` returns an HF tensor (e.g. from a
    safetensors file opened lazily, so only the tensors this rank needs are read)."""
    lay.check(tp, pp)
    sources: dict[str, dict[str, str]] = {}  # Megatron name -> {kind: HF name}
    for row, hf, megatron in stage_tensors(lay, pp_rank, pp):
        if row.tied_to and lay.tied:
            if pp_rank == 0:  # one stage: Megatron shares the embedding itself
                continue
            hf = row.tied_to  # tied, pipelined: this stage keeps its own copy
        sources.setdefault(megatron, {})[row.kind] = hf
    return {megatron: _cut(members, get, lay, tp_rank, tp) for megatron, members in sources.items()}


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
    return [HFTensorPlan(hf, tuple(getattr(lay, d) for d in row.shape), stage, megatron, row.kind)
            for stage in range(pp) for row, hf, megatron in stage_tensors(lay, stage, pp)
            if not (row.tied_to and lay.tied)]


def from_gathered(item: HFTensorPlan, shards: list[torch.Tensor], lay: DecoderLayout) -> torch.Tensor:
    """The HF tensor from the TP shards of its Megatron source (in TP-rank order)."""
    if item.kind == "replicated":
        return shards[0]
    if item.kind == "vocab":
        return torch.cat(shards)[:lay.vocab]
    if item.kind == "col":
        return torch.cat(shards)
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


# the dtypes a stage's tensor can have when it travels to the rank that gathers the model (`iter_hf_weights`)
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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
            if full is None:  # owned by another stage: its dtype first (bf16 weights beside fp32 norms), then it
                code = recv_tensor((1,), torch.int64, leader, "cpu")
                device = next(iter(local.values())).device
                full = recv_tensor(tuple(item.shape), WIRE_DTYPES[int(code)], leader, device)
            yield item.name, full
        elif rank == leader and full is not None:
            send_tensor(torch.tensor([WIRE_DTYPES.index(full.dtype)]), dst)
            send_tensor(full, dst)

