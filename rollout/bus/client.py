"""GenerateClient: what an agent loop calls to generate; token ids in, ids + logprobs out.

One DEALER socket per EngineServer, so a reply's engine is known from the socket it arrived on
and a dead engine is noticed per socket: a disconnect event (process gone) or heartbeats that
go unanswered (process hung). Either way the requests it held are re-issued on a live engine
and each caller still gets exactly one answer: every attempt has its own wire id, and a late
reply to an abandoned attempt finds no waiter and is dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engines.inference.base import SamplingParams
from rollout.bus import protocol as P
from rollout.bus.auth import AuthError, ClientKeys, needs_auth
from rollout.bus.reader import Wire
from rollout.bus.router import NoEngineAvailable, Router

# a CURVE handshake that fails: the server's key is not the one this client holds (NO_DETAIL,
# PROTOCOL), or the server's ZAP handler refused this client's key (AUTH)
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
REFUSED_AFTER = 3  # failed handshakes in a row (ZMQ retries every 0.1 s) before wait_ready names the keys

log = logging.getLogger("switchyard.client")


@dataclass
class GenerateResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    engine_id: str
    engine_index: int
    cached_prompt_tokens: int
    attempts: int
    request_id: str  # wire id of the attempt that answered, as the server logs it
    # (weight version, number of tokens) of each stretch of token_ids, in order: more than one
    # when a preempting weight update interrupted the generation and it went on with new weights;
    # `weight_version` is then the oldest of them
    segments: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    score: float | None = None  # a reward model's score of the prompt (engine hf_reward); None for generations
    # with sampling top_logprobs = k > 0: per token its k most likely ids and their logprobs, most likely first
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


class RequestFailed(RuntimeError):
    """The engine refused the request (bad sampling params, engine error); not retried."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class _EngineDown(Exception):
    pass


class GenerateClient:
    def __init__(self, addresses: Sequence[str], policy: str = "sticky_group", request_timeout_s: float = 600.0,
                 heartbeat_s: float = 0.5, dead_after_s: float = 10.0, max_attempts: int = 4,
                 keys: ClientKeys | None = None) -> None:
        """`keys` (`BusKeys.for_role`) authenticate this client to engines on tcp addresses."""
        if not addresses:
            raise ValueError("GenerateClient needs at least one engine address, e.g. ['ipc:///tmp/e0.sock']")
        self.addresses = list(addresses)
        self.keys = keys
        open_tcp = [a for a in self.addresses if needs_auth(a)]
        if open_tcp and keys is None:
            raise AuthError(f"engines {open_tcp} are reached over the network and need the run's client keys "
                            "(rollout.bus.auth.BusKeys.for_role); pass keys=...")
        self.router = Router(len(addresses), policy)
        for i in range(len(addresses)):  # nothing is routed to an engine before it answered once
            self.router.mark_down(i)
        self.request_timeout_s = request_timeout_s
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.max_attempts = max_attempts
        self.engine_ids: list[str | None] = [None] * len(addresses)
        self.versions = [0] * len(addresses)  # each engine's weight version as it last reported it
        self._ctx = zmq.asyncio.Context()
        self._socks: list[zmq.asyncio.Socket] = []
        self._wires: list[Wire] = []  # per socket: replies by the loop's read callback, sends straight out
        self._monitors: list[zmq.asyncio.Socket] = []
        self._pending: list[dict[str, asyncio.Future]] = [{} for _ in addresses]
        self._last_seen = [0.0] * len(addresses)
        self._ever_seen = [False] * len(addresses)
        self._refused = [0] * len(addresses)  # CURVE handshakes failed in a row: the keys do not match
        self._asked: dict[int, tuple[asyncio.Task, float]] = {}  # version questions to engines seen behind
        self._live_changed = asyncio.Event()
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._prefix = uuid.uuid4().hex[:8]

    # ------------------------------------------------------------ life cycle
    async def start(self) -> "GenerateClient":
        for i, addr in enumerate(self.addresses):
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            if needs_auth(addr):
                assert self.keys is not None
                self.keys.apply(s)
            mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            s.connect(addr)
            self._socks.append(s)
            self._monitors.append(mon)
            self._wires.append(Wire(s, functools.partial(self._on_reply, i)))
            self._tasks.append(asyncio.create_task(self._monitor_loop(i, mon)))
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
        return self

    async def wait_ready(self, timeout_s: float = 300.0, min_engines: int | None = None) -> None:
        """Wait until `min_engines` (default: all) servers answered; engines may take minutes to load."""
        need = len(self.addresses) if min_engines is None else min_engines
        deadline = time.monotonic() + timeout_s
        while sum(self.router.alive) < need:
            left = deadline - time.monotonic()
            refused = [a for a, up, n in zip(self.addresses, self.router.alive, self._refused)
                       if not up and n >= REFUSED_AFTER]
            if refused:
                raise AuthError(f"engines {refused} refused this client in the CURVE handshake: its keys are not the "
                                "ones their servers were started with; give the keys file those servers use "
                                "(rollout.engine_keys; python -m rollout.service keys PATH makes one)")
            if left <= 0:
                down = [a for a, up in zip(self.addresses, self.router.alive) if not up]
                raise TimeoutError(f"engines {down} did not answer within {timeout_s:.0f}s; "
                                   f"check that their servers started (logs) and the addresses match")
            self._live_changed.clear()
            try:
                await asyncio.wait_for(self._live_changed.wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        tasks = [*self._tasks, *(t for t, _ in self._asked.values())]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for wire in self._wires:
            wire.close()
        for s, mon in zip(self._socks, self._monitors):
            s.disable_monitor()
            mon.close(0)
            s.close(0)
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> "GenerateClient":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------ generation
    async def generate(self, prompt_ids: Sequence[int] | np.ndarray, sampling: SamplingParams | dict | None = None,
                       session_id: str | None = None, group_id: str | None = None,
                       min_weight_version: int = 0, pixel_values: np.ndarray | None = None) -> GenerateResult:
        """Generate on the engine the router picks; re-issued elsewhere if that engine dies.

        A generation preempted by a weight update (finish_reason "preempted") is continued from
        the tokens it has, on the new weights (the next request waits for a newer version), until
        it ends or reaches max_tokens; the caller gets one result whose `segments` say which
        version produced which tokens. The stop strings of `sampling` are checked per segment,
        so one that straddles a preemption is missed (token stop ids are not). `pixel_values`
        ([n, C, H, W] float32) are the images behind the prompt's image tokens, for an engine
        serving a vision-language model."""
        sp = sampling.to_dict() if isinstance(sampling, SamplingParams) else dict(sampling or {})
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        ids: list[int] = []
        lps: list[float] = []
        tops: tuple[list[list[int]], list[list[float]]] | None = None  # (top_ids, top_logprobs) when asked
        segments: list[tuple[int, int]] = []
        budget = sp.get("max_tokens")
        preempted = 0
        while True:
            # the first request goes as the caller sent it (the engine validates it); a continuation
            # asks for what is left of the budget
            part = await self._generate_once(np.concatenate([prompt, np.asarray(ids, np.int32)]) if ids else prompt,
                                             {**sp, "max_tokens": int(budget) - len(ids)} if ids and budget is not None
                                             else sp, session_id, group_id, min_weight_version, pixel_values)
            if not segments and part.finish_reason != "preempted":  # the common case: one piece, no copies
                part.segments = [(part.weight_version, len(part.token_ids))]
                return part
            ids += part.token_ids
            lps += part.logprobs
            if part.top_ids is not None:
                tops = tops or ([], [])
                tops[0].extend(part.top_ids)
                tops[1].extend(part.top_logprobs or [])
            if part.token_ids or not segments:
                segments.append((part.weight_version, len(part.token_ids)))
            reason = part.finish_reason
            if reason == "preempted" and budget is not None and len(ids) >= int(budget):
                reason = "length"
            if reason != "preempted":
                return dataclasses.replace(part, token_ids=ids, logprobs=lps, finish_reason=reason,
                                           weight_version=min(v for v, _ in segments), segments=segments,
                                           preemptions=preempted, top_ids=tops and tops[0],
                                           top_logprobs=tops and tops[1])
            preempted += 1
            min_weight_version = max(min_weight_version, part.weight_version + 1)

    async def _generate_once(self, prompt: np.ndarray, sp: dict[str, Any], session_id: str | None,
                             group_id: str | None, min_weight_version: int,
                             pixel_values: np.ndarray | None = None) -> GenerateResult:
        rid = f"{self._prefix}-{next(self._ids)}"
        failed: set[int] = set()
        for attempt in range(1, self.max_attempts + 1):
            stale = self._stale(min_weight_version)
            if stale - failed:  # a push may have reached them since their last heartbeat: ask before passing over
                stale = await self._recheck(stale - failed, min_weight_version)
            engine = await self._pick(session_id, group_id, failed | stale)
            msg = P.Generate(rid=f"{rid}.{attempt}", prompt_ids=prompt, sampling=sp, session_id=session_id or "",
                             group_id=group_id or "", min_weight_version=min_weight_version,
                             pixel_values=None if pixel_values is None else np.asarray(pixel_values, np.float32))
            try:
                reply = await self._request(engine, msg, self.request_timeout_s)
            except (_EngineDown, asyncio.TimeoutError) as e:
                log.warning("request %s attempt %d on engine %d failed (%s); re-issuing", rid, attempt, engine,
                            type(e).__name__)
                failed.add(engine)
                continue
            if isinstance(reply, P.Error) and reply.code in ("engine_dead", "engine_stopping"):
                log.warning("engine %d is gone serving %s (%s); re-issuing", engine, rid, reply.message)
                self._down(engine, f"engine reported {reply.code}")
                failed.add(engine)
                continue
            if isinstance(reply, P.Error):
                raise RequestFailed(reply.code, reply.message)
            assert isinstance(reply, P.Result)
            return GenerateResult(reply.token_ids.tolist(), reply.logprobs.tolist(), reply.finish_reason,
                                  reply.weight_version, reply.engine_id, engine, reply.cached_prompt_tokens, attempt,
                                  reply.rid, score=reply.score,
                                  top_ids=None if reply.top_ids is None else reply.top_ids.tolist(),
                                  top_logprobs=None if reply.top_logprobs is None else reply.top_logprobs.tolist())
        raise RequestFailed("unavailable", f"request {rid} failed on {self.max_attempts} attempts (engines {sorted(failed)})")

    async def _recheck(self, engines: set[int], need: int) -> set[int]:
        """Ask the live `engines` for their weight version now (one question per engine at a time, at most
        once a heartbeat period each, answered within one) and return those still behind `need`. Without
        it a rollout that starts right after a push, before the next heartbeat, would pass over every
        engine another process pushed to and pile onto the ones this client pushed to itself."""
        now = time.monotonic()
        asks = []
        for i in engines:
            task, asked_at = self._asked.get(i, (None, 0.0))
            if task is None or (task.done() and now - asked_at > self.heartbeat_s):
                if not self.router.alive[i]:
                    continue
                task = asyncio.ensure_future(self.status(i, timeout_s=self.heartbeat_s))
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a timeout just leaves it stale
                self._asked[i] = (task, now)
            asks.append(task)
        if asks:
            await asyncio.wait(asks, timeout=self.heartbeat_s)
        return self._stale(need)

    def _stale(self, need: int) -> set[int]:
        """Engines that cannot serve weight version `need` soon: at version 0 (restarted, never given
        weights) or more than one version behind (one behind may be mid-update; the heartbeat lags).
        They are passed over while another engine can serve (the router falls back to them if none)."""
        if need <= 0:
            return set()
        return {i for i, v in enumerate(self.versions) if v == 0 or v < need - 1}

    def end_session(self, session_id: str) -> None:
        """Forget a finished trajectory's engine pin."""
        self.router.end_session(session_id)

    async def _pick(self, session_id: str | None, group_id: str | None, failed: set[int]) -> int:
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                return self.router.pick(session_id, group_id, exclude=failed)
            except NoEngineAvailable:
                if time.monotonic() > deadline:
                    raise
                self._live_changed.clear()
                try:
                    await asyncio.wait_for(self._live_changed.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass

    async def _request(self, engine: int, msg: P.Message, timeout_s: float) -> P.Message:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending[engine][msg.rid] = fut
        self.router.sent(engine)
        timer = loop.call_later(timeout_s, _expire, fut)  # one timer, not wait_for's wrapper task per request
        try:
            self._wires[engine].send(msg.encode())
            return await fut
        except asyncio.TimeoutError:
            if isinstance(msg, P.Generate):  # free the engine; a late reply is dropped anyway
                self._wires[engine].send(P.Abort(rid=msg.rid).encode())
            raise
        finally:
            timer.cancel()
            self._pending[engine].pop(msg.rid, None)
            self.router.done(engine)

    # ------------------------------------------------------------ control plane
    async def status(self, engine: int, timeout_s: float = 10.0) -> P.Status:
        reply = await self._request(engine, P.Health(rid=f"{self._prefix}-h{next(self._ids)}"), timeout_s)
        assert isinstance(reply, P.Status)
        return reply

    async def call(self, engine: int, msg: P.Message, timeout_s: float = 600.0) -> P.Message:
        """Send one control message (sleep, wake, weights_*) and return its Ack; raise on Error."""
        msg.rid = f"{self._prefix}-c{next(self._ids)}"
        reply = await self._request(engine, msg, timeout_s)
        if isinstance(reply, P.Error):
            raise RequestFailed(reply.code, reply.message)
        return reply

    def live(self, only: list[int] | None = None) -> list[int]:
        """The indices of the engines (of `only`, if given) that are up now."""
        return [i for i in (range(len(self.addresses)) if only is None else only) if self.router.alive[i]]

    async def broadcast(self, msg: P.Message, timeout_s: float = 600.0, only: list[int] | None = None,
                        skip_down: bool = False) -> list[P.Message]:
        """Send a control message to every live engine (of `only`, engine indices) and wait for all acks.
        `skip_down`: an engine whose connection is lost meanwhile is left out of the acks (it is marked
        down) instead of failing the call; an engine that answers with an error still fails it."""
        live = self.live(only)
        msgs = [dataclasses.replace(msg) for _ in live]

        async def one(i: int, m: P.Message) -> P.Message | None:
            try:
                return await self.call(i, m, timeout_s)
            except _EngineDown:
                if not skip_down:
                    raise
                self.router.mark_down(i)
                return None

        acks = await asyncio.gather(*(one(i, m) for i, m in zip(live, msgs)))
        return [a for a in acks if a is not None]

    # ------------------------------------------------------------ receiving and liveness
    def _seen(self, engine: int) -> None:
        self._last_seen[engine] = time.monotonic()
        self._ever_seen[engine] = True
        if not self.router.alive[engine]:
            log.info("engine %d (%s) is up", engine, self.addresses[engine])
            self.router.mark_up(engine)
            self._live_changed.set()

    def _down(self, engine: int, why: str) -> None:
        if self.router.alive[engine]:
            log.warning("engine %d (%s) is down: %s", engine, self.addresses[engine], why)
        self.router.mark_down(engine)
        self._live_changed.set()
        for fut in list(self._pending[engine].values()):
            if not fut.done():
                fut.set_exception(_EngineDown(why))

    def _on_reply(self, engine: int, frames: list[zmq.Frame]) -> None:
        """One message from engine `engine`, from the loop's read callback."""
        try:
            msg = P.decode([f.buffer for f in frames])
        except P.ProtocolError as e:
            log.error("engine %d sent an undecodable reply: %s", engine, e)
            return
        self._seen(engine)
        if isinstance(msg, P.Status):
            self.engine_ids[engine] = msg.engine_id
            self.router.report_load(engine, msg.load)
            self.versions[engine] = msg.weight_version
        elif isinstance(msg, P.Result):
            self.router.report_load(engine, msg.load)
            self.versions[engine] = max(self.versions[engine], msg.weight_version)
        elif isinstance(msg, P.Ack):  # a commit's ack says the new version is loaded
            self.versions[engine] = max(self.versions[engine], msg.weight_version)
        fut = self._pending[engine].get(msg.rid)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def _monitor_loop(self, engine: int, mon: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await mon.recv_multipart())
            if event["event"] & HANDSHAKE_FAILED:  # a ZAP refusal is final (libzmq stops reconnecting)
                self._refused[engine] += REFUSED_AFTER if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH else 1
                self._live_changed.set()  # wait_ready says so now, not at its deadline
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._refused[engine] = 0
            elif event["event"] == zmq.EVENT_DISCONNECTED and self._ever_seen[engine]:
                self._down(engine, "connection lost")

    async def _heartbeat_loop(self) -> None:
        while True:
            now = time.monotonic()
            for i in range(len(self._socks)):
                if self.router.alive[i] and now - self._last_seen[i] > self.dead_after_s:
                    self._down(i, f"no reply to heartbeats for {self.dead_after_s:.1f}s")
                self._wires[i].send(P.LoadRequest(rid=f"{self._prefix}-hb").encode())
            await asyncio.sleep(self.heartbeat_s)
