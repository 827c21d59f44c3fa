"""Interactions: the per-instance lifecycle, interaction.yaml loading errors, and the GSM8K tutor's
retry flow on real GSM8K problems."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from agent.interactions import BaseInteraction, InteractionConfigError, build_interactions, load_interactions
from agent.interactions.base import last_assistant_text
from agent.interactions.gsm8k import CORRECT, GAVE_UP, NO_ANSWER, WRONG, Gsm8kInteraction
from agent.rewards import extract_answer

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
GSM8K_CLASS = "agent.interactions.gsm8k.Gsm8kInteraction"


@pytest.fixture(scope="module")
def problems() -> list[tuple[str, str, str]]:
    """(question, solution text, ground truth) for the first 20 GSM8K test rows."""
    path = GSM8K_DIR / "test.jsonl"
    if not path.exists():
        pytest.skip(f"GSM8K data not found at {path}; put the dataset's test.jsonl there to run this test")
    with path.open() as f:
        rows = [json.loads(line) for _, line in zip(range(20), f)]
    return [(r["question"], r["answer"], extract_answer(r["answer"])) for r in rows]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "interaction.yaml"
    path.write_text(text)
    return path


class Conversation:
    """Drives an interaction the way the tool agent loop does: append the model's turn, ask the
    interaction, append its reply as the next user turn."""

    def __init__(self, interaction: BaseInteraction, iid: str, question: str) -> None:
        self.interaction, self.iid = interaction, iid
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": question}]

    async def say(self, text: str) -> tuple[bool, str, float]:
        self.messages.append({"role": "assistant", "content": text})
        done, reply, score = await self.interaction.generate_response(self.iid, self.messages)
        if not done:
            self.messages.append({"role": "user", "content": reply})
        return done, reply, score


# ---------------------------------------------------------------- lifecycle

def test_base_lifecycle_keeps_state_per_instance_and_finalize_is_idempotent():
    async def go() -> None:
        inter = BaseInteraction({"name": "echo"})
        assert inter.name == "echo" and BaseInteraction({}).name == "interaction"
        a = await inter.start(topic="x")
        b = await inter.start("fixed-id", topic="y")
        assert b == "fixed-id" and a != b and inter.state(a) == {"topic": "x"}
        with pytest.raises(ValueError, match="'fixed-id' already exists"):
            await inter.start("fixed-id")
        with pytest.raises(NotImplementedError, match="BaseInteraction must implement generate_response"):
            await inter.generate_response(a, [])
        assert await inter.calculate_score(a) == 0.0
        for _ in range(2):
            await inter.finalize(a)
        await inter.finalize("never-started")
        assert list(inter.instances) == ["fixed-id"]
        with pytest.raises(KeyError, match="unknown instance .*call `await interaction.start"):
            inter.state(a)

    asyncio.run(go())


def test_last_assistant_text():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "first"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                                                 {"type": "text", "text": "b"}]}]
    assert last_assistant_text(msgs) == "ab"
    assert last_assistant_text(msgs[:3]) == "first"
    with pytest.raises(ValueError, match=r"no assistant message.*\['user'\]"):
        last_assistant_text(msgs[:1])


# ---------------------------------------------------------------- yaml loading

def test_load_from_yaml(tmp_path):
    path = write(tmp_path, f"""
interaction:
  - class_name: {GSM8K_CLASS}
    config: {{max_retries: 4}}
  - name: strict_tutor
    class_name: {GSM8K_CLASS}
    config: {{max_retries: 0}}
""")
    inters = load_interactions(path)
    assert list(inters) == ["gsm8k", "strict_tutor"]
    assert all(isinstance(i, Gsm8kInteraction) for i in inters.values())
    assert inters["gsm8k"].name == "gsm8k" and inters["gsm8k"].max_retries == 4
    assert inters["strict_tutor"].name == "strict_tutor" and inters["strict_tutor"].max_retries == 0
    assert build_interactions([{"class_name": GSM8K_CLASS}])["gsm8k"].max_retries == 2


@pytest.mark.parametrize("text,match", [
    ("interaction: [oops", r"not valid YAML"),
    ("", r"expected a top-level `interaction:` list.*NoneType"),
    ("tools: []", r"expected a top-level `interaction:` list.*\['tools'\]"),
    ("interaction: [42]", r"interaction\[0\] is 42; expected a mapping"),
    ("interaction: [{config: {}}]", r"interaction\[0\] has no class_name"),
    ("interaction: [{class_name: Gsm8kInteraction}]", r"'Gsm8kInteraction' is not a dotted path"),
    ("interaction: [{class_name: agent.nowhere.Thing}]", r"cannot import module 'agent.nowhere'"),
    ("interaction: [{class_name: agent.interactions.gsm8k.Nope}]", r"has no attribute 'Nope'"),
    ("interaction: [{class_name: agent.tools.calculator.CalculatorTool}]", r"not a subclass of .*BaseInteraction"),
    (f"interaction: [{{class_name: {GSM8K_CLASS}, confg: {{}}}}]", r"unknown key\(s\) \['confg'\].*'config'"),
    (f"interaction: [{{class_name: {GSM8K_CLASS}, config: [1]}}]", r"config is \[1\]; expected a mapping"),
    (f"interaction: [{{class_name: {GSM8K_CLASS}, config: {{max_retries: -1}}}}]",
     r"interaction\[0\] \(.*Gsm8kInteraction\): constructing interaction 'gsm8k' failed: .*max_retries=-1"),
    (f"interaction: [{{class_name: {GSM8K_CLASS}}}, {{name: gsm8k, class_name: {GSM8K_CLASS}}}]",
     r"interaction\[1\] .*duplicate interaction name 'gsm8k'"),
])
def test_bad_yaml_names_the_entry(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(InteractionConfigError, match=match) as info:
        load_interactions(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(InteractionConfigError, match="does not exist"):
        load_interactions(tmp_path / "nope.yaml")


# ---------------------------------------------------------------- the GSM8K tutor

def test_wrong_then_right_across_turns(problems):
    async def go() -> None:
        inter = Gsm8kInteraction({"max_retries": 3})
        for question, solution, gt in problems:
            iid = await inter.start(ground_truth=gt)
            convo = Conversation(inter, iid, question)
            wrong = int(gt) + 7
            assert await convo.say(f"I get {wrong}.") == (False, WRONG, 0.0)
            assert await convo.say("Let me think about it more.") == (False, NO_ANSWER, 0.0)
            assert await inter.calculate_score(iid) == 0.0
            assert await convo.say(solution) == (True, CORRECT, 1.0)  # the dataset's own solution
            assert await inter.calculate_score(iid) == 1.0
            # the model saw two try-again turns, neither with the answer in it
            feedback = [m["content"] for m in convo.messages if m["role"] == "user"][1:]
            assert len(feedback) == 2 and not any(gt in f for f in feedback)
            await inter.finalize(iid)
        assert inter.instances == {}

    asyncio.run(go())


@pytest.mark.parametrize("max_retries", [0, 1, 3])
def test_max_retries_ends_the_interaction(problems, max_retries):
    async def go() -> None:
        question, _, gt = problems[0]
        inter = Gsm8kInteraction({"max_retries": max_retries})
        iid = await inter.start(ground_truth=gt)
        convo = Conversation(inter, iid, question)
        for _ in range(max_retries):
            assert (await convo.say(f"#### {int(gt) + 1}"))[0] is False
        assert await convo.say(f"#### {int(gt) + 1}") == (True, GAVE_UP, 0.0)
        # asked again after it ended: still done, no credit, even for the right answer now
        assert await convo.say(f"#### {gt}") == (True, GAVE_UP, 0.0)
        assert await inter.calculate_score(iid) == 0.0

    asyncio.run(go())


def test_right_first_time_and_answer_forms(problems):
    async def go() -> None:
        inter = Gsm8kInteraction({})
        for text, gt in [("So the total is $1,234.", "1234"), ("#### 18.0", "#### 18"), ("It is 72", 72)]:
            iid = await inter.start(ground_truth=gt)
            assert await Conversation(inter, iid, "q").say(text) == (True, CORRECT, 1.0)
            assert await inter.calculate_score(iid) == 1.0

    asyncio.run(go())


def test_concurrent_trajectories_do_not_share_state(problems):
    async def one(inter: Gsm8kInteraction, question: str, solution: str, gt: str, right: bool) -> float:
        iid = await inter.start(ground_truth=gt)
        try:
            convo = Conversation(inter, iid, question)
            await asyncio.sleep(0)
            await convo.say(solution if right else f"#### {int(gt) + 1}")
            return await inter.calculate_score(iid)
        finally:
            await inter.finalize(iid)

    async def go() -> tuple[list[float], Gsm8kInteraction]:
        inter = Gsm8kInteraction({"max_retries": 1})
        return await asyncio.gather(*[one(inter, q, s, gt, i % 2 == 0) for i, (q, s, gt) in enumerate(problems)]), inter

    scores, inter = asyncio.run(go())
    assert scores == [1.0 if i % 2 == 0 else 0.0 for i in range(len(problems))]
    assert inter.instances == {}


def test_start_needs_a_usable_ground_truth():
    async def go() -> None:
        inter = Gsm8kInteraction({})
        with pytest.raises(ValueError, match="needs ground_truth.*interaction_kwargs"):
            await inter.start()
        with pytest.raises(ValueError, match="'many'"):
            await inter.start(ground_truth="many")
        assert inter.instances == {}
        iid = await inter.start(ground_truth="3")
        with pytest.raises(ValueError, match="no assistant message"):
            await inter.generate_response(iid, [{"role": "user", "content": "q"}])
        with pytest.raises(KeyError, match="unknown instance 'gone'"):
            await inter.generate_response("gone", [{"role": "assistant", "content": "3"}])

    asyncio.run(go())


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_max_retries_validation(bad):
    with pytest.raises(ValueError, match=f"max_retries={bad!r}"):
        Gsm8kInteraction({"max_retries": bad})
