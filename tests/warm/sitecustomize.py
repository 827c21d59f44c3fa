"""The stand-in half of the suite's warm starts (see zygote.py beside it): imported by every
interpreter that starts with this folder on PYTHONPATH, it does nothing unless SWITCHYARD_WARM names
a running zygote, the interpreter is the zygote's and the command is `python [-u] [-B] SCRIPT|-m
MODULE ...` of the repository's own code. Then the zygote forks the program and this process only
passes on signals and exits as the program did. Anything unexpected: it returns and Python goes on
to run the program itself, cold."""

import fnmatch
import os
import sys

# the programs that import torch and transformers first thing (the rest start fast anyway, and some
# tests look at their process trees)
SCRIPTS = ("launch/*.py", "benchmarks/*.py", "tests/fidelity_run.py", "tests/dist_*.py", "tests/megatron_*.py",
           "tests/warm/child.py")
MODULES = ("rollout.bus.server", "rollout.service", "launch.*")


def _target(repo: str) -> tuple[str, str] | None:
    """(script, module) this interpreter was asked to run, if it is the repository's own."""
    args = list(getattr(sys, "orig_argv", [])[1:])
    while args and args[0] in ("-u", "-B"):
        args.pop(0)
    if not args:
        return None
    if args[0] == "-m" and len(args) > 1:
        module = args[1]
        if not any(fnmatch.fnmatch(module, m) for m in MODULES):
            return None
        rel = os.path.join(repo, *module.split("."))
        if not (os.path.isfile(rel + ".py") or os.path.isfile(os.path.join(rel, "__main__.py"))):
            return None
        roots = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        return ("", module) if any(r and os.path.realpath(r) == repo for r in roots) else None
    if args[0].startswith("-") or not args[0].endswith(".py"):
        return None
    script = os.path.realpath(args[0])
    if not (script.startswith(repo + os.sep) and os.path.isfile(script)):
        return None
    rel = os.path.relpath(script, repo)
    return (args[0], "") if any(fnmatch.fnmatch(rel, s) for s in SCRIPTS) else None


def _stand_in(address: str) -> None:
    import json
    import signal
    import socket

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    target = _target(repo)
    # vLLM and SGLang set up their own processes (engine cores, env for them): those start as they would
    # (a vLLM server forked warm passed its tests but ran slower: test_vllm_engine's server fixture 63 s in a
    # clean-clone run against under 43 s cold)
    if target is None or any("vllm" in a or "sglang" in a for a in sys.argv):
        return
    script, module = target
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            os.fstat(fd)
        except (ValueError, OSError):
            continue
        fds.append(fd)
    if len(fds) > 250:
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(address)
    except OSError:  # not up yet, or gone: run cold
        sock.close()
        return
    if script:
        path0 = os.path.dirname(os.path.realpath(script))
    else:
        path0 = os.getcwd()
    request = {"pid": os.getpid(), "cwd": os.getcwd(), "env": dict(os.environ), "argv": sys.argv,
               "path": [path0, *sys.path], "script": script, "module": module, "fds": fds,
               "inheritable": [os.get_inheritable(fd) for fd in fds]}
    reader = sock.makefile("rb")
    try:
        socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], fds)
        answer = reader.readline().decode().split()
    except OSError:
        answer = []
    if len(answer) != 2 or answer[0] != "pid":  # refused (environment differs) or failed: run cold
        sock.close()  # the zygote's log says why (SWITCHYARD_WARM_LOGS)
        return
    sock.settimeout(None)
    child = int(answer[1])

    def forward(sig: int, _frame: object) -> None:
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    line = reader.readline().decode().split()
    status = int(line[1]) if len(line) == 2 and line[0] == "exit" else 1 << 8
    for fd in range(3):
        try:
            os.close(fd)
        except OSError:
            pass
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


if os.environ.get("SWITCHYARD_WARM") and sys.executable == os.environ.get("SWITCHYARD_WARM_PYTHON"):
    _stand_in(os.environ["SWITCHYARD_WARM"])
