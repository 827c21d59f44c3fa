"""Padded training batches shaped like rollouts (varied prompt and response lengths, tool tokens
with mask 0), built from a seed so separate processes build the same one."""

from __future__ import annotations

import torch

from agent.loop import AgentLoopOutput
from engines.training.batch import Batch, pad_outputs


def make_batch(vocab: int, n: int = 8, group: int = 4, seed: int = 0, prompt: int = 12, response: int = 20,
               shared_prompts: bool = False) -> Batch:
    """`n` rows in groups of `group`, ragged; `shared_prompts`: a group's rows share their prompt (GRPO)."""
    g = torch.Generator().manual_seed(seed)
    outs = []
    prompts: dict[int, list[int]] = {}
    for i in range(n):
        p = prompt + int(torch.randint(-4, 5, (1,), generator=g))
        r = response + int(torch.randint(-8, 9, (1,), generator=g))
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        if shared_prompts:
            ids = prompts.setdefault(i // group, ids[:p]) + ids[p:]
            p = len(prompts[i // group])
        cut = r // 2  # model tokens, then a tool result (mask 0), then model tokens again
        mask = [1] * cut + [0] * 3 + [1] * (r - cut - 3)
        lps = [-float(torch.rand(1, generator=g)) * 3 if m else 0.0 for m in mask]
        outs.append(AgentLoopOutput(prompt_ids=ids[:p], response_ids=ids[p:], response_mask=mask,
                                    response_logprobs=lps, reward=float(i % 3 == 0), num_turns=2,
                                    termination="stop"))
    return pad_outputs(outs, 0, [i // group for i in range(n)])


def advantages_for(batch: Batch, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(batch), generator=g)[:, None] * batch.response_mask
