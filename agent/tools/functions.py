"""Plain Python functions as tools: the OpenAI schema comes from the signature and the docstring.

    functions:                        # in a tools.yaml, beside (or instead of) `tools:`
      - source: my_tools.py           # a file (relative to the yaml), or a module: mypkg.tools
        names: [add, word_count]      # optional: default every public function defined there
        config: {timeout_s: 5}        # optional: the same keys a tool's config takes

A function needs a docstring (its first paragraph is the description the model reads) and a type
hint on every parameter; parameters without a default are required. A Google-style `Args:`
section describes the parameters. Supported hints: str, int, float, bool, list[...], dict,
Literal[...] (an enum), Optional[X] / X | None. The function may be sync or async; what it
returns becomes the tool message (a str as is, a `ToolResponse` as it is, so a function can give
the call a step reward, anything else as JSON). Arguments the schema
does not allow, or missing required ones, come back to the model as a failed call.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable

from agent.tools.base import BaseTool, ToolResponse

_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON:
        return {"type": _JSON[hint]}
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        out: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in _JSON:
            out["type"] = _JSON[next(iter(kinds))]
        return out
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        return _json_type(next(a for a in args if a is not type(None)), where)  # Optional[X]: X, not required
    if origin in (list, tuple, set, frozenset):
        out = {"type": "array"}
        if args and args[0] is not Ellipsis:
            out["items"] = _json_type(args[0], where)
        return out
    if origin is dict:
        return {"type": "object"}
    raise ValueError(f"{where} has type hint {hint!r}; use str, int, float, bool, list[...], dict, Literal[...] "
                     "or Optional[...] of these")


def _doc_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {parameter: description from an `Args:` section})."""
    summary = doc.split("\n\n", 1)[0].strip().replace("\n", " ")
    args: dict[str, str] = {}
    section = re.search(r"^\s*(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*(?:\n|$))+)", doc, re.M)
    if section:
        lines = [ln for ln in section.group(1).splitlines() if ln.strip()]
        indent = len(lines[0]) - len(lines[0].lstrip()) if lines else 0  # a parameter line's indentation
        current = None
        for line in lines:
            m = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
            if m and len(line) - len(line.lstrip()) == indent:
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif current is not None:  # a continuation line of the last parameter
                args[current] = f"{args[current]} {line.strip()}".strip()
    return summary, args


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI function-tool schema of `fn`; a ValueError naming what is missing."""
    name = fn.__name__
    doc = inspect.getdoc(fn) or ""
    summary, arg_docs = _doc_parts(doc)
    if not summary:
        raise ValueError(f"function {name!r} has no docstring; its first paragraph is the description the model "
                         "reads, so write one")
    hints = typing.get_type_hints(fn)
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, p in inspect.signature(fn).parameters.items():
        where = f"parameter {pname!r} of function {name!r}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ValueError(f"{where} is {p.kind.description}; a tool takes named arguments only")
        if pname not in hints:
            raise ValueError(f"{where} has no type hint; the schema is built from the hints")
        props[pname] = _json_type(hints[pname], where)
        if pname in arg_docs:
            props[pname]["description"] = arg_docs[pname]
        if p.default is p.empty:
            required.append(pname)
    return {"type": "function", "function": {"name": name, "description": summary,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


class FunctionTool(BaseTool):
    """A tool that calls one plain function with the model's arguments."""

    def __init__(self, fn: Callable[..., Any], config: dict[str, Any] | None = None) -> None:
        super().__init__(config or {}, function_schema(fn))
        self.fn = fn
        params = self.tool_schema["function"]["parameters"]
        self._allowed, self._required = set(params["properties"]), list(params["required"])

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResponse:
        unknown = sorted(set(arguments) - self._allowed)
        missing = [a for a in self._required if a not in arguments]
        if unknown or missing:
            return ToolResponse(f"Error: {self.name}() " + "; ".join(
                ([f"takes no argument(s) {unknown}"] if unknown else []) +
                ([f"is missing required argument(s) {missing}"] if missing else [])) +
                f"; its arguments are {sorted(self._allowed)}", success=False, metrics={"invalid": True})
        result = self.fn(**arguments)
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, ToolResponse):
            return result
        return ToolResponse(result if isinstance(result, str) else json.dumps(result, default=str))


def _module(source: str, base: Path | None) -> types.ModuleType:
    if source.endswith(".py"):
        path = Path(source) if Path(source).is_absolute() or base is None else base / source
        if not path.exists():
            raise ValueError(f"function tools file {str(path)!r} does not exist; fix `source`")
        name = f"switchyard_function_tools_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # so dataclasses and pickling inside it find their module
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(source)
    except ImportError as e:
        raise ValueError(f"cannot import function tools module {source!r} ({e}); give a .py file or an importable "
                         "module") from e


def function_tools(source: str, names: list[str] | None = None, config: dict[str, Any] | None = None,
                   base: Path | None = None) -> list[FunctionTool]:
    """Tools from the functions of a file or module: `names`, or every public function defined there."""
    module = _module(source, base)
    if names:
        missing = [n for n in names if not inspect.isfunction(getattr(module, n, None))]
        if missing:
            found = sorted(n for n, f in vars(module).items() if inspect.isfunction(f) and not n.startswith("_"))
            raise ValueError(f"{source} has no function(s) {missing}; it defines {found}")
        fns = [getattr(module, n) for n in names]
    else:
        fns = [f for n, f in vars(module).items()
               if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("_")]
        if not fns:
            raise ValueError(f"{source} defines no public function to turn into a tool")
    return [FunctionTool(fn, config) for fn in fns]
