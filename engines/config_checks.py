"""The checks every config section shares, so each says a bad value the same way: the section
and key, the value, and what to give instead. Every config dataclass of the tree (launch/config.py
and the sections it holds: engines, rollout, agent loops, sampling) uses these."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def positive(section: str, obj: Any, *names: str, error: type[Exception] = ValueError) -> None:
    """Each of `names` on `obj` must be an integer >= 1."""
    for name in names:
        value = getattr(obj, name)
        if value is None or value < 1:
            raise error(f"{section}.{name}={value!r} must be a positive integer")


def choice(section: str, name: str, value: Any, allowed: tuple[str, ...] | list[str],
           error: type[Exception] = ValueError) -> None:
    """`value` must be one of `allowed`."""
    if value not in allowed:
        raise error(f"{section}.{name}={value!r} is not allowed; choose one of {list(allowed)}")


def known_keys(section: str, given: Mapping[str, Any], allowed: Any, error: type[Exception] = ValueError) -> None:
    """Every key of `given` must be one of `allowed` (names, or a dataclass whose fields they are):
    an unknown key is a typo that would silently leave a setting at its default."""
    names = [f.name for f in fields(allowed)] if hasattr(allowed, "__dataclass_fields__") else list(allowed)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise error(f"{section}: unknown key(s) {unknown}; allowed: {names}")


def from_mapping(cls: type[T], given: Mapping[str, Any], section: str) -> T:
    """The dataclass `cls` built from a config mapping whose keys must all be its fields."""
    known_keys(section, given, cls)
    return cls(**given)
