"""The package layering holds: compute backends never reach up into orchestration, agent loops
reach rollout/ only through its bus, and no two modules import each other (directly or around a
circle). Every import in a file counts, at module level, inside functions and under TYPE_CHECKING
alike, since each one is a dependency a reader (and a refactor) has to follow."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {  # package -> top-level packages it must not import
    "engines": {"rollout", "agent", "launch"},
    "parallel": {"rollout", "agent", "launch"},
    "agent": {"launch"},
    "rollout": {"launch"},
}
ALLOWED = {"agent": {"rollout": ("rollout.bus",)}}  # package -> {top-level package: the only parts it may import}
PRODUCT = ("agent", "engines", "launch", "parallel", "rollout")
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


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(root: Path, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module of the product) of every import in `path`, relative ones resolved; `from a
    import b` counts as a.b when that is a module, else as a."""
    me = module_name(root, path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [(base, a.name) for a in node.names]
        else:
            continue
        for module, name in names:
            for candidate in (f"{module}.{name}" if name else "", module):
                while candidate and candidate not in known:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != me:
                    found.append((node.lineno, candidate))
                    break
    return found


def upward_imports(root: Path, package: str) -> list[str]:
    bad = []
    known = {module_name(root, p) for top in PRODUCT for p in (root / top).rglob("*.py")}
    for path in sorted((root / package).rglob("*.py")):
        for line, top in imported_packages(path.read_text()):
            if top in FORBIDDEN.get(package, ()):
                bad.append(f"{path.relative_to(root)}:{line} imports {top}")
        for line, module in imported_modules(root, path, known):
            allowed = ALLOWED.get(package, {}).get(module.split(".")[0])
            if allowed is not None and not any(module == a or module.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(root)}:{line} imports {module} (only {', '.join(allowed)})")
    return bad


def import_circles(root: Path) -> list[list[str]]:
    """Every set of product modules that import each other around a circle (strongly connected)."""
    paths = {module_name(root, p): p for top in PRODUCT if (root / top).is_dir() for p in (root / top).rglob("*.py")}
    graph = {m: {d for _, d in imported_modules(root, p, set(paths))} for m, p in paths.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_checker_catches_an_upward_import(tmp_path):
    (tmp_path / "engines" / "training").mkdir(parents=True)
    (tmp_path / "engines" / "training" / "x.py").write_text(
        "import torch\nfrom engines.training.batch import Batch\n\n"
        "def f():\n    from rollout.manager import AgentLoopManager\n")
    assert upward_imports(tmp_path, "engines") == ["engines/training/x.py:5 imports rollout"]


def test_the_checker_catches_a_circle_and_an_agent_reaching_past_the_bus(tmp_path):
    for pkg in ("agent", "rollout/bus"):
        (tmp_path / pkg).mkdir(parents=True)
    (tmp_path / "rollout" / "a.py").write_text("def f():\n    from rollout.b import x\n")
    (tmp_path / "rollout" / "b.py").write_text("from . import a\n")
    (tmp_path / "rollout" / "bus" / "client.py").write_text("")
    (tmp_path / "agent" / "loop.py").write_text("from rollout.bus.client import C\nimport rollout.a\n")
    assert import_circles(tmp_path) == [["rollout.a", "rollout.b"]]
    assert upward_imports(tmp_path, "agent") == ["agent/loop.py:2 imports rollout.a (only rollout.bus)"]


def test_no_import_circles():
    circles = import_circles(REPO)
    assert not circles, "modules that import each other (move what both need into a third):\n" + \
        "\n".join(" <-> ".join(c) for c in circles)


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


def design_claims(text: str) -> tuple[list[str], list[str]]:
    """The folders docs/design.md's map draws (nested ones under their parent) and every file path
    it names in backticks."""
    block = text.split("## The map", 1)[1].split("```")[1]
    folders, parent = [], ""
    for line in block.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.endswith("/"):
            continue
        if line.startswith("  "):
            folders.append(parent + name)
        else:
            parent = name
            folders.append(name)
    files = [m for m in re.findall(r"`([\w/]+\.(?:py|md|yaml))`", text) if "/" in m]
    return folders, files


def test_the_design_document_names_folders_and_files_that_exist():
    folders, files = design_claims((REPO / "docs" / "design.md").read_text())
    assert "rollout/bus/" in folders and "rollout/weights/" in folders
    missing = [f for f in folders + files if not (REPO / f).exists() and not (REPO / "rollout" / f).exists()]
    assert not missing, f"docs/design.md names what the tree lacks (update one or the other): {missing}"
    drawn = {f.rstrip("/") for f in folders}
    undrawn = [p.name for p in (REPO / "rollout").iterdir() if p.is_dir() and not p.name.startswith(("_", "."))
               and f"rollout/{p.name}" not in drawn]
    assert not undrawn, f"rollout/ has folders the design's map does not draw: {undrawn}"


# rollout/'s rooms that meet only through a value: the weight sync is given the fleet's `Topology`
# (rollout/topology.py) and reaches the engines through the bus; the fleet knows nothing of the weights
ROOMS = {
    "rollout/weights": ("rollout.weights", "rollout.bus", "rollout.topology", "rollout.engine_stats"),
    "rollout/fleet.py": ("rollout.fleet", "rollout.bus", "rollout.topology", "rollout.engine_stats", "rollout.config",
                         "rollout.service", "rollout.reward_engines", "rollout.inproc"),
}


def room_imports(root: Path, room: str, allowed: tuple[str, ...]) -> list[str]:
    """Every import of another part of rollout/ from `room` (a folder or a file) that `allowed` lacks."""
    known = {module_name(root, p) for top in PRODUCT if (root / top).is_dir() for p in (root / top).rglob("*.py")}
    paths = sorted((root / room).rglob("*.py")) if (root / room).is_dir() else [root / room]
    return [f"{path.relative_to(root)}:{line} imports {module}" for path in paths
            for line, module in imported_modules(root, path, known)
            if module.startswith("rollout.") and not any(module == a or module.startswith(a + ".") for a in allowed)]


def test_the_checker_catches_the_weights_reaching_into_the_fleet(tmp_path):
    (tmp_path / "rollout" / "weights").mkdir(parents=True)
    (tmp_path / "rollout" / "fleet.py").write_text("")
    (tmp_path / "rollout" / "topology.py").write_text("")
    (tmp_path / "rollout" / "weights" / "sync.py").write_text(
        "from rollout.topology import Topology\n\ndef f():\n    from rollout.fleet import EngineFleet\n")
    assert room_imports(tmp_path, "rollout/weights", ROOMS["rollout/weights"]) == [
        "rollout/weights/sync.py:4 imports rollout.fleet"]


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_the_fleet_and_the_weights_meet_only_through_the_topology(room):
    bad = room_imports(REPO, room, ROOMS[room])
    assert not bad, f"{room} reaches past its room (hand it a value instead, as the plane does):\n" + "\n".join(bad)
