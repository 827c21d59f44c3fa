"""Curriculum: rows follow the schedule (stages, linear), the adaptive mode retires a prompt once
its recent pass rate reaches 1 (or 0), the state round-trips, and a run killed with -9 resumes the
schedule where it was (same rows per step as an uninterrupted run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch.data.curriculum import CurriculumConfig, CurriculumStream, scorer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
needs_gsm8k = pytest.mark.skipif(not GSM8K.exists(), reason="needs the GSM8K jsonl beside the repository")


def _rows(n: int = 40) -> list[dict]:
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "extra_info": {"difficulty": (i * 7) % 10, "id": i}}
            for i in range(n)]
    return rows


def _d(stream: CurriculumStream, batch: list[dict]) -> list[float]:
    return [float(r["extra_info"]["difficulty"]) for r in batch]


def test_stages_open_the_easiest_rows_first_and_visit_each_before_repeating():
    cfg = CurriculumConfig(mode="stages", difficulty="field:extra_info.difficulty", stages=[0.25, 0.5, 1.0],
                           stage_steps=2)
    s = CurriculumStream(_rows(), cfg, seed=3)
    ranked = sorted(float(r["extra_info"]["difficulty"]) for r in s.rows)
    first = s.next_batch(5) + s.next_batch(5)                 # stage 1: the easiest 10 of 40
    assert max(_d(s, first)) <= ranked[9] and len({id(r) for r in first}) == 10  # all 10, none twice
    second = s.next_batch(5) + s.next_batch(5)                # stage 2: the easiest 20
    assert max(_d(s, second)) <= ranked[19]
    assert {id(r) for r in second}.isdisjoint({id(r) for r in first})  # the 10 not yet seen come first
    third = s.next_batch(20)
    assert max(_d(s, third)) == ranked[-1]                   # stage 3: everything
    assert s.stats(third)["data/pool"] == 40.0 and s.last_pool == 40


def test_linear_ramp_and_the_scorers():
    cfg = CurriculumConfig(mode="linear", difficulty="field:extra_info.difficulty", start_fraction=0.25, ramp_steps=3)
    s = CurriculumStream(_rows(), cfg)
    pools = []
    for _ in range(5):
        pools.append(len(s.pool()))
        s.next_batch(2)
    assert pools == [10, 20, 30, 40, 40]
    sol = {"extra_info": {"solution": "a <<2*3=6>> b <<6+1=7>>\n#### 7"}}
    assert scorer("solution_steps")(sol) == 2.0 and scorer("solution_length")(sol) == len(sol["extra_info"]["solution"])
    with pytest.raises(ValueError, match="no 'extra_info.level'"):
        scorer("field:extra_info.level")(sol)
    with pytest.raises(ValueError, match="is not known"):
        scorer("hardness")


def test_adaptive_retires_a_prompt_once_its_pass_rate_is_1_and_keeps_mixed_ones():
    cfg = CurriculumConfig(mode="adaptive", difficulty="field:extra_info.difficulty", window=4)
    rows = _rows(6)
    s = CurriculumStream(rows, cfg)
    easy, mixed = rows[0], rows[1]
    s.record(easy, [1.0, 1.0])
    assert s.stats([])["data/retired"] == 0.0         # 2 samples are not yet a window
    s.record(easy, [1.0, 1.0])
    s.record(mixed, [1.0, 0.0, 1.0, 1.0])
    assert 0 in s.retired and 1 not in s.retired
    drawn = [id(r) for _ in range(10) for r in s.next_batch(3)]
    assert id(easy) not in drawn and id(mixed) in drawn
    s.record(rows[2], [0.0] * 4)                       # never solved: retired too
    assert 2 in s.retired


def test_state_round_trip_continues_the_same_order():
    cfg = CurriculumConfig(mode="stages", difficulty="field:extra_info.difficulty", stages=[0.5, 1.0], stage_steps=3)
    a = CurriculumStream(_rows(), cfg, seed=1)
    for _ in range(4):
        a.next_batch(3)
    a.record(a.rows[5], [1.0])
    b = CurriculumStream(_rows(), cfg, seed=1)
    b.load_state_dict(a.state_dict())
    assert [r["extra_info"]["id"] for _ in range(5) for r in a.next_batch(3)] == \
        [r["extra_info"]["id"] for _ in range(5) for r in b.next_batch(3)]
    with pytest.raises(ValueError, match="seed"):
        CurriculumStream(_rows(), cfg, seed=2).load_state_dict(a.state_dict())


@pytest.mark.cold  # reads the process tree
@needs_gsm8k
def test_kill_9_resumes_the_schedule_where_it_was(tmp_path: Path):
    import psutil
    from test_train import _env, _wait_for, metrics, train

    args = ["model.path=tiny-llama", "data.val_path=null", "rollout.engine=hf", "rollout.in_process=true",
            "sft.enabled=false", "data.task=gsm8k",
            f"data.train_path={GSM8K}", "data.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=16",
            "trainer.steps=5", "data.curriculum.mode=stages", "data.curriculum.stages=[0.01,0.1,1.0]",
            "data.curriculum.stage_steps=2"]
    ref = tmp_path / "ref"
    proc = train([*args, f"trainer.output_dir={ref}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "run"
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen([sys.executable, "launch/train.py", *args, f"trainer.output_dir={out}"], cwd=REPO,
                             env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(out / "checkpoints" / "step_000003" / "state.pt", first, 300)
        servers = [c for c in psutil.Process(first.pid).children(recursive=True)]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    psutil.wait_procs(servers, timeout=30)
    second = train([*args, f"trainer.output_dir={out}"])
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resuming from" in second.stdout
    keys = ("data/difficulty_mean", "data/difficulty_max", "data/pool", "data/index")
    got, want = metrics(out), metrics(ref)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5]
    assert [[m[k] for k in keys] for m in got] == [[m[k] for k in keys] for m in want]
    pools = [m["data/pool"] for m in want]
    assert pools[0] < pools[2] < pools[4]                      # the stages opened as scheduled
    assert want[0]["data/difficulty_max"] <= want[4]["data/difficulty_max"]
