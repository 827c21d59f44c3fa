"""Which request fields each gateway route honours, ignores on purpose, or takes only at their default,
and the one check that refuses any other field with a 400 naming it (never dropped silently).

Each route has a `Fields` table: `honoured` (what the route reads), `ignored` (accepted and
ignored because none changes what is sampled, each with why), `at_default` (fields the real API
defines that the gateway cannot honour: accepted only at the value that means "off", refused with
why otherwise), and `hints` (a better message for a field clients often reach for). Anything else
is a 400 listing what the route takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.gateway.requests import RequestError


@dataclass(frozen=True)
class Fields:
    route: str  # as the error names it, e.g. "the chat route"
    honoured: frozenset[str]
    ignored: dict[str, str] = field(default_factory=dict)  # field -> why it changes nothing sampled
    at_default: dict[str, tuple[tuple[Any, ...], str]] = field(default_factory=dict)  # field -> (allowed, why)
    hints: dict[str, str] = field(default_factory=dict)  # field -> why it is refused and what to do instead
    unset_ok: bool = False  # any field sent as null, false, [] or {} passes (SDKs that send every parameter)

    def check(self, body: dict[str, Any], prefix: str = "") -> None:
        """A 400 naming the first field of `body` this route would otherwise drop silently
        (`prefix` names a nested object, e.g. "sampling_params.")."""
        for key, value in body.items():
            if key in self.honoured or key in self.ignored:
                continue
            name = prefix + key
            if self.unset_ok and (value is None or value is False or value == [] or value == {}):
                continue
            if key in self.at_default:
                allowed, why = self.at_default[key]
                if value in allowed:
                    continue
                raise RequestError(400, f"{name}={value!r:.80} is not supported by {self.route}: {why}; leave "
                                        f"{name} out" + (f" or set it to {allowed[-1]!r}" if allowed[-1] is not None
                                                          else ""), param=name)
            if key in self.hints:
                raise RequestError(400, f"{name} {self.hints[key]}", param=name)
            ignored = f"; accepted and ignored: {', '.join(sorted(self.ignored))}" if self.ignored else ""
            raise RequestError(400, f"{name} is not a request field {self.route} honours (fields: "
                                    f"{', '.join(sorted(self.honoured))}{ignored})", param=name)


NOT_SAMPLED = "the served model samples text alone"
# the chat route (server.py)
CHAT = Fields(
    "the chat route",
    frozenset({"model", "messages", "tools", "tool_choice", "temperature", "top_p", "top_k", "seed", "max_tokens",
               "max_completion_tokens", "n", "stream", "stream_options", "logprobs", "top_logprobs",
               "frequency_penalty", "presence_penalty", "logit_bias", "parallel_tool_calls", "stop",
               "response_format"}),
    ignored={"user": "an end-user id for the caller's own records", "safety_identifier": "the same, OpenAI's newer name",
             "metadata": "tags OpenAI stores with a completion; the gateway stores none", "store": "the same",
             "service_tier": "one pool of engines, no tiers",
             "prediction": "a latency hint: the reply is the same without it",
             "prompt_cache_key": "the engines reuse cached prefixes by themselves (sticky, prefix-aware routing)",
             "prompt_cache_retention": "the same"},
    at_default={"modalities": ((None, ["text"]), NOT_SAMPLED), "verbosity": ((None, "medium"), NOT_SAMPLED),
                "reasoning_effort": ((None,), "the served model's reasoning is not configurable here"),
                "audio": ((None,), NOT_SAMPLED), "web_search_options": ((None,), "the engines run no hosted tools"),
                "functions": ((None,), "use tools"), "function_call": ((None,), "use tool_choice")},
    hints={k: "is not supported by the engines' sampling; use top_p, top_k, frequency_penalty or presence_penalty"
           for k in ("min_p", "repetition_penalty")})

# Anthropic's Messages API (anthropic.py); stop_sequences, a prefill and other block types are refused there
MESSAGES = Fields(
    "the Messages route",
    frozenset({"model", "messages", "max_tokens", "system", "stream", "temperature", "top_p", "top_k", "tools",
               "tool_choice", "output_config", "stop_sequences"}),
    ignored={"metadata": "a user id for the caller's own records", "service_tier": "one pool of engines, no tiers"},
    at_default={"thinking": ((None, {"type": "disabled"}), "the served model's thinking is not configurable here"),
                "mcp_servers": ((None, []), "the gateway connects to no MCP servers: declare client tools"),
                "container": ((None,), "the gateway runs no code-execution containers"),
                "context_management": ((None,), "the gateway edits no context: a prompt over it gets 413")})
MESSAGES_OUTPUT = Fields(  # output_config's own keys
    "the Messages route", frozenset({"format"}),
    at_default={"effort": ((None, "high"), "the served model's effort is not configurable here")})

# OpenAI's legacy completions (completions.py); echo, suffix, stop, best_of and n > 1 are refused there
COMPLETIONS = Fields(
    "the completions route",
    frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "frequency_penalty",
               "presence_penalty", "logit_bias", "logprobs", "stream", "stream_options", "n", "echo", "suffix", "stop",
               "best_of"}),
    ignored={"user": "an end-user id for the caller's own records"})

# the token endpoint, vLLM's shape (completions.py): the request and its sampling_params
GENERATE = Fields(
    "the token endpoint",
    frozenset({"model", "token_ids", "sampling_params", "stream"}),
    ignored={"request_id": "the engines name requests themselves (the reply's request_id)",
             "cache_salt": "prefix-cache isolation: the engines' caches are the trainer's own",
             "priority": "one queue, no priorities",
             "return_token_ids": "the reply always carries its token ids"},
    at_default={"features": ((None,), "the token endpoint takes no multimodal features"),
                "content_parts": ((None, []), "the token endpoint takes no images: send them through the chat route"),
                "stream_options": ((None,), "the token endpoint does not stream"),
                "kv_transfer_params": ((None,), "the engines transfer no KV cache")})
GENERATE_SAMPLING = Fields(
    "the token endpoint",
    frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "frequency_penalty", "presence_penalty",
               "logit_bias", "logprobs", "stop_token_ids", "n", "stop", "best_of"}),
    ignored={k: "the reply is token ids: nothing is detokenized" for k in (
        "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
        "output_kind")} | {
        "routed_experts_prompt_start": "where a mixture-of-experts engine's routing replay starts (verifiers' "
                                       "train client sends it); the engines return no expert routes"},
    at_default={"repetition_penalty": ((None, 1, 1.0), "use frequency_penalty or presence_penalty"),
                "min_p": ((None, 0, 0.0), "use top_p or top_k"),
                "min_tokens": ((None, 0), "the engines stop where the model does"),
                "ignore_eos": ((None, False), "the engines stop where the model does"),
                "prompt_logprobs": ((None, 0), "the engines score generated tokens only"),
                "bad_words": ((None, []), "use logit_bias"), "allowed_token_ids": ((None, []), "use logit_bias"),
                "structured_outputs": ((None,), "use the chat route's response_format"),
                "truncate_prompt_tokens": ((None,), "a prompt over the context gets 413"),
                "logits_processors": ((None, []), "the engines run no custom logits processors"),
                "extra_args": ((None, {}), "the engines read no extra arguments")})

# the Responses API (responses.py checks text, reasoning and truncation's values itself); the Agents SDK
# sends every parameter, unset ones as null
RESPONSES = Fields(
    "the Responses route",
    frozenset({"model", "input", "instructions", "tools", "tool_choice", "previous_response_id", "max_output_tokens",
               "temperature", "top_p", "parallel_tool_calls", "stream", "stream_options", "text", "reasoning",
               "include", "truncation", "seed", "top_logprobs"}),
    ignored={"user": "an end-user id for the caller's own records", "safety_identifier": "the same, OpenAI's newer name",
             "metadata": "tags OpenAI stores with a response; the gateway stores none", "store": "the same",
             "service_tier": "one pool of engines, no tiers",
             "prompt_cache_key": "the engines reuse cached prefixes by themselves (sticky, prefix-aware routing)",
             "prompt_cache_retention": "the same", "prompt_cache_options": "the same"},
    hints={"background": "is not supported by the gateway's Responses API: every response is answered while the "
                         "request waits",
           "conversation": "is not supported by the gateway's Responses API: continue with previous_response_id or "
                           "send the history",
           "prompt": "is not supported by the gateway's Responses API: stored prompts live with OpenAI; send "
                     "instructions and input",
           "max_tool_calls": "is not supported by the gateway's Responses API: the engine runs no hosted tools"},
    unset_ok=True)
