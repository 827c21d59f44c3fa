"""Coming from verl: a dataset written the way verl's GSM8K tool-agent preprocessing writes it
(parquet, `extra_info.tools_kwargs` and `extra_info.interaction_kwargs` without a name) trains
through `launch/train.py` unchanged, and a tool class written to verl's contract (no verl import,
no switchyard base class) runs in the tool agent with its step rewards and all four kwargs blocks."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_tool_agent_states import run, tok  # noqa: E402,F401 (fixture)
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
    common = ["model.path=tiny-llama", "data.val_path=null", "rollout.engine=hf", "rollout.in_process=true",
              "sft.enabled=false", "data.task=rows",
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


class ToolResponse:
    """Shaped like verl's: a `text` field (the tool below uses it the way verl tools do)."""

    def __init__(self, text: str = "") -> None:
        self.text = text


class GuessTool:
    """Written to verl's tool contract: attribute access to the schema, create -> (id, response),
    execute(instance_id, parameters, **kwargs) -> (response, step_reward, metrics)."""

    calls: list = []

    def __init__(self, config: dict, tool_schema) -> None:
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema.function.name
        self._instance_dict: dict = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or f"g{len(self._instance_dict)}"
        self._instance_dict[instance_id] = {"truth": ground_truth, "best": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        GuessTool.calls.append(("execute", kwargs))
        right = str(parameters.get("answer")) == self._instance_dict[instance_id]["truth"]
        step = kwargs.get("right_bonus", 0.1) if right else kwargs.get("wrong_penalty", -0.05)
        return ToolResponse(text="correct" if right else "try again"), step, {"right": right, "note": "text"}

    async def calc_reward(self, instance_id, **kwargs):
        GuessTool.calls.append(("calc_reward", kwargs))
        return kwargs.get("scale", 1.0) * 0.5

    async def release(self, instance_id, **kwargs):
        GuessTool.calls.append(("release", kwargs))
        self._instance_dict.pop(instance_id, None)


def test_a_verl_contract_tool_runs_with_step_rewards_and_every_kwargs_block(tok, tmp_path):  # noqa: F811
    from agent.tools import load_tools
    from agent.tools.verl_compat import VerlTool

    (tmp_path / "tools.yaml").write_text("""tools:
  - class_name: test_verl_compat.GuessTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: guess
        description: Submit a guess.
        parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}
""")
    tools = load_tools(tmp_path / "tools.yaml")
    assert isinstance(tools["guess"], VerlTool) and tools["guess"].inner.name == "guess"
    GuessTool.calls.clear()
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "6*7?"}],
           "reward_model": {"style": "rule", "ground_truth": "42"},
           "extra_info": {"tools_kwargs": {"guess": {
               "create_kwargs": {"ground_truth": "42"}, "execute_kwargs": {"right_bonus": 0.3},
               "calc_reward_kwargs": {"scale": 2.0}, "release_kwargs": {"why": "done"}}}}}
    replies = ['<tool_call>{"name": "guess", "arguments": {"answer": "41"}}</tool_call>',
               '<tool_call>{"name": "guess", "arguments": {"answer": "42"}}</tool_call>', "#### 42"]
    out, _, _ = run(tok, replies, {"max_assistant_turns": 4}, row=row, tools=tools)
    assert [m["content"] for m in out.messages if m["role"] == "tool"] == ["try again", "correct"]
    parts = out.reward_extra
    assert parts["tool_step"] == pytest.approx(-0.05 + 0.3)  # each call's step reward, summed
    assert parts["tool"] == pytest.approx(1.0) and parts["rule"] == 1.0  # calc_reward got its kwargs (scale 2)
    assert out.reward == pytest.approx(sum(parts.values()))
    assert GuessTool.calls == [("execute", {"right_bonus": 0.3}), ("execute", {"right_bonus": 0.3}),
                               ("calc_reward", {"scale": 2.0}), ("release", {"why": "done"})]
    assert tools["guess"].inner._instance_dict == {}  # released


class TutorInteraction:
    """Written to verl's interaction contract (as its GSM8K example is): async methods, kwargs from
    the row on every call, (should_terminate, text, turn_score, extra) from generate_response."""

    log: list = []

    def __init__(self, config: dict) -> None:
        self.config, self.name = config, config.get("name", "interaction_agent")
        self._instance_dict: dict = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        instance_id = instance_id or f"t{len(self._instance_dict)}"
        self._instance_dict[instance_id] = {"truth": ground_truth}
        TutorInteraction.log.append(("start", ground_truth, kwargs))
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        said = messages[-1]["content"]
        right = said.strip().endswith(self._instance_dict[instance_id]["truth"])
        TutorInteraction.log.append(("respond", kwargs.get("query")))
        if right:
            return True, "Correct.", 1.0, {}
        return False, "Not quite, try again.", 0.0, {"hint": True}

    async def calculate_score(self):  # verl's base signature: no instance id
        return 0.0

    async def finalize_interaction(self, instance_id, **kwargs):
        TutorInteraction.log.append(("finalize", instance_id in self._instance_dict))
        self._instance_dict.pop(instance_id, None)


def test_a_verl_contract_interaction_runs_in_the_tool_agent(tok, tmp_path):  # noqa: F811
    """Named in a verl-format interaction.yaml, selected by a row without a name (the only one loaded),
    given the row's interaction_kwargs on every call; its last turn score is the interaction reward."""
    from agent.interactions import load_interactions
    from agent.interactions.verl_compat import VerlInteraction

    (tmp_path / "interaction.yaml").write_text(
        "interaction:\n  - name: tutor\n    class_name: test_verl_compat.TutorInteraction\n    config: {}\n")
    inters = load_interactions(tmp_path / "interaction.yaml")
    assert isinstance(inters["tutor"], VerlInteraction) and inters["tutor"].inner.name == "tutor"
    TutorInteraction.log.clear()
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "6*7?"}],
           "reward_model": {"style": "rule", "ground_truth": "42"},
           "extra_info": {"interaction_kwargs": {"query": "6*7?", "ground_truth": "42"}}}
    out, _, _ = run(tok, ["#### 41", "#### 42"], {"max_assistant_turns": 4, "max_user_turns": 3},
                    row=row, tools={}, interactions=inters)
    assert out.termination == "interaction_done" and out.num_turns == 2
    assert [t["score"] for t in out.turns if t["kind"] == "interaction"] == [0.0, 1.0]
    assert out.reward_extra["interaction"] == 1.0 and out.reward_extra["rule"] == 1.0
    assert [m["content"] for m in out.messages if m["role"] == "user"][-1] == "Not quite, try again."
    assert TutorInteraction.log == [("start", "42", {"query": "6*7?"}), ("respond", "6*7?"), ("respond", "6*7?"),
                                    ("finalize", True)]
    assert inters["tutor"].instances == {} and inters["tutor"].inner._instance_dict == {}
