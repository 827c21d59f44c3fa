"""The plan check: every recipe's plan passes as its own header says to check it, and impossible plans
fail naming the fix, all without a model or a GPU (launch/train.py --plan)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from launch.plan import SHAPES, model_shape

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "launch" / "configs" / "recipes").glob("*.yaml"))


def plan(*args: str) -> subprocess.CompletedProcess:
    """`python launch/train.py <args>` as its entry point runs it (in this process: a plan loads no model)."""
    import contextlib
    import io
    import os

    from launch.train import main

    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(REPO)  # recipes and --config paths are relative to the repository, as for the CLI
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(["launch/train.py", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_passes_its_plan(recipe: Path):
    text = recipe.read_text()
    for key in ("# Reproduces:", "# Check:", "# Status:"):
        assert key in text, f"{recipe.name}: its header needs a {key!r} line"
    check = re.search(r"# Check: python launch/train.py (\S+) (--plan.*)$", text, re.M)
    assert check and check.group(1) == f"launch/configs/recipes/{recipe.name}"
    proc = plan(check.group(1), *check.group(2).split())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plan ok" in proc.stdout and "start: " in proc.stdout and "memory per GPU" in proc.stdout


def test_impossible_plans_fail_naming_the_fix():
    recipe = "launch/configs/recipes/gsm8k_qwen2.5-3b_megatron_tp2.yaml"
    proc = plan(recipe, "--plan", "actor.tp=3")
    assert proc.returncode == 2
    assert "actor.tp=3 must divide the model's 16 heads and 2 KV heads; use actor.tp in [1, 2]" in proc.stdout
    proc = plan(recipe, "--plan", "--gpus-per-node", "1", "model.path=meta-llama/Llama-3.1-70B-Instruct", "actor.tp=1")
    assert proc.returncode == 2 and "does not fit 80 GiB" in proc.stdout and "actor.sharding=fsdp" in proc.stdout
    proc = plan(recipe, "--plan", "model.path=someone/unknown-model")
    assert proc.returncode == 2 and "--model-config" in proc.stdout


def test_a_config_json_gives_the_shape(tmp_path: Path):
    cfg = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert model_shape(str(tmp_path)) == SHAPES["qwen2.5-0.5b"]
    assert 0.49e9 < SHAPES["qwen2.5-0.5b"].parameters() < 0.50e9  # published: 0.49B
    assert 7.6e9 < SHAPES["qwen2.5-7b"].parameters() < 7.7e9  # published: 7.61B
    assert 8.0e9 < SHAPES["llama-3.1-8b"].parameters() < 8.1e9  # published: 8.03B


def test_the_plan_counts_a_lora_adapter_and_a_critic():
    recipe = "launch/configs/recipes/gsm8k_qwen2.5-3b_async_split.yaml"
    full = plan(recipe, "--plan")
    lora = plan(recipe, "--plan", "actor.lora={rank: 16}")
    critic = plan(recipe, "--plan", "algorithm.advantage=gae")
    assert full.returncode == lora.returncode == critic.returncode == 0, full.stdout + lora.stdout + critic.stdout
    # qwen2.5-3b, rank 16 on every Linear of its 36 layers: 16 x 51,968 x 36 = 29.9M parameters, bf16
    assert "(the LoRA adapter, 29.9M parameters)" in lora.stdout and "0.0558 GiB in 1 bucket" in lora.stdout
    # colocated: a LoRA run's engines keep their base asleep (sleep level 1 by default), so the adapter travels
    colocated = plan("launch/configs/recipes/gsm8k_qwen2.5-3b_4gpu.yaml", "--plan", "actor.lora={rank: 16}")
    assert "(the LoRA adapter, 29.9M parameters)" in colocated.stdout, colocated.stdout
    actor_gb = lambda out: float(re.search(r"actor ([\d.]+) GiB", out).group(1))  # noqa: E731
    assert actor_gb(lora.stdout) < actor_gb(full.stdout) / 3  # a frozen bf16 base, AdamW for the adapter only
    assert "critic:" in critic.stdout and actor_gb(critic.stdout) > 1.9 * actor_gb(full.stdout)


def test_the_plan_places_attached_engines_and_the_reward_model():
    recipe = "launch/configs/recipes/gsm8k_qwen2.5-3b_4gpu.yaml"
    mem = lambda out: float(re.search(r"fits: ([\d.]+) of", out).group(1))  # noqa: E731
    base = plan(recipe, "--plan")
    attached = plan(recipe, "--plan", "rollout.engines=[ipc:///run/engines/e0.sock]",
                    "rollout.placement=auto")
    assert base.returncode == attached.returncode == 0, base.stdout + attached.stdout
    # attached engines run on GPUs of their own: the weights go over the bus and take none of the trainer's memory
    assert "1 attached server(s) (rollout.engines)" in attached.stdout and "route bus" in attached.stdout
    assert "engine 0 (attached elsewhere)" in attached.stdout and mem(attached.stdout) < mem(base.stdout) - 30
    # a judge of qwen2.5-7b's size (7.6B, bf16: 14.2 GiB) pinned to GPU 0 of the trainer's, then on two of its own
    judge = ["reward.model={path: qwen2.5-7b, kind: judge, devices: [0]}"]
    shared = plan(recipe, "--plan", "--gpus-per-node", "4", *judge)
    assert shared.returncode == 0, shared.stdout
    assert "1 x hf on GPUs [0] (GPU 0: 14.2 GiB of weights" in shared.stdout and "shares the trainer's GPUs" in shared.stdout
    alone = plan(recipe, "--plan", "--gpus-per-node", "4")
    assert mem(shared.stdout) == pytest.approx(mem(alone.stdout) + 14.2, abs=0.11)
    own = plan(recipe, "--plan", "--gpus-per-node", "4", "--gpu-memory-gb", "40",
               "reward.model={path: qwen2.5-7b, kind: judge, devices: [0], num_engines: 1}")
    assert own.returncode == 2 and "does not fit 40 GiB" in own.stdout, own.stdout  # the judge tips GPU 0 over
    bad = plan(recipe, "--plan", "--gpus-per-node", "4", "reward.model={path: qwen2.5-7b, devices: [7]}")
    assert bad.returncode == 2 and "reward.model.devices=[7]: [7] not on a node of 4 GPUs" in bad.stdout


def test_engine_options_are_each_engines_own_and_an_empty_override_clears_them():
    proc = plan("launch/configs/recipes/gsm8k_qwen2.5-3b_sglang.yaml", "--plan", "--gpus-per-node", "4")
    assert proc.returncode == 0 and "(mem_fraction_static 0.4:" in proc.stdout, proc.stdout + proc.stderr
    from launch.config import load_config

    recipe = "launch/configs/recipes/arithmetic_curriculum_qwen2.5-0.5b.yaml"
    assert load_config(REPO / recipe).rollout.engine_options["gpu_memory_utilization"] == 0.5
    # `key={}` empties the file's mapping (a merge would keep its entries): how a run swaps vllm for hf
    cfg = load_config(REPO / recipe, ["rollout.engine=hf", "rollout.engine_options={}"])
    assert cfg.rollout.engine_options == {}
