"""The actor's update with row-count micro-batches against token-budget ones, side by side on one batch.

    python benchmarks/micro_batches.py --quick   # tiny-llama
    python benchmarks/micro_batches.py           # SmolLM2-135M-Instruct, the CPU demo's batch shape

The batch is shaped like the CPU demo's: 32 trajectories of varied length (prompts 60-180 tokens,
responses 10-120). `fixed` uses `actor.micro_batch_size=8` (the demo's); `budget` uses
`actor.max_tokens_per_micro_batch` set to what 8 rows of median length take, so it does the same
number of micro-batches on average but pads far less. The two alternate (A, B, A, B, ...) from one
initial state; reported: update seconds, real tokens per second, padded tokens per update, and the
per-pair ratio's median.

It also puts the update against this box's limit: the model's arithmetic per update (forward +
backward = 3 x the forward's 2 FLOPs per parameter per token, plus attention's score and value
products over each row's real length), divided by the update's seconds, against the matmul peak
measured here (square fp32 matmuls, the same threads) — the update's fraction of the limit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, result_line, write_result  # noqa: E402


def demo_batch(vocab: int, n: int = 32, seed: int = 0) -> Any:
    import torch

    from agent.loop import AgentLoopOutput
    from engines.training.batch import pad_outputs

    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(n):
        p = int(torch.randint(60, 181, (1,), generator=g))
        r = int(torch.randint(10, 121, (1,), generator=g))
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        outs.append(AgentLoopOutput(prompt_ids=ids[:p], response_ids=ids[p:], response_mask=[1] * r,
                                    response_logprobs=[-1.0] * r, reward=float(i % 2), num_turns=1,
                                    termination="stop"))
    return pad_outputs(outs, 0, [i // 4 for i in range(n)])


def matmul_peak(n: int = 2048, repeats: int = 5, dtype: str = "float32") -> float:
    """FLOP/s of an n x n matmul in `dtype` on this box with torch's threads: the best of `repeats`."""
    import torch

    a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def update_flops(module: Any, batch: Any) -> float:
    """Model arithmetic of one update over the batch's real tokens: 6 x parameters x tokens (forward
    2, backward 4; embeddings counted as the tied or separate LM head's matmul) plus attention's
    QK^T and AV products, 12 x layers x hidden x length^2 / 2 per row (causal) forward + backward."""
    cfg = module.config
    params = sum(p.numel() for p in module.parameters())
    if not getattr(cfg, "tie_word_embeddings", False):
        params -= cfg.vocab_size * cfg.hidden_size  # the input embedding is a lookup, not a matmul
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    dense = 6.0 * params * sum(lengths)
    attention = sum(12.0 * cfg.num_hidden_layers * cfg.hidden_size * n * n / 2 for n in lengths)
    return dense + attention


def padded_tokens(batch: Any, parts: list[Any]) -> int:
    return sum(len(rows) * (int(batch.prompt_lengths[rows].max()) + int(batch.response_lengths[rows].max()))
               for rows in parts)


def main() -> None:
    import torch

    from engines.models import resolve_model
    from engines.training.actor import token_budget_rows
    from engines.training.config import ActorConfig
    from engines.training.losses import LossConfig
    from engines.training.torch_actor import TorchActor

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny-llama, 2 pairs")
    ap.add_argument("--pairs", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name = "tiny-llama" if args.quick else "smollm2-135m-instruct"
    pairs = args.pairs or (2 if args.quick else 4)
    model = str(resolve_model(name))
    torch.manual_seed(0)
    actors = {"fixed": TorchActor(ActorConfig(lr=1e-6, micro_batch_size=8), model, progress=False)}
    batch = demo_batch(int(actors["fixed"].module.config.vocab_size))
    lengths = (batch.prompt_lengths + batch.response_lengths).float()
    budget = int(8 * lengths.median())
    actors["budget"] = TorchActor(ActorConfig(lr=1e-6, max_tokens_per_micro_batch=budget), model, progress=False)
    actors["budget"].module.load_state_dict(actors["fixed"].module.state_dict())
    rows = torch.arange(len(batch))
    parts = {"fixed": list(rows.split(8)), "budget": token_budget_rows(rows, batch.prompt_lengths,
                                                                       batch.response_lengths, budget)}
    real = int(batch.loss_mask.sum() + batch.prompt_lengths.sum())
    adv = torch.randn(len(batch))[:, None] * batch.response_mask
    times: dict[str, list[float]] = {k: [] for k in actors}
    for _ in range(pairs):
        for kind, actor in actors.items():
            t0 = time.perf_counter()
            actor.update(batch, adv, None, None, LossConfig())
            times[kind].append(time.perf_counter() - t0)
            print(f"{kind}: {times[kind][-1]:.2f} s", flush=True)
    ratios = [f / b for f, b in zip(times["fixed"], times["budget"])]
    report: dict[str, Any] = {"machine": machine(), "model": name, "trajectories": len(batch), "budget_tokens": budget,
                              "real_tokens": real, "pairs": pairs, "runs": {}}
    for kind in actors:
        med = statistics.median(times[kind])
        report["runs"][kind] = {"update_s": times[kind], "update_s_median": med, "micro_batches": len(parts[kind]),
                                "padded_tokens": padded_tokens(batch, parts[kind]), "tokens_per_s": real / med}
    report["budget_speedup_median"] = statistics.median(ratios)
    peak = matmul_peak()
    flops = update_flops(actors["fixed"].module, batch)
    report["limit"] = {"matmul_peak_gflops": peak / 1e9, "update_gflop": flops / 1e9, "threads": torch.get_num_threads(),
                       **{f"{k}_fraction_of_peak": flops / statistics.median(times[k]) / peak for k in actors}}
    write_result("micro_batches", report, args.out)
    print(result_line({"budget_vs_fixed_update_speed": report["budget_speedup_median"],
                       "fixed_fraction_of_peak": report["limit"]["fixed_fraction_of_peak"],
                       "padded_fixed": report["runs"]["fixed"]["padded_tokens"],
                       "padded_budget": report["runs"]["budget"]["padded_tokens"]}))


if __name__ == "__main__":
    main()
