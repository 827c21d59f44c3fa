"""The OpenAI-shaped error body every OpenAI route of the gateway answers with."""

from __future__ import annotations

from aiohttp import web


def openai_error(status: int, message: str, code: str = "invalid_request_error", param: str | None = None
                 ) -> web.Response:
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)
