"""The package layering holds: compute backends never reach up into orchestration. Every import
in a file counts, at module level, inside functions and under TYPE_CHECKING alike, since each one
is a dependency a reader (and a refactor) has to follow."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {  # package -> top-level packages it must not import
    "engines": {"rollout", "agent", "launch"},
    "parallel": {"rollout", "agent", "launch"},
    "agent": {"launch"},
    "rollout": {"launch"},
}
MAX_LINES = 500


def imported_packages(source: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def upward_imports(root: Path, package: str) -> list[str]:
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        for line, top in imported_packages(path.read_text()):
            if top in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(root)}:{line} imports {top}")
    return bad


def test_the_checker_catches_an_upward_import(tmp_path):
    (tmp_path / "engines" / "training").mkdir(parents=True)
    (tmp_path / "engines" / "training" / "x.py").write_text(
        "import torch\nfrom engines.training.batch import Batch\n\n"
        "def f():\n    from rollout.manager import AgentLoopManager\n")
    assert upward_imports(tmp_path, "engines") == ["engines/training/x.py:5 imports rollout"]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    assert list((REPO / package).rglob("*.py")), f"no python files under {package}/"
    bad = upward_imports(REPO, package)
    assert not bad, f"{package}/ must not import {sorted(FORBIDDEN[package])}:\n" + "\n".join(bad)


def test_no_file_over_the_size_limit():
    big = []
    for path in sorted(REPO.rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(REPO).parts):
            continue
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            big.append(f"{path.relative_to(REPO)}: {n} lines")
    assert not big, f"files over {MAX_LINES} lines (split them by role):\n" + "\n".join(big)
