"""Sampling one token per row from logits, the way the hf engine does it: the logprob of the
chosen token under log_softmax(logits / T), before top-k and top-p (what the actor recomputes)."""

from __future__ import annotations

import torch

from engines.inference.base import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
            generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row tokens and their logprobs under log_softmax(logits / T), before top-k/top-p."""
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.temperature > 0:
            tokens[i] = draw(logp[i], p.top_k, p.top_p, generators[i])
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def draw(logp: torch.Tensor, top_k: int, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Sample from one row: top-k first, then top-p over what is left (vLLM's order)."""
    if top_k < 0 and top_p >= 1.0:
        return torch.multinomial(logp.exp(), 1, generator=gen)[0]
    if top_k > 0:
        vals, idx = logp.topk(min(top_k, logp.numel()))
    else:
        vals, idx = logp.sort(descending=True)
    if top_p < 1.0:
        probs = vals.softmax(-1)
        keep = (probs.cumsum(-1) - probs) < top_p  # smallest set reaching top_p; the top token always stays
        vals, idx = vals[keep], idx[keep]
    return idx[torch.multinomial(vals.softmax(-1), 1, generator=gen)[0]]
