"""tool_agent on real engine servers: GSM8K rows with the calculator, token-exact masks checked
against what the servers logged, misbehaving tools, and asyncio concurrency."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from agent.loop import AgentContext, AgentLoopOutput
from agent.tool_agent import ToolAgentLoop
from agent.tools import BaseTool, ToolResponse
from agent.tools.calculator import CalculatorTool
from rollout.bus.client import GenerateClient
from tool_model import CALCULATOR_SCHEMA, gsm8k_rows

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
pytestmark = pytest.mark.skipif(not (GSM8K / "test.jsonl").exists(), reason=f"GSM8K jsonl not found in {GSM8K}")


def _server_log(paths: list[Path]) -> dict[str, dict[str, Any]]:
    sent: dict[str, dict[str, Any]] = {}
    for p in paths:
        for line in p.read_text().splitlines():
            rec = json.loads(line)
            sent[rec["rid"]] = rec
    return sent


def check_against_server(out: AgentLoopOutput, sent: dict[str, dict[str, Any]]) -> None:
    """Mask-1 tokens are exactly the engines' tokens in order, and each request continued the
    trajectory exactly where it stood (prompt length = prompt + response so far)."""
    out.check()
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
    engine_tokens: list[int] = []
    pos = 0  # response position where the next generation starts
    for rid in out.request_ids:
        rec = sent[rid]
        assert rec["prompt_len"] == len(out.prompt_ids) + pos, f"{rid} did not continue the trajectory"
        assert out.response_mask[pos:pos + len(rec["token_ids"])] == [1] * len(rec["token_ids"])
        assert out.response_ids[pos:pos + len(rec["token_ids"])] == rec["token_ids"]
        engine_tokens += rec["token_ids"]
        pos += len(rec["token_ids"])
        while pos < len(out.response_mask) and out.response_mask[pos] == 0:
            pos += 1
    assert pos == len(out.response_ids)
    assert out.model_token_ids() == engine_tokens
    assert all(lp == 0.0 for lp, m in zip(out.response_logprobs, out.response_mask) if not m)
    assert all(lp <= 0.0 for lp, m in zip(out.response_logprobs, out.response_mask) if m)


def _tokenizer(path: Path | str) -> Any:
    from transformers import AutoTokenizer

    from engines.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(str(path)))


def _calculator() -> CalculatorTool:
    return CalculatorTool({}, CALCULATOR_SCHEMA)


async def _run_rows(addresses: list[str], tokenizer: Any, rows: list[dict], tools: list[dict[str, BaseTool]],
                    config: dict[str, Any], sampling: dict[str, Any]) -> list[AgentLoopOutput]:
    async with GenerateClient(addresses) as client:
        await client.wait_ready(timeout_s=300)
        loops = [ToolAgentLoop(AgentContext(client, tokenizer, t, config=config)) for t in tools]
        return await asyncio.gather(*(lp.run(sampling, **row) for lp, row in zip(loops, rows)))


def test_gsm8k_with_calculator_is_token_exact(servers, tool_caller):
    srv = servers(1, backend="hf", model=str(tool_caller))
    rows = gsm8k_rows(GSM8K / "test.jsonl", 24)
    tool = _calculator()
    outs = asyncio.run(_run_rows(srv.addresses, _tokenizer(tool_caller), rows, [{"calculator": tool}] * len(rows),
                                 {"max_assistant_turns": 3, "max_turn_tokens": 48, "max_response_tokens": 256},
                                 {"temperature": 1.0, "max_tokens": 48}))
    sent = _server_log(srv.request_logs)
    for out in outs:
        assert out.termination != "error", out.error
        check_against_server(out, sent)
    multi = [o for o in outs if o.num_turns >= 2]
    assert len(multi) >= len(outs) // 2, [o.messages[-1] for o in outs]  # the tool path really ran
    tool_turns = [t for o in outs for t in o.turns if t["kind"] == "tools"]
    assert sum(t["calls"] for t in tool_turns) > 0
    assert any(m["role"] == "tool" and not m["content"].startswith("Error") for o in outs for m in o.messages)
    assert tool.instances == {}  # every instance released


@pytest.mark.slow
def test_smollm2_tool_agent_is_token_exact(servers):
    """SmolLM2's own tokenizer and chat template through the tool agent. Sampled at temperature 1 it
    rarely calls the tool (a turn that stops or runs to its limit is what this checks; the tool rounds
    are test_gsm8k_with_calculator_is_token_exact's, on a model taught to call it)."""
    srv = servers(1, backend="hf", model="smollm2-135m-instruct")
    rows = gsm8k_rows(GSM8K / "test.jsonl", 2)
    outs = asyncio.run(_run_rows(srv.addresses, _tokenizer("smollm2-135m-instruct"), rows,
                                 [{"calculator": _calculator()}] * len(rows),
                                 {"max_assistant_turns": 3, "max_turn_tokens": 48, "max_response_tokens": 144},
                                 {"temperature": 1.0, "max_tokens": 48}))
    sent = _server_log(srv.request_logs)
    for out in outs:
        assert out.termination != "error", out.error
        check_against_server(out, sent)


class _Tracked(BaseTool):
    """Counts lifecycle calls, so the test can see every created instance released."""

    created: list[str]
    released: list[str]

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        super().__init__(config, tool_schema)
        self.created, self.released = [], []

    async def create(self, instance_id: str | None = None, **kw: Any) -> str:
        iid = await super().create(instance_id, **kw)
        self.created.append(iid)
        return iid

    async def release(self, instance_id: str) -> None:
        self.released.append(instance_id)
        await super().release(instance_id)


class RaisingTool(_Tracked):
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        raise RuntimeError("the tool broke")


class SleepingTool(_Tracked):
    finished = 0  # sleeps that ran to their end (a sleep cut at the tool's deadline never gets here)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        await asyncio.sleep(float(self.config["sleep_s"]))
        self.finished += 1
        return ToolResponse("42")


class FloodTool(_Tracked):
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        return ToolResponse("7 " * 500_000)  # 1 MB


class GoodTool(_Tracked):
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        return ToolResponse("42")


def test_raising_hanging_and_flooding_tools_become_observations(servers, tool_caller):
    srv = servers(1, backend="hf", model=str(tool_caller))
    deadline = 1.0
    # each bad tool serves three rows: the tiny model sometimes ends a call early (a malformed call,
    # which never reaches the tool), and every kind of failure must still be exercised
    kinds = (["raise"] * 3 + ["sleep"] * 3 + ["flood"] * 3 + ["good"] * 5)
    make = {"raise": lambda: RaisingTool({}, CALCULATOR_SCHEMA), "flood": lambda: FloodTool({}, CALCULATOR_SCHEMA),
            "sleep": lambda: SleepingTool({"sleep_s": 30, "timeout_s": deadline}, CALCULATOR_SCHEMA),
            "good": lambda: GoodTool({}, CALCULATOR_SCHEMA)}
    tools = [make[k]() for k in kinds]
    rows = gsm8k_rows(GSM8K / "test.jsonl", len(kinds))
    tok = _tokenizer(tool_caller)
    t0 = time.perf_counter()
    outs = asyncio.run(_run_rows(srv.addresses, tok, rows, [{"calculator": t} for t in tools],
                                 {"max_assistant_turns": 2, "max_turn_tokens": 96, "max_tool_response_tokens": 64},
                                 {"temperature": 0.0, "max_tokens": 96}))
    wall = time.perf_counter() - t0
    sent = _server_log(srv.request_logs)
    reached: dict[str, int] = {k: 0 for k in make}
    for kind, out in zip(kinds, outs):
        assert out.termination in ("stop", "max_assistant_turns"), (out.termination, out.error)
        check_against_server(out, sent)
        tool_turns = [t for t in out.turns if t["kind"] == "tools" and t["calls"] >= 1]
        observations = [m["content"] for m in out.messages if m["role"] == "tool" and "<tool_call>" not in m["content"]
                        and "tool_call" not in m["content"]]
        if not tool_turns:
            continue
        reached[kind] += 1
        assert observations, out.messages
        if kind == "raise":
            assert all("RuntimeError: the tool broke" in o for o in observations)
        elif kind == "sleep":
            assert all("did not answer within 1 s" in o for o in observations)
            # cut at the deadline: well under the 30 s sleep (a bound that holds on a loaded box too)
            assert all(t["latency_s"] < 10 and t["timeouts"] == t["calls"] for t in tool_turns)
        elif kind == "flood":
            assert "(truncated)" in observations[0]
            assert len(tok.encode(observations[0], add_special_tokens=False)) <= 64 + 8
        else:
            assert all(o == "42" for o in observations)
    assert all(n >= 1 for n in reached.values()), reached  # every kind of tool was really called
    assert sum(reached.values()) >= len(kinds) - 4, reached  # and the model calls tools on most rows
    # nobody waited for the 30 s sleepers: not one sleep ran to its end (the rollout's wall time says the
    # same on an idle box, ~10 s, but a loaded one can take longer to generate)
    assert sum(t.finished for t in tools if isinstance(t, SleepingTool)) == 0, wall
    for t in tools:
        assert sorted(t.created) == sorted(t.released) and t.instances == {}
    assert sum(len(t.created) for t in tools) == len(kinds)  # one instance per trajectory, all released


def test_64_trajectories_with_a_1s_tool_overlap(servers, tool_caller):
    srv = servers(1, backend="hf", model=str(tool_caller))
    rows = gsm8k_rows(GSM8K / "test.jsonl", 64)
    tools = [{"calculator": SleepingTool({"sleep_s": 1.0}, CALCULATOR_SCHEMA)} for _ in rows]
    tok = _tokenizer(tool_caller)
    durations: list[float] = []
    wall = 0.0

    async def main() -> list[AgentLoopOutput]:
        nonlocal wall
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            t_start = time.perf_counter()

            async def one(tool: dict, row: dict) -> AgentLoopOutput:
                t0 = time.perf_counter()
                out = await ToolAgentLoop(AgentContext(client, tok, tool, config={
                    "max_assistant_turns": 2, "max_turn_tokens": 40})).run({"temperature": 0.0, "max_tokens": 40},
                                                                           **row)
                durations.append(time.perf_counter() - t0)
                return out
            outs = await asyncio.gather(*(one(t, r) for t, r in zip(tools, rows)))
            wall = time.perf_counter() - t_start
            return outs

    outs = asyncio.run(main())
    slept = sum(sum(t["calls"] for t in o.turns if t["kind"] == "tools") for o in outs)
    assert slept >= 48, "most trajectories should have called the sleeping tool"
    # concurrent: the batch takes about as long as its slowest trajectory, far less than the sum
    assert wall < 1.5 * max(durations), (wall, max(durations))
    assert wall < 0.25 * sum(durations), (wall, sum(durations))
