"""Attention over a micro-batch packed as a prefix tree (engines/training/prefix.py), computing only
the pairs of tokens that see each other.

Packed, a micro-batch is one sequence in which each row's fresh tokens (those after its longest
common prefix with an earlier row) form one contiguous run, and a token sees the tokens of its own
row up to itself: its row's ancestors (runs of other rows' tokens) and the run's own tokens
causally. The dense [n, n] mask that says so makes sdpa and eager attention compute every pair of
the packed sequence, most of them masked: a GRPO group of 8 replies after one prompt computes each
reply against every sibling. Here each run is attended on its own: its queries against its
ancestors' keys and its own, so the pairs computed are those of the padded rows without their
padding and without a shared prefix's square repeated per row. The gradient reaching a shared key
or value is the sum over the runs that read it, as in the dense computation.

Used with `actor.packed_attention=runs`; the default is the dense mask. On the CPU this measured
0.90-1.01x of it at the demo's shapes (the attention a small part of the update there) and 1.22x
where replies are as long as the prompt and two groups share a packed sequence (the mask then
computes 2.4x the padded rows' pairs); not run on a GPU.
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
        """Query-key pairs the runs compute (each run's queries x its ancestors and itself)."""
        return sum((e - s) * (sum(b - a for a, b in anc) + e - s) for s, e, anc in self.runs)


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
    if k.shape[0] != q.shape[0]:
        k = k.repeat_interleave(q.shape[0] // k.shape[0], 0)
        v = v.repeat_interleave(q.shape[0] // v.shape[0], 0)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    run = _run_sdpa if base == "sdpa" else _run_eager
    outs = []
    for i, (start, end, anc) in enumerate(tree.runs):
        ks = torch.cat([k[:, s:e] for s, e in anc] + [k[:, start:end]], 1) if anc else k[:, start:end]
        vs = torch.cat([v[:, s:e] for s, e in anc] + [v[:, start:end]], 1) if anc else v[:, start:end]
        outs.append(run(q[:, start:end], ks, vs, tree.mask(i, q.device) if anc else None, scale))
    out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]  # [heads, n, d]
    return out.transpose(0, 1)[None].contiguous(), None


def _run_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
              ) -> torch.Tensor:
    f = torch.nn.functional.scaled_dot_product_attention
    return f(q, k, v, is_causal=True, scale=scale) if mask is None else f(q, k, v, attn_mask=mask, scale=scale)


def _run_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
               ) -> torch.Tensor:
    """As transformers' eager attention: scores in the compute dtype, softmax in float32."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
