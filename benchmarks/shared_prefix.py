"""The actor's update and old-logprob pass with `actor.shared_prefix` off, on and auto, side by side
(`on`: attending over the dense packed mask, `actor.packed_attention=mask`; `on_runs` and `auto`: by runs, the default).

    python benchmarks/shared_prefix.py                    # SmolLM2-135M-Instruct, bf16 autocast, 3 rounds
    python benchmarks/shared_prefix.py --quick            # tiny-llama, 1 round
    python benchmarks/shared_prefix.py --dtype float32 --attn sdpa --group 4
    python benchmarks/shared_prefix.py --group 4 --prompt-tokens 100,120 --reply-tokens 80,96 --micro-batch-tokens 2600

One process, one model, one GRPO-shaped batch: 32 trajectories (`--trajectories`) in groups of `--group` that share
their prompt (prompts 60-180 tokens, responses 10-120, as the CPU demo's: `--prompt-tokens`, `--reply-tokens`),
micro-batches of 8 rows (`--micro-batch`) or of a token budget (`--micro-batch-tokens`).
The settings alternate in rounds (off, on, auto, on_runs, off, ...), each after a warm-up; reported per setting:
the median seconds of an update (forward and backward of every micro-batch, one optimizer step) and
of a logprob pass, the tokens the forward computes, and the speed-up over off per round (median).
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

MODES = ("off", "on", "auto", "on_runs")  # on_runs: on, attending by runs (engines/training/tree_attention.py)


def grpo_batch(vocab: int, n: int = 32, group: int = 8, seed: int = 0, prompt_tokens: tuple[int, int] = (60, 180),
               reply_tokens: tuple[int, int] = (10, 120)) -> Any:
    """`n` trajectories in groups of `group` sharing their prompt, lengths drawn from the given ranges
    (by default the CPU demo's)."""
    import torch

    from agent.loop import AgentLoopOutput
    from engines.training.batch import pad_outputs

    g = torch.Generator().manual_seed(seed)
    outs, prompt = [], []
    for i in range(n):
        if i % group == 0:
            size = int(torch.randint(prompt_tokens[0], prompt_tokens[1] + 1, (1,), generator=g))
            prompt = torch.randint(3, vocab, (size,), generator=g).tolist()
        r = int(torch.randint(reply_tokens[0], reply_tokens[1] + 1, (1,), generator=g))
        outs.append(AgentLoopOutput(prompt_ids=prompt, response_ids=torch.randint(3, vocab, (r,), generator=g).tolist(),
                                    response_mask=[1] * r, response_logprobs=[-1.0] * r, reward=float(i % 2),
                                    num_turns=1, termination="stop"))
    return pad_outputs(outs, 0, [i // group for i in range(n)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: smollm2-135m-instruct (tiny-llama with --quick)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--group", type=int, default=8, help="samples per GRPO group (sharing one prompt)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trajectories", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch (32: the whole batch, several "
                                                               "groups in one packed sequence)")
    ap.add_argument("--micro-batch-tokens", type=int, default=0, help="actor.max_tokens_per_micro_batch for every "
                    "setting (0: --micro-batch rows); it counts the tokens computed, so packed micro-batches hold more rows")
    ap.add_argument("--prompt-tokens", default="60,180", help="prompt lengths drawn from LOW,HIGH (the demo's)")
    ap.add_argument("--reply-tokens", default="10,120", help="reply lengths drawn from LOW,HIGH (vs_trl.py's: 80,96 "
                    "after prompts of 100,120)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from engines.models import resolve_model
    from engines.training.config import ActorConfig
    from engines.training.losses import LossConfig
    from engines.training.torch_actor import TorchActor

    model = str(resolve_model(args.model or ("tiny-llama" if args.quick else "smollm2-135m-instruct")))
    rounds = 1 if args.quick else args.rounds
    attention = {"on": "mask", "on_runs": "runs"}  # off and auto: the default (auto: by runs where it packs)
    actors = {m: TorchActor(ActorConfig(shared_prefix=m.removesuffix("_runs"), micro_batch_size=args.micro_batch,
                                        max_tokens_per_micro_batch=args.micro_batch_tokens,
                                        attn_implementation=args.attn, trainable=[],
                                        packed_attention=attention.get(m, "auto")),
                            model, args.dtype, progress=False)
              for m in MODES}
    vocab = actors["off"].module.config.vocab_size
    lengths = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    batch = grpo_batch(vocab, n=args.trajectories, group=args.group, prompt_tokens=lengths(args.prompt_tokens),
                       reply_tokens=lengths(args.reply_tokens))
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1))[:, None] * batch.response_mask
    rows = torch.arange(len(batch))
    micro = {m: actors[m]._micro_batches(batch, rows) for m in ("off", "on", "on_runs")}  # as each update forms them
    tokens = {"off": sum(mb.input_ids.numel() for mb in micro["off"]), "on": sum(mb.input_ids.numel() for mb in micro["on"])}
    pairs = {"off": sum(mb.input_ids.shape[0] * mb.input_ids.shape[1] ** 2 for mb in micro["off"]),
             "on": sum(mb.input_ids.shape[1] ** 2 for mb in micro["on"]),
             "on_runs": sum(mb.prefix_tree.pairs() for mb in micro["on_runs"])}
    times: dict[str, dict[str, list[float]]] = {m: {"update": [], "logprobs": []} for m in MODES}
    for r in range(rounds + 1):  # round 0 warms each up
        for m in MODES:
            actor = actors[m]
            t0 = time.perf_counter()
            old, _ = actor.compute_logprobs(batch)
            t1 = time.perf_counter()
            actor.update(batch, adv, old, None, LossConfig())
            t2 = time.perf_counter()
            if r:
                times[m]["logprobs"].append(t1 - t0)
                times[m]["update"].append(t2 - t1)
    report: dict[str, Any] = {"machine": machine(), "model": Path(model).name, "dtype": args.dtype, "attn": args.attn,
                              "group": args.group, "micro_batch": args.micro_batch, "trajectories": len(batch), "rounds": rounds,
                              "micro_batch_tokens": args.micro_batch_tokens, "prompt_tokens": args.prompt_tokens,
                              "reply_tokens": args.reply_tokens,
                              "tokens_padded": tokens["off"], "tokens_packed": tokens["on"],
                              "attention_pairs": pairs}
    line: dict[str, float] = {}
    for m in MODES:
        for what in ("update", "logprobs"):
            report[f"{m}_{what}_s"] = statistics.median(times[m][what])
            if m != "off":
                ratio = statistics.median(a / b for a, b in zip(times["off"][what], times[m][what]))
                report[f"{m}_{what}_speedup"] = line[f"{m}_{what}_x"] = ratio
    report["runs_vs_mask_update"] = line["runs_vs_mask_x"] = statistics.median(
        a / b for a, b in zip(times["on"]["update"], times["on_runs"]["update"]))
    for k in ("off_update_s", "on_update_s", "auto_update_s", "on_runs_update_s"):
        line[k] = report[k]
    print(f"tokens computed per pass: {tokens['off']} padded, {tokens['on']} packed; attention pairs: "
          f"{pairs['off']} padded, {pairs['on']} packed (dense mask), {pairs['on_runs']} by runs", flush=True)
    print(f"wrote {write_result('shared_prefix', report, args.out)}", flush=True)
    print(result_line(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
