"""An OpenAI-compatible endpoint over the bus: `/v1/chat/completions`, `/v1/models`, and the Responses
and Anthropic Messages APIs (`/v1/responses`: responses.py, `/v1/messages`: anthropic.py), which
translate to the chat path and record the same way.

Any agent framework that speaks the OpenAI API is trained by pointing its `base_url` here. Each
API key (or `X-Session-Id` header) is one session whose conversations are recorded token-exactly
(agent/gateway/session.py); a client that sends neither gets its connection's session, so keyless
clients never queue behind each other. Generations carry the session id, so the router keeps a
session on one engine and its prefix cache. Errors are OpenAI-shaped JSON: 400 for a malformed
request, a field the route does not take (fields.py), an output schema the engines cannot decode
under (schemas.py), `max_tokens` over the context, or an unknown model, 401 for a missing or unknown
key when bound beyond loopback, 413 for a prompt over the context (the model's by default), a body
over `max_body_mb` or a schema over `max_schema_kb`, 429 when `max_inflight`
requests are already running. A large body is parsed off the event loop, and text that cannot fit
the context is refused before it is tokenized, so one huge request does not hold up the others;
sessions clients open by themselves are capped (`max_sessions`, least recently used first), and so is
memory: a session over `max_session_bytes` loses its least recently used segments if a client opened
it, or gets 413 if an agent loop did (it is trained on: nothing is dropped from it quietly); the
client-opened sessions together over `max_total_bytes` are forgotten least recently used first. What
was trimmed and evicted is counted at `GET /stats`. Streaming (`stream: true`) sends
the finished reply as server-sent chunks (the bus returns whole generations).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from agent.gateway.anthropic import messages_route
from agent.gateway.completions import completions_routes
from agent.gateway.errors import openai_error as _error
from agent.gateway.fields import CHAT
from agent.gateway.responses import responses_route
from agent.gateway.schemas import GRAMMAR_BUDGET_S, MAX_SCHEMA_KB, SchemaCheck
from agent.gateway.requests import RequestError, normalize, output_schema
from agent.gateway.session import Conversation, Reply

log = logging.getLogger(__name__)

IMPLICIT_SEGMENTS = 16  # segments kept per session a client opened by itself (no agent loop reads them)
MAX_IMPLICIT_SESSIONS = 1024  # sessions clients opened by themselves; the least recently used go first
MAX_BODY_MB = 32  # a request body over this gets 413 before it is read
MAX_SESSION_BYTES = 256 << 20  # recorded conversation one session may hold (Conversation.nbytes)
MAX_TOTAL_BYTES = 2 << 30  # what the sessions clients opened by themselves may hold together
PARSE_ASIDE_BYTES = 1 << 20  # bodies over this are parsed off the event loop
CHARS_PER_TOKEN = 32  # a prompt with more text than max_context x this cannot fit: 413 before tokenizing
DEFAULT_CONTEXT = 32768  # max_context when neither the caller nor the model's config gives one
SAMPLING_KEYS = {"temperature": float, "top_p": float, "seed": int, "top_k": int}


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown routes and methods answer with an OpenAI-shaped JSON error, as every other error does."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _error(404, f"{request.method} {request.path} is not served here; this gateway serves GET /v1/models "
                           "and POST /v1/chat/completions, /v1/responses, /v1/messages, /v1/completions, "
                           "/inference/v1/generate", code="not_found")
    except web.HTTPMethodNotAllowed as e:
        return _error(405, f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(e.allowed_methods))}",
                      code="method_not_allowed")


def default_context(tokenizer: Any) -> int:
    """The served model's context: its config's `max_position_embeddings`, else the tokenizer's
    `model_max_length` when it is a real one, else DEFAULT_CONTEXT."""
    from engines.models import model_positions

    n = model_positions(tokenizer.name_or_path)
    if n:
        return n
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10**8 else DEFAULT_CONTEXT


def text_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of text in normalized messages (image parts not counted)."""
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
        total += sum(len(str(c)) for c in m.get("tool_calls") or [])
    return total


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class Gateway:
    """The HTTP server. `open_session(key)` registers a per-trajectory key (the agent loop does
    this); `close_session(key)` hands back its recorded Conversation."""

    def __init__(self, client: Any, tokenizer: Any, model_name: str = "switchyard", tool_parser: str = "hermes",
                 host: str = "127.0.0.1", port: int = 0, api_keys: list[str] | None = None, max_inflight: int = 256,
                 max_context: int | None = None, end_of_turn_id: int | None = None,
                 session_ttl_s: float = 3600.0, vision: Any = None, max_body_mb: int = MAX_BODY_MB,
                 max_sessions: int = MAX_IMPLICIT_SESSIONS, max_session_bytes: int = MAX_SESSION_BYTES,
                 max_total_bytes: int = MAX_TOTAL_BYTES, grammar_budget_s: float = GRAMMAR_BUDGET_S,
                 max_schema_kb: int = MAX_SCHEMA_KB) -> None:
        self.client, self.tokenizer, self.model_name = client, tokenizer, model_name
        self.vision = vision  # agent.vision.Vision when the model takes images
        self.tool_parser, self.host, self.port = tool_parser, host, port
        self.api_keys = set(api_keys or [])
        self.max_inflight, self.end_of_turn_id = max_inflight, end_of_turn_id
        self.max_context = max_context or default_context(tokenizer)  # prompt + reply tokens; longer prompts get 413
        self.max_body = max_body_mb << 20
        self.max_sessions = max_sessions
        self.max_session_bytes, self.max_total_bytes = int(max_session_bytes), int(max_total_bytes)
        self.counts = {"trimmed_segments": 0, "evicted_sessions": 0, "refused_session_bytes": 0}  # GET /stats
        self.schemas = SchemaCheck(grammar_budget_s, max_schema_kb)  # output schemas checked before any engine
        self._held: dict[str, int] = {}  # client-opened session -> its bytes after its last request
        self.sessions: dict[str, Conversation] = {}
        self._opened: set[str] = set()  # sessions the agent loop opened; it closes them itself
        self._encoders: dict[str, Any] = {}
        self.session_ttl_s = session_ttl_s
        self._requests = 0
        self.inflight = 0
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> str:
        app = web.Application(client_max_size=self.max_body, middlewares=[_json_errors])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/stats", self._stats)
        app.router.add_post("/v1/chat/completions", self._chat)
        for path, handler in completions_routes(self):  # text and token prompts (completions.py)
            app.router.add_post(path, handler)
        app.router.add_post("/v1/responses", responses_route(self))
        app.router.add_post("/v1/messages", messages_route(self))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = self._runner.addresses[0][1]  # the bound port (port 0 picks a free one)
        self.base_url = f"http://{self.host}:{port}/v1"
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, key: str | None = None, sampling: dict[str, Any] | None = None) -> str:
        key = key or f"sy-{uuid.uuid4().hex}"
        self.sessions[key] = self._conversation(key, sampling)
        self._opened.add(key)
        return key

    def close_session(self, key: str) -> Conversation | None:
        self._opened.discard(key)
        return self.sessions.pop(key, None)

    def _conversation(self, session_id: str, sampling: dict[str, Any] | None = None) -> Conversation:
        return Conversation(session_id, self.tokenizer, self.tool_parser, self.end_of_turn_id, self.max_context,
                            sampling, self._encoders, vision=self.vision)

    def _prune(self) -> None:
        """Forget sessions clients opened implicitly (by key or header) once idle for session_ttl_s."""
        self._requests += 1
        if self._requests % 256:
            return
        cutoff = time.monotonic() - self.session_ttl_s
        for sid in [s for s, c in self.sessions.items() if s not in self._opened and c.last_used < cutoff]:
            del self.sessions[sid]

    def _session_for(self, request: web.Request) -> Conversation:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if key in self.sessions:
            return self.sessions[key]
        if not is_loopback(self.host) and key not in self.api_keys:
            raise RequestError(401, "missing or unknown API key: send `Authorization: Bearer <key>` with a key "
                                    "this gateway issued or was started with", code="invalid_api_key")
        sid = request.headers.get("X-Session-Id") or key
        owner = sid
        if not sid:  # a keyless client: its connection is its session (see _connection_session)
            sid, owner = self._connection_session(request), ""
        if sid not in self.sessions:  # a client's own session: recorded, but nobody trains on it here
            implicit = [s for s in self.sessions if s not in self._opened]
            if len(implicit) >= self.max_sessions:  # the least recently used make room
                implicit.sort(key=lambda s: self.sessions[s].last_used)
                for old in implicit[:len(implicit) - self.max_sessions + 1]:
                    del self.sessions[old]
                    self.counts["evicted_sessions"] += 1
            self.sessions[sid] = self._conversation(sid)
            self.sessions[sid].max_segments = IMPLICIT_SEGMENTS
            self.sessions[sid].owner = owner
        return self.sessions[sid]

    @staticmethod
    def _connection_session(request: web.Request) -> str:
        """The session of a request with neither a key nor `X-Session-Id`: its TCP connection's.
        A keep-alive connection carries one client's calls one after another (an agent's turns
        continue its recorded segments and stay on one engine's prefix cache), and two clients
        never share one, so no client queues behind another's work; where the connection cannot
        be told, each request is a session of its own."""
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        if isinstance(peer, (tuple, list)) and len(peer) >= 2:
            return f"conn-{peer[0]}:{peer[1]}"
        return f"req-{uuid.uuid4().hex}"

    async def generate(self, conv: Conversation, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       sampling: dict[str, Any], n: int = 1, parse_calls: bool = True, tool_choice: Any = None,
                       parallel_calls: bool = True) -> list[Reply]:
        """`conv.generate` under the gateway's cap on requests in flight (a 429 past `max_inflight`):
        what every chat-shaped route calls."""
        if self.inflight >= self.max_inflight:
            raise RequestError(429, f"{self.inflight} requests are already running (max_inflight="
                                    f"{self.max_inflight}); retry after a moment", code="rate_limit_exceeded")
        opened = conv.session_id in self._opened
        if opened and conv.nbytes() > self.max_session_bytes:  # trained on: refused, never trimmed
            self.counts["refused_session_bytes"] += 1
            raise RequestError(413, f"session {conv.session_id!r} holds {conv.nbytes() >> 20} MiB of recorded "
                                    f"conversation, over the gateway's max_session_bytes ({self.max_session_bytes >> 20}"
                                    " MiB); end the trajectory, or raise max_session_bytes",
                               code="session_too_large")
        self.inflight += 1
        try:
            return await conv.generate(self.client, messages, tools, sampling, n, parse_calls, tool_choice=tool_choice,
                                       parallel_calls=parallel_calls, check_schema=self.schemas.check)
        finally:
            self.inflight -= 1
            if not opened:
                self._bound(conv)

    def _bound(self, conv: Conversation) -> None:
        """A client-opened session within max_session_bytes (its least recently used segments go),
        and all of them together within max_total_bytes (the least recently used sessions go)."""
        self.counts["trimmed_segments"] += conv.trim(self.max_session_bytes)
        if conv.session_id in self.sessions:
            self._held[conv.session_id] = conv.nbytes()
        self._held = {sid: b for sid, b in self._held.items() if sid in self.sessions}
        total = sum(self._held.values())
        if total <= self.max_total_bytes:
            return
        for sid in sorted(self._held, key=lambda x: self.sessions[x].last_used):
            if sid == conv.session_id or total <= self.max_total_bytes:
                continue
            total -= self._held.pop(sid)
            del self.sessions[sid]
            self.counts["evicted_sessions"] += 1

    async def _stats(self, request: web.Request) -> web.Response:
        """The gateway's own numbers: sessions, what client-opened ones hold, what was trimmed or evicted."""
        return web.json_response({"sessions": len(self.sessions), "trained_sessions": len(self._opened),
                                  "client_session_bytes": sum(self._held.values()), "inflight": self.inflight,
                                  **self.counts, **self.schemas.counts})

    # -------------------------------------------------------------- handlers
    async def _models(self, request: web.Request) -> web.Response:
        # `root` (the tokenizer served) and `max_model_len` as vLLM's cards carry them: clients that
        # tokenize themselves (verifiers' train client) load that tokenizer and check prompts against it
        root = getattr(self.tokenizer, "name_or_path", None) or None
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "switchyard", "root": root,
             "max_model_len": self.max_context}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            self._prune()
            conv = self._session_for(request)
            body = await self._body(request)
            messages, tools, sampling, n, parse_calls = self._parse(body)
            if text_chars(messages) > self.max_context * CHARS_PER_TOKEN:
                raise RequestError(413, f"the messages hold {text_chars(messages)} characters, more than a context of "
                                        f"{self.max_context} tokens can take: shorten the conversation",
                                   code="context_length_exceeded", param="messages")
            replies = await self.generate(conv, messages, tools, sampling, n, parse_calls, body.get("tool_choice"),
                                          parallel_calls=body.get("parallel_tool_calls") is not False)
        except RequestError as e:
            return _error(e.status, str(e), e.code, e.param)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an engine failure must not take the server down
            log.exception("chat completion failed")
            return _error(500, f"generation failed: {type(e).__name__}: {e}", code="server_error")
        want_logprobs = bool(body.get("logprobs"))
        if body.get("stream"):
            return await self._stream(request, replies, want_logprobs, body)
        return web.json_response(self._completion(replies, want_logprobs))

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object. A body over the limit is refused before it is read; a large one
        is parsed off the event loop, so other clients are not held up while it is."""
        limit_mb = self.max_body >> 20
        if request.content_length is not None and request.content_length > self.max_body:
            raise RequestError(413, f"the request body has {request.content_length} bytes, over the gateway's "
                                    f"{limit_mb} MiB (max_body_mb)", code="request_too_large")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(413, f"the request body is over the gateway's {limit_mb} MiB (max_body_mb)",
                               code="request_too_large") from None
        try:
            body = await asyncio.to_thread(json.loads, raw) if len(raw) > PARSE_ASIDE_BYTES else json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestError(400, "the request body is not valid JSON") from None
        except RecursionError:  # a body nested thousands deep: Python's parser gives up before any check runs
            raise RequestError(400, "the request body is nested too deeply to parse; no API shape nests more than a "
                                    "few levels") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        return body

    def _parse(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None,
                                                    dict[str, Any], int, bool]:
        self.check_model(body)
        self._check_fields(body)
        messages = normalize(body.get("messages"))
        tools = body.get("tools") or None
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                                      and isinstance(t["function"].get("name"), str) for t in tools):
                raise RequestError(400, "tools must be a list of {type: function, function: {name, parameters}}",
                                   param="tools")
        choice = body.get("tool_choice")
        Conversation.forced_call(choice, tools)  # a 400 unless auto, none, required (with tools) or a declared function
        sampling: dict[str, Any] = {}
        for key, kind in SAMPLING_KEYS.items():
            if body.get(key) is not None:
                try:
                    sampling[key] = kind(body[key])
                except (TypeError, ValueError):
                    raise RequestError(400, f"{key}={body[key]!r} must be a number", param=key) from None
        sampling.update(self._adjustments(body))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None:
            if not isinstance(limit, int) or limit < 1:
                raise RequestError(400, f"max_tokens={limit!r} must be a positive integer", param="max_tokens")
            if limit > self.max_context:  # as OpenAI answers: refused, not quietly cut
                raise RequestError(400, f"max_tokens={limit} is more than the model's context of {self.max_context} "
                                        "tokens (prompt and reply together): ask for fewer", param="max_tokens")
            sampling["max_tokens"] = limit
        n = body.get("n", 1) or 1
        if not isinstance(n, int) or not 1 <= n <= 64:
            raise RequestError(400, f"n={n!r} must be an integer in [1, 64]", param="n")
        if body.get("stop"):
            raise RequestError(400, "stop is not supported by the gateway (the engines stop on token ids)", param="stop")
        schema = output_schema(body.get("response_format"), "response_format")
        if schema:  # decoded under the schema by the engine (constrained decoding); beside tools offered, the
            sampling["json_schema"] = schema  # reply is the answer under it or one call (Conversation.generate)
        if body.get("parallel_tool_calls") not in (None, True, False):
            raise RequestError(400, f"parallel_tool_calls={body['parallel_tool_calls']!r} must be true or false",
                               param="parallel_tool_calls")
        return messages, tools, sampling, n, choice != "none"

    def check_model(self, body: dict[str, Any]) -> None:
        """Any `model` name (or none) is served by the one model here, and replies name it; a name
        that is not a string is a 400."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError(400, f"model={model!r:.80} must be a string ({self.model_name!r} is served here)",
                               param="model")

    def _check_fields(self, body: dict[str, Any]) -> None:
        """A 400 naming the first field the chat route would otherwise drop silently (fields.CHAT)."""
        CHAT.check(body)
        if body.get("top_k") is not None and (type(body["top_k"]) is not int or body["top_k"] < -1
                                              or body["top_k"] == 0):
            raise RequestError(400, f"top_k={body['top_k']!r} must be a positive integer (or -1: off)", param="top_k")

    def _adjustments(self, body: dict[str, Any]) -> dict[str, Any]:
        """`frequency_penalty`, `presence_penalty`, `logit_bias` and `top_logprobs` as the engines'
        sampling fields (engines/inference/base.py), checked here so a bad one is a 400 naming it."""
        from engines.inference.base import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS

        def number(key: str, value: Any, bound: float) -> float:
            if type(value) not in (int, float) or not -bound <= value <= bound:  # NaN fails the range too
                raise RequestError(400, f"{key}={value!r} must be a number in [{-bound:g}, {bound:g}]", param=key)
            return float(value)

        out: dict[str, Any] = {}
        for key in ("frequency_penalty", "presence_penalty"):
            if body.get(key) is not None:
                out[key] = number(key, body[key], MAX_PENALTY)
        bias = body.get("logit_bias")
        if bias is not None:
            if not isinstance(bias, dict):
                raise RequestError(400, f"logit_bias={bias!r:.100} must be a map of token ids to biases",
                                   param="logit_bias")
            vocab = len(self.tokenizer)
            for key in bias:
                if not (key.isascii() and key.isdigit() and int(key) < vocab):
                    raise RequestError(400, f"logit_bias key {key!r} is not a token id of this model (an integer in "
                                            f"[0, {vocab}))", param="logit_bias")
            out["logit_bias"] = {str(int(k)): number("logit_bias", v, MAX_LOGIT_BIAS) for k, v in bias.items()}
        top = body.get("top_logprobs")
        if top is not None:
            if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
                raise RequestError(400, f"top_logprobs={top!r} must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                                   param="top_logprobs")
            if top and body.get("logprobs") is not True:
                raise RequestError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            out["top_logprobs"] = top
        return out

    # -------------------------------------------------------------- responses
    def _message(self, r: Reply, call_ids: list[str]) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": r.parsed.content or (None if r.parsed.calls else "")}
        if r.parsed.calls:
            msg["tool_calls"] = [{"id": cid, "type": "function", "function": {
                "name": c.name, "arguments": json.dumps(c.arguments)}} for cid, c in zip(call_ids, r.parsed.calls)]
        return msg

    def _finish(self, r: Reply) -> str:
        if r.parsed.calls:
            return "tool_calls"
        return "length" if r.finish_reason == "length" else "stop"

    def _logprobs(self, r: Reply) -> dict[str, Any]:
        """Per token its logprob and, when the request asked for top_logprobs, its alternatives (the
        engine's most likely tokens there, most likely first), each decoded as the token is."""
        def entry(tid: int, lp: float) -> dict[str, Any]:
            tok = self.tokenizer.decode([tid], skip_special_tokens=False)
            return {"token": tok, "logprob": float(lp), "bytes": list(tok.encode())}

        top_ids, top_lps = getattr(r, "top_ids", None) or [], getattr(r, "top_logprobs", None) or []
        out = []
        for i, (tid, lp) in enumerate(zip(r.token_ids, r.logprobs)):
            alts = [entry(t, a) for t, a in zip(top_ids[i], top_lps[i])] if i < len(top_ids) else []
            out.append({**entry(tid, lp), "top_logprobs": alts})
        return {"content": out}

    def _completion(self, replies: list[Reply], want_logprobs: bool) -> dict[str, Any]:
        choices = []
        for i, r in enumerate(replies):
            ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in r.parsed.calls]
            choices.append({"index": i, "message": self._message(r, ids), "finish_reason": self._finish(r),
                            "logprobs": self._logprobs(r) if want_logprobs else None})
        completion = sum(len(r.token_ids) for r in replies)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": replies[0].prompt_tokens, "completion_tokens": completion,
                          "total_tokens": replies[0].prompt_tokens + completion}}

    async def _stream(self, request: web.Request, replies: list[Reply], want_logprobs: bool,
                      body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        async def send(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
            chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                     "choices": choices, **({"usage": usage} if usage is not None else {})}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        for i, r in enumerate(replies):
            msg = self._message(r, [f"call_{uuid.uuid4().hex[:24]}" for _ in r.parsed.calls])
            await send([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}])
            if msg["content"]:
                await send([{"index": i, "delta": {"content": msg["content"]},
                             "logprobs": self._logprobs(r) if want_logprobs else None, "finish_reason": None}])
            for k, call in enumerate(msg.get("tool_calls") or []):
                await send([{"index": i, "delta": {"tool_calls": [{"index": k, **call}]}, "logprobs": None,
                             "finish_reason": None}])
            await send([{"index": i, "delta": {}, "logprobs": None, "finish_reason": self._finish(r)}])
        if (body.get("stream_options") or {}).get("include_usage"):
            completion = sum(len(r.token_ids) for r in replies)
            await send([], {"prompt_tokens": replies[0].prompt_tokens, "completion_tokens": completion,
                            "total_tokens": replies[0].prompt_tokens + completion})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
