"""Rule rewards on real GSM8K solutions, strict vs flexible extraction, and the shaping terms."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from agent.rewards import (FALLBACK_SCORER, RULE_SCORERS, ShapingConfig, TrajectoryStats, extract_answer,
                           gsm8k_reward, loop_reward, rule_reward, shape)
from agent.rewards.gsm8k import to_number

GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def gsm8k_rows(split: str = "test", n: int = 200) -> list[dict[str, Any]]:
    path = GSM8K_DIR / f"{split}.jsonl"
    if not path.exists():
        pytest.skip(f"GSM8K data not found at {path}; put the dataset's {split}.jsonl there to run this test")
    with path.open() as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def perturb(answer_text: str) -> str:
    """The same solution with its final number changed by one."""
    head, tail = answer_text.rsplit("####", 1)
    value = to_number(tail)
    return f"{head}#### {value + 1}"


def verl_row(gsm_row: dict[str, Any], source: str = "openai/gsm8k", **reward_model: Any) -> dict[str, Any]:
    gt = extract_answer(gsm_row["answer"], "strict")
    return {"data_source": source, "prompt": [{"role": "user", "content": gsm_row["question"]}],
            "reward_model": {"style": "rule", "ground_truth": gt, **reward_model}, "extra_info": {}}


def test_every_dataset_answer_scores_one_and_a_perturbed_one_zero():
    rows = gsm8k_rows()
    assert len(rows) == 200
    for row in rows:
        gt = extract_answer(row["answer"], "strict")
        assert gt is not None and re.fullmatch(r"-?\d+(\.\d+)?", gt), row["answer"]
        wrong = perturb(row["answer"])
        for method in ("strict", "flexible"):
            assert gsm8k_reward(row["answer"], gt, method=method) == 1.0, row["answer"]
            assert gsm8k_reward(wrong, gt, method=method) == 0.0, wrong
        # the raw "#### N" tail and the whole solution are valid ground truths too
        assert gsm8k_reward(row["answer"], "####" + row["answer"].rsplit("####", 1)[1]) == 1.0
        assert gsm8k_reward(row["answer"], row["answer"]) == 1.0
        assert gsm8k_reward(wrong, gt, format_score=0.1) == 0.1
        assert rule_reward(verl_row(row), row["answer"]) == 1.0
        assert rule_reward(verl_row(row), wrong) == 0.0


def test_dataset_answers_with_thousands_separators_are_read_whole():
    rows = [r for r in gsm8k_rows("test", 1319) if "," in r["answer"].rsplit("####", 1)[1]]
    assert rows, "the GSM8K test split has answers like '#### 2,125'"
    for row in rows:
        tail = row["answer"].rsplit("####", 1)[1].strip()
        assert extract_answer(row["answer"]) == tail.replace(",", "")
        assert gsm8k_reward(row["answer"], tail) == 1.0


def test_strict_needs_the_marker_and_flexible_takes_the_last_number():
    text = "6 * 7 = 42, so the answer is 42."
    assert extract_answer(text, "strict") is None and extract_answer(text, "flexible") == "42"
    assert gsm8k_reward(text, "42", method="strict") == 0.0
    assert gsm8k_reward(text, "42", method="flexible") == 1.0
    # strict reads the number after the LAST marker; flexible reads whatever number came last
    text = "#### 40\nWait, recount: #### 42\nI checked 3 times."
    assert extract_answer(text, "strict") == "42" and extract_answer(text, "flexible") == "3"
    # a marker with no number after it is no answer in strict mode, even if numbers precede it
    assert extract_answer("I think 42 ####", "strict") is None
    assert extract_answer("I think 42 ####", "flexible") == "42"


@pytest.mark.parametrize("text,strict,flexible", [
    ("#### $1,234.50", "1234.50", "1234.50"),
    ("#### -7", "-7", "-7"),
    ("#### -$5", "-5", "-5"),
    ("it fell to -3 degrees", None, "-3"),
    ("pages 3-5", None, "5"),            # a hyphen between numbers is not a sign
    ("counts 3,4,5", None, "5"),         # commas only group thousands
    ("The answer is 72.", None, "72"),   # sentence period is not a decimal point
    ("no digits here", None, None),
])
def test_extraction_cases(text, strict, flexible):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_unknown_method_names_it_and_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'lenient'.*\['strict', 'flexible'\]"):
        extract_answer("#### 1", "lenient")
    row = {"data_source": "gsm8k", "reward_model": {"style": "rule", "ground_truth": "1", "method": "lenient"}}
    with pytest.raises(ValueError, match="lenient"):
        rule_reward(row, "#### 1")


@pytest.mark.parametrize("gt", ["1,234", "1234", 1234, 1234.0, "#### 1,234", "$1,234", "1234.00", Decimal("1234")])
def test_ground_truth_forms_compare_numerically(gt):
    assert gsm8k_reward("so #### 1234.0", gt) == 1.0
    assert gsm8k_reward("so #### 1235", gt) == 0.0


@pytest.mark.parametrize("gt", ["three", "3/4", None, True, float("nan"), ""])
def test_unusable_ground_truth_raises_naming_it(gt):
    with pytest.raises(ValueError, match=re.escape(repr(gt))):
        gsm8k_reward("#### 3", gt)


def test_format_score_and_score():
    assert gsm8k_reward("#### 5", "6", format_score=0.1, score=2.0) == 0.1
    assert gsm8k_reward("#### 6", "6", format_score=0.1, score=2.0) == 2.0
    assert gsm8k_reward("six", "6", format_score=0.1) == 0.0  # no answer earns nothing


def test_scorers_by_data_source():
    assert {"openai/gsm8k", "gsm8k", "arithmetic"} <= set(RULE_SCORERS)
    free_text = "The result is 12"

    def row(source: str | None, **rm: Any) -> dict[str, Any]:
        return {"data_source": source, "reward_model": {"style": "rule", "ground_truth": "12", **rm}}

    assert rule_reward(row("openai/gsm8k"), free_text) == 0.0       # strict by default
    assert rule_reward(row("gsm8k"), "#### 12") == 1.0
    assert rule_reward(row("arithmetic"), free_text) == 1.0         # flexible by default
    assert rule_reward(row("arithmetic", method="strict"), free_text) == 0.0
    assert rule_reward(row("gsm8k", method="flexible"), free_text) == 1.0
    assert rule_reward(row("gsm8k", format_score=0.2), "#### 13") == 0.2
    # unknown data_source with a ground truth: numeric, flexible fallback
    assert rule_reward(row("my/dataset"), free_text) == 1.0
    assert rule_reward(row(None), "13") == 0.0
    assert FALLBACK_SCORER("12", "12", {}) == 1.0


def test_rows_without_a_rule_reward_give_none():
    assert rule_reward({"data_source": "gsm8k"}, "#### 1") is None
    assert rule_reward({"data_source": "gsm8k", "reward_model": {"style": "model", "ground_truth": "1"}}, "1") is None
    assert rule_reward({"data_source": "my/dataset", "reward_model": {"style": "rule"}}, "1") is None
    with pytest.raises(ValueError, match="'gsm8k'.*no ground_truth"):
        rule_reward({"data_source": "gsm8k", "reward_model": {"style": "rule"}}, "#### 1")


def test_shaping_math():
    cfg = ShapingConfig(tool_success_bonus=0.1, invalid_call_penalty=0.25, turn_limit_penalty=0.5,
                        max_tool_bonus_calls=3)
    terms = shape(TrajectoryStats(tool_calls=6, tool_successes=5, invalid_calls=2, hit_turn_limit=True), cfg)
    assert terms == pytest.approx({"tool_bonus": 0.3, "invalid_call_penalty": -0.5, "turn_limit_penalty": -0.5})
    terms = shape(TrajectoryStats(tool_calls=2, tool_successes=2), cfg)
    assert terms == pytest.approx({"tool_bonus": 0.2, "invalid_call_penalty": 0.0, "turn_limit_penalty": 0.0})
    uncapped = ShapingConfig(tool_success_bonus=0.1)
    assert shape(TrajectoryStats(tool_calls=7, tool_successes=7), uncapped)["tool_bonus"] == pytest.approx(0.7)
    assert shape(TrajectoryStats(tool_calls=7, tool_successes=7), ShapingConfig(max_tool_bonus_calls=0)) == \
        {"tool_bonus": 0.0, "invalid_call_penalty": 0.0, "turn_limit_penalty": 0.0}


@pytest.mark.parametrize("field,value", [("tool_success_bonus", -0.1), ("invalid_call_penalty", -1),
                                         ("turn_limit_penalty", float("inf")), ("turn_limit_penalty", "0.5"),
                                         ("max_tool_bonus_calls", -1), ("max_tool_bonus_calls", 1.5)])
def test_shaping_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"reward_shaping.{field}="):
        ShapingConfig(**{field: value})


def test_shaping_from_mapping_rejects_unknown_keys_listing_the_allowed():
    assert ShapingConfig.from_mapping({"invalid_call_penalty": 1}) == ShapingConfig(invalid_call_penalty=1.0)
    assert ShapingConfig.from_mapping(None) == ShapingConfig()
    with pytest.raises(ValueError, match=r"\['tool_bonus'\].*'tool_success_bonus'.*'max_tool_bonus_calls'"):
        ShapingConfig.from_mapping({"tool_bonus": 0.1})


def test_trajectory_stats_validation():
    with pytest.raises(ValueError, match="tool_calls=-1"):
        TrajectoryStats(tool_calls=-1)
    with pytest.raises(ValueError, match="tool_successes=3 exceeds tool_calls=2"):
        TrajectoryStats(tool_calls=2, tool_successes=3)


def scored(row: dict[str, Any], answer: str | None, loop_parts: tuple[float, dict[str, float]] | None = None,
           reward: dict[str, Any] | None = None) -> Any:
    """A finished single-turn trajectory with the loop's parts, its outcome added as the agent worker adds it."""
    import asyncio

    from agent.loop import AgentLoopOutput
    from agent.rewards.outcome import OutcomeScorer

    total, parts = loop_parts or loop_reward()
    out = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.5], reward=total,
                          num_turns=1, termination="stop", reward_extra=parts, answer_text=answer)
    asyncio.run(OutcomeScorer(reward).score(row, out, tokenizer=None))
    return out


def test_the_loop_parts_and_the_outcome_sum_to_the_reward_and_are_listed():
    row = verl_row(gsm8k_rows(n=1)[0])
    answer = gsm8k_rows(n=1)[0]["answer"]
    stats = TrajectoryStats(tool_calls=3, tool_successes=2, invalid_calls=1, hit_turn_limit=True)
    shaping = {"tool_success_bonus": 0.1, "invalid_call_penalty": 0.2, "turn_limit_penalty": 0.3}
    total, parts = loop_reward(shaping, stats, tool_reward=0.5, interaction_score=1.0)
    assert "rule" not in parts  # the outcome is never a loop's
    assert total == pytest.approx(0.5 + 1.0 + 0.2 - 0.2 - 0.3) == pytest.approx(sum(parts.values()))
    # a ShapingConfig works the same as its mapping
    assert loop_reward(ShapingConfig(**shaping), stats, 0.5, 1.0) == (total, parts)
    out = scored(row, answer, (total, parts))
    assert out.reward_extra == pytest.approx({"rule": 1.0, "tool": 0.5, "tool_step": 0.0, "interaction": 1.0,
                                              "tool_bonus": 0.2, "invalid_call_penalty": -0.2,
                                              "turn_limit_penalty": -0.3})
    assert out.reward == pytest.approx(1.0 + total) == pytest.approx(sum(out.reward_extra.values()))
    assert all(isinstance(v, float) for v in out.reward_extra.values())


def test_the_rule_outcome_of_single_turn_answers():
    rows = gsm8k_rows(n=3)
    for r in rows:
        out = scored(verl_row(r), r["answer"])
        assert out.reward == 1.0 and out.termination == "stop"
        assert out.reward_extra == {"rule": 1.0, "tool": 0.0, "tool_step": 0.0, "interaction": 0.0, "tool_bonus": 0.0,
                                    "invalid_call_penalty": 0.0, "turn_limit_penalty": 0.0}
        assert scored(verl_row(r), perturb(r["answer"])).reward == 0.0
    # no rule reward: the rule component is 0, still listed; no answer text (an environment scored it): no rule
    out = scored({"prompt": []}, "anything")
    assert out.reward == 0.0 and out.reward_extra["rule"] == 0.0 and out.reward_extra["interaction"] == 0.0
    assert scored(verl_row(rows[0]), None).reward_extra["rule"] == 0.0
    with pytest.raises(ValueError, match="unknown key"):
        loop_reward({"bonus": 1})


def test_a_text_answer_the_rule_cannot_read_fails_its_trajectory_and_a_function_replaces_the_rule(tmp_path):
    row = {"prompt": [{"role": "user", "content": "Which animal?"}], "data_source": "zoo",
           "reward_model": {"style": "rule", "ground_truth": "tiger"}}
    out = scored(row, "a tiger")
    assert out.termination == "error" and "not a number" in out.error and "reward.function" in out.error
    fn = tmp_path / "zoo.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return float(ground_truth in solution_str)\n")

    class Decoder:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "a tiger"

    import asyncio

    from agent.loop import AgentLoopOutput
    from agent.rewards.outcome import OutcomeScorer

    out = AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[-0.5], reward=0.0,
                          num_turns=1, termination="stop", reward_extra=loop_reward()[1], answer_text="a tiger")
    asyncio.run(OutcomeScorer({"function": f"{fn}:compute_score"}).score(row, out, Decoder()))
    assert out.termination == "stop" and out.reward == 1.0
    assert out.reward_extra["function"] == 1.0 and out.reward_extra["rule"] == 0.0
