"""EngineServer: one ZMQ ROUTER in front of one engine, many requests in flight.

Each socket is read from the event loop's readiness callback (`rollout/bus/reader.py`). Every
generate runs in a coroutine of its own, started in the turn that read it and left to a task when
it waits on the engine, so the engine sees all concurrent requests at once and batches them; the
read path itself only parses and dispatches, which keeps health and load replies prompt while the
engine is busy. A frame that cannot be parsed gets an `Error` reply and the
server goes on: no client can stop it by sending garbage.

Run one per engine (per engine DP group):
    python -m rollout.bus.server --backend hf --model tiny-llama --address ipc:///tmp/e0.sock
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

import zmq
import zmq.asyncio

from engines.inference import ENGINES, Engine, EngineDeadError, SamplingParams, held_dtype, make_engine
from parallel.host import bound_freed_memory
from parallel.lifetime import exit_now, watch_parent
from rollout.bus import protocol as P
from rollout.bus.eager import start_eagerly
from rollout.bus.reader import Wire
from rollout.bus.auth import (CONTROL_ROLES, AuthError, BusKeys, needs_auth, role_of, secure_server,
                               watch_handshakes, zap_handler)
from rollout.weights.inproc import LocalLoad
from rollout.weights.receive import WeightReceiver
from rollout.bus.launcher import parse_options

log = logging.getLogger("switchyard.server")
GATE_TIMEOUT_S = 1800.0  # longest a generate waits for the engine to wake, finish an update or load its version
MAX_GATED_PER_PEER = 4096
STOP_TIMEOUT_S = 5.0  # how long a stopping server waits for its tasks before it closes the engine anyway
PEER_TIMEOUT_S = 30.0  # a heartbeating peer silent this long is gone
CONTROL = (P.Sleep, P.Wake, P.WeightsBegin, P.WeightsBucket, P.WeightsCommit, P.WeightsDigest)  # the trainer's only


class EngineServer:
    """Serves `engine` on one or more addresses (ipc:// for clients on this node, tcp:// for the
    others). A tcp bind needs the run's `keys` (`rollout.bus.auth`): CURVE admits only the trainer
    and the agent workers, and only the trainer may send control messages. A tcp address with
    port 0 binds a free port; `endpoints` holds what was really bound."""

    def __init__(self, engine: Engine, address: str | Sequence[str], engine_id: str, request_log: str | None = None,
                 keys: BusKeys | None = None, gate_timeout_s: float = GATE_TIMEOUT_S,
                 max_gated_per_peer: int = MAX_GATED_PER_PEER, peer_timeout_s: float = PEER_TIMEOUT_S) -> None:
        self.engine = engine
        self.addresses = [address] if isinstance(address, str) else list(address)
        if keys is None and any(needs_auth(a) for a in self.addresses):
            raise AuthError(f"engine {engine_id}: binding {[a for a in self.addresses if needs_auth(a)]} needs the "
                            "run's bus keys (rollout.bus.auth.BusKeys); an open tcp socket would let any host on the "
                            "network drive the engine")
        self.keys = keys
        self.endpoints: list[str] = []
        self.engine_id = engine_id
        self.weight_version = 0
        self._request_log: TextIO | None = open(request_log, "a", buffering=1) if request_log else None
        self._ctx = zmq.asyncio.Context()
        self._socks: list[zmq.asyncio.Socket] = []
        self._wires: list[Wire] = []  # one per socket: receives by the loop's callback, sends straight out
        self._inflight: dict[tuple[bytes, str], asyncio.Task] = {}
        self._aborted: set[tuple[bytes, str]] = set()  # aborted before reaching the engine
        self._running: set[tuple[bytes, str]] = set()  # inside the engine now
        self._preempted: set[tuple[bytes, str]] = set()  # stopped by a preempting weight update
        # generates held at the gate (asleep, mid update, or behind the weight version they ask
        # for), per peer: they count as load, give up after gate_timeout_s, and a peer may not
        # park more than max_gated_per_peer (no memory grows without bound behind the gate)
        self._gated: collections.Counter[bytes] = collections.Counter()
        self.gate_timeout_s, self.max_gated_per_peer = float(gate_timeout_s), int(max_gated_per_peer)
        # peers that heartbeat (GenerateClient does, every 0.5 s): one silent for peer_timeout_s is
        # gone (libzmq's disconnect notice is a draft API the wheel lacks); its held requests go
        self._heartbeats: dict[bytes, float] = {}
        self.peer_timeout_s = float(peer_timeout_s)
        self.dropped_for_silence = 0
        self.preemptions = 0
        self._weight_jobs: asyncio.Queue[tuple[bytes, P.Message]] = asyncio.Queue()
        self._gate = asyncio.Condition()  # guards sleeping / updating / weight_version
        self._sleeping = False
        self._updating = False
        self._weights_freed = False  # after a level-2 sleep, until the next weight version commits
        self.requests = 0  # generates answered with a result
        self._generating = 0
        self._started = time.monotonic()
        self._busy_s = 0.0  # seconds with at least one generate inside the engine (busy fraction)
        self._busy_since = 0.0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop = asyncio.Event()
        self._bound = asyncio.Event()
        self.bad_frames = 0
        self.refused = 0  # control messages from peers without the trainer's key
        self.exit_code = 0

    # ---------------------------------------------------------------- life cycle
    async def run(self) -> None:
        """Start the engine, bind, serve until stop(); the engine is closed on the way out."""
        self._loop = asyncio.get_running_loop()
        await self.engine.start()
        tasks = [asyncio.create_task(self._control_loop())]
        if self.keys is not None:
            zap_ready = asyncio.Event()
            tasks.append(asyncio.create_task(zap_handler(self._ctx, self.keys, zap_ready)))
            await zap_ready.wait()
        for i, address in enumerate(self.addresses):
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            if needs_auth(address):
                assert self.keys is not None
                secure_server(sock, self.keys)
            sock.bind(address)
            if needs_auth(address):  # a client holding other keys fails the handshake: say so here too
                tasks.append(asyncio.create_task(watch_handshakes(sock, address, self.engine_id)))
            self._socks.append(sock)
            self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            self._wires.append(Wire(sock, functools.partial(self._on_message, i), secured=needs_auth(address)))
        log.info("engine %s serving on %s", self.engine_id, self.endpoints)
        self._bound.set()
        await self._stop.wait()
        await asyncio.sleep(0.05)  # let queued replies (e.g. engine_dead errors) leave
        await self._set_gate()  # requests held at the gate wake, see the stop, answer and leave
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self._gated and time.monotonic() < deadline:  # before any is cancelled mid-way through the lock
            await asyncio.sleep(0.01)
        left = [*tasks, *self._inflight.values()]
        for t in left:
            t.cancel()
        stuck = (await asyncio.wait(left, timeout=STOP_TIMEOUT_S))[1] if left else set()
        if stuck:  # never wait on: a dead trainer's engine must give its memory back
            log.warning("%d task(s) still running %g s after the stop; closing the engine", len(stuck), STOP_TIMEOUT_S)
        await self.engine.close()
        for wire in self._wires:
            wire.close()
        for sock in self._socks:
            sock.close(0)
        self._ctx.term()
        if self._request_log:
            self._request_log.close()

    def stop(self) -> None:
        self._stop.set()
        for wire in self._wires:  # stopping: one message per loop turn, so held requests answer first
            wire.batch = 1

    # ---------------------------------------------------------------- transport
    async def wait_bound(self) -> list[str]:
        """The endpoints once every address is bound (tcp port 0 resolved)."""
        await self._bound.wait()
        return self.endpoints

    def _reply(self, identity: bytes, msg: P.Message) -> None:
        """Send now: the ROUTER's send queue is unbounded (SNDHWM 0), so this never waits. `identity` is
        the socket index byte and the peer's ZMQ identity (see _on_message)."""
        try:
            self._wires[identity[0]].send([identity[1:], *msg.encode()])
        except zmq.ZMQError as e:  # the socket closed under a late reply (shutdown)
            log.debug("reply %s not sent: %s", msg.rid, e)

    def _on_message(self, index: int, frames: list[zmq.Frame]) -> None:
        """One message of socket `index`, from the loop's read callback; a peer is known as (socket index
        byte + ZMQ identity), so replies leave by the socket the request came in on."""
        identity, body = bytes([index]) + frames[0].bytes, [f.buffer for f in frames[1:]]
        secured = self._wires[index].secured
        try:
            msg = P.decode(body)
            if secured and isinstance(msg, CONTROL) and role_of(frames[-1]) not in CONTROL_ROLES:
                self.refused += 1
                self._reply(identity, P.Error(rid=msg.rid, code="forbidden", message=(
                    f"{msg.TYPE} is only accepted from the trainer; this peer may generate, abort and read load")))
                return
            if isinstance(msg, P.WeightsBucket) and msg.ref is not None and not self.addresses[index].startswith("ipc://"):
                self.refused += 1
                self._reply(identity, P.Error(rid=msg.rid, code="forbidden", message=(
                    "a weights bucket in shared memory is only taken on the ipc socket (same node); send frames "
                    "over tcp")))
                return
            self._dispatch(identity, msg)
        except P.ProtocolError as e:
            self.bad_frames += 1
            self._reply(identity, P.Error(rid=P.request_id_of(body) if body else "", code="bad_frame", message=str(e)))
        except Exception as e:  # a bug in dispatch must not take the server down either
            self.bad_frames += 1
            log.exception("dispatch failed")
            self._reply(identity, P.Error(rid="", code="internal", message=f"{type(e).__name__}: {e}"))

    def _dispatch(self, identity: bytes, msg: P.Message) -> None:
        if isinstance(msg, P.LoadRequest):  # GenerateClients send these as heartbeats
            self._heartbeats[identity] = time.monotonic()
        elif identity in self._heartbeats:
            self._heartbeats[identity] = time.monotonic()
        if isinstance(msg, P.Generate):
            if self._stop.is_set():  # answered here: a client still sending cannot keep a stopping server busy
                self._reply(identity, P.Error(rid=msg.rid, code="engine_stopping", message=(
                    f"engine {self.engine_id} is shutting down; the request was not run")))
                return
            key = (identity, msg.rid)
            if key in self._inflight:
                self._reply(identity, P.Error(rid=msg.rid, code="duplicate_rid",
                                              message=f"request {msg.rid!r} is already in flight; use a new rid"))
                return
            task = start_eagerly(self._generate(identity, msg))  # an answer needing no wait leaves at once
            if task is not None:
                self._inflight[key] = task
                task.add_done_callback(lambda _t, k=key: (self._inflight.pop(k, None), self._aborted.discard(k)))
        elif isinstance(msg, P.Abort):
            if (identity, msg.rid) in self._inflight:
                self._aborted.add((identity, msg.rid))
                asyncio.create_task(self.engine.abort(self._engine_rid(identity, msg.rid)))
        elif isinstance(msg, (P.LoadRequest, P.Health)):
            self._reply(identity, self._status(msg.rid))
        elif isinstance(msg, CONTROL):
            self._weight_jobs.put_nowait((identity, msg))  # applied strictly in arrival order
        else:
            self._reply(identity, P.Error(rid=msg.rid, code="unexpected",
                                          message=f"a server does not accept {msg.TYPE!r} messages"))

    def _status(self, rid: str) -> P.Status:
        stats = self.engine.stats().to_dict()
        stats["sleeping"] = self._sleeping
        stats["updating"] = self._updating
        stats["bad_frames"] = self.bad_frames
        stats["refused"] = self.refused
        stats["weights_freed"] = self._weights_freed
        stats.update(requests=self.requests, preemptions=self.preemptions)
        stats["gated"] = sum(self._gated.values())
        stats["dropped_for_silence"] = self.dropped_for_silence
        stats["rss_mb"] = _rss_mb()
        now = time.monotonic()
        stats["busy_s"] = self._busy_s + (now - self._busy_since if self._generating else 0.0)
        stats["uptime_s"] = now - self._started
        stats["dtype"] = held_dtype(self.engine)  # what a push must arrive in: an attached run casts to it
        return P.Status(rid=rid, engine_id=self.engine_id, weight_version=self.weight_version, stats=stats)

    @staticmethod
    def _engine_rid(identity: bytes, rid: str) -> str:
        return f"{identity.hex()}:{rid}"

    # ---------------------------------------------------------------- generation
    async def _generate(self, identity: bytes, msg: P.Generate) -> None:
        try:
            params = SamplingParams.from_dict(msg.sampling)
        except (TypeError, ValueError) as e:
            self._reply(identity, P.Error(rid=msg.rid, code="bad_sampling", message=str(e)))
            return
        if int(msg.prompt_ids.min()) < 0:
            self._reply(identity, P.Error(rid=msg.rid, code="bad_prompt", message=(
                f"prompt token ids must be >= 0, got {int(msg.prompt_ids.min())}")))
            return
        if self._gated[identity] >= self.max_gated_per_peer:
            self._reply(identity, P.Error(rid=msg.rid, code="too_many_waiting", message=(
                f"{self._gated[identity]} of this peer's requests already wait for the engine (asleep, updating "
                f"or behind a weight version); the cap is {self.max_gated_per_peer}")))
            return
        if self._stop.is_set() or not self._gate_open(msg.min_weight_version):  # else no lock, no await
            if not await self._wait_at_gate(identity, msg):
                return
        if self._generating == 0:  # no await since the gate was seen open: the weight path sees this at once
            self._busy_since = time.monotonic()
        self._generating += 1
        self._idle.clear()
        started = time.time()  # wall clock, for the request log (when the engine took the request)
        key = (identity, msg.rid)
        self._running.add(key)
        try:
            if (identity, msg.rid) in self._aborted:  # aborted while held at the gate
                self._reply(identity, P.Result(rid=msg.rid, finish_reason="abort", engine_id=self.engine_id,
                                               weight_version=self.weight_version))
                return
            images = {} if msg.pixel_values is None else {"pixel_values": msg.pixel_values}
            if images and not getattr(self.engine, "takes_images", False):
                raise ValueError(f"this engine ({type(self.engine).__name__}) does not take images; serve the "
                                 "vision-language model with rollout.engine=hf")
            out = await self.engine.generate(self._engine_rid(identity, msg.rid), msg.prompt_ids, params, **images)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:  # say so, then exit: clients re-issue on a live engine
            log.error("engine is dead, shutting the server down: %s", e)
            self._reply(identity, P.Error(rid=msg.rid, code="engine_dead", message=str(e)))
            self.exit_code = 1
            self.stop()
            return
        except Exception as e:
            log.exception("generate %s failed", msg.rid)
            self._reply(identity, P.Error(rid=msg.rid, code="engine_error", message=f"{type(e).__name__}: {e}"))
            return
        finally:
            self._running.discard(key)
            preempted = key in self._preempted
            self._preempted.discard(key)
            self._generating -= 1
            if self._generating == 0:
                self._busy_s += time.monotonic() - self._busy_since
                self._idle.set()
        reason = out.finish_reason
        if preempted and reason == "abort":  # stopped for a weight update, not by its client: it continues
            reason = "preempted"
            self.preemptions += 1
        score = None if out.score is None else float(out.score)  # a numpy scalar would not pack
        if self._request_log:  # logged before the reply leaves, so an audit never misses one
            self._request_log.write(json.dumps({
                "rid": msg.rid, "session_id": msg.session_id, "group_id": msg.group_id, "engine_id": self.engine_id,
                "weight_version": self.weight_version, "prompt_len": int(msg.prompt_ids.size),
                "token_ids": list(map(int, out.token_ids)), "finish_reason": reason, "score": score,
                "started": round(started, 6), "time": round(time.time(), 6)}) + "\n")
        stats = self.engine.stats()
        self.requests += 1
        self._reply(identity, P.Result(
            rid=msg.rid, token_ids=out.token_ids, logprobs=out.logprobs, finish_reason=reason,
            weight_version=self.weight_version, engine_id=self.engine_id,
            cached_prompt_tokens=out.cached_prompt_tokens, load=stats.waiting + stats.running + sum(self._gated.values()),
            score=score, top_ids=out.top_ids, top_logprobs=out.top_logprobs))

    def _gate_open(self, min_weight_version: int) -> bool:
        """Generation may start now: awake, no weight update under way, weights loaded at a version the
        request accepts."""
        return not self._sleeping and not self._updating and not self._weights_freed \
            and self.weight_version >= min_weight_version

    async def _wait_at_gate(self, identity: bytes, msg: P.Generate) -> bool:
        """Hold a generate until the gate opens; False when it was answered (or dropped) here instead."""
        self._gated[identity] += 1  # counted before the lock is awaited, so a burst cannot pass the cap
        try:
            async with self._gate:  # held while sleeping, mid weight update, or behind the wanted version
                open_ = lambda: self._stop.is_set() or self._gate_open(msg.min_weight_version)  # noqa: E731
                deadline = time.monotonic() + self.gate_timeout_s
                while not open_():
                    if identity in self._heartbeats and \
                            time.monotonic() - self._heartbeats[identity] > self.peer_timeout_s:
                        self.dropped_for_silence += 1  # the peer is gone: nobody to answer
                        return False
                    if time.monotonic() > deadline:
                        self._reply(identity, P.Error(rid=msg.rid, code="gate_timeout", message=(
                            f"waited {self.gate_timeout_s:g} s for the engine (weight version "
                            f"{msg.min_weight_version} asked, {self.weight_version} loaded, sleeping={self._sleeping}, "
                            f"updating={self._updating})")))
                        return False
                    try:
                        await asyncio.wait_for(self._gate.wait_for(open_), min(1.0, self.peer_timeout_s / 2))
                    except asyncio.TimeoutError:
                        pass
                if self._stop.is_set():
                    self._reply(identity, P.Error(rid=msg.rid, code="engine_stopping", message=(
                        f"engine {self.engine_id} is shutting down; the request was not run")))
                    return False
        finally:
            self._gated[identity] -= 1
            if self._gated[identity] <= 0:
                del self._gated[identity]
        return True

    # ---------------------------------------------------------------- control plane
    def submit_local(self, job: LocalLoad) -> None:
        """From another thread of this process: queue an in-process weight load (see LocalLoad)."""
        self._loop.call_soon_threadsafe(self._weight_jobs.put_nowait, (b"", job))

    async def _set_gate(self, **flags: Any) -> None:
        async with self._gate:
            for k, v in flags.items():
                setattr(self, k, v)
            self._gate.notify_all()

    async def pause_for_update(self, version: int, preempt: bool) -> None:
        """Hold new generation for weight version `version`; running requests end on the old weights
        (with `preempt` they stop now with their tokens, and their clients continue them)."""
        if version <= self.weight_version:
            raise ValueError(f"weight version {version} is not newer than the engine's "
                             f"{self.weight_version}; versions must increase")
        await self._set_gate(_updating=True)
        if preempt:
            for key in list(self._running):
                self._preempted.add(key)
                await self.engine.abort(self._engine_rid(*key))
        await self._idle.wait()

    async def resume(self, version: int) -> None:
        """Serve `version` from now on and let held requests through."""
        self.weight_version = version
        await self._set_gate(_updating=False, _weights_freed=False)

    async def _control_loop(self) -> None:
        """Sleep, wake and weight messages, strictly in arrival order."""
        weights = WeightReceiver(self)
        while True:
            identity, msg = await self._weight_jobs.get()
            try:
                if isinstance(msg, P.Sleep):
                    await self._set_gate(_sleeping=True)
                    await self._idle.wait()
                    await self.engine.sleep(msg.level)
                    if msg.level >= 2:
                        await self._set_gate(_weights_freed=True)
                elif isinstance(msg, P.Wake):
                    await self.engine.wake()
                    await self._set_gate(_sleeping=False)
                elif isinstance(msg, P.WeightsDigest):
                    self._reply(identity, await weights.digest(msg.rid, msg.names))
                    continue
                else:
                    report = await weights.apply(msg)
                    if isinstance(msg, LocalLoad):
                        msg.done.set_result(report)
                        continue
                self._reply(identity, P.Ack(rid=msg.rid, of=msg.TYPE, weight_version=self.weight_version))
            except Exception as e:
                log.warning("%s %s failed: %s", msg.TYPE, msg.rid, e)
                if isinstance(msg, LocalLoad):
                    if self._updating:
                        await self._set_gate(_updating=False)
                    msg.done.set_exception(e)
                    continue
                self._reply(identity, P.Error(rid=msg.rid, code=f"{msg.TYPE}_failed", message=f"{type(e).__name__}: {e}"))


def _log_send_error(sent: "asyncio.Future[Any]") -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("a reply could not be sent: %s", sent.exception())


def _rss_mb() -> float:
    """This process's resident memory in MiB (Linux /proc; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve one inference engine on the switchyard bus.")
    ap.add_argument("--backend", default="hf", help="hf | hf_reward | vllm | sglang | echo")
    ap.add_argument("--model", default="tiny-llama", help="built-in name, HF directory or hub id")
    ap.add_argument("--address", action="append", required=True,
                    help="ipc:///path or tcp://host:port (port 0 = any free port); repeat to bind several")
    ap.add_argument("--keys", default=None, help="bus keys file (rollout.bus.auth.BusKeys.write); required for tcp")
    ap.add_argument("--endpoint-file", default=None, help="write the bound endpoints here as a JSON list")
    ap.add_argument("--engine-id", default=None, help="name reported in every reply (default: the address)")
    ap.add_argument("--option", action="append", default=[], help="engine option key=json-value, repeatable")
    ap.add_argument("--request-log", default=None, help="append one JSON line per reply sent (audits, tests)")
    ap.add_argument("--gate-timeout-s", type=float, default=GATE_TIMEOUT_S,
                    help="longest a generate waits for the engine to wake, update or load the version it asks for")
    ap.add_argument("--peer-timeout-s", type=float, default=PEER_TIMEOUT_S,
                    help="a heartbeating peer silent this long is gone: its held requests are dropped")
    ap.add_argument("--watch-parent", type=int, default=None,
                    help="stop (closing the engine) when this process is gone, e.g. a trainer killed with -9")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("SWITCHYARD_LOG", "INFO"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cores = os.environ.get("SWITCHYARD_ENGINE_CORES")
    if cores and hasattr(os, "sched_setaffinity"):  # this engine's slice of the box, before any thread starts
        os.sched_setaffinity(0, [int(c) for c in cores.split(",")])
    if args.backend in ENGINES and ENGINES[args.backend].bounded_heap:
        bound_freed_memory()  # before the engine computes: a server lives for the run, every step a new shape
    engine = make_engine(args.backend, args.model, **parse_options(args.option))
    keys = BusKeys.read(args.keys) if args.keys else None
    server = EngineServer(engine, args.address, args.engine_id or args.address[0], args.request_log, keys,
                          gate_timeout_s=args.gate_timeout_s, peer_timeout_s=args.peer_timeout_s)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        if args.watch_parent:  # a server outliving its trainer would hold its memory (vLLM: gigabytes) forever
            def gone() -> None:
                log.warning("parent process %d is gone; stopping", args.watch_parent)
                loop.call_soon_threadsafe(server.stop)

            watch_parent(gone, parent=args.watch_parent)
        running = asyncio.create_task(server.run())
        if args.endpoint_file:
            bound = asyncio.create_task(server.wait_bound())
            await asyncio.wait([bound, running], return_when=asyncio.FIRST_COMPLETED)
            if bound.done():
                tmp = Path(args.endpoint_file + ".tmp")
                tmp.write_text(json.dumps(bound.result()))
                tmp.rename(args.endpoint_file)  # readers never see a half-written file
        await running

    asyncio.run(serve())
    # the engine, its sockets and the request log are closed: a vLLM server's teardown took 2.4 s of nothing
    exit_now(server.exit_code)


if __name__ == "__main__":
    main()
