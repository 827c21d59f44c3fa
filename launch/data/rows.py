"""Dataset rows in verl's format: load them unchanged, check them before any model loads, build
new ones for tool_agent, and stream them in a seeded order a resumed run can continue exactly.

A row is one dict (see the README's "Agent loops"):

    {"data_source": "openai/gsm8k", "agent_name": "tool_agent",
     "prompt": [{"role": "system", "content": ...}, {"role": "user", "content": ...}],
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"tools": ["calculator"], "tools_kwargs": {"calculator": {"create_kwargs": {...}}}},
     "interaction_kwargs": {"name": "gsm8k", "ground_truth": "72"}}        # optional

Rows are handed to the agent loops as they are, so datasets prepared for verl work here and a
row written by this project reads the same in verl.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping, Sequence

MESSAGE_ROLES = ("system", "user", "assistant", "tool")
FORMATS = (".jsonl", ".json", ".parquet")


class RowError(ValueError):
    """Rows that the loops would fail on mid-rollout; the message names each row index and key."""


def _suffix(path: Path) -> str:
    if path.suffix not in FORMATS:
        raise ValueError(f"{str(path)!r}: unknown dataset format {path.suffix!r}; use one of {list(FORMATS)}")
    return path.suffix


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ImportError("reading or writing .parquet rows needs pyarrow, which is not installed; "
                          "`pip install pyarrow`, or convert the data to .jsonl") from None
    return pyarrow


def _drop_nulls(value: Any) -> Any:
    """Parquet keeps one schema per file, so a key that only some rows (or messages) have comes
    back as null in the others. Dropping those nulls makes a row read back as it was written."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def load_rows(path: str) -> list[dict[str, Any]]:
    """All rows of a `.jsonl`, `.json` (a list of rows) or `.parquet` file, unchanged."""
    p = Path(path).expanduser()
    kind = _suffix(p)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {str(p)!r} does not exist; fix the path (or use the built-in "
                                "'arithmetic' task, which needs no file)")
    if kind == ".parquet":
        rows = [_drop_nulls(r) for r in _pyarrow().parquet.read_table(p).to_pylist()]
    elif kind == ".json":
        rows = json.loads(p.read_text())
        if not isinstance(rows, list):
            raise RowError(f"{p}: a .json dataset must hold a list of rows, got {type(rows).__name__}; "
                           "use .jsonl for one row per line")
    else:
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise RowError(f"{p}:{n}: not valid JSON ({e.msg} at column {e.colno}); fix that line") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise RowError(f"{p}: row {i} is a {type(row).__name__}, not a mapping of columns")
    return rows


def save_rows(rows: Sequence[Mapping[str, Any]], path: str) -> Path:
    """Write rows as `.jsonl`, `.json` or `.parquet` (the format follows the suffix)."""
    p = Path(path).expanduser()
    kind = _suffix(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    if kind == ".parquet":
        pa = _pyarrow()
        try:
            columns = list(dict.fromkeys(k for r in rows for k in r))  # every row's keys, not the first's
            pa.parquet.write_table(pa.table({k: pa.array([r.get(k) for r in rows]) for k in columns}), p)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
            raise RowError(f"{p}: these rows do not fit one parquet schema ({e}); parquet cannot hold empty "
                           "dicts or a key whose type differs between rows; write .jsonl instead") from None
    elif kind == ".json":
        p.write_text(json.dumps(list(rows), ensure_ascii=False))
    else:
        p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return p


def tool_row(data_source: str, system: str, question: str, ground_truth: str, extra_info: Mapping[str, Any],
             tools: Sequence[str] = ("calculator",), interaction: str | None = None) -> dict[str, Any]:
    """A tool_agent row offering `tools` (tool_agent offers a row only the tools in
    `extra_info.tools`). Every tool gets the ground truth in its create_kwargs, as verl's GSM8K
    rows do: answer-checking tools need it, the others ignore it."""
    extra = dict(extra_info)
    extra["tools"] = list(tools)
    extra["tools_kwargs"] = {t: {"create_kwargs": {"ground_truth": ground_truth}} for t in tools}
    row = {"data_source": data_source, "agent_name": "tool_agent",
           "prompt": [{"role": "system", "content": system}, {"role": "user", "content": question}],
           "reward_model": {"style": "rule", "ground_truth": ground_truth}, "extra_info": extra}
    if interaction:
        row["interaction_kwargs"] = {"name": interaction, "ground_truth": ground_truth}
    return row


def has_images(row: Mapping[str, Any]) -> bool:
    """Whether a row holds an image: verl's `images` list, or an image part in its prompt."""
    if row.get("images"):
        return True
    for m in row.get("prompt") or []:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") in ("image", "image_url")
                                             for p in content):
            return True
    return False


def _part_errors(parts: list[Any], where: str) -> Iterator[str]:
    """Content parts: {"type": "text", "text": ...}, {"type": "image", "image": ...} or
    {"type": "image_url", "image_url": {"url": ...}} (images are read when the loop runs)."""
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image" and part.get("image") is not None or kind == "image_url" and part.get("image_url"):
            continue
        yield (f"key '{where}[{k}]' must be {{type: text, text: ...}}, {{type: image, image: ...}} or "
               f"{{type: image_url, image_url: {{url: ...}}}}, got {str(part)[:60]!r}")


def _row_errors(row: Any, known_agent_names: Collection[str] | None, known_tools: Collection[str] | None,
                known_interactions: Collection[str] | None) -> Iterator[str]:
    from agent.loop import DEFAULT_AGENT_NAME
    from agent.rewards import RULE_SCORERS

    if not isinstance(row, Mapping):
        yield f"is a {type(row).__name__}, not a mapping of columns"
        return
    prompt = row.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        yield f"key 'prompt' must be a non-empty list of messages, got {str(prompt)[:60]!r}"
    else:
        for j, m in enumerate(prompt):
            if not isinstance(m, Mapping):
                yield f"key 'prompt[{j}]' must be a message mapping with role and content, got {str(m)[:60]!r}"
            elif m.get("role") not in MESSAGE_ROLES:
                yield f"key 'prompt[{j}].role' is {m.get('role')!r}; allowed: {list(MESSAGE_ROLES)}"
            elif m["role"] == "system" and j != 0:
                yield f"key 'prompt[{j}].role' is 'system' but a system message may only come first"
            elif isinstance(m.get("content"), list):
                yield from _part_errors(m["content"], f"prompt[{j}].content")
            elif not isinstance(m.get("content"), str):
                yield (f"key 'prompt[{j}].content' must be a string or a list of parts, got "
                       f"{type(m.get('content')).__name__}")
        if not any(isinstance(m, Mapping) and m.get("role") == "user" for m in prompt):
            yield "key 'prompt' has no user message; add the question as {'role': 'user', 'content': ...}"
    agent = row.get("agent_name") or DEFAULT_AGENT_NAME
    if known_agent_names is not None and agent not in known_agent_names:
        yield (f"key 'agent_name' is {agent!r}; known: {sorted(known_agent_names)} (register a loop under "
               "`agent_loops:` in the config)")
    rm = row.get("reward_model")
    if rm is not None and not isinstance(rm, Mapping):
        yield f"key 'reward_model' must be a mapping like {{style: rule, ground_truth: '72'}}, got {rm!r}"
    elif rm and rm.get("style") == "rule" and row.get("data_source") in RULE_SCORERS and rm.get("ground_truth") is None:
        yield f"key 'reward_model.ground_truth' is missing; data_source {row.get('data_source')!r} is scored by rule"
    extra = row.get("extra_info") or {}
    if not isinstance(extra, Mapping):
        yield f"key 'extra_info' must be a mapping, got {type(extra).__name__}"
        return
    tools_kwargs = extra.get("tools_kwargs") or {}
    if not isinstance(tools_kwargs, Mapping):
        yield f"key 'extra_info.tools_kwargs' must map tool names to {{create_kwargs: ...}}, got {tools_kwargs!r}"
        tools_kwargs = {}
    named = [(f"extra_info.tools_kwargs.{t}", t) for t in tools_kwargs]
    named += [(f"extra_info.tools[{j}]", t) for j, t in enumerate(extra.get("tools") or [])]
    if known_tools is not None:
        for key, tool in named:
            if tool not in known_tools:
                yield (f"key '{key}' names tool {tool!r}, which is not loaded; loaded tools: {sorted(known_tools)} "
                       "(add it to the tools config or drop it from the row)")
    inter = interaction_kwargs_of(row)
    if inter is not None and not isinstance(inter, Mapping):
        yield f"key 'interaction_kwargs' must be a mapping like {{name: gsm8k, ground_truth: '72'}}, got {inter!r}"
    elif inter and known_interactions:  # none loaded: verl's behaviour, the kwargs are ignored (one notice)
        name = inter.get("name")
        if name is None and len(known_interactions) > 1:
            yield (f"key 'interaction_kwargs' has no 'name' and {len(known_interactions)} interactions are loaded "
                   f"({sorted(known_interactions)}); add name to say which")
        elif name is not None and name not in known_interactions:
            yield f"key 'interaction_kwargs.name' is {name!r}; loaded interactions: {sorted(known_interactions)}"


def interaction_kwargs_of(row: Mapping[str, Any]) -> Any:
    """A row's interaction kwargs: top level, or inside `extra_info` where verl's preprocessing puts them."""
    extra = row.get("extra_info") or {}
    return row.get("interaction_kwargs") or (extra.get("interaction_kwargs") if isinstance(extra, Mapping) else None)


def ignored_interaction_notice(rows: Sequence[Any], known_interactions: Collection[str] | None) -> str | None:
    """The one notice for rows whose interaction kwargs no loaded interaction will read."""
    if known_interactions is None or known_interactions:
        return None
    n = sum(1 for r in rows if isinstance(r, Mapping) and interaction_kwargs_of(r))
    if not n:
        return None
    return (f"notice: {n} row(s) carry interaction_kwargs but no interaction is loaded, so they are ignored (as verl "
            "does); set rollout.interaction_config (e.g. launch/configs/interaction_gsm8k.yaml) to use them")


def validate_rows(rows: Sequence[Any], known_agent_names: Collection[str] | None,
                  known_tools: Collection[str] | None, known_interactions: Collection[str] | None = None,
                  max_errors: int = 10) -> None:
    """Raise RowError listing the first problems (row index and key) before any model loads,
    instead of a trajectory failing mid-rollout. `None` for a `known_*` skips that check."""
    if not rows:
        raise RowError("the dataset has no rows; check the file or the generator's size")
    problems: list[str] = []
    for i, row in enumerate(rows):
        problems += [f"row {i}: {e}" for e in _row_errors(row, known_agent_names, known_tools, known_interactions)]
        if len(problems) >= max_errors:
            break
    if problems:
        raise RowError(f"{len(problems)} problem(s) in the dataset (showing up to {max_errors}):\n  "
                       + "\n  ".join(problems[:max_errors]))
    notice = ignored_interaction_notice(rows, known_interactions)
    if notice:
        print(notice, file=sys.stderr, flush=True)


def row_uid(row: Mapping[str, Any]) -> str:
    """A row's identity by content: a short hash of its prompt messages, so the same question has
    the same id in the training data and in a validation set, whichever file it came from."""
    import hashlib

    text = json.dumps(row.get("prompt"), sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _text_chars(messages: Any) -> int:
    if not isinstance(messages, list):
        return len(str(messages or ""))
    n = 0
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else m
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(str(part.get("text", ""))) if isinstance(part, Mapping) else len(str(part)) for part in content)
        else:
            n += len(str(content or ""))
    return n


SLACK_PER_MESSAGE = 4  # tokens a message's text may gain inside its template (merges at its edges)


def _rendered_tokens(tokenizer: Any, messages: Any) -> int:
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    except Exception:  # noqa: BLE001 - a template that cannot render it: count its text instead
        return len(tokenizer(str(messages), add_special_tokens=False)["input_ids"])


def _plain_texts(messages: Any) -> list[str] | None:
    """The texts of a conversation of plain {role, content: str} messages; None for anything else."""
    if not isinstance(messages, list) or not messages:
        return None
    if not all(isinstance(m, Mapping) and set(m) == {"role", "content"} and isinstance(m["content"], str)
               for m in messages):
        return None
    return [m["content"] for m in messages]


def too_long(rows: Sequence[Mapping[str, Any]], tokenizer: Any, limit: int) -> list[int]:
    """The indices of rows whose prompt (chat template applied) holds more than `limit` tokens. Short
    prompts pass without tokenizing (3 tokens a character at most, plus the template), prompts of more
    than 32 characters a token for every allowed token fail without it. Of the rest, plain chat
    conversations are counted in one batch: their texts' tokens plus what the template adds to the
    same roles with empty texts, give or take SLACK_PER_MESSAGE a message (a template renders the
    prompt of a few thousand rows a second, the batch a few hundred thousand); only prompts within
    that slack of the limit, and the others, are rendered whole."""
    out, plain, overheads = [], [], {}
    for i, row in enumerate(rows):
        messages = row.get("prompt")
        chars = _text_chars(messages)
        if 3 * chars + 256 <= limit:
            continue
        if chars > 32 * limit:
            out.append(i)
            continue
        texts = _plain_texts(messages)
        roles = tuple(m["role"] for m in messages) if texts is not None else ()
        if texts is not None and roles not in overheads:
            try:
                overheads[roles] = _rendered_tokens(tokenizer, [{"role": r, "content": ""} for r in roles])
            except Exception:  # noqa: BLE001 - tokenizer(str) failed too: render these rows whole
                overheads[roles] = None
        if texts is None or overheads[roles] is None:
            if _rendered_tokens(tokenizer, messages) > limit:
                out.append(i)
            continue
        plain.append((i, roles, texts))
    if plain:
        unique = list(dict.fromkeys(t for _, _, texts in plain for t in texts))  # a shared system prompt once
        counts = dict(zip(unique, map(len, tokenizer(unique, add_special_tokens=False)["input_ids"])))
        for i, roles, texts in plain:
            n = overheads[roles] + sum(counts[t] for t in texts)
            slack = SLACK_PER_MESSAGE * len(texts)
            if n - slack > limit or (n + slack > limit and _rendered_tokens(tokenizer, rows[i]["prompt"]) > limit):
                out.append(i)
    return sorted(out)


class RowStream:
    """Rows in a seeded, shuffled order, epoch after epoch, with a position that a checkpoint
    saves so a resumed run continues with exactly the next row: nothing repeated, nothing skipped.

    Epoch `e` visits every row once, in a permutation fixed by (seed, e). A batch that runs past
    the end of an epoch takes the rest of that epoch and the start of the next, so no row is ever
    dropped to make batches even.
    """

    def __init__(self, rows: Sequence[dict[str, Any]], seed: int = 0, shuffle: bool = True) -> None:
        if not rows:
            raise RowError("RowStream needs at least one row; the dataset is empty")
        self.rows = list(rows)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, index within the epoch's order) of the next row to be handed out."""
        return self.epoch, self.index

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __iter__(self) -> "RowStream":
        return self

    def __next__(self) -> dict[str, Any]:
        if self.index >= len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        row = self.rows[self._order[self.index]]
        self.index += 1
        return row

    def next_batch(self, k: int) -> list[dict[str, Any]]:
        """The next `k` rows (crossing into the next epoch when this one runs out)."""
        if int(k) < 1:
            raise ValueError(f"next_batch(k={k}): k must be >= 1")
        return [next(self) for _ in range(int(k))]

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "num_rows": len(self.rows)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position. The dataset size, seed and shuffle must match: with
        others the saved index points into a different order, silently repeating or skipping rows."""
        for key, mine in (("num_rows", len(self.rows)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if key in state and state[key] != mine:
                raise ValueError(f"data position was saved with {key}={state[key]!r} but this run has {key}={mine!r}; "
                                 "resume with the same dataset and data seed, or start over (trainer.resume=fresh)")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self.rows):
            raise ValueError(f"bad data position epoch={epoch} index={index} for {len(self.rows)} rows")
        self.epoch, self.index = epoch, index
        self._order = self._permutation(epoch)
