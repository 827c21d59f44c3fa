"""Resolve "package.module.Name" strings from config files to the objects they name.

Agent loops, tools, interactions and LangGraph factories are all chosen by dotted path in
user config, so a typo must fail at start-up with a message naming the path and the fix,
not deep inside a rollout. Callers wrap the ValueError in their own error type and check
what kind of object they got (a BaseTool subclass, a callable, ...).
"""

from __future__ import annotations

import importlib
from typing import Any


def import_dotted(path: str, what: str) -> Any:
    """The object `path` ("package.module.Name") names; `what` is the config field it came from,
    used in the message. Raises ValueError (chained to the ImportError, if any) when the path has
    no module part, the module cannot be imported, or the module lacks the attribute."""
    module_name, _, attr = str(path).rpartition(".")
    if not module_name:
        raise ValueError(f"{what} {path!r} is not a dotted path; write it as package.module.Name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} for {what} {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}; check {what} {path!r}") from None


def import_class(path: str, base: type, what: str) -> type:
    """The class `path` names, which must subclass `base`; ValueError otherwise."""
    cls = import_dotted(path, what)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{path!r} is not a {base.__name__}: not a subclass of {base.__module__}.{base.__qualname__}")
    return cls
