"""A renderer for verifiers' train client that tokenizes the way the gateway's chat route does.

verifiers' train client (`client: train` in agent/verifiers_env.py) renders each prompt to token
ids itself with a renderer of the `renderers` package, sends them to `/inference/v1/generate`
and parses the reply's tokens back into a message. `SwitchyardRenderer` is such a renderer built
on switchyard's own pieces: the prompt is the model's chat template rendered by
`agent.chat.ChatEncoder` (the same ids the chat route would send), a reply is parsed by the
gateway's tool parser (`tool_parser`, default `hermes`), and the next turn is bridged by
appending (the reply's tokens kept verbatim, then the template's tokens for the tool results or
user turn), so a multi-turn episode is one growing token list: one trajectory at the gateway,
one branch in verifiers' trace. It needs no entry in the renderers package's model map and works
for any model switchyard serves, tool tokens in the vocabulary or not.

Use it through the renderers package's custom-renderer config (agent/verifiers_env.py does this
by default for `client: train`):

    {"name": "custom", "import_path": "agent.verifiers_renderer.SwitchyardRenderer",
     "tool_parser": "hermes"}

The classes subclass the renderers package's types, so they are built on first access (this
module imports without that package).
"""

from __future__ import annotations

import json
from typing import Any

IMPORT_PATH = "agent.verifiers_renderer.SwitchyardRenderer"
_GEN_PROBE = [{"role": "user", "content": "Dummy user turn used to measure the generation prompt."}]


def __getattr__(name: str) -> Any:
    if name in ("SwitchyardRenderer", "SwitchyardRendererConfig"):
        renderer, config = _build()
        globals().update(SwitchyardRenderer=renderer, SwitchyardRendererConfig=config)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """verifiers' wire messages as the chat template takes them (the gateway's own normalization)."""
    from agent.gateway.requests import RequestError, normalize

    try:
        return normalize([dict(m) for m in messages])
    except RequestError as e:
        raise ValueError(f"the renderer cannot render these messages: {e}") from None


def _build() -> tuple[type, type]:
    from renderers.base import ParsedResponse, ParsedToolCall, RenderedTokens, ToolCallParseStatus
    from renderers.configs import BaseRendererConfig

    from agent.chat import ChatEncoder
    from agent.parsers import get_tool_parser

    class SwitchyardRendererConfig(BaseRendererConfig):
        """`tool_parser`: the gateway's parser name (or a dotted path to an agent.parsers.ToolParser);
        `end_of_turn_id`: the token that closes an assistant turn (default: the tokenizer's eos)."""

        tool_parser: str = "hermes"
        end_of_turn_id: int | None = None
        _internal_fields = frozenset({"tool_parser", "end_of_turn_id"})

    class SwitchyardRenderer:
        config_class = SwitchyardRendererConfig
        is_multimodal = False
        supports_tools = True

        def __init__(self, tokenizer: Any, config: Any = None) -> None:
            self.tokenizer = tokenizer
            self.config = config if config is not None else SwitchyardRendererConfig()
            get_tool_parser(self.config.tool_parser)  # an unknown parser fails here, not on the first reply
            self._encoders: dict[str, Any] = {}
            self.end_of_turn_id = self._encoder(None).end_of_turn_id

        @property
        def is_prefix_stable(self) -> bool:
            return False  # a chat template is opaque; turns are bridged by appending instead

        def _encoder(self, tools: list[dict[str, Any]] | None) -> Any:
            key = json.dumps(tools, sort_keys=True)
            if key not in self._encoders:
                self._encoders[key] = ChatEncoder(self.tokenizer, tools, self.config.end_of_turn_id)
            return self._encoders[key]

        def get_stop_token_ids(self) -> list[int]:
            return [self.end_of_turn_id]

        def render(self, messages: list[Any], *, tools: list[dict[str, Any]] | None = None,
                   add_generation_prompt: bool = False) -> Any:
            msgs, enc = _messages(messages), self._encoder(tools)
            indices: list[int] = []
            for i in range(len(msgs)):  # each message's tokens: what its render adds to the one before
                n = len(enc.render(msgs[:i + 1], add_generation_prompt=False))
                indices += [i] * max(0, n - len(indices))
            ids = enc.render(msgs, add_generation_prompt=add_generation_prompt)
            indices = (indices + [-1] * len(ids))[:len(ids)]  # the generation prompt belongs to no message
            return RenderedTokens(token_ids=ids, message_indices=indices,
                                  message_roles=[m["role"] for m in msgs])

        def render_ids(self, messages: list[Any], *, tools: list[dict[str, Any]] | None = None,
                       add_generation_prompt: bool = False) -> list[int]:
            return self._encoder(tools).render(_messages(messages), add_generation_prompt=add_generation_prompt)

        def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                                new_messages: list[Any], *, tools: list[dict[str, Any]] | None = None) -> Any:
            """The previous prompt and reply verbatim (closed as the template closes a turn when the
            reply was cut), then the template's tokens for the new tool results or user turn."""
            msgs, enc = _messages(new_messages), self._encoder(tools)
            if not msgs or any(m["role"] == "assistant" for m in msgs):
                return None  # only tool results and user turns extend a sampled reply
            prior = list(previous_prompt_ids) + list(previous_completion_ids)
            prior += enc.close_assistant_turn(previous_completion_ids)
            added = enc.turn_tokens(msgs)
            return RenderedTokens(token_ids=prior + added, message_indices=[-1] * (len(prior) + len(added)),
                                  message_roles=[m["role"] for m in msgs])

        def parse_response(self, token_ids: list[int], *, tools: list[dict[str, Any]] | None = None,
                           prompt_ids: list[int] | None = None) -> Any:
            """The reply as the gateway's chat route parses it: calls to declared tools only; a reply
            whose calls are malformed or undeclared stays text."""
            ids = list(token_ids)
            if ids and ids[-1] == self.end_of_turn_id:
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                       for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)}
            parsed = get_tool_parser(self.config.tool_parser, schemas).parse(text)
            undeclared = any(c.name not in schemas for c in parsed.calls)
            keep = not undeclared and not (parsed.errors and not parsed.calls)
            calls = []
            for c in parsed.calls:
                raw = json.dumps({"name": c.name, "arguments": c.arguments})
                if keep:
                    calls.append(ParsedToolCall(raw=raw, name=c.name, arguments=c.arguments))
                else:  # no name: verifiers keeps it out of the message, which stays text
                    calls.append(ParsedToolCall(raw=raw, status=ToolCallParseStatus.UNKNOWN_TOOL
                                                if c.name not in schemas else ToolCallParseStatus.MALFORMED_STRUCTURE))
            calls += [ParsedToolCall(raw=e, status=ToolCallParseStatus.MALFORMED_STRUCTURE) for e in parsed.errors]
            return ParsedResponse(content=parsed.content if keep else text.strip(), tool_calls=calls,
                                  reasoning_complete=None)

    return SwitchyardRenderer, SwitchyardRendererConfig
