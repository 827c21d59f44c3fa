"""Text and token prompts: `/v1/completions` (OpenAI's legacy completions: text in, text out, with
logprobs) and `/inference/v1/generate` (token ids in, token ids and logprobs out: the token-in /
token-out shape orchestrators that render prompts themselves send, e.g. verifiers' and prime-rl's
training clients).

Both record into the session like chat does, without a chat template: each call continues the
session's raw trajectory whose tokens (prompt and everything generated) are a prefix of the new
prompt, the new tokens appended as context (mask 0) and the engine's reply as model tokens (mask
1); a prompt that extends none opens a new one. So a client that renders a multi-turn conversation
itself and sends the growing token list trains as one trajectory, token-exactly. A text prompt is
encoded once with the tokenizer's own special tokens (its BOS, if it adds one); a token prompt is
taken as it is.

Honoured: `max_tokens`, `temperature`, `top_p`, `top_k` (generate), `seed`, `frequency_penalty`,
`presence_penalty`, `logit_bias`, `logprobs` (completions: the top-k alternatives too; generate:
`sampling_params.logprobs`), `stop_token_ids` (generate: verifiers' train client sends its
renderer's); the token endpoint answers vLLM's shape (`choices[0].token_ids`, per-token
`logprobs.content` as `token_id:N`, `request_id`). Refused with a 400 naming the field: `n` > 1,
`echo`, `suffix`, `stop`, `best_of`, batched prompts, streaming on the token endpoint, and any field
(top level or in `sampling_params`) the route does not take (fields.COMPLETIONS, fields.GENERATE:
vLLM's output-only options such as `skip_special_tokens` are accepted and ignored, its sampling
options the engines lack are accepted only when off).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from agent.gateway.errors import openai_error
from agent.gateway.fields import COMPLETIONS, GENERATE, GENERATE_SAMPLING
from agent.gateway.requests import RequestError
from agent.gateway.session import Segment
from agent.loop import Trajectory

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
REFUSED = ("echo", "suffix", "stop", "best_of")
ADJUSTMENTS = ("frequency_penalty", "presence_penalty", "logit_bias")  # checked by the gateway, as on chat
GENERATE_KEYS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}


def _number(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise RequestError(400, f"{key}={value!r} must be a number" + (" (an integer)" if kind is int else ""),
                           param=key)
    return kind(value)


def _sampling(body: dict[str, Any], keys: dict[str, type]) -> dict[str, Any]:
    out = {k: _number(body, k, kind) for k, kind in keys.items() if body.get(k) is not None}
    if "max_tokens" in out and out["max_tokens"] < 1:
        raise RequestError(400, f"max_tokens={out['max_tokens']} must be >= 1", param="max_tokens")
    return out


def _token_list(value: Any, key: str) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in value):
        return [int(t) for t in value]
    return None


class RawPrompts:
    """The two routes of Gateway `gw` that take prompts without a chat template."""

    def __init__(self, gw: Any) -> None:
        self.gw = gw

    async def _generate(self, request: web.Request, body: dict[str, Any], prompt: list[int],
                        sampling: dict[str, Any]) -> tuple[Any, int]:
        """Continue (or open) the session's raw trajectory with `prompt`, generate, record."""
        gw = self.gw
        gw.check_model(body)
        vocab = len(gw.tokenizer)
        if any(t >= vocab for t in prompt):
            raise RequestError(400, f"the prompt holds token ids outside the vocabulary (size {vocab})", param="prompt")
        conv = gw._session_for(request)
        room = gw.max_context - len(prompt)
        if room < 1:
            raise RequestError(413, f"the prompt holds {len(prompt)} tokens; the model's context is {gw.max_context}",
                               code="context_length_exceeded", param="prompt")
        params = {**sampling, **conv.sampling}  # the trainer's settings win over the client's
        limits = [int(d["max_tokens"]) for d in (sampling, conv.sampling) if "max_tokens" in d]
        asked = sampling.get("max_tokens")
        if asked is not None and asked > room and min(limits) == asked:  # as OpenAI: refused, not quietly cut
            raise RequestError(400, f"the prompt holds {len(prompt)} tokens and max_tokens asks for {asked}: "
                                    f"{len(prompt) + asked} in all, over the model's context of {gw.max_context}; ask "
                                    f"for at most {room}", code="context_length_exceeded", param="max_tokens")
        params["max_tokens"] = min([room, *limits] if limits else [room, DEFAULT_MAX_TOKENS])
        if gw.inflight >= gw.max_inflight:
            raise RequestError(429, f"{gw.inflight} requests are already running (max_inflight={gw.max_inflight})",
                               code="rate_limit_exceeded")
        gw.inflight += 1
        try:
            async with conv._lock:  # one session's calls are sequential, as an agent's are
                conv.last_used = time.monotonic()
                seg = self._segment(conv, prompt)
                t0 = time.perf_counter()
                result = await gw.client.generate(prompt, params, session_id=conv.session_id, group_id=conv.group_id)
                seg.traj.add_model(result.token_ids, result.logprobs)
                seg.request_ids.append(result.request_id)
                seg.versions.append(result.weight_version)
                seg.turns.append({"kind": "generate", "request_id": result.request_id, "tokens": len(result.token_ids),
                                  "prompt_tokens": len(prompt), "finish_reason": result.finish_reason,
                                  "weight_version": result.weight_version, "latency_s": time.perf_counter() - t0,
                                  "route": request.path})
                seg.last_finish, seg.updated = result.finish_reason, time.monotonic()
        finally:
            gw.inflight -= 1
        return result, len(prompt)

    @staticmethod
    def _segment(conv: Any, prompt: list[int]) -> Segment:
        """The raw trajectory `prompt` extends (the longest), brought up to it; else a new one."""
        best = None
        for seg in conv.segments:
            if getattr(seg, "raw", False):
                held = seg.traj.all_ids()
                if len(held) <= len(prompt) and prompt[:len(held)] == held and (best is None or len(held) > best[0]):
                    best = (len(held), seg)
        if best is not None:
            n, seg = best
            if len(prompt) > n:
                seg.traj.add_context(prompt[n:])
                seg.turns.append({"kind": "context", "tokens": len(prompt) - n})
            return seg
        seg = Segment(encoder=None, traj=Trajectory(prompt), held=[], tools=None)  # never continued by chat
        seg.raw = True  # type: ignore[attr-defined]
        conv.segments.append(seg)
        return seg

    def _alternatives(self, result: Any, text: bool) -> list[Any]:
        """Per generated token its top-k alternatives: {token text: logprob} (completions) or
        [{token: "token_id:N", logprob}] (the token endpoint); empty where the engine sent none."""
        ids, lps = getattr(result, "top_ids", None), getattr(result, "top_logprobs", None)
        if ids is None or lps is None:
            return [{} if text else [] for _ in result.token_ids]
        out: list[Any] = []
        for row_ids, row_lps in zip(ids, lps):
            if text:
                out.append({self.gw.tokenizer.decode([int(t)], skip_special_tokens=False): float(x)
                            for t, x in zip(row_ids, row_lps)})
            else:
                out.append([{"token": f"token_id:{int(t)}", "logprob": float(x)} for t, x in zip(row_ids, row_lps)])
        return out

    async def completions(self, request: web.Request) -> web.StreamResponse:
        gw = self.gw
        try:
            gw._prune()
            body = await gw._body(request)
            COMPLETIONS.check(body)
            for key in REFUSED:
                if body.get(key) not in (None, False, "", [], {}):
                    raise RequestError(400, f"{key} is not supported by the gateway's completions route", param=key)
            if (body.get("n") or 1) != 1:
                raise RequestError(400, f"n={body.get('n')!r}: one completion per request (send n requests)", param="n")
            raw = body.get("prompt")
            if isinstance(raw, list) and len(raw) == 1 and (isinstance(raw[0], str) or isinstance(raw[0], list)):
                raw = raw[0]  # a batch of one
            prompt = _token_list(raw, "prompt")
            if prompt is None:
                if not isinstance(raw, str) or not raw:
                    raise RequestError(400, "prompt must be a non-empty string or a list of token ids (one prompt per "
                                            "request)", param="prompt")
                prompt = list(gw.tokenizer(raw)["input_ids"])
            logprobs = body.get("logprobs")
            if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                         or not 0 <= logprobs <= 5):
                raise RequestError(400, f"logprobs={logprobs!r} must be an integer in [0, 5]", param="logprobs")
            sampling = {**_sampling(body, {k: v for k, v in GENERATE_KEYS.items() if k != "top_k"}),
                        **gw._adjustments({k: body.get(k) for k in ADJUSTMENTS})}
            if logprobs:
                sampling["top_logprobs"] = logprobs
            result, prompt_tokens = await self._generate(request, body, prompt, sampling)
        except RequestError as e:
            return openai_error(e.status, str(e), e.code, e.param)
        text = gw.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        lp = None
        if logprobs is not None:
            tokens = [gw.tokenizer.decode([t], skip_special_tokens=False) for t in result.token_ids]
            offsets, at = [], 0
            for t in tokens:
                offsets.append(at)
                at += len(t)
            lp = {"tokens": tokens, "token_logprobs": [float(x) for x in result.logprobs],
                  "top_logprobs": self._alternatives(result, text=True) if logprobs else None, "text_offset": offsets}
        reply = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                 "model": gw.model_name, "choices": [{
                     "index": 0, "text": text, "logprobs": lp,
                     "finish_reason": "length" if result.finish_reason == "length" else "stop"}],
                 "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.token_ids),
                           "total_tokens": prompt_tokens + len(result.token_ids)}}
        if not body.get("stream"):
            return web.json_response(reply)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(reply).encode() + b"\n\n")  # the whole reply as one chunk
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def tokens(self, request: web.Request) -> web.Response:
        gw = self.gw
        try:
            gw._prune()
            body = await gw._body(request)
            GENERATE.check(body)
            if body.get("stream"):
                raise RequestError(400, "stream is not supported on the token endpoint", param="stream")
            prompt = _token_list(body.get("token_ids"), "token_ids")
            if prompt is None:
                raise RequestError(400, "token_ids must be a non-empty list of token ids", param="token_ids")
            sp = body.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise RequestError(400, "sampling_params must be an object", param="sampling_params")
            GENERATE_SAMPLING.check(sp, "sampling_params.")
            for key in ("n", "stop", "best_of"):
                if sp.get(key) not in (None, 1 if key != "stop" else None, [], ""):
                    raise RequestError(400, f"sampling_params.{key} is not supported by the token endpoint",
                                       param=f"sampling_params.{key}")
            sampling = {**_sampling(sp, GENERATE_KEYS), **gw._adjustments({k: sp.get(k) for k in ADJUSTMENTS})}
            stops = sp.get("stop_token_ids")
            if stops not in (None, []):
                ids = _token_list(stops, "stop_token_ids")
                if ids is None or any(t >= len(gw.tokenizer) for t in ids):
                    raise RequestError(400, f"sampling_params.stop_token_ids={str(stops)[:80]} must be a list of token "
                                            f"ids of the vocabulary (size {len(gw.tokenizer)})",
                                       param="sampling_params.stop_token_ids")
                sampling["stop_token_ids"] = ids
            k = sp.get("logprobs")
            if k not in (None, 0, 1, True, False):
                if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 20:
                    raise RequestError(400, f"sampling_params.logprobs={k!r} must be an integer in [0, 20]",
                                       param="sampling_params.logprobs")
                sampling["top_logprobs"] = k
            result, prompt_tokens = await self._generate(request, body, prompt, sampling)
        except RequestError as e:
            return openai_error(e.status, str(e), e.code, e.param)
        tops = self._alternatives(result, text=False)
        content = [{"token": f"token_id:{t}", "logprob": float(x), "top_logprobs": top}
                   for t, x, top in zip(result.token_ids, result.logprobs, tops)]
        return web.json_response({
            "id": f"gen-{uuid.uuid4().hex}", "request_id": result.request_id, "model": gw.model_name,
            "choices": [{"index": 0, "token_ids": [int(t) for t in result.token_ids], "logprobs": {"content": content},
                         "finish_reason": "length" if result.finish_reason == "length" else "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.token_ids),
                      "total_tokens": prompt_tokens + len(result.token_ids)}})


def completions_routes(gw: Any) -> list[tuple[str, Any]]:
    """(path, handler) of the two routes, for Gateway `gw`."""
    raw = RawPrompts(gw)
    return [("/v1/completions", raw.completions), ("/inference/v1/generate", raw.tokens)]
