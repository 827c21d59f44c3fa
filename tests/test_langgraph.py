"""SwitchyardChatModel under a real LangGraph ReAct agent on real engine servers: GSM8K rows with
the calculator, mask-1 tokens checked against what the servers logged, one session (and one
engine) per trajectory, the tool's result in the graph's state, and history edits refused."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langgraph.prebuilt", reason="langgraph is not installed (pip install langgraph)")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from agent.chat import ChatEncoder  # noqa: E402
from agent.langgraph import (HistoryEditedError, LangGraphAgentLoop, SwitchyardChatModel,  # noqa: E402
                             calculator_react_agent, calculator_tool, message_to_dict, reply_message)
from agent.loop import AgentContext, AgentLoopOutput  # noqa: E402
from agent.parsers import get_tool_parser  # noqa: E402
from agent.tools.calculator import CalculatorError, safe_eval  # noqa: E402
from rollout.bus.client import GenerateClient  # noqa: E402
from test_chat import HERMES_TEMPLATE  # noqa: E402
from scoring import add_outcome  # noqa: E402
from test_tool_agent import _server_log, _tokenizer, check_against_server  # noqa: E402
from tool_model import gsm8k_rows  # noqa: E402

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
needs_gsm8k = pytest.mark.skipif(not (GSM8K / "test.jsonl").exists(), reason=f"GSM8K jsonl not found in {GSM8K}")

CALCULATOR_OPENAI = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _calculator_results(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(expression, tool message content) for every calculator call answered in `messages`."""
    calls = {c["id"]: c["function"] for m in messages if m["role"] == "assistant" for c in m.get("tool_calls", [])}
    return [(calls[m["tool_call_id"]]["arguments"].get("expression"), m["content"])
            for m in messages if m["role"] == "tool" and m["tool_call_id"] in calls
            and calls[m["tool_call_id"]]["name"] == "calculator"]


def _calculator_says(expression: Any) -> str | None:
    """What the calculator answers a valid expression; None for one a sampled model wrote badly
    (the tool then answers with an error, which no check below counts as an answer)."""
    try:
        value = safe_eval(expression)
    except CalculatorError:
        return None
    return str(int(value) if isinstance(value, float) and value.is_integer() else value)


# ------------------------------------------------------------------ without an engine

def test_bind_tools_converts_tools_to_openai_schemas() -> None:
    @tool
    def lookup(query: str, k: int = 3) -> str:
        """Search the wiki."""
        return query

    class Weather(BaseModel):
        """Current weather of a city."""

        city: str = Field(description="city name")

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        return a + b

    model = SwitchyardChatModel(client=None, tokenizer=None)
    bound = model.bind_tools([calculator_tool(), lookup, Weather, add, CALCULATOR_OPENAI])
    assert bound.bound is model  # one trajectory behind every binding
    schemas = bound.kwargs["tools"]
    assert schemas[0] == CALCULATOR_OPENAI
    assert schemas[1]["function"]["name"] == "lookup"
    assert schemas[1]["function"]["parameters"]["properties"]["k"] == {"type": "integer", "default": 3}
    assert schemas[1]["function"]["parameters"]["required"] == ["query"]
    assert schemas[2]["function"]["name"] == "Weather"
    assert schemas[2]["function"]["parameters"]["properties"]["city"]["description"] == "city name"
    assert schemas[3]["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "first"}
    assert schemas[4] == CALCULATOR_OPENAI
    assert all(s["type"] == "function" for s in schemas)
    with pytest.raises(ValueError, match="tool_choice='any' is not supported"):
        model.bind_tools([add], tool_choice="any")


def test_reply_text_becomes_tool_calls_and_invalid_tool_calls() -> None:
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>')
    msg = reply_message(text, get_tool_parser("hermes"), {"finish_reason": "stop"})
    assert msg.content == "Let me compute."
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("calculator", {"expression": "3*4"})]
    assert len(msg.invalid_tool_calls) == 1 and "bad JSON" in msg.invalid_tool_calls[0]["error"]
    ids = [c["id"] for c in msg.tool_calls + msg.invalid_tool_calls]
    assert all(i and i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert msg.response_metadata["finish_reason"] == "stop"
    assert message_to_dict(msg) == {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"type": "function", "id": ids[0], "function": {"name": "calculator", "arguments": {"expression": "3*4"}}}]}
    plain = reply_message("#### 12", get_tool_parser("hermes"))
    assert plain.content == "#### 12" and not plain.tool_calls and not plain.invalid_tool_calls


def test_sync_calls_and_bad_options_are_refused() -> None:
    model = SwitchyardChatModel(client=None, tokenizer=None)
    with pytest.raises(RuntimeError, match="ainvoke"):
        model.invoke([HumanMessage("2+2?")])
    with pytest.raises(ValueError, match="unknown tool parser 'xml'"):
        SwitchyardChatModel(client=None, tokenizer=None, tool_parser="xml")
    with pytest.raises(ValueError, match="stop_token_ids"):
        asyncio.run(model.ainvoke([HumanMessage("hi")], stop=["\n"]))
    with pytest.raises(ValueError, match="'audio'"):  # images are encoded (tests/test_multimodal.py), audio not
        message_to_dict(HumanMessage(content=[{"type": "audio", "base64": "AAAA", "mime_type": "audio/wav"}]))
    assert message_to_dict(HumanMessage(content=[{"type": "image_url", "image_url": {"url": "x"}}])) == {
        "role": "user", "content": [{"type": "image", "image": "x"}]}
    assert message_to_dict(HumanMessage(content=["a", {"type": "text", "text": "b"}])) == {"role": "user",
                                                                                      "content": "ab"}
    assert message_to_dict(ToolMessage("4", tool_call_id="c1", name="calculator")) == {
        "role": "tool", "content": "4", "tool_call_id": "c1", "name": "calculator"}
    with pytest.raises(ValueError, match="langgraph_agent: unknown key\\(s\\) \\['max_turns'\\]"):
        LangGraphAgentLoop(AgentContext(client=None, tokenizer=None, config={"max_turns": 3}))
    with pytest.raises(ValueError, match="graph_factory='no.such.factory' cannot be imported"):
        LangGraphAgentLoop(AgentContext(client=None, tokenizer=None, config={"graph_factory": "no.such.factory"}))


# ------------------------------------------------------------------ on real engine servers

@needs_gsm8k
def test_react_agent_on_gsm8k_is_token_exact_and_sticky(servers, tool_caller) -> None:
    srv = servers(2, backend="hf", model=str(tool_caller))
    rows = gsm8k_rows(GSM8K / "test.jsonl", 12, agent_name="langgraph_agent")
    tok = _tokenizer(tool_caller)
    config = {"recursion_limit": 7, "max_turn_tokens": 48, "max_response_tokens": 384}

    async def main() -> list[AgentLoopOutput]:
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            loops = [LangGraphAgentLoop(AgentContext(client, tok, config=config)) for _ in rows]
            outs = await asyncio.gather(*(lp.run({"temperature": 0.7, "max_tokens": 48}, **row)
                                          for lp, row in zip(loops, rows)))
            return [await add_outcome(row, out, tok) for row, out in zip(rows, outs)]

    outs = asyncio.run(main())
    sent = _server_log(srv.request_logs)
    prompt_encoder = ChatEncoder(tok, tools=[CALCULATOR_OPENAI])
    engines_used = set()
    for row, out in zip(rows, outs):
        assert out.termination != "error", out.error
        assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
        assert out.num_turns == len(out.request_ids) == len(out.weight_versions) >= 1
        assert out.prompt_ids == prompt_encoder.initial(row["prompt"])  # encoded once, with the bound tools
        check_against_server(out, sent)
        # sticky: every turn carried the trajectory's session id and landed on one engine
        assert {sent[r]["session_id"] for r in out.request_ids} == {out.session_id}
        engines = {sent[r]["engine_id"] for r in out.request_ids}
        assert len(engines) == 1, (out.session_id, engines)
        engines_used |= engines
        assert out.reward in (0.0, 1.0) and out.reward_extra["rule"] == out.reward
    assert len({o.session_id for o in outs}) == len(outs)
    assert len(engines_used) == 2  # trajectories were spread, so one engine per trajectory means something
    # the tool really ran inside the graph: its results sit in the final state next to the calls
    answered = [o for o in outs if any(content == _calculator_says(expr)
                                       for expr, content in _calculator_results(o.messages))]
    assert len(answered) >= len(outs) // 2, [o.messages[-2:] for o in outs]
    assert all(o.num_turns >= 2 for o in answered)


@needs_gsm8k
def test_graph_state_tokens_and_history_edits(servers, tool_caller) -> None:
    srv = servers(1, backend="hf", model=str(tool_caller))
    rows = gsm8k_rows(GSM8K / "test.jsonl", 4)
    tok = _tokenizer(tool_caller)
    sampling = {"temperature": 0.0, "max_tokens": 48}

    async def main() -> dict[str, Any]:
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            models = [SwitchyardChatModel(client=client, tokenizer=tok, sampling_params=sampling) for _ in rows]
            states = await asyncio.gather(*(calculator_react_agent(m).ainvoke({"messages": r["prompt"]},
                                                                                config={"recursion_limit": 7})
                                            for m, r in zip(models, rows)))
            model, msgs = models[0], list(states[0]["messages"])
            before = model.to_agent_loop_output()
            errors = {}
            edited = copy.deepcopy(msgs)
            edited[1].content += " Answer quickly."
            attempts = {
                "edited": edited + [HumanMessage("Again?")],
                "dropped": msgs[:-1] + [HumanMessage("Again?")],
                "injected": msgs + [AIMessage("I am not the engine.")],
                "nothing_new": msgs,
            }
            for name, history in attempts.items():
                with pytest.raises(HistoryEditedError) as e:
                    await model.bind_tools([calculator_tool()]).ainvoke(history)
                errors[name] = str(e.value)
            with pytest.raises(HistoryEditedError) as e:
                await model.ainvoke(msgs + [HumanMessage("Again?")])  # no tools bound this time
            errors["tools"] = str(e.value)
            after_errors = model.to_agent_loop_output()
            reply = await model.bind_tools([calculator_tool()]).ainvoke(msgs + [HumanMessage("Again?")])
            # the bound tools reach the chat template: a template that shows them, one call
            shown = copy.deepcopy(tok)
            shown.chat_template = HERMES_TEMPLATE
            with_tools = SwitchyardChatModel(client=client, tokenizer=shown, sampling_params=sampling)
            await with_tools.bind_tools([calculator_tool()]).ainvoke(rows[0]["prompt"])
            return {"models": models, "states": states, "before": before, "after_errors": after_errors,
                    "errors": errors, "reply": reply, "with_tools": with_tools}

    r = asyncio.run(main())
    sent = _server_log(srv.request_logs)
    for model, state in zip(r["models"][1:], r["states"][1:]):
        check_against_server(model.to_agent_loop_output(), sent)
    # the graph's final state holds the calculator's real answer to the model's call
    answered = []
    for state in r["states"]:
        calls = {c["id"]: c for m in state["messages"] if isinstance(m, AIMessage) for c in m.tool_calls}
        for m in state["messages"]:
            if isinstance(m, ToolMessage) and not m.content.startswith("Error"):
                assert m.content == _calculator_says(calls[m.tool_call_id]["args"]["expression"])
                answered.append(m)
    assert len(answered) >= 2, [s["messages"] for s in r["states"]]
    # what the model tokenized is the graph's history, message for message
    state0 = [message_to_dict(m) for m in r["states"][0]["messages"]]
    assert r["models"][0].messages[:len(state0)] == state0
    # every refused history left the trajectory untouched, naming the problem
    errors = r["errors"]
    assert "message 1 differs" in errors["edited"] and "append-only" in errors["edited"]
    assert f"message {len(state0) - 1} differs" in errors["dropped"]
    assert "assistant message the engine did not generate" in errors["injected"]
    assert "at least one new" in errors["nothing_new"]
    assert "tools changed" in errors["tools"]
    assert r["after_errors"].response_ids == r["before"].response_ids
    assert r["after_errors"].request_ids == r["before"].request_ids
    # and the valid continuation still extends it token-exactly
    out = r["models"][0].to_agent_loop_output()
    assert isinstance(r["reply"], AIMessage) and out.num_turns == r["before"].num_turns + 1
    assert out.response_ids[:len(r["before"].response_ids)] == r["before"].response_ids
    check_against_server(out, sent)
    prompt = tok.decode(r["with_tools"].to_agent_loop_output().prompt_ids)
    assert "<tools>" in prompt and '"name": "calculator"' in prompt and "Evaluate an arithmetic expression." in prompt


@needs_gsm8k
def test_token_budget_ends_the_trajectory_cleanly(servers, tool_caller) -> None:
    srv = servers(1, backend="hf", model=str(tool_caller))
    rows = gsm8k_rows(GSM8K / "test.jsonl", 4)
    tok = _tokenizer(tool_caller)

    async def main() -> list[AgentLoopOutput]:
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            loop = LangGraphAgentLoop(AgentContext(client, tok, config={"max_response_tokens": 40}))
            return await asyncio.gather(*(loop.run({"temperature": 0.0, "max_tokens": 48}, **row) for row in rows))

    outs = asyncio.run(main())
    sent = _server_log(srv.request_logs)
    for out in outs:
        check_against_server(out, sent)
        assert len(out.response_ids) <= 40
    assert any(o.termination == "token_budget" for o in outs), [(o.termination, o.error) for o in outs]
