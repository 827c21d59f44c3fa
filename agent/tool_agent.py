"""The multi-turn tool-calling loop: a small state machine around one trajectory.

    PENDING ──► GENERATING ──► PROCESSING_TOOLS ──► GENERATING ...
                    │    └───► INTERACTING ──────► GENERATING ...
                    └──────────────────────────────► TERMINATED

Model tokens go into the trajectory exactly as the engine returned them (mask 1). Tool results,
user turns from an interaction and the template's glue are encoded by `ChatEncoder` and appended
with mask 0. Tools of one turn run concurrently, each under a deadline; a tool that raises, hangs
or floods becomes an observation the model reads, never a stalled or failed batch. Every tool
instance created for the trajectory is released, and the interaction finalized, whatever happens.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

from agent.chat import ChatEncoder
from agent.loop import (
    AgentContext,
    AgentLoopBase,
    AgentLoopOutput,
    Trajectory,
    new_session_id,
)
from agent.parsers import ToolCall, get_tool_parser, parameter_schemas
from agent.tools.base import BaseTool, ToolResponse
from agent.vision import without_pixels
from agent.tools.guard import call_tool
from engines.config_checks import from_mapping

log = logging.getLogger("switchyard.tool_agent")


class State(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass
class ToolAgentConfig:
    """Limits of one trajectory. Token budgets count tokens, not characters.

    max_turn_tokens: most tokens one generation may produce (caps sampling max_tokens).
    max_response_tokens: the whole response (model + tool + user tokens) of a trajectory.
    max_tool_response_tokens: one tool observation; longer ones are cut on `truncate_side`
      ("left" keeps the end, "right" keeps the start, "middle" keeps both ends).
    tool_timeout_s: a call's deadline unless the tool's own config sets `timeout_s`.
    A tool's step rewards (what its `execute` returns with a call) are attached to the turn that made
    the call (`AgentLoopOutput.turn_rewards`), and so are interaction turn scores with
    `interaction_turn_rewards`, for the turn-level estimator (`algorithm.advantage: turn_grpo`).
    """

    max_assistant_turns: int = 5
    max_user_turns: int = 3
    max_parallel_calls: int = 4
    max_turn_tokens: int = 512
    max_response_tokens: int = 2048
    max_tool_response_tokens: int = 256
    truncate_side: str = "middle"
    tool_timeout_s: float = 30.0
    tool_parser: str = "hermes"
    reward_shaping: Mapping[str, float] | None = None
    # add each interaction turn's score to the reward as a reward of that turn (part "interaction_turns")
    interaction_turn_rewards: bool = False

    def __post_init__(self) -> None:
        for name in ("max_assistant_turns", "max_parallel_calls", "max_turn_tokens", "max_response_tokens",
                     "max_tool_response_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"tool_agent.{name}={getattr(self, name)} must be >= 1")
        if self.max_user_turns < 0:
            raise ValueError(f"tool_agent.max_user_turns={self.max_user_turns} must be >= 0")
        if self.truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"tool_agent.truncate_side={self.truncate_side!r}; allowed: {TRUNCATE_SIDES}")
        if self.tool_timeout_s <= 0:
            raise ValueError(f"tool_agent.tool_timeout_s={self.tool_timeout_s} must be > 0")
        get_tool_parser(self.tool_parser)  # unknown names fail here, at start-up

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "ToolAgentConfig":
        return from_mapping(cls, d, "tool_agent")


def truncate_tokens(tokenizer: Any, text: str, max_tokens: int, side: str) -> tuple[str, bool]:
    """`text` cut to at most about `max_tokens` tokens on `side`, and whether it was cut.

    A token covers at least one character, so the first cut by characters (cheap even for 1 MB)
    never removes text the token cut would keep.
    """
    if len(text) <= max_tokens:
        return text, False
    chars = max_tokens * 32
    text_cut = text if len(text) <= 2 * chars else text[:chars] + text[-chars:]
    ids = tokenizer.encode(text_cut, add_special_tokens=False)
    if len(ids) <= max_tokens and text_cut is text:
        return text, False
    marker = "...(truncated)..."
    keep = max(1, max_tokens - 8)  # room for the marker
    if side == "right":
        return tokenizer.decode(ids[:keep]) + marker, True
    if side == "left":
        return marker + tokenizer.decode(ids[-keep:]), True
    head = keep // 2
    return tokenizer.decode(ids[:head]) + marker + tokenizer.decode(ids[-(keep - head):]), True


class ToolAgentLoop(AgentLoopBase):
    """Generate, run the tools the model called, feed results back; repeat within the limits.

    Row columns used: `prompt` (messages), `extra_info.tools_kwargs.<tool>.create_kwargs`,
    `interaction_kwargs` (or `extra_info.interaction_kwargs`) with `name` selecting the interaction
    (none: the only one loaded; with none loaded the kwargs are ignored, as verl does),
    `reward_model` / `data_source` for the rule reward. `num_turns` counts assistant generations.
    """

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self.cfg = ToolAgentConfig.from_mapping(self.config)
        self.parser = get_tool_parser(self.cfg.tool_parser, parameter_schemas(self.ctx.tools))

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        ep = Episode(self, sampling_params, row)
        try:
            await ep.open()
            ep.state = State.GENERATING
            while ep.state is not State.TERMINATED:
                ep.state = await ep.step()
            await ep.score()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a broken trajectory is reported (SystemExit from a tool's create too)
            log.exception("trajectory %s failed in state %s", ep.session_id, ep.state.value)
            ep.termination, ep.error = "error", f"{type(e).__name__}: {e}"
        finally:
            self.client.end_session(ep.session_id)
            await self._cleanup(ep.tools, ep.instances, ep.interaction, ep.inter_id)
        return ep.output()

    def _decode(self, token_ids: list[int], end_of_turn_id: int) -> str:
        ids = token_ids[:-1] if token_ids and token_ids[-1] == end_of_turn_id else token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _append(self, traj: Trajectory, encoder: ChatEncoder, messages: list[dict[str, Any]],
                new: list[dict[str, Any]]) -> bool:
        """Append a non-model turn if it leaves room to generate at least one token."""
        ids = encoder.turn_tokens(new)
        if len(traj) + len(ids) >= self.cfg.max_response_tokens:
            return False
        traj.add_context(ids)
        self.add_turn_images(traj, new)
        messages.extend(without_pixels(new))
        return True

    async def _run_tools(self, parsed: Any, tools: Mapping[str, BaseTool], instances: Mapping[str, str],
                         stats: dict[str, int], turns: list[dict[str, Any]], step_rewards: list[float]
                         ) -> list[dict[str, Any]]:
        """Run this turn's calls concurrently; one tool message per call, parse error and skipped call."""
        t0 = time.perf_counter()
        calls = parsed.calls[:self.cfg.max_parallel_calls]
        skipped = parsed.calls[self.cfg.max_parallel_calls:]
        responses = await asyncio.gather(*[self._call(c, tools, instances) for c in calls])
        texts: list[Any] = []
        truncated = 0
        for resp in responses:
            text, cut = truncate_tokens(self.tokenizer, resp.text, self.cfg.max_tool_response_tokens,
                                        self.cfg.truncate_side)
            texts.append(self._with_images(text, list(resp.images or [])))
            truncated += cut
            stats["tool_successes"] += bool(resp.success)
            step_rewards.append(float(getattr(resp, "reward", 0.0) or 0.0))
        texts += [f"Error: {e}" for e in parsed.errors]
        texts += [f"Error: call to {c.name!r} was not run: at most {self.cfg.max_parallel_calls} tool calls "
                  f"per turn" for c in skipped]
        stats["tool_calls"] += len(calls)
        stats["invalid_calls"] += len(parsed.errors) + sum(bool(not r.success and r.metrics.get("invalid")) for r in responses)
        turns.append({"kind": "tools", "calls": len(calls), "parse_errors": len(parsed.errors),
                      "skipped": len(skipped), "failed": sum(not r.success for r in responses),
                      "timeouts": sum(bool(r.metrics.get("timeout")) for r in responses), "truncated": truncated,
                      "latency_s": time.perf_counter() - t0})
        return [{"role": "tool", "content": t} for t in texts]

    def _with_images(self, text: str, images: list[Any]) -> Any:
        """A tool message's content: its images as image parts before the text for a
        vision-language policy; a note in the text for one that takes no images."""
        if not images:
            return text
        if self.ctx.vision is None:
            return f"{text}\n[{len(images)} image(s) omitted: the model takes no images]"
        from agent.vision import to_pil

        readable = []
        for im in images:
            try:
                readable.append(to_pil(im))
            except Exception as e:  # an unreadable image is reported to the model, not a failed trajectory
                text += f"\n[an image the tool returned could not be read: {type(e).__name__}: {e}]"
        return [*({"type": "image", "image": im} for im in readable), {"type": "text", "text": text}]

    async def _call(self, call: ToolCall, tools: Mapping[str, BaseTool], instances: Mapping[str, str]) -> ToolResponse:
        tool = tools.get(call.name)
        if tool is None:
            return ToolResponse(f"Error: unknown tool {call.name!r}; available tools: {sorted(tools)}", False,
                                {"invalid": True})
        timeout = float(tool.config.get("timeout_s", self.cfg.tool_timeout_s))
        try:  # hard deadline; a tool seen blocking the loop moves to a thread (agent/tools/guard.py)
            resp = await call_tool(tool, instances[call.name], call.arguments, timeout)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a tool cannot end its worker: SystemExit is a failed call
            return ToolResponse(f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}", False)
        return resp if isinstance(resp, ToolResponse) else ToolResponse(str(resp))

    def _score(self, stats: dict[str, int], termination: str, tool_reward: float, inter_score: float | None,
               step_reward: float = 0.0) -> tuple[float, dict[str, float]]:
        """The loop's part of the reward (the outcome is scored once the loop ends: agent/rewards/outcome.py)."""
        from agent.rewards import TrajectoryStats, loop_reward

        st = TrajectoryStats(hit_turn_limit=termination in ("max_assistant_turns", "max_user_turns"), **stats)
        return loop_reward(self.cfg.reward_shaping, st, tool_reward, inter_score, step_reward)

    async def _cleanup(self, tools: Mapping[str, BaseTool], instances: Mapping[str, str], interaction: Any,
                       inter_id: str | None) -> None:
        """Release every created instance and finalize the interaction, even if one of them raises."""
        for name, iid in instances.items():
            try:
                await tools[name].release(iid)
            except asyncio.CancelledError:
                raise
            except BaseException:
                log.exception("tool %r: release(%s) failed", name, iid)
        if interaction is not None and inter_id is not None:
            try:
                await interaction.finalize(inter_id)
            except asyncio.CancelledError:
                raise
            except BaseException:
                log.exception("interaction finalize(%s) failed", inter_id)


class Episode:
    """One trajectory of `ToolAgentLoop` as it runs: what it holds, and one method per state, each
    returning the next state (TERMINATED with `termination` set)."""

    def __init__(self, loop: "ToolAgentLoop", sampling_params: dict[str, Any], row: dict[str, Any]) -> None:
        self.loop, self.cfg, self.sampling_params, self.row = loop, loop.cfg, sampling_params, row
        ctx = loop.ctx
        self.session_id = row.get("session_id") or new_session_id()
        messages = loop.prompt_messages(row)
        extra = row.get("extra_info") or {}
        self.tools_kwargs = extra.get("tools_kwargs") or {}
        self.tools = {name: tool for name, tool in ctx.tools.items() if not extra.get("tools") or name in extra["tools"]}
        # verl's rows keep them in extra_info and may omit the name; with no interaction loaded they are ignored
        self.inter_kwargs = dict(row.get("interaction_kwargs") or extra.get("interaction_kwargs") or {})
        if not ctx.interactions:
            self.inter_kwargs = {}
        self.encoder = ChatEncoder(loop.tokenizer, tools=[t.tool_schema for t in self.tools.values()] or None,
                                   vision=ctx.vision)
        self.traj = loop.start_trajectory(self.encoder, messages)
        self.messages = without_pixels(messages)
        self.turns: list[dict[str, Any]] = []
        self.versions: list[int] = []
        self.request_ids: list[str] = []
        self.instances: dict[str, str] = {}
        self.interaction: Any = None
        self.inter_id: str | None = None
        self.stats = {"tool_calls": 0, "tool_successes": 0, "invalid_calls": 0}
        self.step_rewards: list[float] = []  # what tools' execute returned as step rewards, call by call
        self.turn_rewards: list[list[float]] = []  # [response position, reward]: what the turn before it earned
        self.inter_turns = 0.0  # interaction turn scores added to the reward (interaction_turn_rewards)
        self.termination, self.error, self.last_text = "stop", "", ""
        self.reward, self.reward_extra = 0.0, {}
        self.assistant_turns = self.user_turns = 0
        self.parsed: Any = None
        self.state = State.PENDING

    async def open(self) -> None:
        """Every tool's instance created for this trajectory, and its interaction started."""
        interactions = self.loop.ctx.interactions
        for name, tool in self.tools.items():
            self.instances[name] = await tool.create(**((self.tools_kwargs.get(name) or {}).get("create_kwargs") or {}))
            if hasattr(tool, "bind_row_kwargs"):  # verl-contract tools take the other kwargs blocks too
                tool.bind_row_kwargs(self.instances[name], self.tools_kwargs.get(name) or {})
        if self.inter_kwargs:
            iname = self.inter_kwargs.pop("name", None)
            if iname is None and len(interactions) == 1:
                iname = next(iter(interactions))  # the only one loaded
            if iname not in interactions:
                raise KeyError(f"interaction {iname!r} is not loaded; known: {sorted(interactions)}"
                               + ("" if iname else " (the row's interaction_kwargs has no name: add one)"))
            self.interaction = interactions[iname]
            self.inter_id = await self.interaction.start(**self.inter_kwargs)

    def step(self) -> Any:
        return {State.GENERATING: self.generating, State.PROCESSING_TOOLS: self.processing_tools,
                State.INTERACTING: self.interacting}[self.state]()

    def end(self, termination: str) -> State:
        self.termination = termination
        return State.TERMINATED

    async def generating(self) -> State:
        """One model turn, exactly as the engine returned it; then tools, the interaction, or the end."""
        traj, cfg = self.traj, self.cfg
        remaining = cfg.max_response_tokens - len(traj)
        params = {**self.sampling_params, "max_tokens": min(cfg.max_turn_tokens, remaining,
                                                            int(self.sampling_params.get("max_tokens", remaining)))}
        result = await self.loop.generate(traj, params, self.session_id, self.row.get("group_id"), self.turns)
        self.assistant_turns += 1
        self.versions.append(result.weight_version)
        self.request_ids.append(result.request_id)
        self.last_text = self.loop._decode(result.token_ids, self.encoder.end_of_turn_id)
        self.messages.append({"role": "assistant", "content": self.last_text})
        if result.finish_reason in ("abort", "length"):
            return self.end("token_budget" if result.finish_reason == "length" and
                            len(traj) >= cfg.max_response_tokens else result.finish_reason)
        traj.add_context(self.encoder.close_assistant_turn(result.token_ids))
        self.parsed = self.loop.parser.parse(self.last_text)
        if not self.parsed.calls and not self.parsed.errors:
            return self.end("stop") if self.interaction is None else State.INTERACTING
        if self.assistant_turns >= cfg.max_assistant_turns:
            return self.end("max_assistant_turns")
        return State.PROCESSING_TOOLS

    async def processing_tools(self) -> State:
        """The turn's calls run; their observations appended (mask 0) if they fit the budget."""
        before = len(self.step_rewards)
        new = await self.loop._run_tools(self.parsed, self.tools, self.instances, self.stats, self.turns,
                                         self.step_rewards)
        if any(self.step_rewards[before:]) and len(self.traj):
            self.turn_rewards.append([len(self.traj), sum(self.step_rewards[before:])])
        if not self.loop._append(self.traj, self.encoder, self.messages, new):
            return self.end("token_budget")
        return State.GENERATING

    async def interacting(self) -> State:
        """The interaction answers the model's turn as the user; done, out of user turns, or on."""
        t0 = time.perf_counter()
        done, text, score = await self.interaction.generate_response(self.inter_id, self.messages)
        self.turns.append({"kind": "interaction", "done": bool(done), "score": float(score),
                           "latency_s": time.perf_counter() - t0})
        if self.cfg.interaction_turn_rewards and float(score) and len(self.traj):
            self.turn_rewards.append([len(self.traj), float(score)])
            self.inter_turns += float(score)
        if done:
            return self.end("interaction_done")
        if self.user_turns >= self.cfg.max_user_turns:
            return self.end("max_user_turns")
        self.user_turns += 1
        if not self.loop._append(self.traj, self.encoder, self.messages, [{"role": "user", "content": text}]):
            return self.end("token_budget")
        return State.GENERATING

    async def score(self) -> None:
        """The loop's part of the reward: tools' calc_reward, the interaction's score, step rewards, shaping."""
        tool_reward = sum([await self.tools[n].calc_reward(i) for n, i in self.instances.items()])  # raising: an error
        inter_score = await self.interaction.calculate_score(self.inter_id) if self.interaction is not None else None
        self.reward, self.reward_extra = self.loop._score(self.stats, self.termination, tool_reward, inter_score,
                                                          sum(self.step_rewards))
        if self.cfg.interaction_turn_rewards:
            self.reward += self.inter_turns
            self.reward_extra = {**self.reward_extra, "interaction_turns": self.inter_turns}

    def output(self) -> AgentLoopOutput:
        traj, failed = self.traj, self.termination == "error"
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids, response_ids=traj.response_ids, response_mask=traj.response_mask,
            response_logprobs=traj.response_logprobs, reward=self.reward, num_turns=self.assistant_turns,
            termination=self.termination, turns=self.turns, weight_versions=self.versions,
            request_ids=self.request_ids, reward_extra=self.reward_extra, messages=self.messages,
            session_id=self.session_id, error=self.error, multi_modal=traj.multi_modal(),
            turn_rewards=[] if failed else self.turn_rewards, answer_text=self.last_text)
