"""What the agent-loop benchmarks share: the machine description, a tool-calling model made with
the project's own SFT warm-up (cached), GSM8K rows, engine servers, and result files."""

from __future__ import annotations

import json
import os
import platform
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
GSM8K_BESIDE = ROOT.parent / "shared" / "data" / "gsm8k"  # where a checkout's GSM8K copy may lie


def machine() -> dict[str, Any]:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"device": gpu or f"CPU only: {cpu}, {cores} cores", "python": platform.python_version(),
            "torch": torch.__version__, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def child_env(*paths: Path | str, **extra: str) -> dict[str, str]:
    """The environment of a program a benchmark starts: this one's, with the repository (then `paths`)
    ahead of the PYTHONPATH it already had (kept, not replaced), the hub offline, output unbuffered,
    and `extra` on top."""
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, paths), *given]), **extra}


def gsm8k_file(path: str | None, split: str = "test") -> Path:
    p = Path(path) if path else GSM8K_BESIDE / f"{split}.jsonl"
    if not p.is_file():
        raise SystemExit(f"GSM8K {split} file {str(p)!r} not found; pass --gsm8k-dir with {split}.jsonl "
                         "(lines of {question, answer}, the format of the openai/gsm8k dataset)")
    return p


def gsm8k_tool_rows(path: Path, n: int) -> list[dict[str, Any]]:
    from launch.data.gsm8k import gsm8k_rows, read_gsm8k

    records = read_gsm8k(str(path))
    if len(records) < n:
        raise SystemExit(f"{path} has {len(records)} records, fewer than the {n} asked for")
    return gsm8k_rows(records[:n], "test")


SFT_STEPS_HELP = "SFT steps teaching --model the calculator (0: it calls it already; default by model)"


def sft_steps(given: int | None, base: str) -> int:
    """The SFT steps a tool benchmark teaches `base` the calculator with: `given` (0: none), else by model."""
    return given if given is not None else 200 if base == "tiny-llama" else 40


def tool_model(base: str, train_file: Path, steps: int, lr: float, trainable: list[str] | None = None) -> Path:
    """`base` after `steps` SFT steps on calculator traces of GSM8K train rows, built once and
    cached; the trained model calls the calculator in hermes format, imperfectly. `steps` = 0: `base`
    calls it already (a model made so elsewhere) and is used as it is."""
    from engines.models import build_once, cache_root, resolve_model

    if steps == 0:
        return resolve_model(base)
    out = cache_root() / "benchmarks" / f"{Path(base).name}-calculator-sft{steps}"
    # benchmarks started side by side build it once
    return build_once(out, lambda tmp: _build_tool_model(base, train_file, steps, lr, trainable, tmp), "config.json")


def _build_tool_model(base: str, train_file: Path, steps: int, lr: float, trainable: list[str] | None,
                      out: Path) -> None:
    import torch

    from engines.models import load_tokenizer, resolve_model
    from engines.training.config import ActorConfig
    from engines.training.torch_actor import TorchActor
    from launch.data.sft import build_sft_examples, sft_batches
    from agent.tools.registry import load_tools

    path = str(resolve_model(base))
    tok = load_tokenizer(path)
    tools = load_tools(ROOT / "launch/configs/tools_calculator.yaml")
    rows = gsm8k_tool_rows(train_file, 512)
    examples = build_sft_examples(rows, tok, {n: t.tool_schema for n, t in tools.items()}, max_calls=1,
                                  max_length=384)
    torch.manual_seed(0)
    actor = TorchActor(ActorConfig(lr=lr, micro_batch_size=8, trainable=list(trainable or [])), path, progress=False)
    done, epoch = 0, 0
    print(f"making a calculator-calling model: {steps} SFT steps of {base} on {len(examples)} traces", flush=True)
    while done < steps:
        for b in sft_batches(examples, 8, tok.eos_token_id, seed=epoch):
            loss = actor.sft_step(b["input_ids"], b["labels"], b["attention_mask"])["loss"]
            done += 1
            if done % 25 == 0 or done == steps:
                print(f"  sft step {done}/{steps} loss {loss:.3f}", flush=True)
            if done >= steps:
                break
        epoch += 1
    actor.save_hf(out)


def calculator_workload(gsm8k_dir: str | None, base: str, steps: int, n: int) -> tuple[str, Any, list[dict[str, Any]]]:
    """(model dir, tokenizer, n GSM8K test rows) for a tool-calling benchmark: `base` taught the
    calculator by `steps` SFT steps on GSM8K train traces (cached)."""
    from engines.models import load_tokenizer

    gdir = Path(gsm8k_dir) if gsm8k_dir else None
    train_file = gsm8k_file(str(gdir / "train.jsonl") if gdir else None, "train")
    test_file = gsm8k_file(str(gdir / "test.jsonl") if gdir else None, "test")
    lr, trainable = (3e-3, None) if base == "tiny-llama" else (1e-4, [r"model\.layers\.(2[0-9])\.", r"model\.norm\."])
    model = str(tool_model(base, train_file, steps, lr, trainable))
    return model, load_tokenizer(model), gsm8k_tool_rows(test_file, n)


@contextmanager
def servers(backend: str, model: str, n: int, tmp: Path, options: dict[str, Any] | None = None) -> Iterator[list[str]]:
    """n EngineServers on ipc sockets, each on its own slice of the cores; stopped on exit."""
    from parallel.mesh import cpu_slices
    from rollout.bus.launcher import start_server_process

    cores = cpu_slices(n)
    procs, addrs = [], []
    try:
        for i in range(n):
            addr = f"ipc://{tmp}/bench{i}.sock"
            procs.append(start_server_process(backend, model, addr, f"engine{i}", options, log_file=tmp / f"e{i}.log",
                                              cpu_cores=cores[i]))
            addrs.append(addr)
        yield addrs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except Exception:
                p.kill()


def write_result(name: str, report: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path


def result_line(values: dict[str, float]) -> str:
    return "RESULT " + " ".join(f"{k}={v:.3g}" for k, v in values.items())
