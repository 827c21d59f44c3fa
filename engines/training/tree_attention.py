"""Attention over a micro-batch packed as a prefix tree (engines/training/prefix.py), computing only
the pairs of tokens that see each other.

Packed, a micro-batch is one sequence in which each row's fresh tokens (those after its longest
common prefix with an earlier row) form one contiguous run, and a token sees the tokens of its own
row up to itself: its row's ancestors (runs of other rows' tokens) and the run's own tokens
causally. The dense [n, n] mask that says so makes sdpa and eager attention compute every pair of
the packed sequence, most of them masked: a GRPO group of 8 replies after one prompt computes each
reply against every sibling. Here each run is attended on its own: its queries against its
ancestors' keys and its own, so the pairs computed are those of the padded rows without their
padding and without a shared prefix's square repeated per row. Runs of similar length go in one
kernel call (`Plan`: gathered by index into [kv heads, heads per kv head, runs, length, dim],
padded to the bucket's longest run, at most `BUCKET_WASTE` query slots per token), so a GRPO
group's replies are one call per layer, not one each. The gradient reaching a shared key or value is the sum over the runs that
read it (the gathers' backward adds), as in the dense computation.

Runs of a bucket are gathered head-major, once per key/value head (a GQA model's query heads share
them without copies of the whole sequence), and attended by two matmuls around a softmax on CPUs,
where sdpa's kernel with a mask took 2-3x as long in bf16 at these shapes; sdpa on GPUs.
`actor.packed_attention=auto` (the default) attends by runs where the model's attention is sdpa or
eager; `mask` keeps the dense mask. Measured on CPUs only (benchmarks/RESULTS.md): at the demo's
shapes 0.90-0.96x of the mask's update time; with replies as long as the prompt (vs_trl.py's shape,
where the dense mask gains little or nothing over `shared_prefix=off`) 0.78x of it with sdpa, a quarter
with eager attention.

The model is a Hugging Face causal LM, unmodified: its attention is switched once to
`switchyard_tree_sdpa` or `switchyard_tree_eager` (`install`), registered with transformers'
attention and mask interfaces. Given a `prefix_tree` (passed with the forward's keyword arguments,
which transformers hands to every attention call), it computes by runs; without one (a padded
micro-batch, a model that does not pass the keyword arguments on) it is the model's own sdpa or
eager attention with the mask it was given. Layers with a sliding window, logit soft-capping,
attention sinks or a position bias (`CHANGES_THE_MATH`), and attention with dropout while
training, use the dense mask as well.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

PREFIX = "switchyard_tree_"
BASES = ("sdpa", "eager")  # the attention a tree attention stands in for (and delegates to)
# keyword arguments some models give their attention that change what it computes (attention sinks,
# a position bias, soft-capping, a sliding window, chunked attention): with any of them, the dense mask
CHANGES_THE_MATH = ("s_aux", "sinks", "position_bias", "softcap", "sliding_window", "attention_chunk_size",
                    "output_attentions")


@dataclass
class PrefixTree:
    """The runs of a packed sequence: `runs[i] = (start, end, ancestors)`, packed positions
    [start, end) the run's tokens and `ancestors` the (start, end) ranges of the tokens before
    them in their row, in order. Runs are contiguous and in order and cover the sequence."""

    runs: list[tuple[int, int, list[tuple[int, int]]]]
    _masks: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict, repr=False)
    _plans: dict[str, "Plan"] = field(default_factory=dict, repr=False)

    @classmethod
    def from_paths(cls, paths: list[torch.Tensor]) -> "PrefixTree":
        """From each row's packed positions (prefix.layout): the row's fresh tokens are the last
        ones of its path, contiguous; the ones before them are its ancestors."""
        runs, end = [], 0
        for path in paths:
            fresh = len(path) - int((path < end).sum())  # positions placed before this row are shared
            if fresh == 0:
                continue  # a row equal to an earlier one (or its prefix): nothing of its own to compute
            start = int(path[len(path) - fresh])
            runs.append((start, start + fresh, _ranges(path[:len(path) - fresh])))
            end = start + fresh
        return cls(runs)

    def mask(self, k: int, device: torch.device) -> torch.Tensor:
        """Run k's bool mask [fresh, ancestors + fresh]: every ancestor, its own tokens causally."""
        key = (str(device), k)
        if key not in self._masks:
            start, end, anc = self.runs[k]
            f, a = end - start, sum(e - s for s, e in anc)
            m = torch.ones(f, a + f, dtype=torch.bool, device=device)
            m[:, a:] = torch.ones(f, f, dtype=torch.bool, device=device).tril_()
            self._masks[key] = m
        return self._masks[key]

    def pairs(self) -> int:
        """Query-key pairs the runs need (each run's queries x its ancestors and itself)."""
        return sum((e - s) * (sum(b - a for a, b in anc) + e - s) for s, e, anc in self.runs)

    def plan(self, device: torch.device) -> "Plan":
        """The runs batched for the kernel (`Plan`), made once per device."""
        key = str(device)
        if key not in self._plans:
            self._plans[key] = Plan.of(self, device)
        return self._plans[key]


BUCKET_WASTE = 1.25  # a bucket of runs padded to its longest may compute at most this many query slots per token


@dataclass
class Bucket:
    """Runs of similar length attended in one call: `queries` [R * F] and `keys` [R * K] packed
    positions gathered (padding points at position 0 and is masked), `mask` [R, F, K], and
    `real` the [R * F] slots that are tokens, in packed order."""

    rows: int
    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor
    real: torch.Tensor
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive bias [R, F, K] in `dtype` (0 where seen, the dtype's lowest elsewhere)."""
        if dtype not in self._bias:
            self._bias[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, torch.finfo(dtype).min)
        return self._bias[dtype]


@dataclass
class Plan:
    """A tree's runs in buckets (`Bucket`), and `order`: for each packed position, its place in
    the buckets' real slots laid end to end."""

    buckets: list[Bucket]
    order: torch.Tensor

    @classmethod
    def of(cls, tree: PrefixTree, device: torch.device) -> "Plan":
        runs = sorted(range(len(tree.runs)), key=lambda i: tree.runs[i][1] - tree.runs[i][0])
        groups: list[list[int]] = []
        for i in runs:  # ascending fresh length: each bucket is padded to its last (longest) run
            f = tree.runs[i][1] - tree.runs[i][0]
            if groups and f * (len(groups[-1]) + 1) <= BUCKET_WASTE * (
                    f + sum(tree.runs[j][1] - tree.runs[j][0] for j in groups[-1])):
                groups[-1].append(i)
            else:
                groups.append([i])
        buckets, placed = [], []
        for g in groups:
            spans = [(tree.runs[i], sum(b - a for a, b in tree.runs[i][2])) for i in g]
            f_max = max(e - s for (s, e, _), _a in spans)
            k_max = max(a + e - s for (s, e, _), a in spans)
            q = torch.zeros(len(g), f_max, dtype=torch.long)
            k = torch.zeros(len(g), k_max, dtype=torch.long)
            mask = torch.zeros(len(g), f_max, k_max, dtype=torch.bool)
            mask[:, :, 0] = True  # padding queries see position 0 (their output is dropped): no empty row
            real = torch.zeros(len(g), f_max, dtype=torch.bool)
            for r, (i, ((s, e, anc), a)) in enumerate(zip(g, spans)):
                f = e - s
                q[r, :f] = torch.arange(s, e)
                k[r, :a + f] = torch.cat([torch.arange(x, y) for x, y in anc] + [torch.arange(s, e)])
                mask[r, :f] = False
                mask[r, :f, :a + f] = tree.mask(i, torch.device("cpu"))
                real[r, :f] = True
                placed.append(q[r, :f])
            buckets.append(Bucket(len(g), q.flatten().to(device), k.flatten().to(device), mask.to(device),
                                  real.flatten().nonzero().flatten().to(device)))
        order = torch.empty(sum(len(p) for p in placed), dtype=torch.long)
        order[torch.cat(placed)] = torch.arange(len(order))
        return cls(buckets, order.to(device))


def _ranges(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Ascending positions as (start, end) ranges of consecutive ones."""
    out: list[tuple[int, int]] = []
    for p in positions.tolist():
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def install(model: torch.nn.Module) -> bool:
    """Switch `model`'s attention to the tree attention standing in for its sdpa or eager one
    (idempotent). False where its attention is another (flex, flash): the dense mask then."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_attn_implementation")}
    done = False
    for c in configs.values():
        impl = c._attn_implementation
        if isinstance(impl, str) and impl.startswith(PREFIX):
            done = True
        elif impl in BASES:
            _register()
            c._attn_implementation = PREFIX + impl
            done = True
    return done


def by_runs(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention was switched to the tree attention (`install`)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return isinstance(impl, str) and impl.startswith(PREFIX)


def base_of(impl: str | None) -> str | None:
    """The attention a tree attention stands in for ('sdpa' for 'switchyard_tree_sdpa'); `impl` otherwise."""
    return impl[len(PREFIX):] if isinstance(impl, str) and impl.startswith(PREFIX) else impl


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    for base, make_mask in (("sdpa", sdpa_mask), ("eager", eager_mask)):
        AttentionInterface.register(PREFIX + base, _tree_attention)
        AttentionMaskInterface.register(PREFIX + base, make_mask)
    _REGISTERED = True


def _base_attention(module: torch.nn.Module, base: str) -> Callable[..., Any]:
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward in its module; set "
                           "actor.attn_implementation=sdpa or actor.shared_prefix=off")
    return eager


def _tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    tree: PrefixTree | None = kwargs.pop("prefix_tree", None)
    base = base_of(module.config._attn_implementation)
    dense = (tree is None or query.shape[0] != 1 or getattr(module, "sliding_window", None)
             or getattr(module.config, "attn_logit_softcapping", None) or (dropout and module.training)
             or any(kwargs.get(k) is not None and kwargs.get(k) is not False for k in CHANGES_THE_MATH))
    if dense:
        return _base_attention(module, base)(module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **kwargs)
    q, k, v = query[0], key[0], value[0]  # [heads, n, d]; keys and values may have fewer heads (GQA)
    h, kv, d = q.shape[0], k.shape[0], q.shape[-1]
    scale = scaling if scaling is not None else d ** -0.5
    scores = _by_scores(base, q.device)
    plan, outs = tree.plan(q.device), []
    for b in plan.buckets:  # gathered head-major, [kv, heads per kv, R, F or K, d]: no transposes, each key
        # and value gathered once per kv head (their gradients summed by the gathers' backward)
        qb = q.index_select(1, b.queries).view(kv, h // kv, b.rows, -1, d)
        kb = k.index_select(1, b.keys).view(kv, 1, b.rows, -1, d)
        vb = v.index_select(1, b.keys).view(kv, 1, b.rows, -1, d)
        o = _run_scores(qb, kb, vb, b.bias(qb.dtype), scale) if scores else _run_sdpa(qb, kb, vb, b.mask, scale)
        outs.append(o.reshape(h, -1, d).index_select(1, b.real))
    out = (torch.cat(outs, 1) if len(outs) > 1 else outs[0]).index_select(1, plan.order)
    return out.transpose(0, 1)[None].contiguous(), None


def _by_scores(base: str, device: torch.device) -> bool:
    """Whether the runs are attended by `_run_scores` (else sdpa): always for an eager model, and on
    CPU for an sdpa one too, where sdpa's kernel with a mask took 2-3x as long as the two matmuls in
    bf16 at a GRPO group's shapes and no less in fp32 (benchmarks/RESULTS.md)."""
    return base == "eager" or device.type == "cpu"


def _run_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """[kv, rep, R, F, d] queries against [kv, 1, R, K, d] keys and values, `mask` [R, F, K]."""
    kv, rep, r, f, d = q.shape
    k, v = (t.expand(kv, rep, *t.shape[2:]).reshape(kv * rep, r, -1, d) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.reshape(kv * rep, r, f, d), k, v, attn_mask=mask,
                                                           scale=scale)
    return out.view(kv, rep, r, f, d)


def _run_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """As transformers' eager attention: scores in the compute dtype with the mask added, softmax
    (accumulated in float32 for bf16 on CPU and CUDA alike) rounded to the compute dtype, in place
    where autograd allows (neither the scaling nor the bias is needed by the backward)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(bias)  # bias [R, F, K], the same for every head
    return torch.matmul(torch.softmax(scores, dim=-1), v)
