"""The floor under the bus, for `benchmarks/bus_vs_ray.py`: bare pyzmq with the same bytes and
the same process layout (an asyncio ROUTER in its own process, an asyncio DEALER here) and
nothing else: no protocol header beyond a request id, no router, no engine, no validation.

    python benchmarks/bare_zmq.py ADDRESS REPLY_TOKENS     # the echo server (bus_vs_ray starts it)
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from typing import Any

import numpy as np
import zmq
import zmq.asyncio


async def serve(address: str, reply_tokens: int) -> None:
    """Echo the first `reply_tokens` ids of every prompt with logprob 0."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    zeros = np.zeros(reply_tokens, np.float32).tobytes()
    while True:
        peer, rid, prompt = await sock.recv_multipart(copy=False)
        ids = np.frombuffer(prompt.buffer, np.int32)[:reply_tokens]
        await sock.send_multipart([peer, rid, ids.tobytes(), zeros], copy=False)


class BareClient:
    """One DEALER, replies matched to callers by request id; returns Python lists like the bus."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.waiting: dict[bytes, asyncio.Future] = {}
        self.ids = itertools.count()
        self.reader: asyncio.Task | None = None

    async def _read(self) -> None:
        while True:
            rid, ids, lps = await self.sock.recv_multipart(copy=False)
            fut = self.waiting.pop(rid.bytes, None)
            if fut is not None and not fut.done():
                fut.set_result((np.frombuffer(ids.buffer, np.int32).tolist(),
                                np.frombuffer(lps.buffer, np.float32).tolist(), "length"))

    async def generate(self, prompt: np.ndarray) -> Any:
        if self.reader is None:
            self.reader = asyncio.ensure_future(self._read())
        rid = str(next(self.ids)).encode()
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        await self.sock.send_multipart([rid, prompt], copy=False)
        return await fut

    def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        self.sock.close(0)
        self.ctx.term()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))
