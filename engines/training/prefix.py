"""Shared-prefix packing: the tokens several rows of a micro-batch begin with are computed once.

A GRPO group's samples carry the same prompt, and the samples of a multi-turn group often share
whole earlier turns; the padded forward reads and back-propagates each of those tokens once per
row. Packed, the rows of a micro-batch become one sequence laid out as a prefix tree: each row's
tokens up to its longest common prefix with an earlier row are that row's tokens (already placed),
its remaining tokens follow, once. An attention mask lets each token see exactly the tokens of its
own row up to itself (its ancestors in the tree and itself, never a sibling), and each token keeps
the position it has in its row, so every hidden state equals the unshared one and the gradient
that reaches a shared token is the sum over the rows that share it, as unshared.

The model is any Hugging Face causal LM, unmodified: it takes the 4D mask as it is (bool for
`sdpa`, additive for `eager`). Logits are gathered per row and target (`MicroBatch.target_at`),
so the losses see the same [rows, targets] shape as without packing. Rows of unrelated prompts
share nothing and simply follow each other, without padding.
"""

from __future__ import annotations

from typing import Any

import torch

from engines.training.batch import Batch, MicroBatch
from engines.training.tree_attention import PrefixTree, base_of

MASK_ATTENTION = ("sdpa", "eager", "flex_attention")  # attention implementations that take the packed mask


def _sequences(batch: Batch, rows: torch.Tensor) -> list[torch.Tensor]:
    """Each row's real tokens: its prompt, then its response."""
    p = batch.prompt_width
    out = []
    for i in rows.tolist():
        plen, rlen = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
        out.append(torch.cat([batch.prompts[i, p - plen:], batch.responses[i, :rlen]]))
    return out


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many tokens `a` and `b` begin with alike."""
    m = min(len(a), len(b))
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0]) if len(differ) else m


def layout(seqs: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Each sequence's packed positions (`paths[i][t]`: where token t of row i sits) and the packed
    length. Row i reuses the positions of the earlier row it shares the longest prefix with."""
    paths: list[torch.Tensor] = []
    size = 0
    for i, s in enumerate(seqs):
        best, parent = 0, -1
        for j in range(i):
            n = _common(s, seqs[j])
            if n > best:
                best, parent = n, j
        fresh = torch.arange(size, size + len(s) - best)
        paths.append(torch.cat([paths[parent][:best], fresh]) if best else fresh)
        size += len(s) - best
    return paths, size


def shared_micro_batch(batch: Batch, rows: torch.Tensor,
                       laid: tuple[list[torch.Tensor], list[torch.Tensor], int] | None = None,
                       tree: PrefixTree | None = None) -> MicroBatch:
    """`rows` of `batch` packed as a prefix tree into one sequence (see the module's docstring);
    the targets, their mask and `rows` are those `batch.micro_batch(rows)` has."""
    if has_images(batch, rows):
        raise ValueError("rows with images are not packed by shared prefix (their images would have to be shared "
                         "too); set actor.shared_prefix=off for a vision-language model")
    seqs, paths, size = laid if laid is not None else _laid_out(batch, rows)  # `laid`: already computed
    p = batch.prompt_width
    ids = torch.zeros(size, dtype=torch.long)
    pos = torch.zeros(size, dtype=torch.long)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for i, (row, seq, path) in enumerate(zip(rows.tolist(), seqs, paths)):
        plen = int(batch.prompt_lengths[row])
        ids[path] = seq
        pos[path] = batch.position_ids[row, p - plen:p - plen + len(seq)]
        mine = torch.ones(len(seq), len(seq), dtype=torch.bool).tril_()
        mask[path[:, None], path[None, :]] |= mine  # a row's tokens see the row up to themselves; shared rows agree
    rlen = batch.response_lengths[rows]
    k = max(1, int(rlen.max()) if len(rows) else 0)
    target_at = torch.zeros(len(rows), k, dtype=torch.long)
    for i, (row, path) in enumerate(zip(rows.tolist(), paths)):
        plen, n = int(batch.prompt_lengths[row]), int(rlen[i])
        target_at[i, :n] = path[plen - 1:plen - 1 + n]  # the logit at token t-1 scores token t
    return MicroBatch(rows=rows, input_ids=ids[None], attention_mask=mask[None, None], position_ids=pos[None],
                      first=0, targets=batch.responses[rows, :k], target_mask=torch.arange(k)[None, :] < rlen[:, None],
                      target_at=target_at, prefix_tree=tree or PrefixTree.from_paths(paths))


def model_mask(model: Any, mask: torch.Tensor, dtype: torch.dtype) -> Any:
    """The packed bool mask in the form `model`'s attention takes: bool for sdpa, additive in
    `dtype` (the dtype attention computes in) for eager, a block mask for flex attention (whose
    kernel then skips every block of keys that no query of a block of queries sees: a sibling's)."""
    impl = base_of(getattr(getattr(model, "config", None), "_attn_implementation", None)) or "sdpa"
    if impl == "sdpa":
        return mask
    if impl == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    if impl == "flex_attention":
        return flex_block_mask(mask)
    raise ValueError(f"attention {impl!r} does not take a packed mask; actor.shared_prefix needs one of "
                     f"{MASK_ATTENTION} (actor.attn_implementation), or set actor.shared_prefix=off")


def flex_block_mask(mask: torch.Tensor) -> Any:
    """The packed [1, 1, n, n] bool mask as flex attention's `BlockMask` (the same mask, by lookup)."""
    from torch.nn.attention.flex_attention import create_block_mask

    dense = mask[0, 0]
    n = dense.shape[0]

    def sees(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return dense[q, kv]

    return create_block_mask(sees, None, None, n, n, device=str(dense.device))


def computed_tokens(batch: Batch, rows: torch.Tensor) -> int:
    """Tokens a packed forward over `rows` computes (each shared prefix once)."""
    return layout(_sequences(batch, rows))[1]


# auto packs a micro-batch when the FLOP count says it saves at least this share, by device type. On a GPU
# the padded rows run sdpa's fused causal kernels and the packed ones its slower masked kernels: on an
# H200 (1B llama, bf16, FSDP2 update; benchmarks/RESULTS.md, GPU smoke suite 2026-11-27) a 0.38 saving by
# this count ran 0.91x and a 0.77 saving 1.17x, break-even near 0.51; 0.55 keeps clear of it.
MIN_SAVING = {"cpu": 0.1, "cuda": 0.55}


def min_saving(device: torch.device | str | None) -> float:
    """The share of FLOPs `auto` must save on `device` (MIN_SAVING; the CPU's for unknown types)."""
    kind = torch.device(device).type if device is not None else "cpu"
    return MIN_SAVING.get(kind, MIN_SAVING["cpu"])


def has_images(batch: Batch, rows: torch.Tensor) -> bool:
    return bool(batch.pixel_values) and any(batch.pixel_values[i] is not None for i in rows.tolist())


def by_group(batch: Batch, rows: torch.Tensor) -> torch.Tensor:
    """`rows` with each GRPO group's rows together (groups in order of first appearance), so the
    micro-batches cut from them hold whole groups. Regrouping rows within a mini-batch changes
    nothing but the summation order (the loss is normalised by the mini-batch's denominator)."""
    first: dict[int, int] = {}
    for k, g in enumerate(batch.group_index[rows].tolist()):
        first.setdefault(int(g), k)
    key = torch.tensor([first[int(g)] for g in batch.group_index[rows].tolist()], dtype=torch.long)
    return rows[torch.argsort(key, stable=True)]


def budget_rows(batch: Batch, rows: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """`rows` (in order) cut into micro-batches that each compute at most `budget` tokens packed
    (a row over the budget alone goes alone)."""
    seqs = _sequences(batch, rows)
    out: list[list[int]] = []
    current: list[int] = []
    size = 0
    for k, s in enumerate(seqs):
        fresh = len(s) - max((_common(s, seqs[j]) for j in current), default=0)
        if current and size + fresh > budget:
            out.append(current)
            current, size, fresh = [], 0, len(s)
        current.append(k)
        size += fresh
    if current:
        out.append(current)
    return [rows[torch.tensor(idx)] for idx in out]


def pair_cost(model: str) -> float:
    """An attention pair's forward FLOPs (4 x hidden x layers: scores and values) over a token's
    through the decoder layers (2 x their weights), from the model's config; 0 when the config
    cannot be read. The LM head is left out: it runs on the targets only, as many packed or not."""
    from engines.models import resolve_model

    try:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(str(resolve_model(model))).get_text_config()
        h, layers, ff = c.hidden_size, c.num_hidden_layers, c.intermediate_size
    except (OSError, ValueError, AttributeError):
        return 0.0
    return 4 * h * layers / (2 * layers * (4 * h * h + 3 * h * ff))


def _laid_out(batch: Batch, rows: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    seqs = _sequences(batch, rows)
    return (seqs, *layout(seqs))


def packing_pays(batch: Batch, rows: torch.Tensor, pair: float, n: int | None = None, least: float = MIN_SAVING["cpu"],
                 pairs: int | None = None) -> bool:
    """Whether packing `rows` saves at least `least` (`min_saving`) of the FLOPs: tokens plus attention pairs
    weighted by `pair` (`pair_cost`), padded (rows x width, each row's square) against packed (the
    tokens computed, and the attention pairs: `pairs` where attention goes by runs (`PrefixTree.pairs`),
    else every pair of them, as a dense mask computes them all)."""
    width = int(batch.prompt_lengths[rows].max() + batch.response_lengths[rows].max())
    padded = len(rows) * (width + pair * width * width)
    n = computed_tokens(batch, rows) if n is None else n  # `n`: the packed size, when already known
    return n + pair * (n * n if pairs is None else pairs) <= (1 - least) * padded


def micro_batch(batch: Batch, rows: torch.Tensor, mode: str, pair: float, device: torch.device | None = None,
                runs: bool = False) -> MicroBatch:
    """`rows` as one micro-batch by `actor.shared_prefix` `mode`: packed (on; auto where
    `packing_pays` with `pair` the saving `min_saving(device)` asks) or padded (off, or rows with images)."""
    if mode == "off" or has_images(batch, rows):
        return batch.micro_batch(rows)
    laid = _laid_out(batch, rows)  # once, for the decision and the packing
    tree = PrefixTree.from_paths(laid[1])
    # auto: `runs`, the model attends by runs (actor.packed_attention), fewer pairs than the mask
    if mode == "auto" and not packing_pays(batch, rows, pair, laid[2], min_saving(device), tree.pairs() if runs else None):
        return batch.micro_batch(rows)
    return shared_micro_batch(batch, rows, laid, tree)
