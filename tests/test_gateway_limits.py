"""The gateway under abuse: a huge request does not hold up other clients, a body over the limit gets
413 (not 500), every gateway has a context limit, and sessions clients open by themselves are
bounded. Driven with a real HTTP client against the real server; the bus client is scripted (the
test is about the gateway, not the engines)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.gateway import Gateway  # noqa: E402
from test_tool_agent_states import ScriptedClient, tok  # noqa: E402,F401


def _big_body(mb: int) -> bytes:
    """A chat request of about `mb` MB: many ordinary messages, as a long agent transcript would be."""
    text = "the quick brown fox jumps over the lazy dog " * 23  # ~1 KB
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i in range(mb * 1000)]
    return json.dumps({"model": "switchyard", "messages": messages}).encode()


async def _poll(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> float:
    """The longest a small request waited while the big one was in flight."""
    worst = 0.0
    while not stop.is_set():
        t0 = time.perf_counter()
        async with session.get(url) as r:
            assert r.status == 200
        worst = max(worst, time.perf_counter() - t0)
        await asyncio.sleep(0.02)
    return worst


def test_a_huge_request_neither_stalls_others_nor_fails_with_500(tok):  # noqa: F811
    async def body():
        gw = Gateway(ScriptedClient(tok, ["ok"]), tok, max_body_mb=64)
        await gw.start()
        try:
            async with aiohttp.ClientSession() as s:
                big = _big_body(40)
                stop = asyncio.Event()
                poller = asyncio.create_task(_poll(s, gw.base_url + "/models", stop))
                await asyncio.sleep(0.1)
                t0 = time.perf_counter()
                async with s.post(gw.base_url + "/chat/completions", data=big,
                                  headers={"Content-Type": "application/json"}) as r:
                    status, err = r.status, (await r.json())["error"]
                took = time.perf_counter() - t0
                stop.set()
                worst = await poller
                async with s.post(gw.base_url + "/chat/completions", data=_big_body(100),
                                  headers={"Content-Type": "application/json"}) as r:
                    too_big, err_big = r.status, (await r.json())["error"]
            return status, err, took, worst, too_big, err_big, gw.max_context
        finally:
            await gw.stop()

    status, err, took, worst, too_big, err_big, context = asyncio.run(body())
    assert context == 2048  # the tiny model's max_position_embeddings: every gateway has a limit
    assert status == 413 and err["code"] == "context_length_exceeded", err
    assert worst < 1.0, f"a /v1/models poll waited {worst:.2f}s while a 40 MB request took {took:.2f}s"
    assert too_big == 413 and err_big["code"] == "request_too_large" and "max_body_mb" in err_big["message"]


def test_sessions_clients_open_by_themselves_are_bounded(tok):  # noqa: F811
    async def body():
        gw = Gateway(ScriptedClient(tok, ["ok"]), tok, max_sessions=50)
        await gw.start()
        mine = gw.open_session()  # an agent loop's session is never evicted
        try:
            async with aiohttp.ClientSession() as s:
                for i in range(120):
                    async with s.post(gw.base_url + "/chat/completions", headers={"X-Session-Id": f"s{i}"},
                                      json={"model": "switchyard", "messages": [{"role": "user", "content": "hi"}]}) as r:
                        assert r.status == 200, await r.text()
            return set(gw.sessions), mine
        finally:
            await gw.stop()

    sessions, mine = asyncio.run(body())
    assert mine in sessions and len(sessions) == 51
    assert {f"s{i}" for i in range(70, 120)} <= sessions  # the most recent stay


def test_refused_requests_leave_the_session_as_it_was(tok):  # noqa: F811
    """A conversation turned away for its length (413 after tokenizing: it passes the character check)
    keeps nothing of itself in the session: 1,500 of them leave the session's tokens where they were
    and the process's memory within 50 MB; the conversation then goes on from its last good turn."""
    import os

    import psutil

    def held(gw) -> int:
        return sum(len(seg.traj.response_ids) + len(seg.traj.prompt_ids) + len(seg.held)
                   for sess in gw.sessions.values() for seg in sess.segments)

    async def body():
        gw = Gateway(ScriptedClient(tok, ["ok"] * 4), tok)
        await gw.start()
        rss = psutil.Process(os.getpid()).memory_info().rss
        try:
            async with aiohttp.ClientSession() as s:
                async def chat(messages):
                    async with s.post(gw.base_url + "/chat/completions", headers={"X-Session-Id": "abuse"},
                                      json={"model": "switchyard", "messages": messages}) as r:
                        return r.status, await r.json()

                first = [{"role": "user", "content": "hi"}]
                status, reply = await chat(first)
                assert status == 200, reply
                so_far = first + [reply["choices"][0]["message"]]
                before = held(gw)
                long = " ".join(["hello"] * 2100)  # ~2,100 tokens > the context of 2,048, 12.6k characters < 65k
                for _ in range(1500):
                    status, err = await chat(so_far + [{"role": "user", "content": long}])
                    assert status == 413 and err["error"]["code"] == "context_length_exceeded", err
                after = held(gw)
                grown = psutil.Process(os.getpid()).memory_info().rss - rss
                status, reply = await chat(so_far + [{"role": "user", "content": "and now?"}])
                return before, after, grown, status, len(gw.sessions["abuse"].segments)
        finally:
            await gw.stop()

    before, after, grown, status, segments = asyncio.run(body())
    assert after == before, (before, after)
    assert grown < 50 * 2**20, f"RSS grew {grown / 2**20:.0f} MB over 1,500 refused requests"
    assert status == 200 and segments == 1  # the good turn continued the one segment, none was left behind


def test_a_body_nested_100000_deep_gets_400_on_every_route(tok):  # noqa: F811
    deep = '{"model": "switchyard", "max_tokens": 4, "messages": [{"role": "user", "content": ' + "[" * 100_000 \
        + "]" * 100_000 + "}], \"input\": " + "[" * 100_000 + "]" * 100_000 + "}"

    async def body():
        gw = Gateway(ScriptedClient(tok, ["ok"]), tok)
        await gw.start()
        try:
            got = {}
            async with aiohttp.ClientSession() as s:
                for route in ("/chat/completions", "/responses", "/messages"):
                    async with s.post(gw.base_url + route, data=deep, headers={"Content-Type": "application/json"}) as r:
                        got[route] = (r.status, await r.text())
            return got
        finally:
            await gw.stop()

    for route, (status, text) in asyncio.run(body()).items():
        assert status == 400 and "nested too deeply" in text, (route, status, text[:300])


class _Held(ScriptedClient):
    """A scripted engine that holds the first request until `release` is set (another client's long work)."""

    def __init__(self, tok) -> None:  # noqa: F811
        super().__init__(tok, ["ok"])
        self.release, self.holding = asyncio.Event(), asyncio.Event()

    async def generate(self, prompt_ids, sampling, **kw):
        if not self.holding.is_set():
            self.holding.set()
            await self.release.wait()
        return await super().generate(prompt_ids, sampling, **kw)


def test_keyless_clients_never_queue_behind_each_other(tok):  # noqa: F811
    """Two clients sending neither a key nor X-Session-Id: the second's request completes while the
    first's is still generating (each connection is its own session), and one client's turns on its
    keep-alive connection continue one session and its recorded segment."""
    async def body():
        client = _Held(tok)
        gw = Gateway(client, tok)
        await gw.start()
        ask = {"model": "switchyard", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        try:
            async with aiohttp.ClientSession() as a, aiohttp.ClientSession() as b:
                async def chat(s, messages):
                    async with s.post(gw.base_url + "/chat/completions", json={**ask, "messages": messages}) as r:
                        assert r.status == 200, await r.text()
                        return (await r.json())["choices"][0]["message"]

                slow = asyncio.create_task(chat(a, ask["messages"]))
                await asyncio.wait_for(client.holding.wait(), 10)
                try:  # without a session of its own this waits on the first client's session until released
                    said = await asyncio.wait_for(chat(b, ask["messages"]), 10)
                    await asyncio.wait_for(chat(b, ask["messages"] + [said, {"role": "user", "content": "more"}]), 10)
                finally:
                    client.release.set()
                await asyncio.wait_for(slow, 10)
                sessions = {sid: len(c.segments) for sid, c in gw.sessions.items()}
            return sessions
        finally:
            await gw.stop()

    sessions = asyncio.run(body())
    assert len(sessions) == 2 and sorted(sessions.values()) == [1, 1], sessions  # b's second turn continued its one
