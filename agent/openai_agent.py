"""`openai_agent`: train an agent written against the OpenAI API, unchanged but for its base_url.

The loop starts one gateway (agent/gateway) per worker process on loopback, opens a session with
a fresh API key per trajectory, and awaits the user's function

    async def my_agent(base_url: str, api_key: str, row: dict) -> float | None

which may use any OpenAI-compatible client or framework. The gateway records the session
token-exactly; every segment of it (a client that edits its history opens a new one) is trained
on, as a row of its own in the sample's GRPO group, with the sample's reward: the function's
return value, or the row's rule reward on the last reply (the segment that generated last) when
the function returns None. Options (`rollout.agent.openai_agent`): `agent_function`
(dotted path, required), `tool_parser`, `model_name` (what the client must send as `model`),
`timeout_s`, `max_context`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Mapping

from agent.dotted import import_dotted
from agent.loop import AgentContext, AgentLoopBase, AgentLoopOutput
from agent.parsers import get_tool_parser
from engines.config_checks import from_mapping


@dataclass
class OpenAIAgentConfig:
    agent_function: str = ""
    tool_parser: str = "hermes"
    model_name: str = "switchyard"
    timeout_s: float = 600.0
    max_context: int | None = None
    grammar_budget_s: float = 10.0  # seconds an output schema may take to compile at the gateway (400 past it)

    def __post_init__(self) -> None:
        if not self.agent_function:
            raise ValueError("openai_agent.agent_function is required: the dotted path of an async function "
                             "(base_url, api_key, row) -> reward or None")
        fn = import_dotted(self.agent_function, "openai_agent.agent_function")
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(f"openai_agent.agent_function {self.agent_function!r} must be an async function "
                             "(async def f(base_url, api_key, row))")
        get_tool_parser(self.tool_parser)
        if not self.timeout_s > 0:
            raise ValueError(f"openai_agent.timeout_s={self.timeout_s} must be > 0")
        if not self.grammar_budget_s > 0:
            raise ValueError(f"openai_agent.grammar_budget_s={self.grammar_budget_s} must be > 0 (seconds)")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "OpenAIAgentConfig":
        return from_mapping(cls, d, "openai_agent")


_GATEWAYS: dict[int, Any] = {}  # one per GenerateClient (one per worker process and event loop)
_LOCK: dict[int, asyncio.Lock] = {}


async def gateway_for(ctx: AgentContext, cfg: OpenAIAgentConfig) -> Any:
    """The worker's gateway on loopback, started on first use."""
    from agent.gateway import Gateway

    key = id(ctx.client)
    lock = _LOCK.setdefault(key, asyncio.Lock())
    async with lock:
        if key not in _GATEWAYS:
            gw = Gateway(ctx.client, ctx.tokenizer, model_name=cfg.model_name, tool_parser=cfg.tool_parser,
                         max_context=cfg.max_context, vision=ctx.vision, grammar_budget_s=cfg.grammar_budget_s)
            await gw.start()
            _GATEWAYS[key] = gw
    return _GATEWAYS[key]


class OpenAIAgentLoop(AgentLoopBase):
    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self.cfg = OpenAIAgentConfig.from_mapping(self.config)
        self.fn = import_dotted(self.cfg.agent_function, "openai_agent.agent_function")

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        gw = await gateway_for(self.ctx, self.cfg)
        session = row.get("session_id")
        key = gw.open_session(f"sy-{session}" if session else None, sampling=dict(sampling_params))
        error, result = "", None
        try:
            result = await asyncio.wait_for(self.fn(gw.base_url, key, dict(row)), self.cfg.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the agent's failure is this trajectory's, not the batch's
            error = f"{type(e).__name__}: {e}"
        finally:
            conv = gw.close_session(key)
        seg = conv.latest() if conv is not None else None
        if seg is None:
            prompt = list(self.ctx.tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                                 tokenize=True, return_dict=True)["input_ids"])
            return AgentLoopOutput.failed(prompt, error or "the agent function never called the model", key)
        # the agent's own score is the outcome; without one its last reply is the answer scored
        reward, parts = (0.0, {}) if result is None else (float(result), {"agent": float(result)})
        out = seg.to_output(reward, parts, session_id=key, termination="error" if error else None)
        out.error, out.answer_text = error, seg.last_text if result is None else None
        others = [s for s in conv.segments if s is not seg and s.request_ids]
        out.extra_segments = [dataclasses.asdict(s.to_output(reward, parts, session_id=key)) for s in others]
        out.turns.append({"kind": "segments", "count": 1 + len(others)})
        return out
