"""One TRL GRPOTrainer run on the arithmetic task, for `benchmarks/vs_trl.py` (which starts it with
the python of a venv that has TRL over this environment's torch and transformers).

The workload is the switchyard side's: the same rows file (arithmetic problems written by
vs_trl.py), one reply per prompt (single turn), the project's own answer check as the reward, GRPO
with group-std scaling, clip 0.2 / 0.28, no KL, a constant learning rate, all parameters trained,
generation with transformers (TRL's path on a CPU). Each step's wall time and the part spent in
TRL's generate-and-score phase are recorded by wrapping that phase; everything else in the step is
the update.

    python benchmarks/trl_grpo.py ROWS.jsonl OUT.json --model smollm2-135m-instruct --steps 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", help="a jsonl of rows (prompt, reward_model.ground_truth, data_source)")
    ap.add_argument("out")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="samples per forward/backward (per_device_train_batch_size), the rest by gradient accumulation; "
                         "default: the whole batch at once")
    ap.add_argument("--bf16", action="store_true", help="TRL's mixed precision (bf16 autocast over fp32 weights)")
    ap.add_argument("--retain-freed-memory", action="store_true",
                    help="the host allocator setting switchyard's CPU actor applies (parallel/host.py); off: glibc's defaults")
    args = ap.parse_args()
    if args.retain_freed_memory:
        from parallel.host import retain_freed_memory

        retain_freed_memory()

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agent.rewards import compute_score
    from engines.models import resolve_model

    rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines() if line.strip()]
    ds = Dataset.from_list([{"prompt": r["prompt"], "answer": r["reward_model"]["ground_truth"],
                             "data_source": r.get("data_source")} for r in rows])

    def reward(completions, answer, data_source, **_):
        return [compute_score(d, c[-1]["content"] if isinstance(c, list) else c, a)
                for c, a, d in zip(completions, answer, data_source)]

    steps: list[dict] = []
    gen_s = [0.0]

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            gen_s[0] = 0.0
            steps.append({"begin": time.time()})

        def on_step_end(self, *_, **__):
            steps[-1].update(end=time.time(), generation_s=gen_s[0])

    batch = args.prompts * args.n
    micro = args.micro_batch or batch
    if batch % micro:
        raise SystemExit(f"--micro-batch {micro} must divide the batch of {batch} samples")
    cfg = GRPOConfig(output_dir=str(Path(args.out).with_suffix("")) + "-trl", per_device_train_batch_size=micro,
                     num_generations=args.n, max_completion_length=args.max_tokens, learning_rate=args.lr,
                     lr_scheduler_type="constant", warmup_steps=0, beta=0.0, epsilon=0.2, epsilon_high=0.28,
                     loss_type="dapo", scale_rewards="group", temperature=1.0, num_iterations=1,
                     gradient_accumulation_steps=batch // micro, max_steps=args.steps, logging_steps=1, save_strategy="no",
                     report_to=[], use_cpu=True, seed=0, disable_tqdm=True, bf16=args.bf16)
    trainer = GRPOTrainer(model=str(resolve_model(args.model)), reward_funcs=reward, args=cfg, train_dataset=ds,
                          callbacks=[Clock()])
    phase = trainer._generate_and_score_completions

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return phase(*a, **k)
        finally:
            gen_s[0] += time.perf_counter() - t0

    trainer._generate_and_score_completions = timed
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for s, h in zip(steps, logs):
        s.update(reward=h["reward"], completion_length=h.get("completions/mean_length"))
    Path(args.out).write_text(json.dumps({"start": t_start, "steps": steps}))


if __name__ == "__main__":
    main()
