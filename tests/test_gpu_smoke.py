"""The GPU smoke suite (benchmarks/gpu_smoke.sh) kept working on a box without a GPU: with --device cpu
every check runs on the tiny llama (the one that needs CUDA skips and says why), so a GPU user who runs
it meets checks that ran before; on a CUDA machine the whole suite must pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("hf_engine", "sleep_wake", "handle_route", "fsdp_actor", "shared_prefix", "drift", "grpo_run", "megatron_run", "lora_run",
          "deepspeed_ref", "reward_model", "fsdp2_two_ranks", "ddp_two_ranks", "megatron_tp2", "megatron_pp2", "megatron_zero1",
          "recipes", "weight_sync_bench", "vllm_logprobs", "vllm_sleep", "vllm_handle_route", "vllm_preempt",
          "vllm_vs_hf", "vllm_grpo_run", "vllm_lora_run")
TWO_RANKS = "two ranks on CPU run in CI as tests/test_distributed.py (DDP, FSDP2) and tests/test_megatron.py"
CUDA_ONLY = {"sleep_wake": "needs CUDA",  # torch.cuda.mem_get_info; the handle route runs its CPU form here
             "reward_model": "tests/test_reward_model_engine.py",
             "fsdp2_two_ranks": TWO_RANKS, "ddp_two_ranks": TWO_RANKS, "megatron_tp2": TWO_RANKS,
             "megatron_pp2": TWO_RANKS, "megatron_zero1": TWO_RANKS,
             "recipes": "their plans are checked in CI (tests/test_plan.py)",
             "weight_sync_bench": "tests/test_benchmarks.py::test_weight_sync_small_run",
             **{name: "needs CUDA: vLLM's CUDA build" for name in CHECKS if name.startswith("vllm_")}}


def smoke(args: list[str], out: Path, timeout: int) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    proc = subprocess.run(["bash", "benchmarks/gpu_smoke.sh", *args, "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.exists(), proc.stderr[-4000:]
    report = json.loads(out.read_text())
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ") and json.loads(last[len("RESULT "):]) == report["result"], proc.stdout[-2000:]
    return proc, report


def failures(report: dict[str, Any]) -> str:
    return "\n".join(f"{name}: {c.get('error')}\n{c.get('traceback', '')}" for name, c in report["checks"].items()
                     if c["status"] == "failed")


@pytest.mark.slow
def test_every_check_runs_on_cpu_or_says_why_not(tmp_path: Path) -> None:
    proc, report = smoke(["--device", "cpu", "--model", "tiny-llama", "--quick"], tmp_path / "gpu_smoke.json", 600)
    checks = report["checks"]
    assert list(checks) == list(CHECKS)
    assert proc.returncode == 0 and not failures(report), failures(report) or proc.stderr[-4000:]
    for name, c in checks.items():
        if name in CUDA_ONLY:
            assert c["status"] == "skipped" and CUDA_ONLY[name] in c["reason"], c
        else:
            assert c["status"] == "ok", (name, c)
    result = report["result"]
    assert (result["ok"], result["skipped"], result["failed"]) == (len(CHECKS) - len(CUDA_ONLY), len(CUDA_ONLY), 0)
    assert result["hf_fp32_max_diff"] < 1e-4 and result["handle_flip_refused"] is True, result
    assert checks["handle_route"]["path"] == "handle" and checks["handle_route"]["refused_bucket_left_weights"]
    assert "FSDP" in checks["fsdp_actor"]["sharded"] and checks["fsdp_actor"]["weights_moved"]
    for point in checks["shared_prefix"]["points"]:  # packed: each group's prompt once, the same logprobs
        assert point["tokens_on"] < point["tokens_off"] and point["logprob_max_diff"] < 0.1, point
    assert len(checks["grpo_run"]["step_s"]) == 3 and checks["grpo_run"]["weight_route"] == ["shm"]
    for name in ("megatron_run", "lora_run", "deepspeed_ref"):  # launch/train.py, 2 steps each, engines verified
        assert len(checks[name]["step_s"]) == 2 and checks[name]["drift_mean"][-1] < 1e-4, (name, checks[name])
    assert checks["lora_run"]["sync_fraction"] < 0.05 and result["lora_sync_fraction"] < 0.05, checks["lora_run"]
    # the figures read against what this device measured in the same run: copy bandwidth, matmul rate
    limits = report["limits"]
    assert limits["copy_gb_per_s"] > 0 and limits["matmul_tflops"] > 0 and limits["matmul_dtype"] == "float32", limits
    assert 0 < checks["handle_route"]["of_copy"] and result["copy_gb_per_s"] == limits["copy_gb_per_s"]
    assert result["fsdp_of_peak"] > 0 and result["megatron_of_peak"] > 0, result  # rates: benchmarks, not tests
    assert checks["fsdp_actor"]["tflops"] > 0 and checks["megatron_run"]["update_tflops"] > 0
    assert checks["hf_engine"]["bf16_generate_tokens_per_s"] > 0 and result["hf_engine_vs_generate"] > 0, result


def test_model_size_builds_the_model_on_the_device(tmp_path: Path) -> None:
    """--model-size builds a random llama of that shape with the given model's tokenizer and runs the checks
    on it (1b on a GPU; `test` is the same build at a size the CPU runs in seconds)."""
    proc, report = smoke(["--device", "cpu", "--model", "tiny-llama", "--quick", "--model-size", "test", "--only",
                          "hf_engine"], tmp_path / "gpu_smoke.json", 300)
    assert proc.returncode == 0, failures(report) or proc.stderr[-3000:]
    assert report["model"].startswith("random test llama") and report["result"]["model"] == report["model"]
    assert report["checks"]["hf_engine"]["fp32_max_abs_diff"] < 1e-4 and "built a random test llama" in proc.stderr


def test_a_part_runs_its_checks_and_each_check_is_in_one_part(tmp_path: Path) -> None:
    """The suite in parts of one device command each (`--part`); every check in exactly one part."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_smoke import PARTS

    assert sorted(sum(PARTS.values(), [])) == sorted(CHECKS)
    proc, report = smoke(["--device", "cpu", "--model", "tiny-llama", "--quick", "--part", "3"],
                         tmp_path / "gpu_smoke.json", 120)
    assert proc.returncode == 0 and list(report["checks"]) == PARTS["3"], proc.stderr[-3000:]
    assert report["complete"] is True


def test_the_vllm_part_says_why_it_skips_without_a_gpu(tmp_path: Path) -> None:
    """The vLLM checks (part `vllm`) run on a GPU with vLLM's CUDA build; here each skips and names why."""
    proc, report = smoke(["--device", "cpu", "--model", "tiny-llama", "--quick", "--part", "vllm"],
                         tmp_path / "gpu_smoke.json", 120)
    names = [n for n in CHECKS if n.startswith("vllm_")]
    assert proc.returncode == 0 and list(report["checks"]) == names, proc.stderr[-3000:]
    for name in names:
        assert report["checks"][name]["status"] == "skipped" and CUDA_ONLY[name] in report["checks"][name]["reason"]


def test_a_failing_check_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    """A model directory that cannot load fails every check that loads it, each on its own, and the
    suite exits 1 with a report that names the errors."""
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    proc, report = smoke(["--device", "cpu", "--model", str(bad), "--quick", "--only", "hf_engine,sleep_wake"],
                         tmp_path / "gpu_smoke.json", 120)
    assert proc.returncode == 1
    assert report["checks"]["hf_engine"]["status"] == "failed" and report["checks"]["hf_engine"]["error"]
    assert report["checks"]["sleep_wake"]["status"] == "skipped"
    assert report["result"]["failed"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the whole suite on the GPU (bash "
                    "benchmarks/gpu_smoke.sh, model from $SMOKE_MODEL or benchmarks/.gpu_wheels/models)")
@pytest.mark.parametrize("part", ["1", "2", "3"])
def test_the_whole_suite_passes_on_a_gpu(tmp_path: Path, part: str) -> None:
    proc, report = smoke(["--part", part], tmp_path / "gpu_smoke.json", 600)
    assert report["device"] == "cuda"
    assert proc.returncode == 0 and all(c["status"] == "ok" for c in report["checks"].values()), \
        failures(report) or report["checks"]
