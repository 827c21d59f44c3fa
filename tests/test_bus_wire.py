"""Wire: messages reach the callback however they interleave with sends, including the case libzmq's
edge-triggered descriptor makes hard (a send that takes the edge of a message already waiting)."""

import asyncio
import time

import zmq
import zmq.asyncio

from rollout.bus.reader import Wire


def test_a_message_waiting_behind_a_send_is_still_read(tmp_path) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        for s in (server, client):
            s.setsockopt(zmq.LINGER, 0)
        server.bind(f"ipc://{tmp_path}/w.sock")
        client.connect(f"ipc://{tmp_path}/w.sock")
        got_server: list[list[bytes]] = []
        got_client: list[bytes] = []
        s_wire = Wire(server, lambda frames: got_server.append([f.bytes for f in frames]))
        c_wire = Wire(client, lambda frames: got_client.append(frames[0].bytes))
        c_wire.send([b"hello"])
        deadline = time.monotonic() + 10
        while not got_server and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        peer = got_server[0][0]
        for round_ in range(20):
            # the server answers while the client's loop is busy; the client then sends before its
            # loop polls again, and that send processes the pending input and takes its edge
            s_wire.send([peer, b"reply %d" % round_])
            time.sleep(0.005)
            c_wire.send([b"next %d" % round_])
            deadline = time.monotonic() + 5
            while len(got_client) <= round_ and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            assert got_client[-1:] == [b"reply %d" % round_], f"round {round_}: client got {got_client[-3:]}"
        # a burst larger than one drain's batch arrives whole, in order
        for i in range(500):
            s_wire.send([peer, b"%d" % i])
        deadline = time.monotonic() + 10
        while len(got_client) < 520 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        assert got_client[20:] == [b"%d" % i for i in range(500)]
        for w in (s_wire, c_wire):
            w.close()
        server.close(0)
        client.close(0)
        ctx.term()

    asyncio.run(main())
