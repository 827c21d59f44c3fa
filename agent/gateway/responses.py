"""The OpenAI Responses API (`POST /v1/responses`) on the gateway, recorded token-exactly as chat is.

A Responses request is translated into a Chat Completions body and goes through the gateway's own
`_parse`, `_session_for` and `Conversation.generate`, so the same session, segments and checks apply:
`instructions` become the first system message; `input` items become chat messages (a `message` or
role item -> that role's message, `function_call` items -> the `tool_calls` of the assistant message
they follow, `function_call_output` -> a tool message, `reasoning` items are dropped: the prompt keeps
only what the chat template renders, and the served model's reasoning is not replayed); flat function
tools become chat's nested ones. Each returned response's conversation (without its instructions, as
OpenAI keeps it) is kept in memory, the least recently used forgotten past `max_stored`, so a request
with `previous_response_id` and only new items continues it, for the same key or `X-Session-Id` only
(keyless clients, whose connections are their sessions, share theirs).

What cannot be honoured is refused with a 400 naming it, never silently ignored: tools other than
function tools, `text.verbosity`, `reasoning` settings,
`truncation: auto`, `background`, `conversation`, stored `prompt`s, `max_tool_calls`,
and any parameter the API does not have. `strict` on a function tool is accepted but not enforced.
`text.format` json_schema or json_object is honoured: the engine decodes under the schema (beside
function tools not forced, as on chat: the answer under it or one call, the model's choice).
`parallel_tool_calls: false` returns a reply's first call only.
The bus returns whole generations, so a streamed response sends the finished reply as events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any

from aiohttp import web

from agent.gateway.errors import openai_error as _error
from agent.gateway.fields import RESPONSES
from agent.gateway.requests import RequestError, output_schema
from agent.gateway.session import Reply

log = logging.getLogger(__name__)

MAX_STORED = 4096  # responses whose conversation a `previous_response_id` can continue; LRU past this
CHARS_PER_TOKEN = 32  # as the chat route: text that cannot fit the context is refused before it is tokenized
OTHER_TOOLS = "only function tools are served ({type: function, name, parameters}); the engine runs no hosted tools"


def _hex() -> str:
    return uuid.uuid4().hex


def check_options(body: dict[str, Any], served: str = "") -> None:
    """A 400 naming the first option that would change the output in a way the gateway cannot honour."""
    RESPONSES.check(body)
    text = body.get("text") or {}
    fmt = (text.get("format") or {}) if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        raise RequestError(400, "text must be an object like {format: {type: text}}", param="text")
    output_schema(fmt, "text.format")  # a 400 unless text, json_object or json_schema with a schema
    # the Agents SDK sets these by itself for its default (OpenAI) model when the agent names none
    hint = (f"; the Agents SDK sets it for its own default model when an agent names none: name the served "
            f"model, Agent(model={served!r}) or OpenAIResponsesModel(model={served!r}, ...)"
            if served and body.get("model") != served else "")
    if text.get("verbosity") not in (None, "medium"):
        raise RequestError(400, "text.verbosity is not supported: the served model's verbosity is not configurable"
                           + hint, param="text.verbosity")
    reasoning = body.get("reasoning") or {}
    set_keys = [k for k, v in reasoning.items() if v is not None] if isinstance(reasoning, dict) else ["reasoning"]
    if set_keys:
        raise RequestError(400, f"reasoning.{set_keys[0]} is not supported: the served model's reasoning is not "
                                "configurable here" + hint, param=f"reasoning.{set_keys[0]}")
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError(400, f"truncation={body['truncation']!r} is not supported: a prompt over the context "
                                "gets 413; use 'disabled'", param="truncation")
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise RequestError(400, f"max_output_tokens={limit!r} must be a positive integer", param="max_output_tokens")


def chat_choice(choice: Any) -> Any:
    """The Responses API's `tool_choice` in chat's form: a named function is flat here
    ({type: function, name}) and nested there ({type: function, function: {name}})."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice and "function" not in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Flat Responses function tools -> chat's {type: function, function: {...}}; `strict` is not kept."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError(400, "tools must be a list", param="tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        if kind != "function":
            raise RequestError(400, f"tools[{i}]: tool type {kind!r} is not supported: {OTHER_TOOLS}", param="tools")
        if not isinstance(t.get("name"), str):
            raise RequestError(400, f"tools[{i}]: a function tool needs a name", param="tools")
        fn = {"name": t["name"], **{k: t[k] for k in ("description", "parameters") if t.get(k) is not None}}
        out.append({"type": "function", "function": fn})
    return out or None


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Responses message content (a string or parts) -> chat content (text, or text and image_url parts)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(400, f"{where}: content must be a string or a list of parts", param="input")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise RequestError(400, f"{where}: content part of type {kind!r} is not supported (input_text, "
                                    "output_text, input_image with an image_url)", param="input")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _output(raw: Any, where: str) -> str:
    if isinstance(raw, str):
        return raw
    text = _content(raw, where)
    if not isinstance(text, str):
        raise RequestError(400, f"{where}: a function_call_output must be text", param="input")
    return text


def chat_messages(items: Any, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`history` (chat messages) followed by the Responses `input` (a string or a list of items)."""
    out = list(history)
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError(400, "input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(400, f"{where}: role {role!r} is not one of user, system, developer, assistant",
                                   param="input")
            out.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not item.get("call_id"):
                raise RequestError(400, f"{where}: a function_call needs name and call_id", param="input")
            call = {"id": str(item["call_id"]), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if not out or out[-1]["role"] != "assistant":  # calls follow the text of the reply they were in
                out.append({"role": "assistant", "content": ""})
            out[-1] = {**out[-1], "tool_calls": [*(out[-1].get("tool_calls") or []), call]}
        elif kind == "function_call_output":
            cid = str(item.get("call_id") or "")
            names = [c["function"]["name"] for m in out for c in m.get("tool_calls") or [] if c["id"] == cid]
            out.append({"role": "tool", "tool_call_id": cid, "content": _output(item.get("output"), where),
                        **({"name": names[-1]} if names else {})})
        elif kind == "reasoning":
            continue  # the chat template renders no reasoning items; the prompt stays the template's
        else:
            raise RequestError(400, f"{where}: item type {kind!r} is not supported (message, function_call, "
                                    "function_call_output, reasoning)", param="input")
    return out


class Responses:
    """The `/v1/responses` route of one Gateway, and the conversations of the responses it returned."""

    def __init__(self, gateway: Any, max_stored: int = MAX_STORED) -> None:
        self.gw, self.max_stored = gateway, max_stored
        self.stored: OrderedDict[str, tuple[str, list[dict[str, Any]]]] = OrderedDict()  # id -> (session, history)

    def _history(self, rid: Any, session_id: str) -> list[dict[str, Any]]:
        if rid is None:
            return []
        held = self.stored.get(str(rid))
        if held is None or held[0] != session_id:
            raise RequestError(400, f"Previous response with id {rid!r} not found: the gateway keeps its last "
                                    f"{self.max_stored} responses, each for the session that made it",
                               code="previous_response_not_found", param="previous_response_id")
        self.stored.move_to_end(str(rid))
        return held[1]

    def _store(self, rid: str, session_id: str, history: list[dict[str, Any]]) -> None:
        self.stored[rid] = (session_id, history)
        while len(self.stored) > self.max_stored:
            self.stored.popitem(last=False)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        gw = self.gw
        try:
            gw._prune()
            conv = gw._session_for(request)
            body = await gw._body(request)
            check_options(body, gw.model_name)
            history = chat_messages(body.get("input"), self._history(body.get("previous_response_id"),
                                                                     conv.owner))
            instructions = body.get("instructions")
            if instructions is not None and not isinstance(instructions, str):
                raise RequestError(400, "instructions must be a string", param="instructions")
            chat = {"model": body.get("model"), "tools": chat_tools(body.get("tools")),
                    "messages": ([{"role": "system", "content": instructions}] if instructions else []) + history,
                    "tool_choice": chat_choice(body.get("tool_choice")),
                    "parallel_tool_calls": body.get("parallel_tool_calls"),
                    "max_completion_tokens": body.get("max_output_tokens"),
                    **{k: body.get(k) for k in ("temperature", "top_p", "seed")},
                    **({"logprobs": True, "top_logprobs": body["top_logprobs"]} if body.get("top_logprobs") else {}),
                    **({"response_format": {"type": "json_schema", "json_schema": {"schema": json.loads(schema)}}}
                       if (schema := output_schema((body.get("text") or {}).get("format"), "text.format")) else {})}
            messages, tools, sampling, n, parse_calls = gw._parse(chat)
            chars = sum(len(m["content"]) if isinstance(m["content"], str) else
                        sum(len(p.get("text", "")) for p in m["content"]) for m in messages)
            if chars > gw.max_context * CHARS_PER_TOKEN:
                raise RequestError(413, f"the input holds {chars} characters, more than a context of {gw.max_context}"
                                        " tokens can take: shorten the conversation", code="context_length_exceeded",
                                   param="input")
            reply = (await gw.generate(conv, messages, tools, sampling, n, parse_calls, chat["tool_choice"],
                                       parallel_calls=chat["parallel_tool_calls"] is not False))[0]
        except RequestError as e:
            return _error(e.status, str(e), e.code, e.param)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an engine failure must not take the server down
            log.exception("response failed")
            return _error(500, f"generation failed: {type(e).__name__}: {e}", code="server_error")
        effective = {**sampling, **conv.sampling}
        response = self._response(body, reply, effective)
        calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
                 for o in response["output"] if o["type"] == "function_call"]
        said = {"role": "assistant", "content": reply.parsed.content or "", **({"tool_calls": calls} if calls else {})}
        self._store(response["id"], conv.owner, history + [said])
        if body.get("stream"):
            return await self._stream(request, response)
        return web.json_response(response)

    def _response(self, body: dict[str, Any], r: Reply, sampling: dict[str, Any]) -> dict[str, Any]:
        cut = r.finish_reason == "length"
        output: list[dict[str, Any]] = []
        if r.parsed.content:
            text: dict[str, Any] = {"type": "output_text", "text": r.parsed.content, "annotations": []}
            if "message.output_text.logprobs" in (body.get("include") or []):
                text["logprobs"] = self.gw._logprobs(r)["content"]
            output.append({"type": "message", "id": f"msg_{_hex()}", "status": "incomplete" if cut else "completed",
                           "role": "assistant", "content": [text]})
        for c in r.parsed.calls:
            output.append({"type": "function_call", "id": f"fc_{_hex()}", "call_id": f"call_{_hex()[:24]}",
                           "name": c.name, "arguments": json.dumps(c.arguments), "status": "completed"})
        n_out = len(r.token_ids)
        return {
            "id": f"resp_{_hex()}", "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if cut else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": self.gw.model_name, "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
            "store": body.get("store", True) is not False, "temperature": sampling.get("temperature", 1.0),
            "text": {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_p": sampling.get("top_p", 1.0), "truncation": "disabled",
            "usage": {"input_tokens": r.prompt_tokens, "output_tokens": n_out, "total_tokens": r.prompt_tokens + n_out,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
            "user": body.get("user"), "metadata": body.get("metadata") or {},
        }

    async def _stream(self, request: web.Request, response: dict[str, Any]) -> web.StreamResponse:
        """The finished response as the events of a streamed one, each with its `sequence_number`."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        seq = 0

        async def send(kind: str, **fields: Any) -> None:
            nonlocal seq
            event = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            await resp.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())

        start = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
        await send("response.created", response=start)
        await send("response.in_progress", response=start)
        for i, item in enumerate(response["output"]):
            where = {"item_id": item["id"], "output_index": i}
            if item["type"] == "message":
                await send("response.output_item.added", output_index=i,
                           item={**item, "status": "in_progress", "content": []})
                for k, part in enumerate(item["content"]):
                    lps = part.get("logprobs") or []
                    await send("response.content_part.added", **where, content_index=k,
                               part={**part, "text": "", **({"logprobs": []} if "logprobs" in part else {})})
                    await send("response.output_text.delta", **where, content_index=k, delta=part["text"],
                               logprobs=lps)
                    await send("response.output_text.done", **where, content_index=k, text=part["text"],
                               logprobs=lps)
                    await send("response.content_part.done", **where, content_index=k, part=part)
            else:
                await send("response.output_item.added", output_index=i,
                           item={**item, "status": "in_progress", "arguments": ""})
                await send("response.function_call_arguments.delta", **where, delta=item["arguments"])
                await send("response.function_call_arguments.done", **where, name=item["name"],
                           arguments=item["arguments"])
            await send("response.output_item.done", output_index=i, item=item)
        await send(f"response.{response['status']}", response=response)  # completed, or incomplete (OpenAI's)
        await resp.write_eof()
        return resp


def responses_route(gw: Any) -> Any:
    """The `/v1/responses` handler of Gateway `gw`."""
    return Responses(gw).handle
