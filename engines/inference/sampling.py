"""Sampling one token per row from logits, the way the hf engine does it: the logprob of the
chosen token under log_softmax(logits / T), before top-k and top-p (what the actor recomputes).

OpenAI's logits adjustments (`logit_bias`, `presence_penalty`, `frequency_penalty`; `adjust`)
and a `json_schema` constraint (`engines/inference/grammar.py`) change which token is drawn, and are
applied before temperature, top-k and top-p, as vLLM does.
The returned logprobs are then of the distribution the token was actually drawn from,
log_softmax(adjusted logits / T), on every engine (vLLM reports its logprobs after the adjustments
too): they are the behaviour probabilities of a steered rollout, which the trainer's off-policy
corrections (`algorithm.loss.off_policy`) weigh against the policy it recomputes. Without
adjustments that is the policy itself. `top_logprobs` alternatives are of that same distribution,
so the sampled token's logprob equals its entry when it is among them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engines.inference.base import SamplingParams


def check_vocab(params: SamplingParams, vocab: int) -> None:
    """A logit_bias id outside the model's vocabulary fails its own request, not a batched step."""
    bad = sorted(t for t in params.logit_bias if t >= vocab)
    if bad:
        raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})")


def adjust(logits: torch.Tensor, params: list[SamplingParams], generated: Sequence[Sequence[int]]) -> torch.Tensor:
    """Per row: logits + logit_bias - presence_penalty * (count > 0) - frequency_penalty * count,
    `count` being how often each token is in that row's `generated` ids (this request's output so
    far, never its prompt). `logits` is [B, V]; it is returned as is when no row adjusts anything,
    else a new tensor (one [B, V] bias and one scatter_add of the counts for the whole batch)."""
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    penalised = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and len(generated[i])]
    if not biased and not penalised:
        return logits
    out = logits.clone()
    if biased:
        rows = [i for i in biased for _ in params[i].logit_bias]
        cols = [t for i in biased for t in params[i].logit_bias]
        vals = [b for i in biased for b in params[i].logit_bias.values()]
        dev = logits.device
        out.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                       torch.tensor(vals, dtype=out.dtype, device=dev), accumulate=True)
    if penalised:
        width = max(len(generated[i]) for i in penalised)
        ids = torch.zeros(len(penalised), width, dtype=torch.long)
        ones = torch.zeros(len(penalised), width, dtype=out.dtype)
        for j, i in enumerate(penalised):
            ids[j, :len(generated[i])] = torch.as_tensor(list(generated[i]), dtype=torch.long)
            ones[j, :len(generated[i])] = 1
        counts = torch.zeros(len(penalised), out.shape[1], dtype=out.dtype).scatter_add_(1, ids, ones).to(out.device)
        freq = torch.tensor([params[i].frequency_penalty for i in penalised], dtype=out.dtype, device=out.device)
        pres = torch.tensor([params[i].presence_penalty for i in penalised], dtype=out.dtype, device=out.device)
        rows_t = torch.tensor(penalised, device=out.device)
        out[rows_t] -= freq[:, None] * counts + pres[:, None] * (counts > 0).to(out.dtype)
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           generated: Sequence[Sequence[int]] | None = None, matchers: list[Any] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], list[float]] | None]]:
    """Per-row tokens, their logprobs under the distribution they were drawn from (log_softmax of the
    adjusted and constrained logits / T, before top-k/top-p), and per row its `top_logprobs` most
    likely (ids, logprobs) under that same distribution, most likely first (None for a row that asks
    for none). `generated` is each row's output so far (for the penalties); `matchers` each row's
    grammar matcher or None (`engines.inference.grammar`: a `json_schema` request)."""
    from engines.inference.grammar import constrain

    temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    steered = adjust(logits, params, generated if generated is not None else [[] for _ in params])
    if matchers is not None:
        steered = constrain(steered, matchers)
    draw_logp = logp if steered is logits else torch.log_softmax(steered / temps[:, None], dim=-1)
    tokens = steered.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.temperature > 0:
            tokens[i] = draw(draw_logp[i], p.top_k, p.top_p, generators[i])
    tops: list[tuple[list[int], list[float]] | None] = [None] * len(params)
    k = max(p.top_logprobs for p in params)
    if k:  # one topk for the batch; each row keeps its own first k
        vals, idx = (x.tolist() for x in draw_logp.topk(min(k, draw_logp.shape[-1]), dim=-1))
        tops = [(idx[i][:p.top_logprobs], vals[i][:p.top_logprobs]) if p.top_logprobs else None
                for i, p in enumerate(params)]
    return tokens, draw_logp.gather(1, tokens[:, None]).squeeze(1), tops


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
