"""Warm starts for the suite's own subprocesses: an interpreter that has imported torch and
transformers once and forks a child for each `python launch/train.py ...` or `python -m
rollout.bus.server ...` a test (or a process a test started) runs.

Those two imports cost 5-6 CPU-seconds per process on the 2-core CI box, and the suite starts a few
hundred such processes: about a third of its CPU. `sitecustomize.py` beside this file makes every
interpreter started under the suite (this folder is on PYTHONPATH) ask this server to run its
program instead, when the program is one of the repository's own scripts or modules and its
environment matches the one the imports were made in; it then only stands in for the child:

- its stdin, stdout, stderr and every other open descriptor are passed to the child (SCM_RIGHTS),
  at the same numbers, with its cwd, environment, argv and sys.path;
- a signal it receives (TERM, INT, HUP, QUIT, USR1, USR2) is forwarded to the child; it exits with
  the child's status (killed by a signal: by the same signal), so `Popen.returncode` reads the same;
- killed itself (-9), it closes its end of the connection and the child kills itself at once;
- in the child, `os.getppid()` answers for the stand-in (its parent), so a process that watches its
  parent (`parallel/lifetime.py`) still notices the process that started it going away.

What it cannot reproduce: the real process is not in the stand-in's process group or session and is
not its OS child (psutil `children()`), and rlimits or affinity set on the stand-in do not reach it.
Tests that look at process trees carry `@pytest.mark.cold` (conftest) and start processes the
ordinary way. `SWITCHYARD_WARM_START=0` turns warm starts off for a whole run.

Protocol (AF_UNIX stream): the stand-in sends one JSON line with the descriptors attached; the server
answers `pid N` once forked and `exit STATUS` (os.waitpid's status) when the child ends.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback

MAX_FDS = 250
BEFORE: dict[str, str] = {}  # the environment the imports were made in (its import-time part)
ADDED: dict[str, str] = {}


def preload() -> None:
    """What the suite's processes import first and spend their start on; nothing of the repository
    (its files can change between tests) and nothing that starts a thread."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401
    for optional in ("zmq", "msgpack", "xxhash", "safetensors.torch", "yaml", "omegaconf", "peft",
                     "matplotlib.figure", "matplotlib.backends.backend_agg"):  # the run's reward plot
        try:
            __import__(optional)
        except ImportError:
            pass


def serve(path: str) -> None:
    global BEFORE, ADDED
    before = dict(os.environ)
    preload()
    ADDED = {k: v for k, v in os.environ.items() if k not in before}  # set by the imports themselves
    BEFORE = _relevant(before)
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        raise SystemExit(f"warm start: the preloaded imports started threads ({threading.enumerate()}); "
                         "forking would copy held locks")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # clients see the socket only once it accepts
    children: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (connection, pid)
    parent = os.getppid()
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *children], [], [], 1.0)
        for r in ready:
            if r is listener:
                conn, _ = listener.accept()
                try:
                    forked = _start(listener, conn)
                except Exception:  # a malformed request: the stand-in sees the connection close and runs cold
                    traceback.print_exc()
                    conn.close()
                    continue
                if forked:
                    children[os.pidfd_open(forked)] = (conn, forked)
            else:
                conn, pid = children.pop(r)
                os.close(r)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(f"exit {status}\n".encode())
                except OSError:
                    pass
                conn.close()


def _start(listener: socket.socket, conn: socket.socket) -> int:
    conn.settimeout(10)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, MAX_FDS)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("request cut short")
        data += more
    conn.settimeout(None)
    request = json.loads(data)
    theirs = _relevant(request["env"])
    differs = sorted(k for k in {*theirs, *BEFORE} if theirs.get(k) != BEFORE.get(k))
    if differs:  # read at import time by what is preloaded: this program must import it itself
        for fd in fds:
            os.close(fd)
        conn.sendall(f"cold {','.join(differs)}\n".encode())
        print(f"cold ({','.join(differs)}): {' '.join(request['argv'])[:200]}", flush=True)
        conn.close()
        return 0
    pid = os.fork()
    if pid == 0:
        listener.close()
        code = _child(conn, fds, request)
        os._exit(code)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    print(f"warm {pid}: {' '.join(request['argv'])[:200]}", flush=True)
    return pid


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
# environment read while importing what preload() imports; OMP/MKL thread counts are applied per child
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TORCH", "PYTORCH", "KMP_", "GOMP_", "OPENBLAS",
               "CUDA", "LD_", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONPATH", "HOME", "XDG_", "USE_", "ACCELERATE",
               "SAFETENSORS", "NUMPY", "ZMQ", "DS_", "PEFT")


# not read while importing what preload() imports: torchrun's worker settings, inductor's compile
# settings (read when it compiles), and LD_PRELOAD / LD_LIBRARY_PATH, which a fork cannot honour (no
# exec); in the suite the latter come from vLLM, which sets them in the test process that imports it,
# for its own engine processes (those start cold: they are vLLM's)
RUNTIME = ("TORCHELASTIC_", "TORCH_NCCL_", "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_", "LD_PRELOAD",
           "LD_LIBRARY_PATH")


def _relevant(env: dict) -> dict:
    out = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and not k.startswith(RUNTIME)
           and not (k in ADDED and ADDED[k] == v)}
    if "PYTHONPATH" in out:  # the repository's own folders hold nothing preload() imports
        kept = [p for p in out["PYTHONPATH"].split(os.pathsep)
                if p and not (os.path.realpath(p) + os.sep).startswith(REPO + os.sep)]
        out["PYTHONPATH"] = os.pathsep.join(kept)
        if not kept:
            del out["PYTHONPATH"]
    return out


def _child(conn: socket.socket, fds: list[int], request: dict) -> int:
    try:
        _become(conn, fds, request)
    except BaseException:
        traceback.print_exc()
        return 70
    return _run(request)


def _become(conn: socket.socket, fds: list[int], request: dict) -> None:
    """Turn this fork into the stand-in's process: descriptors, cwd, environment, argv, path."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: go with the server
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD,
                signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start
    # descriptors: park the received ones and the connection above every target, then place them
    targets = request["fds"]
    high = max([*targets, *fds, conn.fileno()]) + 1
    parked = [os.dup2(fd, high + i, inheritable=False) for i, fd in enumerate(fds)]
    keep = os.dup2(conn.fileno(), high + len(fds), inheritable=False)
    for fd in fds:
        os.close(fd)
    for num, fd, inheritable in zip(targets, parked, request["inheritable"]):
        os.dup2(fd, num, inheritable=inheritable)
    for fd in parked:
        os.close(fd)
    watch = socket.socket(fileno=keep)
    conn.detach()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in targets and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass
    # the stand-in killed (-9): its end closes, and so does this process, at once
    threading.Thread(target=_die_with, args=(watch,), name="warm-stand-in", daemon=True).start()
    stand_in = request["pid"]
    os.getppid = lambda: _parent_of(stand_in)  # the stand-in's parent is this process's parent
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**ADDED, **request["env"]})
    sys.argv = list(request["argv"])
    sys.path[:] = request["path"]
    import tempfile

    tempfile.tempdir = None  # read TMPDIR again
    if "multiprocessing.process" in sys.modules:  # where spawn's children resolve relative paths from
        sys.modules["multiprocessing.process"].ORIGINAL_DIR = request["cwd"]
    import numpy
    import torch

    numpy.random.seed()  # a fresh process draws its own
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))


def _die_with(watch: socket.socket) -> None:
    try:
        while watch.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 1


def _run(request: dict) -> int:
    """Run the program as `python` would, then shut down as it would (threads, atexit, flush)."""
    import runpy

    code = 0
    try:
        if request["module"]:
            runpy._run_module_as_main(request["module"], alter_argv=True)
        else:
            _run_script(request["script"])
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code < 0:  # died of a signal, as an uncaught KeyboardInterrupt does
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _run_script(script: str) -> None:
    """As `python SCRIPT` runs it: a `__main__` module whose `__file__` is the absolute path (what
    multiprocessing's spawn re-imports in its children), argv[0] as given."""
    import builtins
    import types

    path = os.path.abspath(script)
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__, main.__spec__ = path, builtins, None
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1])
