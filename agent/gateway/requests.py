"""What a client's request says, checked before anything runs: its messages normalized into the
one shape every route and the session share (text or text-and-image parts, tool calls with parsed
arguments), its output schema's text, and the call its `tool_choice` forces. A request the gateway
refuses is a RequestError: its status, message and OpenAI-style code and param.
"""

from __future__ import annotations

import json
from typing import Any

from agent.vision import part_image

class RequestError(ValueError):
    """A request the gateway refuses; `status` and `code` become the OpenAI-style error."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Message content as text (a string, null, or a list of text parts), or as text and image
    parts when it holds `image_url` parts (whether the model takes images is checked later)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[dict[str, Any]] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("text", "input_text") and isinstance(part.get("text"), str):
                out.append({"type": "text", "text": part["text"]})
            elif isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part_image(part), str) \
                    and part_image(part):
                out.append({"type": "image", "image": part_image(part)})
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(400, f"{where}: content part of type {kind!r} is not supported (text and "
                                        "image_url)", param="messages")
        if any(p["type"] == "image" for p in out):
            return out
        return "".join(p["text"] for p in out)
    raise RequestError(400, f"{where}: content must be a string, null or a list of text parts, got "
                            f"{type(content).__name__}", param="messages")


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.strip() else {}
    except json.JSONDecodeError as e:
        raise RequestError(400, f"{where}: function.arguments is not valid JSON ({e.msg})", param="messages") from None
    if not isinstance(value, dict):
        raise RequestError(400, f"{where}: function.arguments must be a JSON object", param="messages")
    return value


def normalize(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the chat template's dicts (text content, tool-call arguments as
    objects); a RequestError (400) names the first malformed message."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise RequestError(400, f"{where}: role {role!r} is not one of {list(ROLES)}", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RequestError(400, f"{where}.tool_calls[{j}] needs function.name", param="messages")
                calls.append({"type": "function", "function": {
                    "name": fn["name"], "arguments": _arguments(fn.get("arguments"), f"{where}.tool_calls[{j}]")}})
            msg["tool_calls"] = calls
        if role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = str(m["tool_call_id"])
            if m.get("name"):
                msg["name"] = str(m["name"])
        out.append(msg)
    return out


def output_schema(fmt: Any, param: str) -> str:
    """The JSON schema (text) an OpenAI output format asks for, "" for plain text: chat's
    `response_format` ({type: json_schema, json_schema: {schema}} or {type: json_object}) and the
    Responses API's `text.format` ({type: json_schema, schema}); the engines decode under it."""
    if fmt is None:
        return ""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in (None, "text"):
        if not isinstance(fmt, dict):
            raise RequestError(400, f"{param} must be an object like {{type: json_schema, ...}}", param=param)
        return ""
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        inner = fmt.get("json_schema", fmt)
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise RequestError(400, f"{param} json_schema needs a `schema` object (a JSON schema)", param=param)
        return json.dumps(schema)
    raise RequestError(400, f"{param} type {kind!r} is not supported; use text, json_object or json_schema",
                       param=param)


def forced_call(choice: Any, tools: list[dict[str, Any]] | None) -> bool | str:
    """What an OpenAI `tool_choice` forces: False (absent, auto, none), True (required: some call)
    or the name of the function to call; a RequestError (400) for any other value, for required
    without tools, and for a function the request's tools do not declare."""
    if choice in (None, "auto", "none"):
        return False
    names = [str(t["function"]["name"]) for t in tools or []
             if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]]
    if choice == "required":
        if not names:
            raise RequestError(400, "tool_choice='required' is not supported without tools: the request declares "
                                    "no function to call", param="tool_choice")
        return True
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str) and fn["name"]):
        raise RequestError(400, f"tool_choice={choice!r} is not supported: use 'auto', 'none', 'required' or "
                                "{type: function, function: {name}}", param="tool_choice")
    if fn["name"] not in names:
        raise RequestError(400, f"tool_choice names function {fn['name']!r}, which is not among the request's "
                                f"tools ({', '.join(map(repr, names)) or 'none'})", param="tool_choice")
    return fn["name"]
