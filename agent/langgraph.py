"""A langchain-core chat model over the GenerateClient, so a LangGraph agent can be trained.

LangGraph hands a chat model the whole message list on every turn. Rendering that list with the
chat template each time would re-tokenize the model's own text, and the ids trained on would
drift from the ids the engine sampled (see agent/chat.py). `SwitchyardChatModel` therefore keeps
the token trajectory of ONE conversation itself:

    first call   ChatEncoder.initial(all messages)          prompt, mask 0
    reply        engine tokens exactly as returned          mask 1, with logprobs
    next call    the incoming list must start with what it has already seen (its own replies
                 included); only the new tool/user messages are encoded (`turn_tokens`, mask 0)

Every generation carries the same session id, so the router keeps the trajectory on one engine
and its prefix cache. After the graph finishes, `to_agent_loop_output` gives the training data.

Tool calls are parsed from the reply text (hermes by default) into `AIMessage.tool_calls` with
fresh ids. Calls that cannot be parsed go to `AIMessage.invalid_tool_calls` with the parser's
error and the content keeps the rest of the text: a ReAct graph routes only on `tool_calls`, so
a malformed call ends the episode and the reward judges it, as it should during RL.

Only the async API works (`ainvoke`, `graph.ainvoke`): the GenerateClient's sockets belong to the
event loop they were started on, so `_generate` raises instead of starting a second loop.
"""

from __future__ import annotations

import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.tool import invalid_tool_call, tool_call
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool, StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import Field, PrivateAttr, model_validator

from agent.chat import ChatEncoder
from agent.dotted import import_dotted
from agent.loop import AgentContext, AgentLoopBase, AgentLoopOutput, Trajectory, new_session_id
from agent.parsers import ToolParser, get_tool_parser
from agent.tools.calculator import CalculatorError, safe_eval
from agent.vision import as_image_url_parts, without_pixels
from engines.config_checks import from_mapping


class HistoryEditedError(ValueError):
    """The graph changed messages the trajectory already holds as tokens."""


class TokenBudgetExceeded(RuntimeError):
    """The trajectory has no room left for another generation (max_response_tokens)."""


def message_to_dict(message: BaseMessage) -> dict[str, Any]:
    """The chat-template dict of a langchain message (OpenAI shape; ToolMessage -> role "tool").

    Names of system/user/assistant messages are left out: graphs stamp the agent's name on
    replies after the fact, and no template we target renders it."""
    content = _text(message)
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": content}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": content}
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if message.tool_calls:
            out["tool_calls"] = [{"type": "function", "id": c.get("id"),
                                  "function": {"name": c["name"], "arguments": c["args"]}} for c in message.tool_calls]
        return out
    if isinstance(message, ToolMessage):
        out = {"role": "tool", "content": content, "tool_call_id": message.tool_call_id}
        if message.name:
            out["name"] = message.name
        return out
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": content}
    raise TypeError(f"cannot encode a {type(message).__name__} for the chat template; use SystemMessage, "
                    "HumanMessage, AIMessage, ToolMessage or ChatMessage")


def _text(message: BaseMessage) -> str | list[dict[str, Any]]:
    """The message's text, or its content parts (text and image) when it holds images."""
    if isinstance(message.content, str):
        return message.content
    parts: list[dict[str, Any]] = []
    for block in message.content:
        image = _block_image(block) if isinstance(block, dict) else None
        if isinstance(block, str):
            parts.append({"type": "text", "text": block})
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif image is not None:
            parts.append({"type": "image", "image": image})
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"{type(message).__name__} has a content block of type {kind!r}; only text and images "
                             "(image_url, or image with base64/url data) can be encoded for the chat template")
    if not any(p["type"] == "image" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _block_image(block: dict[str, Any]) -> Any:
    """The image of a langchain image block (OpenAI's image_url; langchain's image with base64 or a
    data URL), as a data URL `agent.vision.to_pil` reads; None for other blocks."""
    if block.get("type") == "image_url":
        url = block.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    if block.get("type") != "image":
        return None
    data = block.get("base64") or (block.get("data") if block.get("source_type", "base64") == "base64" else None)
    if data:
        return f"data:{block.get('mime_type') or 'image/png'};base64,{data}"
    return block.get("url") or (block.get("data") if block.get("source_type") == "url" else None)


def reply_message(text: str, parser: ToolParser, metadata: Mapping[str, Any] | None = None) -> AIMessage:
    """The AIMessage of a decoded reply: well-formed calls become `tool_calls` (fresh ids), each
    parse error an `invalid_tool_calls` entry, and the content is the text outside the markup."""
    parsed = parser.parse(text)
    return AIMessage(
        content=parsed.content, response_metadata=dict(metadata or {}),
        tool_calls=[tool_call(name=c.name, args=c.arguments, id=_call_id()) for c in parsed.calls],
        invalid_tool_calls=[invalid_tool_call(error=e, id=_call_id()) for e in parsed.errors])


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class SwitchyardChatModel(BaseChatModel):
    """A chat model for ONE trajectory: create a fresh instance per rollout sample.

    `sampling_params` go to the engine (`max_tokens` is capped by `max_response_tokens`, the
    budget of the whole response). `session_id` pins the trajectory to one engine; `group_id`
    puts the n samples of one prompt on the same engine.
    """

    client: Any = Field(exclude=True)
    tokenizer: Any = Field(exclude=True)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    session_id: str = Field(default_factory=new_session_id)
    group_id: str | None = None
    tool_parser: str = "hermes"
    max_response_tokens: int | None = None
    end_of_turn_id: int | None = None
    vision: Any = Field(default=None, exclude=True)  # agent.vision.Vision of a vision-language policy
    cache: Any = Field(default=False, exclude=True)  # a cached reply has no tokens to train on

    _parser: ToolParser | None = PrivateAttr(default=None)
    _encoder: ChatEncoder | None = PrivateAttr(default=None)
    _tools: list[dict[str, Any]] | None = PrivateAttr(default=None)
    _traj: Trajectory | None = PrivateAttr(default=None)
    _seen: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _unclosed: list[int] | None = PrivateAttr(default=None)
    _turns: list[dict[str, Any]] = PrivateAttr(default_factory=list)
    _versions: list[int] = PrivateAttr(default_factory=list)
    _request_ids: list[str] = PrivateAttr(default_factory=list)
    _last_text: str = PrivateAttr(default="")
    _last_finish: str = PrivateAttr(default="")
    _last_called_tools: bool = PrivateAttr(default=False)
    _budget_hit: bool = PrivateAttr(default=False)
    _busy: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _check_switchyard_options(self) -> "SwitchyardChatModel":
        self._parser = get_tool_parser(self.tool_parser)  # unknown names fail at construction
        if self.max_response_tokens is not None and self.max_response_tokens < 1:
            raise ValueError(f"max_response_tokens={self.max_response_tokens} must be >= 1 (or None for no budget)")
        return self

    @property
    def _llm_type(self) -> str:
        return "switchyard"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "tool_parser": self.tool_parser, **self.sampling_params}

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation as the trajectory holds it (template dicts), own replies included."""
        return [dict(m) for m in self._seen]

    @property
    def started(self) -> bool:
        """Whether the first call has fixed the prompt (and so there is a trajectory to output)."""
        return self._traj is not None

    @property
    def last_text(self) -> str:
        """The last reply as decoded text, tool-call markup included: what a rule reward reads."""
        return self._last_text

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool], *,
                   tool_choice: str | None = None, **kwargs: Any) -> Runnable:
        """Bind OpenAI-style schemas of `tools`; they reach the chat template on the first call.

        The binding wraps this same instance, so the trajectory is shared by every binding.
        The engine cannot force a call, so only tool_choice None/"auto" is accepted."""
        if tool_choice not in (None, "auto"):
            raise ValueError(f"tool_choice={tool_choice!r} is not supported: the engine samples freely; use None "
                             "or 'auto' and let the reward teach when to call tools")
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        raise RuntimeError("SwitchyardChatModel only runs asynchronously: its GenerateClient lives on the running "
                           "event loop. Call `await model.ainvoke(...)` / `await graph.ainvoke(...)` instead of "
                           "invoke()")

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        if stop:
            raise ValueError(f"stop={stop!r}: the engines stop on token ids, not strings; put stop_token_ids in "
                             "sampling_params instead")
        tools = kwargs.pop("tools", None)
        if kwargs:
            raise ValueError(f"unsupported call options {sorted(kwargs)}; sampling options belong in "
                             "SwitchyardChatModel(sampling_params=...)")
        if self._busy:
            raise RuntimeError(f"session {self.session_id}: a second call started before the first returned; one "
                               "SwitchyardChatModel holds one sequential trajectory, create one per rollout sample")
        self._busy = True
        try:
            self._extend(list(messages), tools)
            return ChatResult(generations=[ChatGeneration(message=await self._generate_turn())])
        finally:
            self._busy = False

    def _extend(self, messages: list[BaseMessage], tools: list[dict[str, Any]] | None) -> None:
        """Bring the trajectory up to `messages`: encode them all on the first call, else check the
        prefix and append only the new ones. The trajectory is unchanged when this raises."""
        incoming = [message_to_dict(m) for m in messages]
        if self._traj is None:
            self._encoder = ChatEncoder(self.tokenizer, tools=tools, end_of_turn_id=self.end_of_turn_id,
                                        vision=self.vision)
            self._tools = list(tools) if tools else None
            self._parser = get_tool_parser(self.tool_parser, {  # raw-text formats type values by the schemas
                str((t.get("function") or t).get("name")): (t.get("function") or t).get("parameters") or {}
                for t in self._tools or []})
            self._traj = Trajectory(self._encoder.initial(incoming))
            self._add_images(incoming)
            self._seen = incoming
            return
        if (tools or None) != self._tools:
            raise HistoryEditedError(f"session {self.session_id}: the bound tools changed mid-trajectory (from "
                                     f"{_names(self._tools)} to {_names(tools)}); the prompt that shows them is "
                                     "already tokenized, so bind the same tools for the whole trajectory")
        n = len(self._seen)
        for i, (old, new) in enumerate(zip(self._seen, incoming)):
            if old != new:
                raise HistoryEditedError(
                    f"session {self.session_id}: message {i} differs from the one already tokenized (was "
                    f"{_show(old)}, now {_show(new)}). Token-exact training needs append-only history: do not "
                    "trim, summarize or rewrite messages (e.g. in a pre_model_hook), and use a fresh "
                    "SwitchyardChatModel per trajectory")
        if len(incoming) <= n:
            raise HistoryEditedError(
                f"session {self.session_id}: called with {len(incoming)} messages but the trajectory already holds "
                f"{n}; each call must append at least one new tool/user message after the model's last reply")
        new = incoming[n:]
        if any(m["role"] == "assistant" for m in new):
            raise HistoryEditedError(
                f"session {self.session_id}: new message {_show(next(m for m in new if m['role'] == 'assistant'))} "
                "is an assistant message the engine did not generate; its tokens cannot be trained on exactly. "
                "Append only tool/user/system messages between model calls")
        ids = self._encoder.close_assistant_turn(self._unclosed or []) + self._encoder.turn_tokens(new)
        if self.max_response_tokens is not None and len(self._traj) + len(ids) >= self.max_response_tokens:
            self._budget_hit = True
            raise TokenBudgetExceeded(
                f"session {self.session_id}: {len(self._traj)} response tokens + {len(ids)} for "
                f"{[m['role'] for m in new]} leave no room below max_response_tokens={self.max_response_tokens}; "
                "raise the budget or limit the turns (recursion_limit)")
        self._traj.add_context(ids)
        self._add_images(new)
        self._turns.append({"kind": "context", "roles": [m["role"] for m in new], "tokens": len(ids)})
        self._seen = incoming
        self._unclosed = None

    def _add_images(self, messages: list[dict[str, Any]]) -> None:
        if self.vision is not None and self._traj is not None:
            pv = self.vision.pixels_in(messages)
            if pv is not None:
                self._traj.add_images(pv)

    async def _generate_turn(self) -> AIMessage:
        traj, params = self._traj, dict(self.sampling_params)
        if self.max_response_tokens is not None:
            remaining = self.max_response_tokens - len(traj)
            if remaining < 1:
                self._budget_hit = True
                raise TokenBudgetExceeded(f"session {self.session_id}: max_response_tokens="
                                          f"{self.max_response_tokens} used up; raise it or limit the turns")
            params["max_tokens"] = min(remaining, int(params.get("max_tokens", remaining)))
        t0 = time.perf_counter()
        pv = traj.all_pixel_values()
        result = await self.client.generate(traj.all_ids(), params, session_id=self.session_id,
                                            group_id=self.group_id, **({"pixel_values": pv} if pv is not None else {}))
        traj.add_model(result.token_ids, result.logprobs)
        self._unclosed = list(result.token_ids)
        self._versions.append(result.weight_version)
        self._request_ids.append(result.request_id)
        self._turns.append({"kind": "generate", "request_id": result.request_id, "tokens": len(result.token_ids),
                            "prompt_tokens": len(traj.prompt_ids) + len(traj) - len(result.token_ids),
                            "cached_prompt_tokens": result.cached_prompt_tokens,
                            "finish_reason": result.finish_reason, "weight_version": result.weight_version,
                            "engine_id": result.engine_id, "latency_s": time.perf_counter() - t0})
        ids = result.token_ids
        if ids and ids[-1] == self._encoder.end_of_turn_id:
            ids = ids[:-1]
        self._last_text = self.tokenizer.decode(ids, skip_special_tokens=False)
        self._last_finish = result.finish_reason
        if result.finish_reason == "length" and self.max_response_tokens is not None \
                and len(traj) >= self.max_response_tokens:
            self._budget_hit = True
        reply = reply_message(self._last_text, self._parser, {
            "finish_reason": result.finish_reason, "request_id": result.request_id,
            "weight_version": result.weight_version, "engine_id": result.engine_id, "model_provider": "switchyard"})
        self._last_called_tools = bool(reply.tool_calls)
        self._seen = self._seen + [message_to_dict(reply)]
        return reply

    def termination(self) -> str:
        """Why the trajectory ended, judged from its last reply: a reply whose tool calls never got
        answered means the graph stopped it (turn/recursion limit)."""
        if self._budget_hit:
            return "token_budget"
        if self._last_finish in ("length", "abort"):
            return self._last_finish
        return "max_assistant_turns" if self._last_called_tools else "stop"

    def to_agent_loop_output(self, reward: float = 0.0, termination: str | None = None,
                             reward_extra: Mapping[str, float] | None = None,
                             messages: list[dict[str, Any]] | None = None, error: str = "") -> AgentLoopOutput:
        """The training record of this trajectory; `termination` defaults to `termination()`."""
        if self._traj is None:
            raise RuntimeError(f"session {self.session_id}: the model was never called, so there is no trajectory; "
                               "run the graph with `await graph.ainvoke(...)` first")
        t = self._traj
        return AgentLoopOutput(
            prompt_ids=list(t.prompt_ids), response_ids=list(t.response_ids), response_mask=list(t.response_mask),
            response_logprobs=list(t.response_logprobs), reward=float(reward), num_turns=len(self._request_ids),
            termination=termination or self.termination(), turns=list(self._turns),
            weight_versions=list(self._versions), request_ids=list(self._request_ids),
            reward_extra=dict(reward_extra or {}),
            messages=without_pixels(self.messages if messages is None else messages),
            session_id=self.session_id, error=error, multi_modal=t.multi_modal())


def _names(tools: list[dict[str, Any]] | None) -> list[str]:
    return [str((t.get("function") or t).get("name")) for t in tools or []]


def _show(m: dict[str, Any]) -> str:
    return f"{m['role']}: {str(m.get('content'))[:60]!r}" + (" +tool_calls" if m.get("tool_calls") else "")


# --------------------------------------------------------------------- the example agent loop

def calculator_tool() -> BaseTool:
    """The calculator as a langchain tool, on the same `safe_eval` as the built-in tool; refusals
    come back as "Error: ..." text, which is what the model should learn from."""

    def calculator(expression: str) -> str:
        try:
            value = safe_eval(expression)
        except CalculatorError as e:
            return f"Error: {e}"
        return str(int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value)

    return StructuredTool.from_function(calculator, name="calculator",
                                        description="Evaluate an arithmetic expression.")


def calculator_react_agent(chat_model: BaseChatModel) -> Any:
    """The default `graph_factory`: LangGraph's prebuilt ReAct agent with the calculator.

    `create_react_agent` is deprecated in favour of `langchain.agents.create_agent`, which needs
    the `langchain` package; a graph built with it works the same through `graph_factory`."""
    from langgraph.prebuilt import create_react_agent

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return create_react_agent(chat_model, [calculator_tool()])


@dataclass
class LangGraphAgentConfig:
    """graph_factory: dotted path of `(chat_model) -> compiled graph` taking {"messages": [...]}.
    recursion_limit: LangGraph's step limit (a model call and a tool round are one step each).
    max_turn_tokens / max_response_tokens: one generation / the whole response, in tokens."""

    graph_factory: str = "agent.langgraph.calculator_react_agent"
    recursion_limit: int = 25
    tool_parser: str = "hermes"
    max_turn_tokens: int = 512
    max_response_tokens: int = 2048
    reward_shaping: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        for name in ("recursion_limit", "max_turn_tokens", "max_response_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"langgraph_agent.{name}={getattr(self, name)} must be >= 1")
        get_tool_parser(self.tool_parser)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "LangGraphAgentConfig":
        return from_mapping(cls, d, "langgraph_agent")


def import_graph_factory(dotted: str) -> Callable[[BaseChatModel], Any]:
    try:
        factory = import_dotted(dotted, "graph_factory")
    except ValueError as e:
        raise ValueError(f"graph_factory={dotted!r} cannot be imported ({e.__cause__ or e}); "
                         "give package.module.function") from e
    if not callable(factory):
        raise ValueError(f"graph_factory={dotted!r} is not a callable; give package.module.function taking the "
                         "chat model and returning a compiled graph")
    return factory


class LangGraphAgentLoop(AgentLoopBase):
    """Run a LangGraph agent on the row's `prompt` with a SwitchyardChatModel and score the last
    reply with the row's rule reward. A graph that fails (recursion limit, token budget, a tool
    raising) still yields its trajectory so far, with the matching termination."""

    def __init__(self, ctx: AgentContext) -> None:
        super().__init__(ctx)
        self.cfg = LangGraphAgentConfig.from_mapping(self.config)
        self.factory = import_graph_factory(self.cfg.graph_factory)

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        from langgraph.errors import GraphRecursionError

        from agent.rewards import loop_reward

        params = {**sampling_params, "max_tokens": min(self.cfg.max_turn_tokens,
                                                       int(sampling_params.get("max_tokens", self.cfg.max_turn_tokens)))}
        model = SwitchyardChatModel(client=self.client, tokenizer=self.tokenizer, sampling_params=params,
                                    session_id=row.get("session_id") or new_session_id(), group_id=row.get("group_id"),
                                    tool_parser=self.cfg.tool_parser, max_response_tokens=self.cfg.max_response_tokens,
                                    vision=self.ctx.vision)
        termination, error, messages = None, "", None
        try:
            graph = self.factory(model)
            final = await graph.ainvoke({"messages": as_image_url_parts(self.prompt_messages(row))},
                                        config={"recursion_limit": self.cfg.recursion_limit})
            if isinstance(final, Mapping) and final.get("messages"):  # the graph's history, for logging
                messages = [message_to_dict(m) for m in final["messages"]]
        except GraphRecursionError:
            termination = "max_assistant_turns"
        except TokenBudgetExceeded:
            termination = "token_budget"
        except Exception as e:  # a broken trajectory is reported, not allowed to fail the batch
            termination, error = "error", f"{type(e).__name__}: {e}"
        finally:
            self.client.end_session(model.session_id)
        if not model.started:  # failed before the first generation: an empty response
            enc = ChatEncoder(self.tokenizer)
            return AgentLoopOutput.failed(enc.initial(row["prompt"]), error or "the graph never called the model",
                                          model.session_id, list(row["prompt"]))
        reward, extra = loop_reward(self.cfg.reward_shaping)
        out = model.to_agent_loop_output(reward=reward, termination=termination, reward_extra=extra,
                                         messages=messages, error=error)
        out.answer_text = model.last_text
        return out
