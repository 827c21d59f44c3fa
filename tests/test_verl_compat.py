"""Coming from verl: a dataset written the way verl's GSM8K tool-agent preprocessing writes it
(parquet, `extra_info.tools_kwargs` and `extra_info.interaction_kwargs` without a name) trains
through `launch/train.py` unchanged."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_train import metrics, train  # noqa: E402


def verl_tool_agent_row(example: dict, index: int, split: str) -> dict:
    """The columns verl's gsm8k tool-agent preprocessing produces, with a prompt of our own words."""
    answer = re.search(r"#### (-?[0-9.,]+)", example["answer"]).group(1).replace(",", "")
    question = example["question"] + " Think step by step and give the final answer after `####`."
    return {
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [{"role": "system", "content": "Solve the problem; check your answer with the calc_gsm8k_reward "
                                                 "tool before you give it as `#### <answer>`."},
                   {"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": example["answer"], "question": example["question"],
                       "need_tools_kwargs": True,
                       "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}},
                       "interaction_kwargs": {"query": question, "ground_truth": answer}},
    }


@pytest.mark.skipif(not GSM8K.exists(), reason="needs the GSM8K jsonl beside the repository")
def test_verl_preprocessed_gsm8k_parquet_trains_unchanged(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    examples = [json.loads(line) for line in GSM8K.read_text().splitlines()[:8]]
    rows = [verl_tool_agent_row(e, i, "train") for i, e in enumerate(examples)]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "run"
    common = ["model.path=tiny-llama", "rollout.engine=hf", "sft.enabled=false", "data.task=rows",
              f"data.train_path={data}", "data.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=24",
              "rollout.tools_config=launch/configs/tools_gsm8k.yaml", "trainer.steps=1"]
    proc = train([*common, f"trainer.output_dir={out}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "8 row(s) carry interaction_kwargs but no interaction is loaded" in proc.stderr  # ignored, as verl does
    m = metrics(out)[-1]
    assert m["step"] == 1 and m["rollout/trajectories"] == 4 and m["rollout/model_tokens_mean"] > 0, m
    # with the GSM8K interaction configured, the nameless kwargs go to it (the only one loaded)
    out2 = tmp_path / "run2"
    proc = train([*common, "rollout.interaction_config=launch/configs/interaction_gsm8k.yaml",
                  f"trainer.output_dir={out2}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "no interaction is loaded" not in proc.stderr
    assert metrics(out2)[-1]["rollout/trajectories"] == 4
