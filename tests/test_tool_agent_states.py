"""tool_agent's branches driven by scripted replies: limits, budgets, malformed calls, failures,
interactions, and that the appended tokens equal the chat template's rendering.

The model is replaced by a client that returns scripted text as token ids: these tests are
about the state machine, and a real model cannot be made to emit a chosen malformed call.
test_tool_agent.py runs the same loop against real engine servers.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from agent.chat import ChatEncoder
from agent.loop import AgentContext, AgentLoopBase, AgentLoopRegistry
from agent.tool_agent import ToolAgentConfig, ToolAgentLoop, truncate_tokens
from agent.tools import BaseTool, ToolResponse
from agent.tools.calculator import CalculatorTool
from rollout.bus.client import GenerateResult
from scoring import with_outcome  # noqa: E402

SCHEMA = {"type": "function", "function": {"name": "calculator", "description": "math",
                                           "parameters": {"type": "object", "properties": {}}}}
ROW = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 6*7?"}],
       "reward_model": {"style": "rule", "ground_truth": "42"}}


def call(expr: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    from engines.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny-llama"))


class ScriptedClient:
    """Answers each generate with the next scripted reply (closed by the end-of-turn token)."""

    def __init__(self, tok: Any, replies: list[str], fail_at: int | None = None) -> None:
        self.tok, self.replies, self.fail_at = tok, list(replies), fail_at
        self.prompts: list[list[int]] = []
        self.ids = itertools.count()

    async def generate(self, prompt_ids: Any, sampling: dict, session_id: str | None = None,
                       group_id: str | None = None, min_weight_version: int = 0) -> GenerateResult:
        i = next(self.ids)
        if i == self.fail_at:
            raise RuntimeError("engine went away")
        self.prompts.append(list(prompt_ids))
        text = self.replies[min(i, len(self.replies) - 1)]
        ids = (self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id])
        reason = "stop"
        if len(ids) > sampling["max_tokens"]:
            ids, reason = ids[:sampling["max_tokens"]], "length"
        return GenerateResult(ids, [-0.5] * len(ids), reason, 3, "e0", 0, 0, 1, f"r{i}")

    def end_session(self, session_id: str) -> None:
        pass


class Counting(CalculatorTool):
    def __init__(self, config: dict[str, Any], schema: dict[str, Any]) -> None:
        super().__init__(config, schema)
        self.created = self.released = 0

    async def create(self, instance_id: str | None = None, **kw: Any) -> str:
        self.created += 1
        return await super().create(instance_id, **kw)

    async def release(self, instance_id: str) -> None:
        self.released += 1
        await super().release(instance_id)


def run(tok: Any, replies: list[str], config: dict[str, Any] | None = None, row: dict | None = None,
        fail_at: int | None = None, tools: dict[str, BaseTool] | None = None, interactions: dict | None = None):
    client = ScriptedClient(tok, replies, fail_at)
    tools = tools if tools is not None else {"calculator": Counting({}, SCHEMA)}
    loop = ToolAgentLoop(AgentContext(client, tok, tools, interactions or {}, config or {}))
    out = asyncio.run(loop.run({"temperature": 1.0, "max_tokens": 256}, **(row or ROW)))
    out.check()
    with_outcome(row or ROW, out, tok)  # as the agent worker adds it
    return out, client, tools


def test_tool_round_trip_matches_the_template_rendering(tok):
    out, client, tools = run(tok, [call("6*7"), "The answer is #### 42"])
    assert out.termination == "stop" and out.num_turns == 2
    assert [m["role"] for m in out.messages] == ["user", "assistant", "tool", "assistant"]
    assert out.messages[2]["content"] == "42"
    # what the loop appended equals the template's own rendering of the final conversation
    # (up to the template's newline after the final end-of-turn token, which no one generates)
    full = ChatEncoder(tok).render(out.messages, add_generation_prompt=False)
    ours = out.prompt_ids + out.response_ids
    assert full[:len(ours)] == ours and tok.decode(full[len(ours):]) == "\n"
    # the second request continued the trajectory exactly
    assert client.prompts[1] == out.prompt_ids + out.response_ids[:len(client.prompts[1]) - len(out.prompt_ids)]
    assert out.reward == 1.0 and out.weight_versions == [3, 3] and out.request_ids == ["r0", "r1"]
    assert tools["calculator"].created == tools["calculator"].released == 1


def test_calls_beyond_max_parallel_get_an_observation(tok):
    out, _, _ = run(tok, [call("1+1") + call("2+2") + call("3+3"), "done"], {"max_parallel_calls": 2})
    obs = [m["content"] for m in out.messages if m["role"] == "tool"]
    assert obs[:2] == ["2", "4"] and "was not run: at most 2 tool calls per turn" in obs[2]
    assert next(t for t in out.turns if t["kind"] == "tools")["skipped"] == 1


def test_malformed_call_becomes_an_error_observation_and_is_penalised(tok):
    out, _, _ = run(tok, ['<tool_call>{"name": "calculator", "arguments": {oops</tool_call>', "#### 42"],
                    {"reward_shaping": {"invalid_call_penalty": 0.5}})
    obs = [m["content"] for m in out.messages if m["role"] == "tool"]
    assert len(obs) == 1 and obs[0].startswith("Error:")
    assert out.termination == "stop" and out.reward == pytest.approx(0.5)


def test_unknown_tool_name_is_reported_to_the_model(tok):
    out, _, _ = run(tok, ['<tool_call>{"name": "browser", "arguments": {}}</tool_call>', "ok"])
    assert "unknown tool 'browser'" in out.messages[2]["content"]


def test_turn_limit_and_budget_terminations(tok):
    out, client, _ = run(tok, [call("1+1")], {"max_assistant_turns": 3})
    assert out.termination == "max_assistant_turns" and out.num_turns == 3 and len(client.prompts) == 3
    out, _, _ = run(tok, [call("1+1")], {"max_assistant_turns": 50, "max_response_tokens": 120})
    assert out.termination == "token_budget" and len(out.response_ids) <= 120
    out, _, _ = run(tok, ["word " * 100], {"max_turn_tokens": 16})
    assert out.termination == "length" and sum(out.response_mask) == 16


def test_client_failure_is_an_error_output_and_tools_are_released(tok):
    out, _, tools = run(tok, [call("1+1"), "x"], fail_at=1)
    assert out.termination == "error" and "engine went away" in out.error
    assert tools["calculator"].created == tools["calculator"].released == 1


def test_truncate_tokens_sides(tok):
    text = " ".join(str(i) for i in range(2000))
    for side, keeps_start, keeps_end in (("right", True, False), ("left", False, True), ("middle", True, True)):
        cut, was_cut = truncate_tokens(tok, text, 50, side)
        assert was_cut and len(tok.encode(cut, add_special_tokens=False)) <= 50 + 8
        assert cut.startswith("0 1 2") == keeps_start and cut.endswith("1998 1999") == keeps_end
    assert truncate_tokens(tok, "short", 50, "middle") == ("short", False)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="truncate_side='up'"):
        ToolAgentConfig(truncate_side="up")
    with pytest.raises(ValueError, match="tool_agent: unknown key\\(s\\) \\['max_turns'\\]"):
        ToolAgentConfig.from_mapping({"max_turns": 3})
    with pytest.raises(ValueError, match="unknown tool parser 'xml'"):
        ToolAgentConfig(tool_parser="xml")
    with pytest.raises(ValueError, match="max_parallel_calls=0"):
        ToolAgentConfig(max_parallel_calls=0)


class MyLoop(AgentLoopBase):
    pass


def test_registry_resolves_builtins_and_dotted_paths():
    reg = AgentLoopRegistry({"mine": f"{__name__}.MyLoop"})
    assert reg.get("tool_agent") is ToolAgentLoop and reg.get("mine") is MyLoop
    assert reg.get(None).__name__ == "SingleTurnAgentLoop"
    with pytest.raises(KeyError, match="unknown agent_name 'nope'"):
        reg.get("nope")
    with pytest.raises(ValueError, match="not a subclass"):
        AgentLoopRegistry({"bad": "agent.tool_agent.ToolAgentConfig"})
    with pytest.raises(ValueError, match="cannot import"):
        AgentLoopRegistry({"bad": "agent.nowhere.Loop"})


def _tutor(max_retries: int = 2) -> Any:
    from agent.interactions.gsm8k import Gsm8kInteraction

    class Tracked(Gsm8kInteraction):
        finalized: list[str] = []

        async def finalize(self, instance_id: str) -> None:
            self.finalized.append(instance_id)
            await super().finalize(instance_id)

    return Tracked({"name": "gsm8k", "max_retries": max_retries})


ROW_TUTOR = {**ROW, "interaction_kwargs": {"name": "gsm8k", "ground_truth": "42"}}


def test_interaction_lets_the_model_retry(tok):
    tutor = _tutor()
    out, client, _ = run(tok, ["#### 41", call("6*7"), "#### 42"], row=ROW_TUTOR, interactions={"gsm8k": tutor})
    assert out.termination == "interaction_done" and out.num_turns == 3
    assert [m["role"] for m in out.messages] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
    assert "wrong" in out.messages[2]["content"] and "42" not in out.messages[2]["content"]
    assert out.reward_extra["interaction"] == 1.0 and out.reward == 2.0  # rule reward + interaction score
    full = ChatEncoder(tok).render(out.messages, add_generation_prompt=False)
    assert full[:len(out.prompt_ids) + len(out.response_ids)] == out.prompt_ids + out.response_ids
    assert len(tutor.finalized) == 1 and tutor.instances == {}


def test_verl_rows_keep_interaction_kwargs_in_extra_info_without_a_name(tok):
    """verl's GSM8K tool-agent rows: `extra_info.interaction_kwargs` = {query, ground_truth}, no name.
    With one interaction loaded it is the one; with none loaded the kwargs are ignored."""
    row = {**ROW, "extra_info": {"interaction_kwargs": {"query": "What is 6*7?", "ground_truth": "42"}}}
    tutor = _tutor()
    out, _, _ = run(tok, ["#### 41", "#### 42"], row=row, interactions={"gsm8k": tutor})
    assert out.termination == "interaction_done" and out.num_turns == 2 and len(tutor.finalized) == 1
    assert out.reward_extra["interaction"] == 1.0
    out, _, _ = run(tok, ["#### 41"], row=row, interactions={})
    assert out.termination == "stop" and out.num_turns == 1 and not out.error
    two = {"gsm8k": _tutor(), "other": _tutor()}
    out, _, _ = run(tok, ["#### 42"], row=row, interactions=two)
    assert out.termination == "error" and "has no name" in out.error


FUNCTIONS = '''
from typing import Literal


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number,
            zero if left out
    """
    return a + b


async def shout(text: str, style: Literal["upper", "lower"] = "upper") -> dict:
    """Change the case of a text."""
    return {"text": text.upper() if style == "upper" else text.lower()}


def _helper() -> None:
    pass
'''


def test_a_file_of_two_functions_becomes_tools_that_run_in_a_trajectory(tok, tmp_path):
    from agent.tools import load_tools

    (tmp_path / "my_tools.py").write_text(FUNCTIONS)
    (tmp_path / "tools.yaml").write_text("functions:\n  - source: my_tools.py\n")
    tools = load_tools(tmp_path / "tools.yaml")
    assert sorted(tools) == ["add", "shout"]  # public functions only
    add = tools["add"].tool_schema["function"]
    assert add["description"] == "Add two integers." and add["parameters"] == {
        "type": "object", "required": ["a"],
        "properties": {"a": {"type": "integer", "description": "the first number"},
                       "b": {"type": "integer", "description": "the second number, zero if left out"}}}
    assert tools["shout"].tool_schema["function"]["parameters"]["properties"]["style"] == {
        "enum": ["upper", "lower"], "type": "string"}
    replies = ['<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>',
               '<tool_call>{"name": "shout", "arguments": {"text": "done"}}</tool_call>'
               '<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>',
               "#### 42"]
    out, _, _ = run(tok, replies, {"max_assistant_turns": 4}, tools=tools)
    observations = [m["content"] for m in out.messages if m["role"] == "tool"]
    assert observations[0] == "42" and observations[1] == '{"text": "DONE"}'
    assert "takes no argument(s) ['c']" in observations[2] and "missing required argument(s) ['a']" in observations[2]
    assert out.termination == "stop" and out.reward == 1.0


def test_user_turn_limit_and_finalize_on_failure(tok):
    tutor = _tutor(max_retries=10)
    out, _, _ = run(tok, ["#### 1"], {"max_user_turns": 2}, row=ROW_TUTOR, interactions={"gsm8k": tutor})
    assert out.termination == "max_user_turns" and out.num_turns == 3 and out.reward == 0.0
    out, _, _ = run(tok, ["#### 1"], row=ROW_TUTOR, interactions={"gsm8k": tutor}, fail_at=1)
    assert out.termination == "error" and len(tutor.finalized) == 2 and tutor.instances == {}
    out, _, _ = run(tok, ["#### 1"], row={**ROW, "interaction_kwargs": {"name": "nope"}}, interactions={"gsm8k": tutor})
    assert out.termination == "error" and "interaction 'nope' is not loaded" in out.error


def test_shipped_tool_and_interaction_configs_load(tok):
    from pathlib import Path

    from agent.interactions import load_interactions
    from agent.tools import load_tools

    configs = Path(__file__).resolve().parents[1] / "launch" / "configs"
    tools = load_tools(configs / "tools_gsm8k.yaml")
    interactions = load_interactions(configs / "interaction_gsm8k.yaml")
    assert sorted(tools) == ["calc_gsm8k_reward", "calculator"] and list(interactions) == ["gsm8k"]
    row = {**ROW_TUTOR, "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "42"}}}}}
    submit = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "42"}}</tool_call>'
    out, _, _ = run(tok, [call("6*7"), submit, "#### 42"], row=row, tools=tools, interactions=interactions)
    assert out.termination == "interaction_done" and out.reward_extra["tool"] == 1.0
    assert [m["content"] for m in out.messages if m["role"] == "tool"][0] == "42"
