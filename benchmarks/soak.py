"""A long run watched for leaks: the demo's configuration on a tiny model for many steps, and a
gateway under steady agent traffic, with every process's memory and open files sampled.

    python benchmarks/soak.py                 # tiny-llama, 200 GRPO steps; 3,000 gateway requests
    python benchmarks/soak.py --quick --steps 8 --requests 96   # the CI form

The run: `launch/train.py` with the CPU demo's config (SFT, GRPO with the calculator tool, the
engine in its own process, shared-memory weight sync, validation off to keep steps alike) on
tiny-llama. Every `--every-s` seconds the trainer and every process under it (engine servers,
agent workers) is sampled: RSS and open file descriptors, summed. The gateway: one in-process
Gateway in front of an echo engine server, driven by `--clients` agents that each hold a
conversation of growing length through the chat, Responses (with previous_response_id) and
Messages routes, then start a new one; the process's RSS and open files are sampled the same way.

"Flat after warm-up": the growth over the second half of the samples (last minus the middle),
reported beside the first half's; a leak grows in both halves, a warm-up only in the first. Since
a step's memory rises and falls (the trainer hands its update's buffers back when the update ends),
the second half is also read by its floor and its peak: the lowest and highest sample of the last
5% of samples against those around the middle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, machine, result_line, write_result  # noqa: E402


def _sample(pids: list[int]) -> tuple[float, int, dict[str, float]]:
    """(RSS in MiB, open files) summed over `pids` and their children now, and the RSS by kind of
    process (`_kind`)."""
    import psutil

    rss, files, seen, kinds = 0, 0, set(), {}
    for pid in pids:
        try:
            top = psutil.Process(pid)
            procs = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                here = p.memory_info().rss
                files += p.num_fds()
                kind = "top" if p.pid == pid else _kind(p.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss += here
            kinds[kind] = kinds.get(kind, 0.0) + here / 2**20
    return rss / 2**20, files, kinds


def _kind(cmdline: list[str]) -> str:
    """Which part of a run a child process is: an engine server or another process (agent workers)."""
    return "engine" if "rollout.bus.server" in cmdline else "other"


def _growth(samples: list[tuple[float, float, int]]) -> dict[str, float]:
    """RSS and open-file growth over each half of the samples (time, MiB, files): single samples
    (last minus middle), and the second half's growth of the floor and of the peak (`_windows`)."""
    if len(samples) < 3:
        return {}
    first, mid, last = samples[0], samples[len(samples) // 2], samples[-1]
    floor, peak = _windows([s[1] for s in samples])
    return {"rss_mib_start": round(first[1], 1), "rss_mib_end": round(last[1], 1),
            "rss_growth_first_half_mib": round(mid[1] - first[1], 1),
            "rss_growth_second_half_mib": round(last[1] - mid[1], 1),
            "rss_floor_growth_second_half_mib": floor, "rss_peak_growth_second_half_mib": peak,
            "files_first_half": mid[2] - first[2], "files_second_half": last[2] - mid[2], "samples": len(samples)}


def _windows(values: list[float]) -> tuple[float, float]:
    """(floor growth, peak growth) over the second half: the lowest and the highest sample in the
    last 5% of the samples against the same in the 5% around the middle. A process whose memory
    rises and falls within a step (an update's buffers handed back when it ends) has samples taken
    in every phase; a leak lifts its floor, a new high-water mark its peak."""
    w = max(1, len(values) // 20)
    m = len(values) // 2
    mid, end = values[max(0, m - w // 2):m - w // 2 + w], values[-w:]
    return round(min(end) - min(mid), 1), round(max(end) - max(mid), 1)


def _growth_by_kind(kinds: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each kind of process's RSS growth over the second half of the samples (where the growth is):
    last minus middle, and of its floor and peak (`_windows`)."""
    if len(kinds) < 3:
        return {}
    mid, last = kinds[len(kinds) // 2], kinds[-1]
    out = {}
    for k in sorted({*mid, *last}):
        floor, peak = _windows([s.get(k, 0.0) for s in kinds])
        out[k] = {"last_minus_middle": round(last.get(k, 0.0) - mid.get(k, 0.0), 1), "floor": floor, "peak": peak}
    return out


QUICK = ["rollout.max_tokens=32", "rollout.n=2", "data.prompts_per_step=2", "sft.steps=2"]  # the CI form's steps


def soak_training(steps: int, every_s: float, work: Path, quick: bool = False) -> dict[str, Any]:
    out = work / "run"
    cmd = [sys.executable, "launch/train.py", "model.path=tiny-llama", "rollout.engine=hf", f"trainer.steps={steps}",
           "data.val_path=null", "trainer.save_every=50", "trainer.export_hf=false", f"trainer.output_dir={out}",
           "trainer.resume=fresh", *(QUICK if quick else [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = work / "train.log"
    samples: list[tuple[float, float, int]] = []
    kinds: list[dict[str, float]] = []
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        metrics = out / "metrics.jsonl"
        while proc.poll() is None:
            time.sleep(every_s)
            logged = metrics.read_text().count("\n") if metrics.exists() else 0
            if 0 < logged < steps:  # between the first step and the last: start-up and shut-down left out
                rss, files, by_kind = _sample([proc.pid])
                samples.append((time.monotonic() - t0, rss, files))
                kinds.append({"trainer" if k == "top" else k: v for k, v in by_kind.items()})
    if proc.returncode != 0:
        raise SystemExit(f"launch/train.py exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    return {"steps": steps, "wall_s": round(time.monotonic() - t0, 1), **_growth(samples),
            "rss_growth_second_half_mib_by_process": _growth_by_kind(kinds),
            "trace": [(round(t, 1), round(r, 1), n) for t, r, n in samples]}


def soak_gateway(requests: int, clients: int, every_s: float, work: Path) -> dict[str, Any]:
    import aiohttp

    from agent.gateway import Gateway
    from engines.models import load_tokenizer
    from rollout.bus.client import GenerateClient
    from rollout.bus.launcher import start_server_process

    tok = load_tokenizer("tiny-llama")
    server = start_server_process("echo", "tiny-llama", f"ipc://{work}/echo.sock", "echo", log_file=work / "echo.log")
    samples: list[tuple[float, float, int]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sampler() -> None:
        while not stop.wait(every_s):
            rss, files, _ = _sample([os.getpid()])
            samples.append((time.monotonic() - t0, rss, files))

    async def agent(s: Any, base: str, i: int, n: int) -> int:
        """Conversations of 8 turns, each on one route (chat, Responses, Messages in turn), each in a
        session of its own (X-Session-Id): the gateway keeps at most max_sessions of them."""
        done, turn, history, previous, route, conv = 0, 0, [], None, "chat", 0
        while done < n:
            if turn == 0:
                route, conv = ("chat", "responses", "messages")[(i + conv) % 3], conv + 1
            headers = {"X-Session-Id": f"agent{i}-conversation{conv}"}
            if route == "chat":
                history.append({"role": "user", "content": f"question {done} of agent {i}"})
                async with s.post(base + "/chat/completions", headers=headers,
                                  json={"model": "switchyard", "messages": history, "max_tokens": 8}) as r:
                    reply = (await r.json())["choices"][0]["message"]
                history.append({"role": "assistant", "content": reply["content"] or "."})
            elif route == "responses":
                body = {"model": "switchyard", "input": f"question {done}", "max_output_tokens": 8}
                if previous:
                    body["previous_response_id"] = previous
                async with s.post(base + "/responses", headers=headers, json=body) as r:
                    previous = (await r.json())["id"]
            else:
                history.append({"role": "user", "content": f"question {done}"})
                async with s.post(base + "/messages", headers=headers,
                                  json={"model": "switchyard", "messages": history, "max_tokens": 8}) as r:
                    blocks = (await r.json())["content"]
                history.append({"role": "assistant", "content": (blocks[0].get("text") if blocks else None) or "."})
            done, turn = done + 1, turn + 1
            if turn == 8:  # a new conversation
                turn, history, previous = 0, [], None
        return done

    async def main() -> int:
        async with GenerateClient([f"ipc://{work}/echo.sock"]) as client:
            await client.wait_ready(timeout_s=120)
            gw = Gateway(client, tok)
            await gw.start()
            try:
                async with aiohttp.ClientSession() as s:
                    counts = await asyncio.gather(*(agent(s, gw.base_url, i, requests // clients)
                                                    for i in range(clients)))
                return sum(counts)
            finally:
                await gw.stop()

    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    try:
        done = asyncio.run(main())
    finally:
        stop.set()
        server.terminate()
        server.wait(30)
    return {"requests": done, "clients": clients, "wall_s": round(time.monotonic() - t0, 1), **_growth(samples),
            "trace": [(round(t, 1), round(r, 1), n) for t, r, n in samples]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--every-s", type=float, default=2.0)
    ap.add_argument("--quick", action="store_true", help="short rollouts and SFT (the CI form)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = Path(tmp)
        (work / "train").mkdir()
        (work / "gw").mkdir()
        training = soak_training(args.steps, args.every_s, work / "train", args.quick)
        gateway = soak_gateway(args.requests, args.clients, min(args.every_s, 0.05), work / "gw")
    report = {"machine": machine(), "training": training, "gateway": gateway}
    path = write_result("soak", report, args.out)
    print(f"training: {args.steps} steps, RSS {training.get('rss_mib_start')} -> {training.get('rss_mib_end')} MiB "
          f"(first half +{training.get('rss_growth_first_half_mib')}, second half "
          f"+{training.get('rss_growth_second_half_mib')}, its floor +{training.get('rss_floor_growth_second_half_mib')}, "
          f"its peak +{training.get('rss_peak_growth_second_half_mib')}; by process "
          f"{training.get('rss_growth_second_half_mib_by_process')}), open files +{training.get('files_second_half')} in the "
          f"second half; gateway: {gateway['requests']} requests, RSS {gateway.get('rss_mib_start')} -> "
          f"{gateway.get('rss_mib_end')} MiB (second half +{gateway.get('rss_growth_second_half_mib')}); {path}")
    print(result_line({"train_rss_growth_second_half_mib": training.get("rss_growth_second_half_mib", float("nan")),
                       "train_rss_floor_growth_second_half_mib": training.get("rss_floor_growth_second_half_mib",
                                                                              float("nan")),
                       "gateway_rss_growth_second_half_mib": gateway.get("rss_growth_second_half_mib", float("nan"))}))


if __name__ == "__main__":
    main()
