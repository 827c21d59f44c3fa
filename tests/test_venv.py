"""`python -m launch.venv`: the virtualenv the verifiers recipe (and the TRL comparison) installs into
sees the environment it was made from, also when that environment is itself a virtualenv, where
`python -m venv --system-site-packages` links the base interpreter's packages and loses torch.
The user's virtualenv is built from a system Python without torch, with this environment's packages
as its own (a .pth file), as a user's `pip install` into a venv would leave it."""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEM_PYTHON = Path(f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}")


def _run(*cmd: object) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason=f"needs a system {SYSTEM_PYTHON} (without torch) to make a "
                                                       "user's virtualenv from")
def test_a_venv_made_from_inside_a_virtualenv_sees_its_packages(tmp_path: Path):
    user = tmp_path / "user-venv"
    assert _run(SYSTEM_PYTHON, "-m", "venv", user).returncode == 0
    if _run(user / "bin" / "python", "-c", "import torch").returncode == 0:
        pytest.skip(f"{SYSTEM_PYTHON} has torch itself: it cannot stand for a base without it")
    purelib = _run(user / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout
    (Path(purelib.strip()) / "installed.pth").write_text(  # switchyard, torch, ... installed into the user's venv
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site.getsitepackages()))
    probe = "import torch, transformers, rollout.bus.client, agent.verifiers_env; print(torch.__version__)"
    assert _run(user / "bin" / "python", "-c", probe).returncode == 0

    naive = tmp_path / "naive"  # what the recipe said before: the base interpreter's packages, no torch
    assert _run(user / "bin" / "python", "-m", "venv", "--system-site-packages", naive).returncode == 0
    assert "No module named 'torch'" in _run(naive / "bin" / "python", "-c", probe).stderr

    made = _run(user / "bin" / "python", "-m", "launch.venv", tmp_path / "vf")
    assert made.returncode == 0, made.stderr
    got = _run(tmp_path / "vf" / "bin" / "python", "-c", probe)
    assert got.returncode == 0, got.stderr
    import torch

    assert got.stdout.strip() == torch.__version__
    own_first = _run(tmp_path / "vf" / "bin" / "python", "-c", "import sys, sysconfig, pathlib, torch; "
                     "print(sys.path.index(sysconfig.get_paths()['purelib']) < "
                     "sys.path.index(str(pathlib.Path(torch.__file__).parents[1])))")
    assert own_first.stdout.strip() == "True", own_first.stderr  # what is installed into it comes first
