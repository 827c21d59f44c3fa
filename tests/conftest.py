"""Shared fixtures: real EngineServer processes on ipc sockets, killed at the end of the test."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread per process (inherited by every subprocess a test starts; engines still get the
# threads their launch names): two xdist workers, each with a trainer, engines and workers of its own,
# already keep both cores busy, and torch's default of a thread per core there makes OpenMP threads
# spin at barriers while another process holds the core. Measured on the 2-core box, -n 2 on
# test_torch_actor plus a Megatron and a fidelity test: 80.7 s -> 67.2 s; the SFT-step test 40.5 -> 21.5 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
WARM = Path(__file__).resolve().parent / "warm"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Warm starts (tests/warm/zygote.py): one interpreter per test process imports torch and
    transformers once and forks the repository's heavy programs the tests start. Off with
    SWITCHYARD_WARM_START=0; not in xdist's controller, which runs no test. SWITCHYARD_WARM_LOGS=DIR
    keeps a log of which programs started warm and why others did not."""
    config = session.config
    if os.environ.get("SWITCHYARD_WARM_START", "1") == "0" or os.environ.get("SWITCHYARD_WARM"):
        return
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import sys
    import tempfile

    if os.environ.get("HF_HUB_OFFLINE") == "1":  # its older twin, which gpu_smoke.sh sets: the same at import
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")  # time, so its programs start warm too
    folder = tempfile.mkdtemp(prefix="warm-")  # short: a unix socket's path is limited to ~107 bytes
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(WARM), os.environ.get("PYTHONPATH")) if p)
    log = open(os.path.join(folder, "zygote.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-u", str(WARM / "zygote.py"), os.path.join(folder, "z.sock")],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd="/")
    os.environ["SWITCHYARD_WARM"] = os.path.join(folder, "z.sock")  # used once it exists; cold until then
    os.environ["SWITCHYARD_WARM_PYTHON"] = sys.executable
    config._warm = (proc, folder)  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session) -> None:
    warm = getattr(session.config, "_warm", None)
    if warm:
        import shutil

        proc, folder = warm
        proc.kill()  # its children left over go with it (PR_SET_PDEATHSIG)
        proc.wait()
        keep = os.environ.get("SWITCHYARD_WARM_LOGS")  # a folder: the log of each start, warm or cold and why
        if keep:
            os.makedirs(keep, exist_ok=True)
            shutil.copy(os.path.join(folder, "zygote.log"), os.path.join(keep, f"{os.path.basename(folder)}.log"))
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _cold_start(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """`@pytest.mark.cold`: the test looks at process trees, so its processes start the ordinary way."""
    if request.node.get_closest_marker("cold"):
        monkeypatch.delenv("SWITCHYARD_WARM", raising=False)


@pytest.fixture(scope="session")
def tool_caller() -> Path:
    """A tiny llama taught to call the calculator (tests/tool_model.py), trained once per machine
    into the switchyard cache, as the built-in models are: keyed by what it is made of (its recipe's
    source, the GSM8K rows it learns from, tiny-llama's weights, torch and transformers), so a change
    to any of them trains a new one. Workers and runs at once: the first trains under a file lock,
    the others wait and load it."""
    import hashlib

    import torch
    import transformers

    from engines.models import build_once, cache_root, resolve_model

    if not (GSM8K / "train.jsonl").exists():
        pytest.skip(f"GSM8K jsonl not found in {GSM8K}")
    from tool_model import TRACE_ROWS, train_tool_caller

    key = hashlib.sha256()
    key.update((Path(__file__).parent / "tool_model.py").read_bytes())
    key.update("\n".join((GSM8K / "train.jsonl").read_text().splitlines()[:TRACE_ROWS]).encode())
    for f in sorted(resolve_model("tiny-llama").glob("*.safetensors")):
        key.update(f.read_bytes())
    key.update(f"{torch.__version__} {transformers.__version__}".encode())
    model = cache_root() / "test-models" / f"tool-caller-{key.hexdigest()[:16]}"
    return build_once(model, lambda tmp: train_tool_caller(tmp, GSM8K / "train.jsonl"), "config.json")


# files whose tests look at every sandboxed process on the box: they run on one worker, one at a time
SANDBOX_FILES = {"test_sandbox", "test_tools"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `pytest -n N --dist loadgroup` (the README's test command) the tests of a file that use
    one of its module fixtures (engine servers, vLLM) are one group on one worker, so each fixture
    starts once; every other test goes to whichever worker is free (in collection order: handing the
    slow tests out first was measured slower, 34 against 29 minutes on a clean clone, as two heavy
    multi-process tests then share the 2 cores). `gpu` tests skip without CUDA."""
    import torch

    for item in items:
        stem = item.path.stem
        if stem in SANDBOX_FILES:
            item.add_marker(pytest.mark.xdist_group("sandbox"))
        elif _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(stem))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Stop a `--dist loadgroup` run whose groups did not take (the sandbox files are always one group):
    each module fixture would start on both workers (vLLM twice) and the sandbox files would run side by side."""
    config = node.config
    lost = [i for i in ids if i.split("::")[0].endswith(tuple(f"/{f}.py" for f in SANDBOX_FILES)) and "@" not in i]
    if config.getvalue("dist") == "loadgroup" and lost:
        import xdist

        pytest.exit(f"pytest-xdist {xdist.__version__} did not put the tests in their groups (e.g. {lost[0]}) under "
                    f"pytest {pytest.__version__}; install the versions the dev extra pins: "
                    f"pip install -c <(echo torch==2.13.0) -e '.[cpu,dev]'", returncode=4)


def _uses_module_fixture(item: pytest.Item) -> bool:
    """Whether the test asks for a fixture that lives longer than it and shorter than the session."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope in ("module", "class", "package")
                                    for defs in info.name2fixturedefs.values() for d in defs)


class Servers:
    """Handles to started servers: `addresses`, `procs`, `request_logs`, `log_files`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.addresses: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.request_logs: list[Path] = []
        self.log_files: list[Path] = []

    def start(self, n: int, backend: str = "hf", model: str = "tiny-llama", options: dict[str, Any] | None = None,
              env: dict[str, str] | None = None, gate_timeout_s: float | None = None) -> "Servers":
        from parallel.mesh import cpu_slices
        from rollout.bus.launcher import start_server_process

        cores = cpu_slices(n)  # servers on one box split its cores
        for k in range(n):
            i = len(self.procs)
            addr = f"ipc://{self.tmp}/e{i}.sock"
            req_log, out_log = self.tmp / f"e{i}.requests.jsonl", self.tmp / f"e{i}.log"
            self.procs.append(start_server_process(backend, model, addr, f"e{i}", options, req_log, env, out_log,
                                                   cpu_cores=cores[k], gate_timeout_s=gate_timeout_s))
            self.addresses.append(addr)
            self.request_logs.append(req_log)
            self.log_files.append(out_log)
        return self

    def logs(self) -> str:
        return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in self.log_files if p.exists())

    def stop(self) -> None:
        # SIGTERM first: the server then closes its engine, and vLLM's engine-core child goes with it
        # (a SIGKILLed server leaves that child orphaned, holding gigabytes)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def servers(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Servers]:
    # a short directory: ipc socket paths are limited to ~107 bytes
    handles: list[Servers] = []

    def start(n: int, **kw: Any) -> Servers:
        s = Servers(tmp_path_factory.mktemp("srv")).start(n, **kw)
        handles.append(s)
        return s

    yield start
    for h in handles:
        h.stop()
