"""The typed config described from its own source: `python launch/train.py --help [SECTION]` lists
every section and key with its default and the one line of meaning its comment (or its section's
docstring) already gives, and a key that is not in the tree is answered with the closest ones."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
from typing import Any, Iterator

WIDTH = 110  # the longest meaning shown on one line
ALIASES = {"trainer.logger": "trainer.loggers", "report_to": "trainer.loggers", "trainer.report_to": "trainer.loggers",
           "trainer.logging": "trainer.loggers"}  # other frameworks' names for a key of this tree


def _comments(cls: type) -> dict[str, str]:
    """Each field of dataclass `cls` and its comment: the one on its line, else the block of comment
    lines just above it (a block above several fields belongs to each of them)."""
    try:
        lines, start = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    found: dict[str, str] = {}
    block: list[str] = []
    last = ""  # the field before, whose comment a block right below its line continues
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        name, above, i = node.target.id, [], node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        raw = [lines[j].strip() for j in range(i + 1, node.lineno - 1)]
        go_on = [r.lstrip("#").strip() for r in raw if r.startswith("#  ")]  # aligned under the line above's comment
        if go_on and last:
            found[last] += " " + " ".join(go_on)
        above = [r.lstrip("#").strip() for r in raw if not r.startswith("#  ")]
        if above:
            block = above
        elif not (block and name in " ".join(block)):  # a block names the later fields it also covers
            block = []
        code = lines[node.lineno - 1]
        inline = code.split("  # ", 1)[1].strip() if "  # " in code else ""
        found[name] = inline or " ".join(block)
        last = name if inline else ""
    return found


def _meaning(text: str) -> str:
    return text if len(text) <= WIDTH else text[:WIDTH - 3].rsplit(" ", 1)[0] + " ..."


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    text = repr(value) if isinstance(value, (list, dict, tuple)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def entries(node: Any, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(dotted key, default, meaning) of every key under dataclass instance `node`, nested sections
    flattened (`data.curriculum.mode`)."""
    notes: dict[str, str] = {}
    for cls in reversed(type(node).__mro__):  # a section's inherited keys keep their base's comments
        if dataclasses.is_dataclass(cls):
            notes.update({k: v for k, v in _comments(cls).items() if v or k not in notes})
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from entries(value, key + ".")
        else:
            yield key, value, notes.get(f.name, "")


def sections(cfg: Any) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def describe(cfg: Any, only: str | None = None) -> str:
    """The help text of config `cfg` (its typed defaults), or of its section `only`."""
    parts = sections(cfg)
    if only is not None and only not in parts:
        raise KeyError(unknown(cfg, only))
    out = []
    for name, section in parts.items():
        if only is not None and name != only:
            continue
        doc = inspect.getdoc(type(section)) or ""
        head = doc.split("\n\n")[0].replace("\n", " ")
        out.append(f"{name}:" + (f"  {_meaning(head)}" if head and not head.startswith(type(section).__name__) else ""))
        rows = list(entries(section, f"{name}."))
        width = max(len(f"{k}={_show(v)}") for k, v, _ in rows)
        for key, value, meaning in rows:
            setting = f"{key}={_show(value)}"
            out.append(f"  {setting:<{width}}  {_meaning(meaning)}".rstrip())
        out.append("")
    return "\n".join(out)


def keys(cfg: Any) -> list[str]:
    return [k for name, section in sections(cfg).items() for k, _, _ in entries(section, f"{name}.")]


def unknown(cfg: Any, key: str) -> str:
    """What to say of `key`, which is not in the config tree: the key it is in this tree, or the closest ones."""
    if key in ALIASES:
        return f"{key} is {ALIASES[key]} here (e.g. {ALIASES[key]}=[console,wandb])"
    names = list(sections(cfg)) if "." not in key else keys(cfg)
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    if not close and "." in key:  # a key under a misspelled section, or a section's key misspelled
        section, _, rest = key.partition(".")
        close = [k for k in keys(cfg) if k.endswith("." + rest)][:3] or difflib.get_close_matches(
            section, list(sections(cfg)), n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else f"; the sections are {', '.join(sections(cfg))}"
    return f"{key!r} is not a {'key' if '.' in key else 'section'} of the config{hint} (python launch/train.py --help)"


def help_main(cfg: Any, args: list[str], doc: str) -> int:
    """`launch/train.py --help [SECTION]`: the entry point's `doc` and every section and key of config
    `cfg` (the typed defaults), or one section."""
    import sys

    section = args[0] if args else None
    try:
        text = describe(cfg, section)  # first: a section that is not there says so, alone
    except KeyError as e:
        print(f"config error: {e.args[0]}", file=sys.stderr)
        return 2
    print(text if section else doc + "\nThe config, `key=default  meaning` (launch/config.py; with no config file "
          "the demo's launch/configs/cpu_demo.yaml sets some of them; `--help SECTION` shows one section):\n\n" + text)
    return 0
