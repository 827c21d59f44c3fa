"""Token-exact recording of the conversations an OpenAI-style client holds through the gateway.

A chat-completions client sends the whole history on every call. Rendering it with the chat
template each time would re-tokenize the model's own replies, so each session keeps *segments*:
one token trajectory each (the template applied once, then the engine's tokens exactly as returned,
then only appended turns), with the messages it holds. A call continues the segment whose messages
are a prefix of the incoming history when everything after that prefix is new tool/user/system
messages; otherwise (the client edited or summarized earlier turns, a sub-agent keeps its own
history, the client continues another of `n` choices) it opens a new segment that renders the
incoming history once. Nothing is ever re-tokenized, and each segment is a trainable trajectory
with its own mask.

`tool_choice` required or a named function forces a call: the tool parser's call opening
(`ToolParser.call_prefix`) is appended after the generation prompt as template tokens (mask 0,
never counted as the model's), the model continues inside the call, and the parser reads opening +
generation. The recorded assistant message holds that whole text, as any reply's does, so a client
that resends it continues the segment.

An output schema beside tools offered (`tool_choice` auto or unset) is a choice the model makes
itself: the engine decodes under the union of the schema's compact JSON (the final answer) and one
call per declared tool in the parser's own format (its named opening, arguments under the tool's
parameters, its closing; `SamplingParams.json_calls`). Nothing is forced, so every token of the reply
is the model's; a reply that begins with a call's opening is parsed as the call, any other is the
answer's JSON as content. A forced call (required, named) stays forced, the schema left for the
answer of a later turn.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from agent.chat import ChatEncoder
from agent.loop import AgentLoopOutput, Trajectory
from agent.vision import images_in, without_pixels
from agent.gateway.requests import RequestError, forced_call
from agent.parsers import ParseResult, ToolParser, get_tool_parser


DEFAULT_MAX_TOKENS = 1024  # a request without max_tokens, on a gateway that knows no context length


def _key(m: dict[str, Any]) -> tuple:
    """What must match for a held message to count as the same one (ids the gateway made up and
    empty-vs-null content do not matter)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in m.get("tool_calls") or [])
    content = m.get("content") or ""
    return (m["role"], content if isinstance(content, str) else json.dumps(content, sort_keys=True), calls)


@dataclass
class Reply:
    """One generated choice: the engine's result, the parsed reply, and the segment holding it."""

    segment: "Segment"
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    parsed: ParseResult
    prompt_tokens: int
    top_ids: list[list[int]] | None = None  # with top_logprobs: per token the engine's k most likely ids
    top_logprobs: list[list[float]] | None = None  # and their logprobs


class _Undo:
    """Puts a session back as `Session._mark` found it: segments it held cut back to their lengths
    then, any segment added since removed."""

    def __init__(self, session: Any, marks: list[tuple[Any, ...]]) -> None:
        self.session, self.marks, self.seg = session, marks, None

    def __call__(self) -> None:
        before = {id(m[0]) for m in self.marks}
        self.session.segments = [x for x in self.session.segments if id(x) in before]
        for seg, n, images, held, unclosed, turns in self.marks:
            t = seg.traj
            del t.response_ids[n:], t.response_mask[n:], t.response_logprobs[n:]
            if len(t.pixel_values) != images:
                del t.pixel_values[images:]
                t._joined = None
            seg.held, seg.unclosed = held, unclosed
            del seg.turns[turns:]


@dataclass(eq=False)
class Segment:
    """One token trajectory and the messages it holds."""

    encoder: ChatEncoder
    traj: Trajectory
    held: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    request_ids: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    unclosed: list[int] | None = None
    last_text: str = ""
    last_finish: str = ""
    updated: float = 0.0

    def nbytes(self) -> int:
        """About what the segment holds in memory: 8 bytes per recorded token entry (ids, mask,
        logprobs), its images' pixels, and the characters of its messages."""
        t = self.traj
        pixels = sum(int(getattr(p, "nbytes", 0)) for p in t.pixel_values)
        text = sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in self.held)
        return 8 * (len(t.prompt_ids) + 3 * len(t.response_ids)) + pixels + text

    def clone(self) -> "Segment":
        twin = copy.copy(self)
        twin.traj = copy.deepcopy(self.traj)
        for name in ("held", "request_ids", "versions", "turns"):
            setattr(twin, name, list(getattr(self, name)))
        return twin

    def to_output(self, reward: float = 0.0, reward_extra: dict[str, float] | None = None,
                  session_id: str = "", termination: str | None = None) -> AgentLoopOutput:
        t = self.traj
        return AgentLoopOutput(
            prompt_ids=list(t.prompt_ids), response_ids=list(t.response_ids), response_mask=list(t.response_mask),
            response_logprobs=list(t.response_logprobs), reward=float(reward), num_turns=len(self.request_ids),
            termination=termination or ("length" if self.last_finish == "length" else "stop"),
            turns=list(self.turns), weight_versions=list(self.versions), request_ids=list(self.request_ids),
            reward_extra=dict(reward_extra or {}), messages=without_pixels(self.held), session_id=session_id,
            multi_modal=t.multi_modal())


class Conversation:
    """The segments of one session (one API key or X-Session-Id)."""

    forced_call = staticmethod(forced_call)  # the gateway's routes check tool_choice with it

    def __init__(self, session_id: str, tokenizer: Any, tool_parser: str = "hermes",
                 end_of_turn_id: int | None = None, max_context: int | None = None,
                 sampling: dict[str, Any] | None = None, encoders: dict[str, ChatEncoder] | None = None,
                 max_segments: int | None = None, vision: Any = None) -> None:
        self.session_id, self.tokenizer, self.tool_parser = session_id, tokenizer, tool_parser
        self.vision = vision  # agent.vision.Vision of a vision-language model: image parts become pixels
        self.encoders = {} if encoders is None else encoders  # shared by a gateway's sessions, by tools
        self.last_used = time.monotonic()
        self.max_segments = max_segments  # sessions nobody trains on keep only their latest segments
        self.end_of_turn_id, self.max_context = end_of_turn_id, max_context
        self.sampling = dict(sampling or {})  # the trainer's settings win over the client's
        self.segments: list[Segment] = []
        self.group_id = uuid.uuid4().hex
        self.owner = session_id  # who may continue its stored responses: its key or X-Session-Id ("" keyless)
        self._lock = asyncio.Lock()

    def _mark(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> "_Undo":
        """What `_continue` and a request would change, to be put back if the request fails."""
        return _Undo(self, [(seg, len(seg.traj.response_ids), len(seg.traj.pixel_values), seg.held, seg.unclosed,
                             len(seg.turns)) for seg in self.segments])

    def _continue(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Segment:
        """The segment to generate on, brought up to `messages` (a new one when none extends)."""
        keys = [_key(m) for m in messages]
        best: Segment | None = None
        for seg in self.segments:
            n = len(seg.held)
            if (seg.tools == tools and n < len(messages) and seg.unclosed is not None
                    and [_key(m) for m in seg.held] == keys[:n]
                    and all(m["role"] != "assistant" for m in messages[n:])
                    and (best is None or n > len(best.held))):
                best = seg
        if best is not None:
            new = messages[len(best.held):]
            pixels = self._pixels(new)  # first: a bad image leaves the segment as it was
            ids = best.encoder.close_assistant_turn(best.unclosed or []) + best.encoder.turn_tokens(new)
            best.traj.add_context(ids)
            if pixels is not None:
                best.traj.add_images(pixels)
            results = [m for m in new if m["role"] == "tool"]
            if results:  # the agent ran the calls of the last reply: a tool round, as a tool_agent's is counted
                failed = sum(1 for m in results if str(m.get("content") or "").lstrip().lower().startswith("error"))
                best.turns.append({"kind": "tools", "calls": len(results), "failed": failed, "recorded_by": "gateway"})
            best.turns.append({"kind": "context", "roles": [m["role"] for m in new], "tokens": len(ids)})
            best.held = best.held + new
            best.unclosed = None
            return best
        tools_key = json.dumps(tools, sort_keys=True)
        encoder = self.encoders.get(tools_key)
        if encoder is None:  # measuring the template costs a few renders: once per tool set
            encoder = self.encoders[tools_key] = ChatEncoder(self.tokenizer, tools=tools,
                                                             end_of_turn_id=self.end_of_turn_id, vision=self.vision)
        pixels = self._pixels(messages)
        seg = Segment(encoder, Trajectory(encoder.initial(messages)), list(messages), tools)
        if pixels is not None:
            seg.traj.add_images(pixels)
        self.segments.append(seg)
        return seg

    def _pixels(self, messages: list[dict[str, Any]]) -> Any:
        """The pixel values of the images in `messages` (None without images); a 400 when the
        model takes no images or one cannot be read."""
        if not images_in(messages):
            return None
        if self.vision is None:
            raise RequestError(400, "the messages hold images but the model takes none (it has no vision tower)",
                               param="messages")
        try:
            return self.vision.pixels_in(messages)
        except (ValueError, TypeError, OSError) as e:
            raise RequestError(400, f"an image could not be read: {e}", param="messages") from None

    def parser(self, tools: list[dict[str, Any]] | None) -> ToolParser:
        return get_tool_parser(self.tool_parser, {
            str(t["function"]["name"]): t["function"].get("parameters") or {} for t in tools or []
            if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]})

    def _calls(self, parser: ToolParser, tools: list[dict[str, Any]]) -> str:
        """`SamplingParams.json_calls` for an output schema beside `tools`: per declared tool its
        call's opening, arguments schema and closing in the parser's format; a 400 when the format
        cannot write a call under a grammar."""
        out = []
        for name in dict.fromkeys(str(t["function"]["name"]) for t in tools):
            opening, constraint = parser.call_prefix(name), parser.call_constraint(name)
            if not opening or constraint is None:
                raise RequestError(400, f"an output schema beside tools is decoded as the answer or one call, and "
                                        f"tool_parser {self.tool_parser!r} has no call format a grammar can write "
                                        f"(for tool {name!r}); use a parser that has (hermes, llama3_json), offer "
                                        "no tools, or send tool_choice=none", param="response_format")
            out.append([opening, constraint[0], constraint[1]])
        return json.dumps(out)

    def _opening(self, parser: ToolParser, force: bool | str) -> str:
        """The call opening that forces `force` (see forced_call); "" when nothing is forced."""
        if force is False:
            return ""
        prefix = parser.call_prefix(None if force is True else force)
        if not prefix:
            what = "'required'" if force is True else f"naming function {force!r}"
            raise RequestError(400, f"tool_choice {what} is not supported with tool_parser {self.tool_parser!r}: its "
                                    "call format has no opening to force the call with; use 'auto'",
                               param="tool_choice")
        return prefix

    async def generate(self, client: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       sampling: dict[str, Any], n: int = 1, parse_calls: bool = True,
                       tool_choice: Any = None, parallel_calls: bool = True, check_schema: Any = None) -> list[Reply]:
        """Generate `n` choices continuing `messages`; the first continues the segment in place,
        the others each get a copy of it (their own segment). `tool_choice` required or a named
        function forces a call (the parser's call opening is appended to the prompt, mask 0), and
        where the format says what follows its opening (`ToolParser.call_constraint`) the engine
        decodes the rest of the call under the declared tools' schemas: one well-formed call. With
        `parallel_calls` False a reply's first call is returned and any others are dropped. An
        output schema (`sampling["json_schema"]`) beside tools not forced is the answer or one call,
        the model's choice (module docstring); a forced call leaves the schema out of that turn.
        `check_schema(schema, suffix, param, calls)` (the gateway's SchemaCheck.check) vets what is
        decoded under before any engine sees it. A client's `max_tokens` over the context the
        prompt leaves is refused (400, context_length_exceeded), as OpenAI does; the trainer's own
        is cut to fit."""
        force = forced_call(tool_choice, tools)
        parser = self.parser(tools)
        prefix = self._opening(parser, force)
        constraint = parser.call_constraint(None if force is True else force) if prefix else None
        openings: tuple[str, ...] = ()
        if prefix:  # the reply is the forced call: an output schema is for the answer of a later turn
            if check_schema is not None and sampling.get("json_schema"):  # vetted all the same
                await check_schema(sampling["json_schema"], "", "response_format")
            sampling = {k: v for k, v in sampling.items() if k != "json_schema"}
            if constraint is not None:
                sampling = {**sampling, "json_schema": json.dumps(constraint[0]), "json_suffix": constraint[1]}
        elif sampling.get("json_schema") and parse_calls and tools:  # the answer, or one call: the model chooses
            sampling = {**sampling, "json_calls": self._calls(parser, tools)}
            openings = tuple(opening for opening, _, _ in json.loads(sampling["json_calls"]))
        if check_schema is not None and sampling.get("json_schema"):
            await check_schema(sampling["json_schema"], sampling.get("json_suffix", ""),
                               "tools" if sampling.get("json_suffix") else "response_format")
            if sampling.get("json_calls"):  # the schema alone passed: a fault now is in a tool's parameters
                await check_schema(sampling["json_schema"], "", "tools", sampling["json_calls"])
        async with self._lock:  # one session's calls are sequential, as an agent's are
            self.last_used = time.monotonic()
            undo = self._mark(messages, tools)
            try:  # a refused or failed request leaves the session as it was: nothing of it is kept
                seg = self._continue(messages, tools)
                undo.seg = seg
                if prefix:  # template tokens: the engine continues after them, the trainer never trains on them
                    seg.traj.add_context(self.tokenizer.encode(prefix, add_special_tokens=False))
                prompt = seg.traj.all_ids()
                params = {**sampling, **self.sampling}
                if "max_tokens" in sampling and "max_tokens" in self.sampling:
                    params["max_tokens"] = min(int(sampling["max_tokens"]), int(self.sampling["max_tokens"]))
                if self.max_context is not None:
                    room = self.max_context - len(prompt)
                    if room < 1:
                        raise RequestError(413, f"the prompt holds {len(prompt)} tokens; the model's context is "
                                                f"{self.max_context}: shorten the conversation",
                                           code="context_length_exceeded", param="messages")
                    asked = sampling.get("max_tokens")
                    if asked is not None and int(asked) > room and int(params["max_tokens"]) == int(asked):
                        raise RequestError(400, f"the prompt holds {len(prompt)} tokens and max_tokens asks for {asked}:"
                                                f" {len(prompt) + int(asked)} in all, over the model's context of "
                                                f"{self.max_context}; ask for at most {room} (or shorten the "
                                                "conversation)", code="context_length_exceeded", param="max_tokens")
                    params["max_tokens"] = min(room, int(params.get("max_tokens", room)))
                params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
                bases = [seg] + [seg.clone() for _ in range(n - 1)]
                t0 = time.perf_counter()
                pv = seg.traj.all_pixel_values()
                images = {} if pv is None else {"pixel_values": pv}
                results = await asyncio.gather(*(client.generate(prompt, params, session_id=self.session_id,
                                                                 group_id=self.group_id, **images) for _ in bases))
            except BaseException:
                undo()
                raise
            self.segments += bases[1:]
            if self.max_segments is not None and len(self.segments) > self.max_segments:
                fresh = {id(b) for b in bases}  # this call's segments stay; then the most recently used
                keep = {id(x) for x in sorted(self.segments, key=lambda x: (id(x) in fresh, x.updated))[-self.max_segments:]}
                self.segments = [x for x in self.segments if id(x) in keep]
            declared = {t["function"]["name"] for t in tools or []}
            replies = []
            for target, result in zip(bases, results):
                replies.append(self._record(target, result, parser, parse_calls or bool(prefix), len(prompt),
                                            time.perf_counter() - t0, declared, prefix, force, parallel_calls,
                                            openings))
                if params.get("json_schema"):  # the trajectory says its tokens were drawn under a constraint
                    target.turns[-1]["constraint"] = ("tool_call_or_json_schema" if params.get("json_calls") else
                                                      "tool_call" if params.get("json_suffix") else "json_schema")
            return replies

    def _record(self, seg: Segment, result: Any, parser: ToolParser, parse_calls: bool, prompt_tokens: int,
                latency: float, declared: set[str] | frozenset[str] = frozenset(), prefix: str = "",
                force: bool | str = False, parallel_calls: bool = True, openings: tuple[str, ...] = ()) -> Reply:
        seg.traj.add_model(result.token_ids, result.logprobs)
        seg.unclosed = list(result.token_ids)
        seg.request_ids.append(result.request_id)
        seg.versions.append(result.weight_version)
        seg.turns.append({"kind": "generate", "request_id": result.request_id, "tokens": len(result.token_ids),
                          "prompt_tokens": prompt_tokens, "finish_reason": result.finish_reason,
                          "weight_version": result.weight_version, "latency_s": latency})
        ids = list(result.token_ids)
        if ids and ids[-1] == seg.encoder.end_of_turn_id:
            ids = ids[:-1]
        text = prefix + self.tokenizer.decode(ids, skip_special_tokens=False)  # a forced call's opening and the rest
        if prefix:
            seg.turns[-1]["forced_call"] = force if isinstance(force, str) else "required"
        if openings and not text.startswith(openings):  # decoded as the answer or a call: it chose the answer
            parsed = ParseResult(content=text)
        else:
            parsed = parser.parse(text) if parse_calls else ParseResult(content=text)
        if isinstance(force, str) and parsed.calls and parsed.calls[0].name != force:  # it wrote on past the name
            parsed = ParseResult(content=text.strip(), errors=[f"the forced call to {force!r} became a call to "
                                                               f"{parsed.calls[0].name!r}"])
        if (parsed.errors or prefix) and not parsed.calls:
            parsed = ParseResult(content=text.strip(), errors=parsed.errors)  # let the agent see what was written
        undeclared = sorted({c.name for c in parsed.calls} - set(declared))
        if undeclared:  # a call to a tool the request did not offer is text, never a tool_call the agent cannot run
            seg.turns[-1]["undeclared_tools"] = undeclared
            parsed = ParseResult(content=text.strip(), errors=[f"call to undeclared tool(s) {undeclared}"])
        if not parallel_calls and len(parsed.calls) > 1:  # parallel_tool_calls=false: the first call only
            seg.turns[-1]["calls_dropped"] = len(parsed.calls) - 1
            parsed = ParseResult(content=parsed.content, calls=parsed.calls[:1], errors=parsed.errors)
        seg.last_text, seg.last_finish, seg.updated = text, result.finish_reason, time.monotonic()
        seg.held = seg.held + [{"role": "assistant", "content": parsed.content, **(
            {"tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                            for c in parsed.calls]} if parsed.calls else {})}]
        return Reply(seg, list(result.token_ids), list(result.logprobs), result.finish_reason, text, parsed,
                     prompt_tokens, getattr(result, "top_ids", None), getattr(result, "top_logprobs", None))

    def nbytes(self) -> int:
        """About what the session holds in memory (`Segment.nbytes` summed)."""
        return sum(seg.nbytes() for seg in self.segments)

    def trim(self, max_bytes: int) -> int:
        """Drop the least recently used segments until the session holds at most `max_bytes`
        (the latest one stays); the number dropped."""
        dropped = 0
        while len(self.segments) > 1 and self.nbytes() > max_bytes:
            self.segments.remove(min(self.segments, key=lambda x: x.updated))
            dropped += 1
        return dropped

    def latest(self) -> Segment | None:
        """The segment that generated last (the one holding the agent's final answer)."""
        return max(self.segments, key=lambda s: s.updated) if self.segments else None

