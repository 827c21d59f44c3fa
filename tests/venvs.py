"""Virtual environments the tests build as a user would, once per machine under the switchyard cache.

`cached_venv(name, requirements)` returns the python of a venv with `requirements` installed:
plain (only what pip installs, as an agent framework's own environment is), or with `overlay`
made by `python -m launch.venv` over the main environment (torch, transformers and switchyard
seen, what is installed into it first; the main torch pinned so pip never replaces it). Keyed by
the requirements and the Python version, built under a file lock (parallel workers build it
once), marked ready only when whole. When pip fails because the package index is unreachable the
test skips saying so; any other failure fails it with pip's output.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

READY = ".switchyard-ready"


def _run(cmd: list, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)


def cached_venv(name: str, requirements: list[str], *, overlay: bool = False) -> Path:
    """The python of the venv `name` with `requirements` installed (see the module's text)."""
    from engines.models import cache_root, file_lock

    key = hashlib.sha256("\n".join([*requirements, str(overlay)]).encode()).hexdigest()[:8]
    py = f"py{sys.version_info[0]}{sys.version_info[1]}"
    venv = cache_root() / "test-venvs" / f"{name}-{py}{'-overlay' if overlay else ''}-{key}"
    python = venv / "bin" / "python"
    if (venv / READY).is_file() and python.exists():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(venv.parent / f".{venv.name}.lock"):
        if (venv / READY).is_file() and python.exists():  # another worker built it while we waited
            return python
        shutil.rmtree(venv, ignore_errors=True)
        pins: list = []
        if overlay:
            made = _run([sys.executable, "-m", "launch.venv", venv])  # the README's recipe, as a user runs it
            import torch

            (venv / "constraints.txt").write_text(f"torch=={torch.__version__.split('+')[0]}\n")
            pins = ["-c", venv / "constraints.txt"]  # never replace the main torch
        else:
            made = _run([sys.executable, "-m", "venv", venv])
        assert made.returncode == 0, made.stderr[-2000:]
        got = _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins, *requirements])
        if got.returncode != 0:
            probe = _run([python, "-m", "pip", "download", "-q", "--no-deps", "-d", venv / "probe",
                          requirements[0]], timeout=300)
            shutil.rmtree(venv, ignore_errors=True)
            if probe.returncode != 0:
                pytest.skip(f"cannot build the {name} venv: the package index is unreachable "
                            f"({probe.stderr.strip()[-300:]})")
            pytest.fail(f"pip could not install {' '.join(requirements)} into the {name} venv:\n"
                        f"{got.stderr[-3000:]}")
        (venv / READY).write_text("\n".join(requirements) + "\n")
    return python
