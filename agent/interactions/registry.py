"""Load interactions from an interaction.yaml in verl's format:

    interaction:
      - name: gsm8k                     # optional; defaults to the class's default_name
        class_name: agent.interactions.gsm8k.Gsm8kInteraction
        config: {max_retries: 2}

Rows pick one with `interaction_kwargs.name`. A class may subclass `BaseInteraction` or be written
to verl's interaction contract (agent/interactions/verl_compat.py). A bad entry fails loudly at start-up, naming the
entry, rather than mid-rollout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.dotted import import_dotted
from agent.interactions.base import BaseInteraction
from agent.interactions.verl_compat import METHODS, VerlInteraction, is_verl_interaction_class
from agent.yaml_file import read_yaml_map
from engines.config_checks import known_keys

ENTRY_KEYS = ("name", "class_name", "config")


class InteractionConfigError(ValueError):
    """An interaction.yaml entry that cannot be turned into an interaction; the message names the entry."""


def load_interactions(path: str | Path) -> dict[str, BaseInteraction]:
    """Read an interaction.yaml and build every interaction in it, keyed by name."""
    expect = "a top-level `interaction:` list of entries"
    data = read_yaml_map(path, "interaction", InteractionConfigError, expect)
    if not isinstance(data.get("interaction"), list):
        raise InteractionConfigError(f"{path}: expected {expect}, got {sorted(data)}")
    return build_interactions(data["interaction"], source=str(path))


def build_interactions(entries: list[dict[str, Any]], source: str = "<interaction>") -> dict[str, BaseInteraction]:
    """Build interactions from already-parsed entries (what the yaml's `interaction:` list holds)."""
    built: dict[str, BaseInteraction] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: interaction[{i}]"
        if not isinstance(entry, dict):
            raise InteractionConfigError(f"{where} is {entry!r}; expected a mapping with name, class_name, config")
        known_keys(where, entry, ENTRY_KEYS, InteractionConfigError)
        dotted = entry.get("class_name")
        if not isinstance(dotted, str) or not dotted:
            raise InteractionConfigError(f"{where} has no class_name; add e.g. "
                                         "`class_name: agent.interactions.gsm8k.Gsm8kInteraction`")
        where = f"{where} ({dotted})"
        cls = _import_class(dotted, where)
        verl = is_verl_interaction_class(cls)
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise InteractionConfigError(f"{where}: config is {config!r}; expected a mapping (or leave it out)")
        name = entry.get("name") or config.get("name") or (VerlInteraction if verl else cls).default_name
        if not isinstance(name, str):
            raise InteractionConfigError(f"{where}: name {name!r} must be a string")
        if name in built:
            raise InteractionConfigError(f"{where}: duplicate interaction name {name!r} (already used by an earlier "
                                         "entry); give each entry a unique `name:`")
        try:
            conf = {**config, "name": name}
            built[name] = VerlInteraction(cls, conf) if verl else cls(conf)
        except Exception as e:
            raise InteractionConfigError(f"{where}: constructing interaction {name!r} failed: {e}") from e
    return built


def _import_class(dotted: str, where: str) -> type:
    """A BaseInteraction subclass, or a class written to verl's interaction contract."""
    try:
        cls = import_dotted(dotted, "class_name")
    except ValueError as e:
        raise InteractionConfigError(f"{where}: {e}") from e
    if is_verl_interaction_class(cls) or (isinstance(cls, type) and issubclass(cls, BaseInteraction)):
        return cls
    raise InteractionConfigError(f"{where}: {dotted!r} is not a subclass of agent.interactions.BaseInteraction "
                                 f"and lacks verl's interaction methods ({', '.join(METHODS)})")
