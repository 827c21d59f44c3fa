"""McpTool against a real stdio MCP server subprocess (tests/fixtures/mcp_server.py): listing,
calls, tool errors, timeouts, a server killed from outside, concurrency, and no process left
behind after close()."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import mcp.types as mcp_types
import pytest

from agent.tools import BaseTool, ToolConfigError, ToolResponse, build_tools
from agent.tools.mcp import McpTool, mcp_tools_from_server, render_content
from waiting import until

SERVER = str(Path(__file__).parent / "fixtures" / "mcp_server.py")
NAMES = ["add", "echo", "fail", "meet", "picture", "pid", "sleep", "sleeping"]


def server_children(marker: str = SERVER) -> list[int]:
    """Running (non-zombie) children of this process whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            cmdline = (entry / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(ppid) == os.getpid() and state != "Z" and marker.encode() in cmdline:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def run(test: Callable[[dict[str, McpTool]], Awaitable[None]], **kw: Any) -> None:
    """Build the tools from the real server, run `test`, always close, and check nothing is left."""
    async def go() -> None:
        tools = await mcp_tools_from_server(sys.executable, [SERVER], **kw)
        try:
            await test(tools)
        finally:
            await tools["add"].close()
        assert server_children() == [], "close() left a server process behind"
    asyncio.run(go())


async def call(tool: BaseTool, **arguments: Any) -> ToolResponse:
    iid = await tool.create()
    try:
        return await tool.execute(iid, arguments)
    finally:
        await tool.release(iid)


async def server_pid(tools: dict[str, McpTool]) -> int:
    r = await call(tools["pid"])
    assert r.success, r.text
    return int(r.text)


def test_lists_tools_and_builds_schemas() -> None:
    async def test(tools: dict[str, McpTool]) -> None:
        assert sorted(tools) == NAMES
        fn = tools["add"].tool_schema["function"]
        assert fn["name"] == "add" and fn["description"] == "Add two numbers."
        assert fn["parameters"]["type"] == "object" and fn["parameters"]["required"] == ["a", "b"]
        assert fn["parameters"]["properties"]["a"]["type"] == "number"
        assert tools["pid"].tool_schema["function"]["parameters"]["properties"] == {}
        assert len({id(t.session) for t in tools.values()}) == 1, "tools of one server must share one session"
        assert len(server_children()) == 1
    run(test)


def test_include_selects_and_names_what_is_missing() -> None:
    async def go() -> None:
        tools = await mcp_tools_from_server(sys.executable, [SERVER], include=["echo"])
        assert list(tools) == ["echo"]
        await tools["echo"].close()
        with pytest.raises(ValueError, match=r"offers no tool \['nope'\].*'add'"):
            await mcp_tools_from_server(sys.executable, [SERVER], include=["echo", "nope"])
        assert server_children() == []
    asyncio.run(go())


def test_successful_calls_and_non_text_content() -> None:
    async def test(tools: dict[str, McpTool]) -> None:
        r = await call(tools["add"], a=2, b=40)
        assert r.success and float(r.text) == 42.0, r.text
        r = await call(tools["echo"], text="héllo\nworld")
        assert r.success and r.text == "héllo\nworld"
        r = await call(tools["picture"])  # the image travels as an image, decodable, not as a note
        assert r.success and r.text == "a red dot", r.text
        assert r.metrics["non_text_blocks"] == 0 and r.metrics["images"] == 1 and len(r.images) == 1
        from agent.vision import to_pil
        assert to_pil(r.images[0]).size[0] > 0
    run(test)


def test_every_content_kind_is_rendered_as_text() -> None:
    """Text resources are shown; binary content becomes a note naming what the model cannot see."""
    result = mcp_types.CallToolResult(content=[
        mcp_types.TextContent(type="text", text="first"),
        mcp_types.EmbeddedResource(type="resource", resource=mcp_types.TextResourceContents(uri="file:///a.txt",
                                                                                             text="inside")),
        mcp_types.EmbeddedResource(type="resource", resource=mcp_types.BlobResourceContents(uri="file:///b.bin",
                                                                                             blob="AAAA")),
        mcp_types.ResourceLink(type="resource_link", uri="file:///c", name="c"),
        mcp_types.AudioContent(type="audio", data="AAAAAAAA", mime_type="audio/wav")])
    text, hidden = render_content(result)
    assert text.splitlines() == [
        "first", "inside", "[resource file:///b.bin not shown: this tool passes only text to the model]",
        "[resource link file:///c not shown: this tool passes only text to the model]",
        "[audio (audio/wav, ~6 bytes) not shown: this tool passes only text to the model]"]
    assert hidden == 3
    structured_only = mcp_types.CallToolResult(content=[], structured_content={"answer": 42})
    assert render_content(structured_only) == ('{"answer": 42}', 0)


def test_tool_errors_are_observations() -> None:
    async def test(tools: dict[str, McpTool]) -> None:
        r = await call(tools["fail"], message="boom")
        assert not r.success and "fail tool refused: boom" in r.text and r.text.startswith("Error"), r.text
        r = await call(tools["add"], a="not a number", b=1)
        assert not r.success and "a" in r.text, r.text
        unknown = McpTool({"tool": "nosuch"}, {"type": "function", "function": {"name": "nosuch"}},
                          session=tools["add"].session)
        r = await call(unknown)
        assert not r.success and "nosuch" in r.text, r.text
        r = await call(tools["add"], a=1, b=1)
        assert r.success and float(r.text) == 2.0
        assert tools["add"].session.starts == 1, "a tool error must not restart the server"
    run(test)


def test_timeout_then_good_call_on_same_session() -> None:
    async def test(tools: dict[str, McpTool]) -> None:
        pid = await server_pid(tools)
        r = await call(tools["sleep"], seconds=60)
        assert not r.success and r.metrics["timeout"] and "did not answer within 0.5s" in r.text, r.text
        # the agent loop's own deadline cancels execute() from outside: the session must survive that too
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call(tools["sleep"], seconds=60), 0.2)
        r = await call(tools["add"], a=1, b=2)
        assert r.success and float(r.text) == 3.0, r.text
        assert await server_pid(tools) == pid and tools["add"].session.starts == 1

        async def none_sleeping() -> bool:
            return (await call(tools["sleeping"])).text == "0"
        await until(none_sleeping, "the server cancelled both abandoned calls")
    run(test, timeout_s=0.5)


def test_killed_server_is_restarted_by_next_call() -> None:
    async def test(tools: dict[str, McpTool]) -> None:
        session = tools["add"].session
        pid = await server_pid(tools)
        os.kill(pid, signal.SIGKILL)
        await until(lambda: not session.running, "the session notices the dead server")
        r = await call(tools["add"], a=5, b=5)
        assert r.success and float(r.text) == 10.0, r.text
        new_pid = await server_pid(tools)
        assert new_pid != pid and not alive(pid) and session.starts == 2
        assert server_children() == [new_pid]
    run(test)


def test_close_leaves_no_process_and_later_calls_fail_clearly() -> None:
    async def go() -> None:
        tools = await mcp_tools_from_server(sys.executable, [SERVER])
        pid = await server_pid(tools)
        await tools["echo"].close()
        await tools["echo"].close()  # idempotent
        assert not alive(pid) and server_children() == []
        r = await call(tools["add"], a=1, b=1)
        assert not r.success and "closed" in r.text, r.text
        assert server_children() == []

        # closed while still starting: the half-started server goes too
        tool = McpTool({"command": sys.executable, "args": [SERVER]}, tools["add"].tool_schema)
        pending = asyncio.create_task(call(tool, a=1, b=1))
        await until(lambda: len(server_children()) == 1, "the server process exists")
        await tool.close()
        assert server_children() == []
        assert not (await pending).success
    asyncio.run(go())


def test_event_loop_end_stops_server_and_next_loop_restarts_it() -> None:
    tool = McpTool({"command": sys.executable, "args": [SERVER], "tool": "add"},
                   {"type": "function", "function": {"name": "plus"}})
    assert asyncio.run(call(tool, a=1, b=2)).success
    assert server_children() == [], "asyncio.run's shutdown must stop the server even without close()"
    assert asyncio.run(call(tool, a=3, b=4)).text == "7.0"
    assert tool.session.starts == 2 and server_children() == []


def test_concurrent_calls_from_instances_share_one_server() -> None:
    async def test(tools: dict[str, McpTool]) -> None:
        meet, n = tools["meet"], 5
        ids = [await meet.create() for _ in range(n)]
        # `meet` answers only when all n calls are inside the server at once: serialized calls would time out
        results = await asyncio.gather(*[meet.execute(iid, {"key": "k", "n": n, "tag": f"t{i}"})
                                         for i, iid in enumerate(ids)])
        assert [r.text for r in results] == [f"t{i} met {n}" for i in range(n)]
        assert all(r.success for r in results)
        for iid in ids:
            await meet.release(iid)
        assert meet.instances == {} and meet.session.starts == 1 and len(server_children()) == 1
    run(test, timeout_s=20)


def test_concurrent_first_calls_start_one_server() -> None:
    async def go() -> None:
        tool = McpTool({"command": sys.executable, "args": [SERVER], "tool": "meet"},
                       {"type": "function", "function": {"name": "meet"}})
        try:
            results = await asyncio.gather(*[call(tool, key="first", n=3, tag=str(i)) for i in range(3)])
            assert all(r.success for r in results), [r.text for r in results]
            assert tool.session.starts == 1
        finally:
            await tool.close()
        assert server_children() == []
    asyncio.run(go())


def test_tools_yaml_entry_and_config_errors() -> None:
    tools = build_tools([{"class_name": "agent.tools.mcp.McpTool",
                          "config": {"command": sys.executable, "args": [SERVER], "tool": "echo", "timeout_s": 10},
                          "tool_schema": {"type": "function", "function": {"name": "say"}}}])

    async def go() -> None:
        try:
            r = await call(tools["say"], text="hi")
            assert r.success and r.text == "hi"
        finally:
            assert isinstance(tools["say"], McpTool)
            await tools["say"].close()
    asyncio.run(go())
    with pytest.raises(ToolConfigError, match="command"):
        build_tools([{"class_name": "agent.tools.mcp.McpTool", "config": {"args": [SERVER]},
                      "tool_schema": {"type": "function", "function": {"name": "x"}}}])
    bad = McpTool({"command": "switchyard-no-such-server"}, {"type": "function", "function": {"name": "x"}})
    r = asyncio.run(call(bad))
    assert not r.success and "switchyard-no-such-server" in r.text and "PATH" in r.text, r.text


def test_server_that_never_answers_hits_startup_timeout() -> None:
    marker = "switchyard-silent-server"
    tool = McpTool({"command": sys.executable, "args": ["-c", f"import sys; sys.stdin.read()  # {marker}"],
                    "startup_timeout_s": 0.5}, {"type": "function", "function": {"name": "x"}})

    async def go() -> None:
        try:
            r = await call(tool)
            assert not r.success and "within 0.5s" in r.text and "startup_timeout_s" in r.text, r.text
            assert server_children(marker) == [], "a server that failed to start must not be left running"
        finally:
            await tool.close()
    asyncio.run(go())


MCP_OF_VERIFIERS = "2.0.0"  # what verifiers 0.4 installs beside the project (its recipe's venv, README)


def test_the_declared_mcp_range_admits_what_verifiers_installs():
    """The project's mcp requirement admits the mcp verifiers 0.4 brings (its recipe's venv then
    installs without a conflict) and the one installed here; this suite passes on both."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    (mcp,) = [Requirement(d) for d in deps if Requirement(d).name == "mcp"]
    assert mcp.specifier.contains(MCP_OF_VERIFIERS), f"pyproject declares {mcp}, verifiers 0.4 installs mcp 2.0"
    assert mcp.specifier.contains(importlib.metadata.version("mcp"))
