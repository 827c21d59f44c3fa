"""Tool classes written to verl's tool contract run as they are, without verl installed.

verl's contract (its `BaseTool`): `__init__(config, tool_schema)` where the schema is an object
with attribute access (`tool_schema.function.name`); `create(instance_id=None, **kwargs)` returns
`(instance_id, response)` (older versions: the id alone); `execute(instance_id, parameters,
**kwargs)` returns `(response, step_reward, metrics)`; `calc_reward(instance_id, **kwargs)` and
`release(instance_id, **kwargs)`. A response is anything with a `text` (verl's ToolResponse), a
mapping with "text", or a str; its `image` (one image or a list, as verl's ToolResponse holds
them) becomes the response's images.

A class named in tools.yaml that does not subclass switchyard's `BaseTool` but has those four
methods is wrapped in `VerlTool`: the row's `tools_kwargs.<name>` blocks reach their methods
(`create_kwargs`, `execute_kwargs`, `calc_reward_kwargs`, `release_kwargs`), and each call's step
reward travels on the `ToolResponse` (`reward`), which the tool agent sums into the trajectory's
reward as its own part (`tool_step`).
"""

from __future__ import annotations

import inspect
from typing import Any

from agent.tools.base import BaseTool, ToolResponse

METHODS = ("create", "execute", "calc_reward", "release")


def is_verl_tool_class(cls: Any) -> bool:
    """A class with verl's four tool methods that is not one of ours."""
    return (isinstance(cls, type) and not issubclass(cls, BaseTool)
            and all(callable(getattr(cls, m, None)) for m in METHODS))


class _Attr(dict):
    """A dict whose keys also read as attributes, nested: what verl's pydantic schema offers."""

    def __getattr__(self, key: str) -> Any:
        try:
            value = self[key]
        except KeyError:
            raise AttributeError(key) from None
        return _Attr(value) if isinstance(value, dict) else value

    def model_dump(self, **_: Any) -> dict[str, Any]:  # pydantic's name, which verl tools call
        return dict(self)


def response_text(resp: Any) -> str:
    if isinstance(resp, str):
        return resp
    if isinstance(resp, dict):
        return str(resp.get("text") or "")
    return str(getattr(resp, "text", None) or "")


def response_images(resp: Any) -> list[Any]:
    found = resp.get("image") if isinstance(resp, dict) else getattr(resp, "image", None)
    if found is None:
        return []
    return list(found) if isinstance(found, (list, tuple)) else [found]


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class VerlTool(BaseTool):
    """Runs an instance of a verl-contract class behind switchyard's BaseTool."""

    def __init__(self, cls: type, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        super().__init__(config, tool_schema)
        self.inner = cls(dict(config or {}), _Attr(tool_schema))
        self.loop_bound = True  # its own coroutines: run on the loop (a blocking step moves it to a thread)

    def bind_row_kwargs(self, instance_id: str, kwargs: dict[str, Any]) -> None:
        """The row's `tools_kwargs.<name>` block, for execute/calc_reward/release of this instance."""
        self.instances.setdefault(instance_id, {})["row_kwargs"] = dict(kwargs or {})

    def _kwargs(self, instance_id: str, block: str) -> dict[str, Any]:
        return dict((self.instances.get(instance_id, {}).get("row_kwargs") or {}).get(block) or {})

    async def create(self, instance_id: str | None = None, **create_kwargs: Any) -> str:
        got = await _maybe(self.inner.create(instance_id, **create_kwargs))
        iid = got[0] if isinstance(got, tuple) else got
        iid = str(iid if iid is not None else instance_id)
        self.instances.setdefault(iid, {})
        return iid

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        got = await _maybe(self.inner.execute(instance_id, arguments, **self._kwargs(instance_id, "execute_kwargs")))
        resp, reward, metrics = (tuple(got) + (0.0, {}))[:3] if isinstance(got, tuple) else (got, 0.0, {})
        numbers = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float, bool))}
        return ToolResponse(response_text(resp), metrics=numbers, reward=float(reward or 0.0),
                            images=response_images(resp))

    async def calc_reward(self, instance_id: str) -> float:
        return float(await _maybe(self.inner.calc_reward(instance_id, **self._kwargs(instance_id, "calc_reward_kwargs")))
                     or 0.0)

    async def release(self, instance_id: str) -> None:
        try:
            await _maybe(self.inner.release(instance_id, **self._kwargs(instance_id, "release_kwargs")))
        finally:
            self.instances.pop(instance_id, None)
