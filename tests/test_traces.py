"""MLflow trajectory traces: off by default and free (mlflow never imported), a clear start-up
error when enabled without mlflow, and, through real agent workers on a real engine, one trace
per trajectory in a local sqlite store whose spans and token attributes read back exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.traces import TraceConfig, TrajectoryTracer, should_trace
from rollout.manager import AgentLoopManager, ManagerConfig
from test_manager import GSM8K, TOOL_AGENT, needs_gsm8k, tools_yaml, unpad
from tool_model import gsm8k_rows

REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_sampling_is_stable_per_group_and_proportional():
    keys = [f"group-{i}" for i in range(4000)]
    picked = [should_trace(k, 0.25) for k in keys]
    assert picked == [should_trace(k, 0.25) for k in keys]  # every worker decides alike
    assert 0.2 < sum(picked) / len(keys) < 0.3
    assert all(should_trace(k, 1.0) for k in keys[:50]) and not any(should_trace(k, 0.0) for k in keys[:50])
    with pytest.raises(ValueError, match="sample_rate=1.5"):
        TraceConfig(enabled=True, sample_rate=1.5)


def test_disabled_tracing_never_imports_mlflow():
    r = _python("import sys\nfrom agent.traces import TraceConfig, TrajectoryTracer\nimport rollout.manager\n"
                "t = TrajectoryTracer(TraceConfig())\n"
                "assert t.record_trajectory(None, {}) is None\n"
                "print('mlflow' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_enabled_without_mlflow_fails_at_start_up():
    # sys.modules[name] = None makes `import mlflow` raise ImportError, as if it were not installed
    r = _python("import sys\nsys.modules['mlflow'] = None\n"
                "from rollout.manager import AgentLoopManager, ManagerConfig\n"
                "cfg = ManagerConfig(addresses=['ipc:///nonexistent.sock'], tokenizer='tiny-llama', num_workers=1,\n"
                "                    tracing={'enabled': True})\n"
                "try:\n    AgentLoopManager(cfg).start()\nexcept Exception as e:\n"
                "    print(type(e).__name__, e)\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("TracingUnavailable") and "pip install mlflow" in r.stdout


@needs_gsm8k
def test_trajectories_are_traced_from_worker_processes(servers, tool_caller, tmp_path):  # noqa: F811
    mlflow = pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    srv = servers(1, backend="hf", model=str(tool_caller))
    rows = gsm8k_rows(GSM8K / "test.jsonl", 4)
    cfg = ManagerConfig(addresses=srv.addresses, tokenizer=str(tool_caller), num_workers=2, n=2,
                        sampling={"temperature": 1.0, "max_tokens": 48}, tools_config=str(tools_yaml(tmp_path)),
                        agent_configs={"tool_agent": TOOL_AGENT}, progress=False,
                        tracing={"enabled": True, "tracking_uri": uri, "experiment": "rollouts-test"})
    with AgentLoopManager(cfg) as mgr:
        batch = mgr.generate(rows)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("rollouts-test")
    assert exp is not None and str(tmp_path / "mlartifacts") in exp.artifact_location  # not ./mlruns in the cwd
    traces = client.search_traces(locations=[exp.experiment_id], max_results=100)
    by_session = {t.info.tags["session_id"]: t for t in traces}
    assert sorted(by_session) == sorted(batch.session_ids) and len(traces) == len(batch)
    for i, sid in enumerate(batch.session_ids):
        trace = by_session[sid]
        root = next(s for s in trace.data.spans if s.parent_id is None)
        prompt, resp, mask, lps = unpad(batch, i)
        assert root.attributes["prompt_ids"] == prompt and root.attributes["response_ids"] == resp
        assert root.attributes["response_mask"] == mask
        assert root.attributes["response_logprobs"] == pytest.approx(lps, abs=1e-6)
        assert root.attributes["reward"] == pytest.approx(batch.rewards[i].item())
        assert trace.info.tags["group_id"] == root.attributes["group_id"] and trace.info.tags["agent_name"] == "tool_agent"
        assert root.outputs["termination"] == batch.termination[i]
        children = sorted((s for s in trace.data.spans if s.parent_id == root.span_id), key=lambda s: s.start_time_ns)
        assert [s.name for s in children] == [t["kind"] for t in batch.turns[i]]
        gens = [s for s in children if s.name == "generate"]
        assert [s.attributes["request_id"] for s in gens] == batch.request_ids[i]
        model_tokens = [t for s in gens for t in s.outputs["token_ids"]]
        assert model_tokens == [t for t, m in zip(resp, mask) if m]
        for s, turn in zip(children, batch.turns[i]):
            assert s.end_time_ns - s.start_time_ns == pytest.approx(turn["latency_s"] * 1e9, abs=2e6)
            assert root.start_time_ns <= s.start_time_ns and s.end_time_ns <= root.end_time_ns
        for s in children:
            if s.name == "tools":
                assert s.attributes["calls"] >= 0 and "failed" in s.attributes
                assert all(m["role"] == "tool" for m in s.outputs["messages"])
    assert any(s.name == "tools" for t in traces for s in t.data.spans)  # the tool path was traced

    # sampling keeps or drops whole groups
    mlflow.set_tracking_uri(uri)
    tracer = TrajectoryTracer(TraceConfig(enabled=True, tracking_uri=uri, experiment="sampled", sample_rate=0.5))
    group_of = [by_session[sid].info.tags["group_id"] for sid in batch.session_ids]
    from agent.loop import AgentLoopOutput

    for i, sid in enumerate(batch.session_ids):
        prompt, resp, mask, lps = unpad(batch, i)
        out = AgentLoopOutput(prompt, resp, mask, lps, float(batch.rewards[i]), batch.num_turns[i],
                              batch.termination[i], turns=batch.turns[i], session_id=sid)
        got = tracer.record_trajectory(out, {"group_id": group_of[i], "prompt": rows[i // 2]["prompt"]})
        assert (got is not None) == should_trace(group_of[i], 0.5)
    tracer.flush()
    sampled = client.search_traces(locations=[tracer.experiment_id], max_results=100)
    assert len(sampled) == tracer.recorded == sum(should_trace(g, 0.5) for g in group_of) and tracer.failed == 0


def test_the_trainer_turns_tracing_on_with_one_config_key(tmp_path):
    """`launch/train.py ... rollout.tracing.enabled=true`: every trajectory of the run lands in the
    run's own sqlite store, and the command that opens it is printed."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "launch/train.py", "model.path=tiny-llama", "data.val_path=null", "rollout.engine=hf",
                           "rollout.in_process=true",
                           "sft.enabled=false", "data.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=16",
                           "trainer.steps=1", "rollout.tracing.enabled=true", f"trainer.output_dir={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    uri = f"sqlite:///{out.resolve() / 'mlflow.db'}"
    assert f"mlflow ui --backend-store-uri {uri}" in proc.stdout
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("switchyard-rollouts")
    traces = client.search_traces(locations=[exp.experiment_id], max_results=100)
    assert len(traces) == 4  # 2 prompts x 2 samples
    assert all(next(s for s in t.data.spans if s.parent_id is None).attributes["response_ids"] for t in traces)
