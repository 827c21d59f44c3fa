"""launch/install.sh's GPU engine choice, checked without the network: a wrong engine name is refused in
one line naming the two choices, and each choice has its pins in launch/constraints/."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("vllm", "sglang")


def install(*args: str) -> subprocess.CompletedProcess:
    # no index: a run that got past the argument check would fail in pip, not install anything
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    return subprocess.run(["bash", "launch/install.sh", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("engine", ["vlm", "VLLM", "hf"])
def test_a_wrong_gpu_engine_is_refused_in_one_line(engine: str) -> None:
    proc = install("gpu", engine)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"'{engine}'" in lines[0] and "choose vllm or sglang" in lines[0], lines[0]
    assert proc.stdout == ""


def test_each_gpu_engine_has_its_pins() -> None:
    script = (REPO / "launch" / "install.sh").read_text()
    accepted = re.search(r"^\s*([\w|]+)\) ;;$", script, re.M).group(1).split("|")
    assert tuple(accepted) == ENGINES
    for engine in ENGINES:
        pins = {re.split(r"==", line)[0]: line.split("==")[1] for line in
                (REPO / "launch" / "constraints" / f"gpu-{engine}.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
        assert {engine, "torch", "megatron-core", "deepspeed", "accelerate", "peft"} <= set(pins), pins
        assert all(re.fullmatch(r"[\w.]+", v) for v in pins.values()), pins  # exact versions only
