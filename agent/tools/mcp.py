"""Tools served by a stdio MCP server (Model Context Protocol), e.g. one written with MCPServer.

Starting a server costs about half a second, more than most tool calls, so one `McpSession`
(server subprocess + MCP client session) is shared by all trajectories, whose concurrent calls
are multiplexed over it by JSON-RPC request id. It starts on first use, the next call after the
server died restarts it, and `close()` stops it. A background task owns it because the SDK's
transport must be opened and closed in one task, which no trajectory's task can promise.
Per-trajectory state stays in BaseTool instances (the server's own state is shared).

    tools:
      - class_name: agent.tools.mcp.McpTool
        config: {command: python, args: [server.py], env: {KEY: value}, tool: add, timeout_s: 30}
        tool_schema: {type: function, function: {name: add, description: ..., parameters: {...}}}

Each yaml entry gets its own server; `mcp_tools_from_server` builds one tool per server tool,
schemas taken from the server's listing, all sharing one process. Image content becomes the
response's images (a vision-language policy sees them; a text-only one gets a note); audio and
binary resources become a bracketed note saying what was left out.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import anyio
import anyio.abc
import mcp.types as mcp_types
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from agent.tools.base import BaseTool, ToolResponse

log = logging.getLogger(__name__)
_CLIENT_INFO = mcp_types.Implementation(name="switchyard", version="0")


class McpStartError(RuntimeError):
    """The MCP server could not be started or did not complete the handshake."""


@dataclass
class _Connection:
    """One server process's lifetime: `stop` is set by close() or when its stdout hits EOF."""

    loop: asyncio.AbstractEventLoop
    ready: asyncio.Future  # -> the initialized ClientSession, or the start-up error
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class _EofWatch(anyio.abc.ObjectReceiveStream):
    """The transport's read stream, passed through, that sets `eof` when the server's stdout
    ends: that is how a crashed or killed server is noticed before the next call is sent."""

    def __init__(self, inner: Any, eof: asyncio.Event) -> None:
        self._inner, self._eof = inner, eof

    last_context = property(lambda self: getattr(self._inner, "last_context", None))

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._eof.set()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()


class McpSession:
    """A stdio MCP server shared by tools: started on first use, restarted after it died.

    `env` is added to the SDK's minimal inherited environment (HOME, PATH, USER, ...), not to
    the whole parent environment, so secrets in the trainer's environment do not leak into
    third-party servers. The server's stderr goes to ours (redirect it in `command` if needed).
    """

    def __init__(self, command: str, args: Iterable[str] = (), env: dict[str, Any] | None = None,
                 cwd: str | None = None, startup_timeout_s: float = 30.0) -> None:
        if not isinstance(command, str) or not command:
            raise ValueError(f"MCP server command is {command!r}; set `command` to the server executable, "
                             "e.g. `command: python, args: [server.py]` or `command: npx, args: [...]`")
        if isinstance(args, str) or (env is not None and not isinstance(env, dict)):
            raise ValueError(f"MCP server args={args!r}, env={env!r}; args must be a list (e.g. [server.py, --flag]) "
                             "and env a mapping of variable name to value")
        self.command, self.args = command, [str(a) for a in args]
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.cwd, self.startup_timeout_s = cwd, float(startup_timeout_s)
        self._conn: _Connection | None = None
        self._owners: set[asyncio.Task] = set()
        self._closed = False
        self.starts = 0  # how many server processes this session has started (restarts show here)

    @property
    def command_line(self) -> str:
        return " ".join([self.command, *self.args])

    @property
    def running(self) -> bool:
        """True while a started server is connected (False before first use and after it died)."""
        c = self._conn
        return c is not None and c.ready.done() and c.ready.exception() is None and not c.stop.is_set()

    async def client(self) -> ClientSession:
        """The live client session, starting the server if there is none or it died."""
        if self._closed:
            raise McpStartError(f"MCP session for {self.command_line!r} is closed; build a new tool or session "
                                "instead of calling one after close()")
        loop = asyncio.get_running_loop()
        conn = self._conn
        # a connection from another (finished) event loop is unusable: asyncio.run's shutdown of
        # that loop already cancelled its owner task, which stopped the server
        if conn is None or conn.loop is not loop or conn.stop.is_set() or \
                (conn.ready.done() and conn.ready.exception() is not None):
            conn = self._conn = _Connection(loop, ready=loop.create_future())
            # an empty context: the server is shared by every trajectory, not the one that started it
            conn.task = contextvars.Context().run(loop.create_task, self._own(conn),
                                                  name=f"mcp-session {self.command_line}")
            self._owners = {t for t in self._owners if not t.done() and t.get_loop() is loop} | {conn.task}
            self.starts += 1
        # shielded: a caller that gives up (timeout) must not abort a start-up others wait for
        return await asyncio.shield(conn.ready)

    async def _own(self, conn: _Connection) -> None:
        """Open the transport and session, publish the session, hold both until `stop`."""
        params = StdioServerParameters(command=self.command, args=self.args, env=self.env, cwd=self.cwd)
        try:
            async with stdio_client(params, errlog=_stderr()) as (read, write):
                async with ClientSession(_EofWatch(read, conn.stop), write, client_info=_CLIENT_INFO) as session:
                    with anyio.fail_after(self.startup_timeout_s):
                        await session.initialize()
                    conn.ready.set_result(session)
                    await conn.stop.wait()
        except BaseException as e:  # reported to the callers waiting for `ready`
            if not conn.ready.done():
                conn.ready.set_exception(self._start_error(_root(e)))
            elif not conn.stop.is_set():
                log.warning("MCP server %r: session ended: %r", self.command_line, e)
            if not isinstance(e, Exception):
                raise  # cancellation (close(), or the event loop ending) and interrupts go on
        finally:
            conn.stop.set()

    def _start_error(self, e: BaseException) -> McpStartError:
        """Why the server did not start, and what to change."""
        if isinstance(e, TimeoutError):  # before OSError, its base class
            why = (f"no answer to `initialize` within {self.startup_timeout_s:g}s; raise startup_timeout_s "
                   "if the server is slow to start")
        elif isinstance(e, OSError):
            why = f"{e}; check that `command` {self.command!r} is installed and on PATH (or give its full path)"
        elif isinstance(e, asyncio.CancelledError):
            why = "it was stopped while starting (close(), or the end of the event loop)"
        elif isinstance(e, MCPError) and e.code == mcp_types.CONNECTION_CLOSED:
            why = "it exited before answering `initialize`; run the command by hand to see its error"
        else:
            why = f"{type(e).__name__}: {e}"
        return McpStartError(f"MCP server {self.command_line!r} did not start: {why}")

    async def list_tools(self) -> list[mcp_types.Tool]:
        """Every tool the server offers, following pagination."""
        session, tools, cursor = await self.client(), [], None
        for _ in range(100):  # a server that pages forever must not hang start-up
            page = await session.list_tools(params=mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None)
            tools += page.tools
            if not (cursor := page.next_cursor):
                break
        return tools

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> mcp_types.CallToolResult:
        """One tools/call; callers bound it with their own deadline (cancelling sends the server
        a cancel notification, and the session stays usable)."""
        return await (await self.client()).call_tool(name, arguments)

    async def close(self) -> None:
        """Stop the server (stdin closed, then SIGTERM/SIGKILL to its process group) and wait for
        it; later calls fail. Idempotent."""
        self._closed = True
        loop = asyncio.get_running_loop()
        conn = self._conn
        if conn is not None:
            conn.stop.set()
            if conn.task is not None and not conn.ready.done():
                conn.task.cancel()  # still starting: do not wait for the handshake to finish first
        owners = [t for t in self._owners if t.get_loop() is loop]
        self._owners.clear()
        await asyncio.gather(*owners, return_exceptions=True)


def _stderr() -> Any:
    """Our stderr for the server's, if it is a real file (not, e.g., a capturing wrapper)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def _root(e: BaseException) -> BaseException:
    """The single cause inside (nested) exception groups, which anyio task groups raise."""
    while len(getattr(e, "exceptions", ())) == 1:
        e = e.exceptions[0]  # type: ignore[attr-defined]
    return e


def result_images(result: mcp_types.CallToolResult) -> list[bytes]:
    """The encoded images (PNG, JPEG, ...) of a tool result's image blocks, in order."""
    import base64

    return [base64.b64decode(block.data) for block in result.content if getattr(block, "type", "") == "image"]


def render_content(result: mcp_types.CallToolResult) -> tuple[str, int]:
    """The text the model sees for a tool result, and how many blocks it cannot see (images are
    not counted: they travel as images, `result_images`)."""
    parts, hidden = [], 0
    for block in result.content:
        kind, resource = getattr(block, "type", "?"), getattr(block, "resource", None)
        if kind == "text" or isinstance(getattr(resource, "text", None), str):  # text, or a text resource
            parts.append(block.text if kind == "text" else resource.text)
            continue
        if kind == "image":
            continue
        hidden += 1
        if kind == "audio":
            what = f"{kind} ({block.mime_type}, ~{len(block.data) * 3 // 4} bytes)"
        elif kind in ("resource_link", "resource"):
            what = f"{kind.replace('_', ' ')} {getattr(block, 'uri', None) or getattr(resource, 'uri', '?')}"
        else:
            what = f"{kind} content"
        parts.append(f"[{what} not shown: this tool passes only text to the model]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts), hidden


class McpTool(BaseTool):
    """One MCP server tool as a model-facing tool.

    Config: command, args, env, cwd (how to start the server), tool (the server's name for it;
    default: the schema's function name), timeout_s per call (30), startup_timeout_s (30),
    max_output_chars (8192). Pass `session=` to share one server between tools.
    """

    loop_bound = True  # the MCP session lives on the worker's event loop (agent/tools/guard.py)

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any], session: McpSession | None = None) -> None:
        super().__init__(config, tool_schema)
        c = self.config
        self.tool, self.timeout_s = str(c.get("tool") or self.name), float(c.get("timeout_s", 30.0))
        self.max_output_chars = int(c.get("max_output_chars", 8192))
        if self.timeout_s <= 0:
            raise ValueError(f"McpTool {self.name!r}: timeout_s={self.timeout_s}; it must be > 0 seconds")
        self.session = session or McpSession(c.get("command"), c.get("args") or (), c.get("env"), c.get("cwd"),
                                             float(c.get("startup_timeout_s", 30.0)))

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        self.state(instance_id)
        if not isinstance(arguments, dict):
            return ToolResponse(f"Error: arguments for {self.name!r} must be a JSON object, got "
                                f"{type(arguments).__name__}", success=False, metrics={"invalid": True})
        start = time.monotonic()
        try:
            result = await asyncio.wait_for(self.session.call_tool(self.tool, arguments), self.timeout_s)
        except Exception as e:  # every failure is an observation, never a crashed trajectory
            timeout = isinstance(e, asyncio.TimeoutError)
            return ToolResponse(self._failure(e), success=False,
                                metrics={"timeout": timeout, "wall_s": time.monotonic() - start})
        text, hidden = render_content(result)
        images = result_images(result)
        if result.is_error and not text.lower().startswith("error"):
            text = f"Error from MCP tool {self.tool!r}: {text or 'no details given'}"
        elif not text:
            text = "(the tool returned an image)" if images else "(the tool returned no content)"
        truncated = len(text) > self.max_output_chars
        if truncated:
            text = (text[: self.max_output_chars]
                    + f"\n...[output truncated: {len(text)} characters, showing the first {self.max_output_chars}]")
        return ToolResponse(text, success=not result.is_error, metrics={
            "timeout": False, "wall_s": time.monotonic() - start, "non_text_blocks": hidden, "truncated": truncated,
            "images": len(images)}, images=images)

    def _failure(self, e: Exception) -> str:
        """The observation for a call that produced no result."""
        if isinstance(e, asyncio.TimeoutError):
            what = "answer" if self.session.running else "start (the MCP server was still starting)"
            return (f"Error: MCP tool {self.tool!r} did not {what} within {self.timeout_s:g}s and was cancelled; "
                    "raise timeout_s in the tool config if it needs longer")
        if isinstance(e, McpStartError):
            return f"Error: {e}"
        if isinstance(e, MCPError):
            return (f"Error: the MCP server {self.session.command_line!r} exited during the call to {self.tool!r}; "
                    "it is restarted on the next call" if e.code == mcp_types.CONNECTION_CLOSED else
                    f"Error: the MCP server refused the call to {self.tool!r}: {e} (code {e.code})")
        return f"Error: calling MCP tool {self.tool!r} failed: {type(e).__name__}: {e}"

    async def close(self) -> None:
        """Stop this tool's server; tools sharing the session (mcp_tools_from_server) stop with it."""
        await self.session.close()


def schema_from_mcp(tool: mcp_types.Tool) -> dict[str, Any]:
    """An OpenAI function-tool schema from an MCP tool listing entry."""
    params = dict(tool.input_schema or {})
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": params}}


async def mcp_tools_from_server(command: str, args: Iterable[str] = (), env: dict[str, Any] | None = None, *,
                                cwd: str | None = None, include: Iterable[str] | None = None,
                                startup_timeout_s: float = 30.0, **tool_config: Any) -> dict[str, McpTool]:
    """Start the server, list its tools, and build one McpTool per tool (keyed by name) with the
    schema the server declares, so nobody writes schemas by hand. All share one session: close
    one of them (or `.session`) once at shutdown. `include` keeps only the named tools;
    `tool_config` is McpTool config for every tool (timeout_s, max_output_chars)."""
    session = McpSession(command, args, env, cwd, startup_timeout_s)
    try:
        listed = {t.name: t for t in await session.list_tools()}
        wanted = list(listed) if include is None else list(include)
        missing = [n for n in wanted if n not in listed]
        if missing:
            raise ValueError(f"MCP server {session.command_line!r} offers no tool {missing}; "
                             f"it offers {sorted(listed)}; fix `include`")
    except BaseException:
        await session.close()
        raise
    return {n: McpTool({**tool_config, "tool": n}, schema_from_mcp(listed[n]), session=session) for n in wanted}
