"""Output schemas checked at the gateway before any engine sees them.

A request's JSON schema (chat's `response_format`, Responses' `text.format`, Messages'
`output_config.format`, a forced tool call's constraint built from the declared tools, and the union
of an output schema with one call per declared tool when both are offered) is
converted to a grammar by xgrammar here, as the engines will convert it, so a schema the engines
cannot decode under (an unsupported type, a bad `pattern` regex, an unresolvable `$ref`) is a 400
naming the fault instead of an engine's 500, and a schema over `max_schema_kb` is a 413.

The conversion runs on a thread of its own per distinct schema (xgrammar releases the GIL), so a
schema that takes long holds up no other request; one still converting after `grammar_budget_s`
is refused with a 400 naming the budget (the thread is left to finish and its verdict kept, so a
resend is answered at once). Concurrent requests with the same schema wait on one conversion.
Verdicts are cached by the schema's digest, the cache bounded in bytes; at most `max_compiles`
conversions run at once (429 past it).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import re
import threading
import time

from agent.gateway.requests import RequestError

GRAMMAR_BUDGET_S = 10.0  # a schema still converting after this is refused (400)
MAX_SCHEMA_KB = 1024  # a schema (or a forced call's constraint) over this is refused (413)
MAX_COMPILES = 8  # conversions running at once; more get 429
MAX_VERDICT_BYTES = 4 << 20  # what the verdict cache may hold
RAISE = ("grammar_budget_s (rollout.agent.openai_agent.grammar_budget_s in a training run, --grammar-budget-s "
         "for python -m agent.gateway)")


def fault(e: BaseException) -> str:
    """xgrammar's message without its timestamp and source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)


class SchemaCheck:
    """The gateway's schema checks (module docstring); one per Gateway."""

    def __init__(self, budget_s: float = GRAMMAR_BUDGET_S, max_schema_kb: int = MAX_SCHEMA_KB,
                 max_compiles: int = MAX_COMPILES, max_bytes: int = MAX_VERDICT_BYTES) -> None:
        if not budget_s > 0:
            raise ValueError(f"grammar_budget_s={budget_s} must be > 0 (seconds a schema may take to compile)")
        self.budget_s, self.max_schema = float(budget_s), int(max_schema_kb) << 10
        self.max_compiles, self.max_bytes = max_compiles, max_bytes
        self._verdicts: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # digest -> "" or fault
        self._bytes = 0
        self._running: dict[bytes, asyncio.Future] = {}
        self.counts = {"schemas_checked": 0, "schemas_refused": 0, "schemas_over_budget": 0}

    async def check(self, schema: str, suffix: str = "", param: str = "response_format", calls: str = "") -> None:
        """Nothing when the engines can decode under `schema` (JSON schema text; `suffix` and `calls`
        as in engines.inference.grammar), else a RequestError: 413 for a schema over the size limit, 400
        naming the schema's fault or the time budget it ran over, 429 when too many are compiling."""
        what = ("a call offered beside the output schema (its constraint from the tools' parameters)" if calls else
                "the output schema" if not suffix else "the forced call's constraint (from the tools' parameters)")
        size = len(schema.encode()) + len(suffix.encode()) + len(calls.encode())
        if size > self.max_schema:
            raise RequestError(413, f"{what} has {size} bytes, over the gateway's {self.max_schema >> 10} KiB "
                                    "(max_schema_kb): send a smaller schema, or raise max_schema_kb",
                               code="schema_too_large", param=param)
        key = hashlib.sha256(schema.encode() + b"\0" + suffix.encode() + b"\0" + calls.encode()).digest()
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = await self._verdict(key, schema, suffix, calls)
        else:
            self._verdicts.move_to_end(key)
        if verdict:
            self.counts["schemas_refused"] += 1
            raise RequestError(400, f"{what} cannot be decoded under: {verdict}", code="invalid_schema", param=param)

    async def _verdict(self, key: bytes, schema: str, suffix: str, calls: str = "") -> str:
        future = self._running.get(key)
        if future is None:
            if len(self._running) >= self.max_compiles:
                raise RequestError(429, f"{len(self._running)} schemas are compiling already (at most "
                                        f"{self.max_compiles}); retry after a moment", code="rate_limit_exceeded")
            future = asyncio.get_running_loop().create_future()
            self._running[key] = future
            self.counts["schemas_checked"] += 1
            threading.Thread(target=self._convert, args=(asyncio.get_running_loop(), key, future, schema, suffix, calls),
                             name="gateway-schema", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.budget_s)
        except asyncio.TimeoutError:
            self.counts["schemas_over_budget"] += 1
            return (f"it did not compile within the gateway's grammar budget of {self.budget_s:g} s; simplify the "
                    f"schema (less nesting, fewer alternatives), or raise {RAISE}")

    def _convert(self, loop: asyncio.AbstractEventLoop, key: bytes, future: asyncio.Future, schema: str,
                 suffix: str, calls: str = "") -> None:
        """On its own thread: the schema's verdict, "" when it converts."""
        from engines.inference.grammar import grammar

        t0 = time.perf_counter()
        try:
            grammar(schema, suffix, calls)
            verdict = ""
        except Exception as e:  # xgrammar raises RuntimeError with the converter's message
            verdict = fault(e)
        took = time.perf_counter() - t0
        if not verdict and took > self.budget_s:  # finished late: a resend is refused at once, as this was
            verdict = (f"it took {took:.1f} s to compile, over the gateway's grammar budget of {self.budget_s:g} s; "
                       f"simplify the schema (less nesting, fewer alternatives), or raise {RAISE}")
        try:
            loop.call_soon_threadsafe(self._done, key, future, verdict)
        except RuntimeError:  # the gateway stopped (its event loop closed) while this converted
            pass

    def _done(self, key: bytes, future: asyncio.Future, verdict: str) -> None:
        self._running.pop(key, None)
        self._verdicts[key] = verdict
        self._bytes += len(key) + len(verdict) + 64
        while self._bytes > self.max_bytes and self._verdicts:
            old, said = self._verdicts.popitem(last=False)
            self._bytes -= len(old) + len(said) + 64
        if not future.done():
            future.set_result(verdict)
