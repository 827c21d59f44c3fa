"""A bus socket driven from the event loop's own readiness callback.

pyzmq's asyncio sockets resolve a future per receive and per send, and wake the waiting task one
loop turn later; at thousands of requests per second that machinery costs as much as the
protocol. `Wire` registers the socket's file descriptor with the loop once and hands each
multipart message to a plain callback in the same turn it is read; sends go straight to libzmq.

libzmq's descriptor signals edges, not levels: it fires when the socket's state changes, and a
send can consume the edge that announced a waiting message. So every drain reads until the socket
reports no input, and every send checks for input and schedules a drain if there is some.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Callable, Sequence

import zmq

log = logging.getLogger("switchyard.bus")
POLLIN = int(zmq.POLLIN)
RETRY_S = 0.001  # a send libzmq refused for now (a peer's queue full) is retried this often
# a drain hands over at most this many messages, then yields the loop to everything else (the
# requests' own tasks, timers, signals) and goes on next turn: a sender without pause cannot
# starve the process
BATCH = 64


class Wire:
    """Receive every message of `sock` (a pyzmq socket, asyncio or not) through `on_message(frames)`,
    called from the loop with the frames not copied; send with `send`. Create it inside the loop
    that serves the socket, and `close` it before the socket."""

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[zmq.Frame]], None], batch: int = BATCH,
                 secured: bool = False) -> None:
        self.secured = secured  # CURVE on this socket: its peers' roles can be read from their frames
        self.sock = zmq.Socket.shadow(sock.underlying)  # the same libzmq socket, without futures
        self.on_message = on_message
        self.batch = batch
        self.loop = asyncio.get_running_loop()
        self.fd = self.sock.getsockopt(zmq.FD)
        self._drain_due = False
        self._backlog: collections.deque[tuple[Sequence[Any], bool]] = collections.deque()
        self.closed = False
        self.loop.add_reader(self.fd, self._drain)
        self._schedule()  # messages that arrived before the reader was added raised no edge we will see

    def _schedule(self) -> None:
        if not self._drain_due and not self.closed:
            self._drain_due = True
            self.loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_due = False
        sock = self.sock
        for _ in range(self.batch):
            if self.closed:
                return
            try:  # read until libzmq says Again (that re-arms the fd's edge): no EVENTS query per message
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:  # closed under us (shutdown)
                log.debug("receive stopped: %s", e)
                return
            self.on_message(frames)
        self._schedule()  # more may be waiting: read them next turn

    def send(self, frames: Sequence[Any], copy: bool = False) -> None:
        """Queue `frames` as one message now; never waits. Raises zmq.ZMQError when the socket is closed."""
        if self._backlog:  # keep the order behind sends that are waiting for room
            self._backlog.append((frames, copy))
            return
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            self._backlog.append((frames, copy))
            self.loop.call_later(RETRY_S, self._flush)
        if self.sock.getsockopt(zmq.EVENTS) & POLLIN:  # the send may have taken the edge of a waiting reply
            self._schedule()

    def _flush(self) -> None:
        while self._backlog and not self.closed:
            frames, copy = self._backlog[0]
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                self.loop.call_later(RETRY_S, self._flush)
                return
            except zmq.ZMQError as e:
                log.debug("queued send dropped: %s", e)
            self._backlog.popleft()
        self._schedule()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.fd)
