"""Anthropic's Messages API on the gateway (`POST /v1/messages`): agents built on Anthropic's SDK
train by pointing their base URL at the gateway.

A Messages request is translated into the Chat Completions body the chat route takes and goes
through the gateway's own `_parse`, `_session_for` and `Conversation.generate`, so the session
records exactly as it does for chat: an assistant `tool_use` block is a tool call (the same id), a
user `tool_result` block a `tool` message (`tool_call_id` = `tool_use_id`; `is_error` prefixes
"Error: " unless the text already says so, which is how the model and the tool-round metrics
see it). The reply comes back as an Anthropic Message, or with `stream: true` as its event
stream. `max_tokens` is required; `temperature`, `top_p` and `top_k` are honoured; `metadata` and
`service_tier` are accepted and ignored; `thinking`, `mcp_servers`, `container`, `context_management`
and `output_config.effort` are accepted only when off (fields.MESSAGES says why), and any other field
is refused with a 400 naming it. `tool_choice` any and tool force a call as on the chat route, and its
`disable_parallel_tool_use` returns the reply's first call only; `output_config.format` (json_schema)
is decoded under the schema as chat's `response_format` is (beside tools: the answer or one call).
Refused with a 400:
`stop_sequences`, a final assistant message (prefill), and content blocks
other than text, image, tool_use and tool_result. Errors are Anthropic-shaped: {"type": "error",
"error": {"type", "message"}}. The key comes as `x-api-key` or `Authorization: Bearer`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web

from agent.gateway.fields import MESSAGES, MESSAGES_OUTPUT
from agent.gateway.requests import RequestError
from agent.gateway.session import Reply

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 32  # as the chat route: more text than max_context x this cannot fit, 413 before tokenizing
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def error(status: int, message: str) -> web.Response:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return web.json_response({"type": "error", "error": {"type": kind, "message": message}}, status=status)


def _refuse(message: str, param: str) -> RequestError:
    return RequestError(400, message, param=param)


def _block(b: Any, where: str) -> dict[str, Any]:
    if not isinstance(b, dict) or not isinstance(b.get("type"), str):
        raise _refuse(f"{where}: a content block must be an object with a type", "messages")
    return b


def _text(b: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(b.get("text"), str):
        raise _refuse(f"{where}: a text block needs text (a string)", "messages")
    return {"type": "text", "text": b["text"]}


def _image(b: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as the chat route's image_url part (the session refuses it when the model
    takes no images)."""
    src = b.get("source") if isinstance(b.get("source"), dict) else {}
    if src.get("type") == "base64" and isinstance(src.get("data"), str):
        url = f"data:{src.get('media_type') or 'image/png'};base64,{src['data']}"
    elif src.get("type") == "url" and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise _refuse(f"{where}: an image block needs source {{type: base64, media_type, data}} or {{type: url, url}}",
                      "messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _unsupported(b: dict[str, Any], where: str, allowed: str) -> RequestError:
    return _refuse(f"{where}: content block type {b['type']!r} is not supported here ({allowed})", "messages")


def _system(system: Any) -> Any:
    if isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise _refuse("system must be a string or a list of text blocks", "system")
    parts = []
    for i, b in enumerate(system):
        if _block(b, f"system[{i}]")["type"] != "text":
            raise _unsupported(b, f"system[{i}]", "the system prompt holds text")
        parts.append(_text(b, f"system[{i}]"))
    return parts


def _tool_result(b: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
        raise _refuse(f"{where}: a tool_result block needs tool_use_id", "messages")
    content = b.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = [_block(p, f"{where}.content[{k}]") for k, p in enumerate(content)]
        for k, p in enumerate(parts):
            if p["type"] != "text":
                raise _unsupported(p, f"{where}.content[{k}]", "a tool_result holds text")
        text = "".join(_text(p, where)["text"] for p in parts)
    else:
        raise _refuse(f"{where}: tool_result content must be a string or a list of text blocks", "messages")
    if b.get("is_error") and not text.lstrip().lower().startswith("error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": b["tool_use_id"], "content": text}


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    parts, calls = [], []
    for j, b in enumerate(content):
        b = _block(b, f"{where}.content[{j}]")
        if b["type"] == "text":
            parts.append(_text(b, f"{where}.content[{j}]"))
        elif b["type"] == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise _refuse(f"{where}.content[{j}]: a tool_use block needs name and input (an object)", "messages")
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input") or {}}})
        else:
            raise _unsupported(b, f"{where}.content[{j}]", "an assistant message holds text and tool_use")
    return {"role": "assistant", "content": parts, **({"tool_calls": calls} if calls else {})}


def _user(content: list[Any], where: str) -> list[dict[str, Any]]:
    """One user message's blocks in order: each run of text/image blocks a user message, each
    tool_result a tool message."""
    out: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        b, at = _block(b, f"{where}.content[{j}]"), f"{where}.content[{j}]"
        if b["type"] == "text":
            run.append(_text(b, at))
        elif b["type"] == "image":
            run.append(_image(b, at))
        elif b["type"] == "tool_result":
            if run:
                out.append({"role": "user", "content": run})
                run = []
            out.append(_tool_result(b, at))
        else:
            raise _unsupported(b, at, "a user message holds text, image and tool_result")
    if run or not out:
        out.append({"role": "user", "content": run})
    return out


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """A Messages request -> (the Chat Completions body the gateway's `_parse` takes, top_k)."""
    MESSAGES.check(body)
    if body.get("max_tokens") is None:
        raise _refuse("max_tokens is required", "max_tokens")
    if body.get("stop_sequences"):
        raise _refuse("stop_sequences is not supported by the gateway (the engines stop on token ids)",
                      "stop_sequences")
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise _refuse("output_config must be an object like {format: {type: json_schema, schema: {...}}}",
                      "output_config")
    MESSAGES_OUTPUT.check(config or {}, "output_config.")
    fmt = (config or {}).get("format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
                                and isinstance(fmt.get("schema"), dict)):
        raise _refuse("output_config.format must be {type: json_schema, schema: {...}}", "output_config.format")
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is not None and kind not in ("auto", "any", "tool", "none"):
        raise _refuse("tool_choice must be {type: auto | any | tool | none}", "tool_choice")
    forced: Any = kind
    if kind == "any":
        forced = "required"
    elif kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _refuse("tool_choice {type: tool} needs the tool's name", "tool_choice")
        forced = {"type": "function", "function": {"name": choice["name"]}}
    top_k = body.get("top_k")
    if top_k is not None and (type(top_k) is not int or top_k < 1):
        raise _refuse(f"top_k={top_k!r} must be a positive integer", "top_k")
    history = body.get("messages")
    if not isinstance(history, list) or not history:
        raise _refuse("messages must be a non-empty list", "messages")
    messages: list[dict[str, Any]] = []
    if body.get("system"):
        messages.append({"role": "system", "content": _system(body["system"])})
    for i, m in enumerate(history):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _refuse(f"{where}: role {role!r} must be 'user' or 'assistant' (the system prompt is the top-level "
                          "system field)", "messages")
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise _refuse(f"{where}: content must be a string or a list of content blocks", "messages")
        elif role == "assistant":
            messages.append(_assistant(content, where))
        else:
            messages.extend(_user(content, where))
    if history[-1].get("role") == "assistant":
        raise _refuse("a final assistant message (prefill) is not supported: the reply is always a new assistant turn",
                      "messages")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _refuse("tools must be a list of {name, description, input_schema}", "tools")
    chat_tools = []
    for i, t in enumerate(tools or []):
        if t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            raise _refuse(f"tools[{i}]: only client tools {{name, description, input_schema}} are supported, got "
                          f"type {t.get('type')!r}", "tools")
        fn = {"name": t["name"], **({"description": t["description"]} if t.get("description") else {}),
              "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        chat_tools.append({"type": "function", "function": fn})
    chat = {"model": body.get("model"), "messages": messages, "tools": chat_tools or None,
            "tool_choice": forced, "max_tokens": body["max_tokens"],
            **({"response_format": fmt} if fmt else {}),  # decoded under the schema, as chat's response_format
            **({"parallel_tool_calls": False} if isinstance(choice, dict) and choice.get("disable_parallel_tool_use")
               else {}),
            **{k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None}}
    return chat, top_k


def to_message(reply: Reply, model: str) -> dict[str, Any]:
    """One generated reply as an Anthropic Message."""
    content: list[dict[str, Any]] = []
    if reply.parsed.content:
        content.append({"type": "text", "text": reply.parsed.content})
    for call in reply.parsed.calls:
        content.append({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": call.name,
                        "input": call.arguments})
    stop = "tool_use" if reply.parsed.calls else "max_tokens" if reply.finish_reason == "length" else "end_turn"
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": len(reply.token_ids)}}


async def stream(request: web.Request, message: dict[str, Any]) -> web.StreamResponse:
    """The finished Message as the event stream Anthropic's SDK accumulates (the bus returns whole
    generations: one delta per block)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(kind: str, **data: Any) -> None:
        await resp.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode())

    usage = message["usage"]
    await send("message_start", message={**message, "content": [], "stop_reason": None,
                                         "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}})
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            await send("content_block_start", index=i, content_block={"type": "text", "text": ""})
            await send("content_block_delta", index=i, delta={"type": "text_delta", "text": block["text"]})
        else:
            await send("content_block_start", index=i, content_block={**block, "input": {}})
            await send("content_block_delta", index=i,
                       delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        await send("content_block_stop", index=i)
    await send("message_delta", delta={"stop_reason": message["stop_reason"], "stop_sequence": None},
               usage={"output_tokens": usage["output_tokens"]})
    await send("message_stop")
    await resp.write_eof()
    return resp


def _keyed(request: web.Request) -> web.Request:
    """The request as `_session_for` reads it: Anthropic's SDKs send the key as `x-api-key`."""
    key = request.headers.get("x-api-key", "").strip()
    if key and not request.headers.get("Authorization", "").lower().startswith("bearer "):
        headers = request.headers.copy()
        headers["Authorization"] = f"Bearer {key}"
        return request.clone(headers=headers)
    return request


def _chars(messages: list[dict[str, Any]]) -> int:
    """Characters of text in normalized messages (as the chat route counts them)."""
    total = 0
    for m in messages:
        content = m.get("content")
        total += len(content) if isinstance(content, str) else sum(
            len(p.get("text", "")) for p in content or [] if isinstance(p, dict))
        total += sum(len(str(c)) for c in m.get("tool_calls") or [])
    return total


def messages_route(gw: Any) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The `POST /v1/messages` handler of gateway `gw` (an agent.gateway.server.Gateway; server.py
    imports this module, so it is passed in rather than imported)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            gw._prune()
            try:
                conv = gw._session_for(_keyed(request))
            except RequestError as e:
                if e.status == 401:
                    raise RequestError(401, "missing or unknown API key: send `x-api-key: <key>` (or `Authorization: "
                                            "Bearer <key>`) with a key this gateway issued or was started "
                                            "with") from None
                raise
            body = await gw._body(request)
            chat, top_k = to_chat(body)
            messages, tools, sampling, _, parse_calls = gw._parse(chat)
            if top_k is not None:
                sampling["top_k"] = top_k
            if _chars(messages) > gw.max_context * CHARS_PER_TOKEN:
                raise RequestError(413, f"the messages hold {_chars(messages)} characters, more than a context of "
                                        f"{gw.max_context} tokens can take: shorten the conversation")
            [reply] = await gw.generate(conv, messages, tools, sampling, 1, parse_calls, chat["tool_choice"],
                                        parallel_calls=chat.get("parallel_tool_calls") is not False)
        except RequestError as e:
            return error(e.status, str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an engine failure must not take the server down
            log.exception("messages request failed")
            return error(500, f"generation failed: {type(e).__name__}: {e}")
        message = to_message(reply, gw.model_name)
        return await stream(request, message) if body.get("stream") else web.json_response(message)

    return handle
