"""A newcomer's first hour with the config: `--help` lists every section and key with its default and
the meaning its own comment gives, `--help SECTION` one section, a key that is not in the tree names the
closest ones, and the README's own `launch/train.py` command lines pass the config check as written."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.config import Config, ConfigError, load_config
from launch.config_help import keys

REPO = Path(__file__).resolve().parents[1]
# README lines that name what only the reader has (their package, their config file, their cluster's keys)
PLACEHOLDERS = ("my_pkg", " CONFIG ", "/shared/")


def _help(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch/train.py", "--help", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_help_lists_every_key_with_its_default_and_meaning():
    out = _help()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for key in keys(Config()):
        assert any(ln.strip().startswith(f"{key}=") for ln in lines), f"--help does not list {key}"
    line = {ln.split("=")[0].strip(): ln for ln in lines if ln.startswith("  ") and "=" in ln}
    assert "samples per prompt: one GRPO group" in line["rollout.n"] and "rollout.n=4 " in line["rollout.n"]
    assert "auto: continue from output_dir's newest checkpoint" in line["trainer.resume"]
    assert "held-out rows" in line["data.val_path"] and "held-out" not in line["data.prompts_per_step"]  # a block
    assert "tcp host engines bind" in line["rollout.bind_host"] and "colocated: 1" in line["rollout.sleep_level"]
    assert "AdamW's learning rate" in line["actor.lr"]  # a key the section inherits keeps its base's comment


def test_help_of_one_section_and_of_a_section_that_is_not_there():
    out = _help("actor")
    listed = [ln.strip().split("=")[0] for ln in out.stdout.splitlines() if ln.startswith("  ") and "=" in ln]
    assert out.returncode == 0 and listed and all(k.startswith("actor.") for k in listed)
    assert sorted(listed) == sorted(k for k in keys(Config()) if k.startswith("actor."))
    bad = _help("actr")
    assert bad.returncode == 2 and "did you mean actor" in bad.stderr


@pytest.mark.parametrize("override,said", [("foo.bar=1", "the sections are model, data, rollout"),
                                           ("trainer.stpes=3", "did you mean trainer.steps"),
                                           ("rollout.temprature=1", "did you mean rollout.temperature"),
                                           ("trainer.logger=[wandb]", "trainer.logger is trainer.loggers here")])
def test_a_key_not_in_the_tree_names_the_closest(override: str, said: str):
    with pytest.raises(ConfigError, match=said):
        load_config(None, [override])


def _readme_commands() -> list[str]:
    lines, found, i = (REPO / "README.md").read_text().splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("python launch/train.py", "torchrun ")) and "launch/train.py" in line:
            while line.rstrip().endswith("\\"):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            found.append(line)
        i += 1
    return found


def test_the_readme_command_lines_pass_the_config_check_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Each `launch/train.py` line of the README, its overrides as written (a `...` left out), gets past
    the config check: in particular `data.task=rows ...` and `data.task=gsm8k ...` on the demo's
    default `data.val_path=test`. Files the lines name that the config check opens are given."""
    shutil.copy(REPO / "launch" / "configs" / "tools_calculator.yaml", tmp_path / "my_tools.yaml")
    (tmp_path / "my_envs.py").write_text("class Wordle:\n    def reset(self, **kw):\n        return 'guess'\n\n"
                                         "    def step(self, action):\n        return 'done', 1.0, True, {}\n")
    monkeypatch.chdir(tmp_path)
    commands = [c for c in _readme_commands() if not any(p in f" {c} " for p in PLACEHOLDERS)]
    assert len(commands) >= 12 and any("data.task=rows" in c for c in commands) and any(
        "data.task=gsm8k" in c for c in commands)
    for command in commands:
        args = shlex.split(command, comments=True)
        args = [a for a in args[args.index("launch/train.py") + 1:] if a != "..."]
        path = args.pop(0) if args and "=" not in args[0] else None
        try:
            load_config(str(REPO / path) if path else None, args)
        except ConfigError as e:
            pytest.fail(f"{command}\n  -> {e}")


@pytest.mark.parametrize("overrides", [["data.task=rows", "data.train_path=rows.jsonl", "data.val_path=test"],
                                       ["data.task=gsm8k", "data.train_path=train.jsonl", "data.val_path=test"]])
def test_a_val_path_the_task_cannot_give_says_null_turns_validation_off(overrides: list[str]):
    with pytest.raises(ConfigError, match="data.val_path=null to train without validation"):
        load_config(None, overrides)
