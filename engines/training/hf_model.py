"""A transformers causal LM as the training side uses it: loaded for training, and asked for the
logprobs (and entropy) of a micro-batch's targets. Shared by the torch actor, the torch reference
and the DeepSpeed reference, so all three score tokens the same way the engines do:
log_softmax(logits / temperature)[token].
"""

from __future__ import annotations

import torch

from engines.training.batch import Batch, MicroBatch
from engines.training.losses import entropy_from_logits, logprobs_from_logits


def default_device() -> torch.device:
    """This process's device: its local GPU under torchrun, else the CPU."""
    if torch.cuda.is_available():
        from parallel.mesh import local_gpu

        return torch.device("cuda", local_gpu())
    return torch.device("cpu")


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The HF model, with `padding_idx` taken off its embeddings: chat models often pad with
    their end-of-turn token, which is a real input in every multi-turn trajectory, and HF's
    padding_idx would silently freeze that row's input embedding. Padding positions get no
    gradient anyway (attention and loss masks keep them out)."""
    from engines.models import load_pretrained

    model = load_pretrained(path, dtype).to(device)
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            m.padding_idx = None
    return model


def target_outputs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """[b, k, out] the model's outputs (logits, or a critic's values) at the positions that score
    each of `mb.targets`. The model is asked only for those (`logits_to_keep`), most of the cost
    saved on CPU; a micro-batch packed by shared prefix has them gathered by `target_at`."""
    s, k = mb.input_ids.shape[1], mb.targets.shape[1]
    if mb.target_at is None:
        return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                     logits_to_keep=s - mb.first, use_cache=False, **mb.model_inputs(_dtype(model))).logits[:, :k]
    from engines.training.prefix import model_mask
    from engines.training.tree_attention import by_runs

    device = mb.input_ids.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else _dtype(model)
    # the head runs only at the positions that score a target (the packed sequence's later prompts have none)
    keep, at = torch.unique(mb.target_at.clamp(0, s - 1), return_inverse=True)
    # actor.packed_attention=runs: attended by runs (tree_attention.py); the dense mask too, for layers that need it
    tree = {"prefix_tree": mb.prefix_tree} if mb.prefix_tree is not None and by_runs(model) else {}
    out = model(input_ids=mb.input_ids, attention_mask=model_mask(model, mb.attention_mask, dtype),
                position_ids=mb.position_ids, logits_to_keep=keep, use_cache=False, **tree).logits[0]
    return out.index_select(0, at.flatten()).view(*at.shape, out.shape[-1])  # its backward adds, unlike indexing's


def micro_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float,
                   want_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, k] logprobs (and entropy) of `mb.targets`, 0 where `target_mask` is False."""
    logits = target_outputs(model, mb)
    if temperature != 1.0:
        logits = logits.float() / temperature
    lp = torch.where(mb.target_mask, logprobs_from_logits(logits, mb.targets.clamp(min=0)), 0)
    ent = torch.where(mb.target_mask, entropy_from_logits(logits), 0) if want_entropy else None
    return lp, ent


def _dtype(model: torch.nn.Module) -> torch.dtype:
    """The model's floating dtype (a wrapper such as a DeepSpeed engine may not say it itself)."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def response_logprobs(model: torch.nn.Module, batch: Batch, rows: torch.Tensor, temperature: float,
                      device: torch.device, shared_prefix: str = "off", pair: float = 0.0,
                      runs: bool = False) -> torch.Tensor:
    """[len(rows), R] logprobs of the rows' response tokens (0 past each response), on the CPU;
    `shared_prefix`, `pair`, `runs`: packed as `engines.training.prefix.micro_batch` decides."""
    from engines.training.prefix import micro_batch

    lp, _ = micro_logprobs(model, micro_batch(batch, rows, shared_prefix, pair, device, runs).to(device), temperature)
    return torch.nn.functional.pad(lp.float().cpu(), (0, batch.responses.shape[1] - lp.shape[1]))
