"""Benchmarks keep running: a tiny run must finish, print its RESULT line and write its JSON."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_bus_vs_ray_small_run(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "bus_vs_ray.json"
    proc = subprocess.run([sys.executable, "benchmarks/bus_vs_ray.py", "--requests", "40", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT p50_ratio_c1=")
    report = json.loads(out.read_text())
    assert set(report["bus"]) == set(report["ray"]) == set(report["bare"]) == {"1", "16", "256"}
    assert all(v > 0 for v in report["ratios"].values())


def _run(script: str, args: list[str], tmp_path: Path) -> tuple[str, dict]:
    out = tmp_path / f"{Path(script).stem}.json"
    try:  # inside the test's own limit, so that what it printed is shown
        proc = subprocess.run([sys.executable, script, *args, "--out", str(out)], cwd=ROOT, capture_output=True,
                              text=True, timeout=780)
    except subprocess.TimeoutExpired as e:
        text = lambda b: (b.decode(errors="replace") if isinstance(b, bytes) else b or "")  # noqa: E731
        pytest.fail(f"{script} did not finish within 780 s:\n{text(e.stdout)[-3000:]}\n{text(e.stderr)[-5000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1], json.loads(out.read_text())


def _tool_model(path: Path) -> list[str]:
    return ["--model", str(path), "--sft-steps", "0"]  # it calls the calculator already


def test_tool_latency_small_run(tmp_path, tool_caller):
    """On the tests' calculator-calling tiny llama (tests/tool_model.py), greedy: the benchmark's own
    (`--sft-steps` on tiny-llama) takes minutes of SFT to make; the same model serves routing's test."""
    last, report = _run("benchmarks/tool_latency.py", ["--quick", "--trajectories", "8", "--concurrency", "4",
                                                        "--latencies", "0,0.5", "--longtail-median-s", "0.05",
                                                        "--longtail-trajectories", "8", "--temperature", "0",
                                                        *_tool_model(tool_caller)], tmp_path)
    assert last.startswith("RESULT async_vs_sync_0s=")
    cells = {(r["mode"], r["latency_s"]): r for r in report["results"]}
    assert set(cells) == {("async", 0.0), ("sync", 0.0), ("async", 0.5), ("sync", 0.5)}
    for r in [*cells.values(), *report["longtail"]]:
        assert r["trajectories"] == 8 and r["tokens"] > 0 and 0 < r["busy_fraction"] <= 1.0
    assert [r["mode"] for r in report["longtail"]] == ["async", "sync"] and "longtail_async_vs_sync" in report["ratios"]
    assert all(r["tool_calls"] > 0 for r in cells.values())  # the SFT'd model really calls the tool
    # a sync wave waits for its slowest tool each tool round: 2 waves, at least one 0.5 s round each
    assert cells[("sync", 0.5)]["wall_s"] >= 2 * 0.5
    sync = cells[("sync", 0.5)]  # generation phases are timed; the rest of the wall is the tool rounds
    assert sync["gen_phases"] >= 3 and 0 < sync["gen_s"] < sync["wall_s"] and sync["tool_wait_s"] >= 0.5
    assert "gen_phases" not in cells[("async", 0.5)]
    assert Path(report["plot"]).exists()


def test_routing_small_run(tmp_path, tool_caller):
    last, report = _run("benchmarks/routing.py", ["--quick", "--engines", "2", "--prompts", "3", "--n", "3",
                                                   "--temperature", "0", "--policies", "round_robin,sticky_group",
                                                   *_tool_model(tool_caller)], tmp_path)
    assert last.startswith("RESULT round_robin_vs_ideal=")
    hits = {r["label"]: r["hit_rate"] for r in report["results"]}
    assert set(hits) == {"single_engine", "round_robin", "sticky_group"}
    assert 0 < hits["single_engine"] < 1
    # greedy: every policy sends the same token streams, so one engine that sees them all is the
    # ceiling, and keeping a trajectory's turns and a group's samples together beats scattering them
    assert hits["single_engine"] >= max(hits.values()) - 1e-9
    assert hits["sticky_group"] > hits["round_robin"]
    for r in report["results"][1:]:
        assert len(r["engines"]) == 2 and all(e["prompt_tokens"] > 0 for e in r["engines"])


def test_weight_sync_small_run(tmp_path):
    last, report = _run("benchmarks/weight_sync.py", ["--quick", "--reps", "1"], tmp_path)
    assert last.startswith("RESULT reshard_vs_memcpy=")
    assert set(report["gb_per_s"]) == {"memcpy", "reshard", "in_process", "shm_1", "shm_2", "handle_1", "handle_2",
                                       "bus_1", "bus_2", "collective_1", "collective_2", "collective_2nodes", "ipc_raw",
                                       "gloo_raw"}
    assert all(v > 0 for v in report["gb_per_s"].values()) and report["tp"] == 2


@pytest.mark.slow
def test_nodes_small_run(tmp_path):
    last, report = _run("benchmarks/nodes.py", ["--quick", "--steps", "2", "--prompts", "2"], tmp_path)
    assert last.startswith("RESULT speedup=")
    assert report["nodes1"]["token_share"] == {"engine0": 1.0}
    assert set(report["nodes2"]["token_share"]) == {"node0-engine0", "node1-engine0"}
    assert all(v > 0 for v in report["nodes2"]["token_share"].values())  # both nodes' engines served
    assert report["speedup"] > 0 and report["nodes2_same_engine_batch"]["prompts_per_step"] == 4


@pytest.mark.slow
def test_async_rl_small_run(tmp_path):
    last, report = _run("benchmarks/async_rl.py", ["--quick", "--steps", "2", "--median-s", "0.05", "--p99-s", "0.2"],
                        tmp_path)
    assert last.startswith("RESULT k1_vs_sync=")
    runs = {r["staleness"]: r for r in report["runs"]}
    assert set(runs) == {0, 1, 2} and all(r["steps"] == 2 and r["steps_per_hour"] > 0 for r in runs.values())
    assert runs[0]["engine_busy_in_update"] < 0.05 and runs[0]["staleness_mean"] == 0  # synchronous
    assert report["ideal_ratio"] >= 1


@pytest.mark.slow
def test_actor_memory_small_run(tmp_path):
    last, report = _run("benchmarks/actor_memory.py", ["--quick"], tmp_path)
    for stuck in report.get("stuck_runs", []):  # measured again and passed: shown (with the ranks' stacks)
        warnings.warn(f"actor_memory {stuck['run']} got stuck once under the suite:\n{stuck['output']}")
    assert last.startswith("RESULT fsdp_dp2_vs_dp1=")
    assert 0.45 <= report["held_ratio_fsdp_vs_dp1"] <= 0.55  # FSDP over 2 ranks: half of everything per rank
    assert report["held_ratio_ddp_vs_dp1"] == pytest.approx(1.0, rel=0.02)  # DDP: a full replica each
    assert report["projection_gb"]["7"]["dp1_ddp"] == pytest.approx(16 * 7e9 / 2**30)
    # LoRA: gradients and AdamW for the adapter alone, the fp32 base 4 of the 16 bytes per parameter
    assert 0.24 <= report["held_ratio_lora_vs_dp1"] <= 0.3
    assert 0.12 <= report["held_ratio_fsdp_lora_vs_dp1"] <= 0.15  # ...and sharded over 2 ranks


def test_micro_batches_small_run(tmp_path):
    last, report = _run("benchmarks/micro_batches.py", ["--quick", "--pairs", "1"], tmp_path)
    assert last.startswith("RESULT budget_vs_fixed_update_speed=")
    fixed, budget = report["runs"]["fixed"], report["runs"]["budget"]
    assert budget["padded_tokens"] < fixed["padded_tokens"]  # sorted by length, packed: less padding
    assert fixed["micro_batches"] == 4 and budget["micro_batches"] >= 1


def test_update_dtype_small_run(tmp_path):
    last, report = _run("benchmarks/update_dtype.py", ["--quick", "--pairs", "1"], tmp_path)
    assert last.startswith("RESULT tiny_fp32_over_bf16=")
    (run,) = report["models"].values()
    assert [len(run["update_s"][d]) for d in ("float32", "bfloat16")] == [1, 1] and run["parameters"] > 1e6
    assert run["fp32_over_bf16_median"] == pytest.approx(run["update_s"]["float32"][0] / run["update_s"]["bfloat16"][0])
    from engines.training.config import native_bf16

    assert report["native_bf16"] == native_bf16("cpu")


def test_optimizer_step_small_run(tmp_path):
    last, report = _run("benchmarks/optimizer_step.py", ["--quick", "--rounds", "1"], tmp_path)
    assert last.startswith("RESULT loop_over_fused=")
    assert set(report["step_s"]) == {"loop", "foreach", "fused"} and report["tensors"] > 10
    assert report["max_abs_diff"] < 1e-6  # the three implement one update


def test_host_memory_small_run(tmp_path):
    last, report = _run("benchmarks/host_memory.py", ["--quick", "--pairs", "1", "--updates", "1",
                                                       "--trajectories", "8"], tmp_path)
    assert last.startswith("RESULT retain_vs_default_update_speed=")
    for setting in ("on", "keep", "off"):
        (run,) = report["runs"][setting]
        assert len(run["update_s"]) == 1 and run["update_s"][0] > 0 and run["peak_rss_gib"] > 0.1
        assert 0.05 < run["rss_after_gib"] <= run["peak_rss_gib"] + 0.01
    assert report["trajectories"] == 8
    assert report["speedup_per_pair"][0] == pytest.approx(report["runs"]["off"][0]["update_s"][0]
                                                          / report["runs"]["on"][0]["update_s"][0])


def test_gateway_overhead_small_run(tmp_path):
    pytest.importorskip("openai")
    last, report = _run("benchmarks/gateway_overhead.py", ["--requests", "64"], tmp_path)
    assert last.startswith("RESULT added_ms_c1=")
    for c in ("1", "64"):
        assert set(report[c]) == {"bus", "gateway_http", "gateway_openai", "gateway_responses", "gateway_messages"}
        assert all(v["req_s"] > 0 and v["p50_ms"] > 0 for v in report[c].values())


@pytest.mark.cold  # measures the memory of the process trees it starts
def test_vs_trl_small_run(tmp_path):
    """TRL (its venv made once in the cache) and switchyard, one short round each on tiny-llama."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vs_trl import trl_python

    try:
        trl_python("1.16.0")
    except subprocess.CalledProcessError as e:  # as tests/test_verifiers_env.py: no package index, no TRL
        pytest.skip(f"could not install TRL into its venv ({e}); the package index may be unreachable")
    # (the trl_retain row, TRL once more with an allocator setting, is left to the full benchmark: each TRL
    # run here is mostly its ~15 s start-up)
    last, report = _run("benchmarks/vs_trl.py", ["--quick", "--extra-rows", "prefix_off"], tmp_path)
    assert last.startswith("RESULT switchyard_vs_trl=")
    (pair,) = report["pairs"]
    for side in (pair["trl"], pair["switchyard"]):
        assert side["steps"] == 3 and side["step_s"] > 0 and side["peak_rss_gb"] > 0.1
        assert 0 < side["rollout_s"] < side["step_s"] * 1.5 and len(side["reward"]) == 3
    assert pair["trl"]["system"] == "trl" and pair["switchyard"]["system"] == "switchyard hf"
    assert pair["ratio"] == pytest.approx(pair["switchyard"]["steps_per_hour"] / pair["trl"]["steps_per_hour"])
    assert report["extra"] == []
    # switchyard again in the round with actor.shared_prefix=off against the default (auto): fewer tokens computed
    off = pair["prefix_off"]
    assert off["system"] == "switchyard hf shared_prefix off" and off["steps"] == 3
    assert pair["update_vs_prefix_off"] == pytest.approx(off["update_s"] / pair["switchyard"]["update_s"])
    assert "update_vs_prefix_off=" in last
    assert pair["switchyard"]["tokens_computed"] < off["tokens_computed"]  # the default packs each group's prompt once


@pytest.mark.cold  # measures the memory of the process trees it starts
def test_soak_small_run(tmp_path):
    pytest.importorskip("aiohttp")
    last, report = _run("benchmarks/soak.py", ["--quick", "--steps", "8", "--requests", "96", "--clients", "4",
                                                "--every-s", "0.5"], tmp_path)
    assert last.startswith("RESULT train_rss_growth_second_half_mib=")
    train, gw = report["training"], report["gateway"]
    assert train["steps"] == 8 and train["samples"] >= 3 and train["rss_mib_end"] > 50, train
    assert {"rss_floor_growth_second_half_mib", "rss_peak_growth_second_half_mib"} <= set(train), train
    assert train["rss_growth_second_half_mib_by_process"]["trainer"].keys() == {"last_minus_middle", "floor", "peak"}
    assert gw["requests"] == 96 and gw["samples"] >= 3, gw


def test_shared_prefix_small_run(tmp_path):
    last, report = _run("benchmarks/shared_prefix.py", ["--quick", "--trajectories", "8", "--group", "4"], tmp_path)
    assert report["tokens_packed"] < report["tokens_padded"]  # each group's prompt once
    for mode in ("off", "on", "auto", "on_runs"):
        assert report[f"{mode}_update_s"] > 0 and report[f"{mode}_logprobs_s"] > 0
    assert report["on_update_speedup"] > 0 and last.startswith("RESULT on_update_x=")
    pairs = report["attention_pairs"]  # by runs: fewer pairs than padded rows, and than the dense packed mask
    assert pairs["on_runs"] < pairs["off"] and pairs["on_runs"] < pairs["on"] and report["runs_vs_mask_update"] > 0
