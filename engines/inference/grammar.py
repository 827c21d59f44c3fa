"""Constrained decoding on the hf engine: a request's `json_schema` (SamplingParams) compiled into a
grammar by xgrammar, whose matcher says before each token which tokens may come next.

Why xgrammar: it is maintained, installs from wheels on CPU and GPU, and is the library vLLM and
SGLang use for their own structured outputs, so the hf engine and vLLM constrain the same way. A
token the grammar forbids gets logit -inf before sampling; the logprob recorded for the token drawn
is then of the constrained distribution, the one it was actually drawn from (what the trainer's
off-policy correction weighs against the policy). JSON is written compact (no free whitespace
between tokens: a model cannot fill its budget with blank lines). A `json_suffix` (a forced tool
call's closing) is literal text after the value, and one space may come before it (where a model
writes `"arguments": {`). `json_calls` (SamplingParams) makes the grammar a choice: the value under
`json_schema` (a final answer), or one tool call, each call an opening literal, then an optional space,
the arguments as compact JSON under that tool's parameters, and a closing literal, so the model picks
the branch itself and nothing is forced. Compiled grammars are kept per schema, suffix and calls,
within a size in bytes, and compiled without blocking other schemas' requests (`Grammars`). vLLM and
SGLang get the same grammar as EBNF text (`ebnf`) when there is a suffix or calls, their JSON-schema
route otherwise.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from typing import Any

import torch

from engines.inference.base import call_options

MAX_GRAMMARS = 64  # EBNF texts kept for vLLM and SGLang (least recently used dropped)
MAX_GRAMMAR_BYTES = 256 << 20  # compiled grammars the hf engine keeps, by their size (least recently used dropped)


def _literal(text: str) -> Any:
    import xgrammar

    return xgrammar.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


def grammar(schema: str, suffix: str = "", calls: str = "") -> Any:
    """The xgrammar Grammar of compact JSON matching `schema`; with `suffix`, an optional space, the
    value, then `suffix` verbatim; with `calls` (`json_calls` text), that value or any one of the
    calls: its opening, an optional space, its arguments' compact JSON, its closing."""
    import xgrammar

    value = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    space = 'root ::= " " | ""'
    if calls:
        return xgrammar.Grammar.union(value, *(
            xgrammar.Grammar.concat(_literal(opening), xgrammar.Grammar.from_ebnf(space),
                                    xgrammar.Grammar.from_json_schema(args, any_whitespace=False), _literal(closing))
            for opening, args, closing in call_options(calls)))
    if not suffix:
        return value
    return xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf(space), value, _literal(suffix))


@functools.lru_cache(maxsize=MAX_GRAMMARS)
def ebnf(schema: str, suffix: str = "", calls: str = "") -> str:
    """`grammar(schema, suffix, calls)` as EBNF text, for engines that take a grammar (vLLM, SGLang;
    kept per schema, suffix and calls: it is asked for on every such request)."""
    return str(grammar(schema, suffix, calls))


class Grammars:
    """Matchers for one tokenizer and vocabulary (the model's, which may be padded past the tokenizer's).

    Compiles run on the caller's thread (the engine calls from a worker thread, off its serving
    path) and never under a shared lock: a schema that takes long to compile holds up only the
    requests that carry it (the same schema compiling already is waited for, not compiled twice).
    Compiled grammars are kept least recently used first within `max_bytes` (their own size, as
    xgrammar counts it): a cache counted in entries grows with the size of the schemas sent."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int], max_bytes: int = MAX_GRAMMAR_BYTES) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, int(vocab_size), sorted(stop_ids)
        self.max_bytes = int(max_bytes)
        self._compiler: Any = None
        self._compiled: collections.OrderedDict[tuple[str, str, str], tuple[Any, int]] = collections.OrderedDict()
        self._bytes = 0
        self._compiling: dict[tuple[str, str, str], threading.Event] = {}
        self._lock = threading.Lock()  # guards the cache's bookkeeping only, never held over a compile

    def _compiler_once(self) -> Any:
        import xgrammar

        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_ids or None)
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # this class caches
            return self._compiler

    def cached_bytes(self) -> int:
        return self._bytes

    def matcher(self, schema: str, suffix: str = "", calls: str = "") -> Any:
        """A fresh matcher of `schema` (JSON schema text), `suffix` and `calls` (see `grammar`);
        compiling them the first time."""
        import xgrammar

        compiler = self._compiler_once()
        key = (schema, suffix, calls)
        while True:
            with self._lock:
                held = self._compiled.get(key)
                if held is not None:
                    self._compiled.move_to_end(key)
                    return xgrammar.GrammarMatcher(held[0])
                busy = self._compiling.get(key)
                if busy is None:
                    busy = self._compiling[key] = threading.Event()
                    break
            busy.wait()  # another thread compiles this very schema: take its result (or compile if it failed)
        try:
            compiled = compiler.compile_grammar(grammar(schema, suffix, calls))
            size = int(getattr(compiled, "memory_size_bytes", 0)) + len(schema) + len(suffix) + len(calls)
            with self._lock:
                if size <= self.max_bytes:
                    self._compiled[key] = (compiled, size)
                    self._bytes += size
                while self._bytes > self.max_bytes and self._compiled:
                    _, (_, dropped) = self._compiled.popitem(last=False)
                    self._bytes -= dropped
        finally:
            with self._lock:
                self._compiling.pop(key, None)
            busy.set()
        return xgrammar.GrammarMatcher(compiled)


def constrain(logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
    """`logits` [B, V] with every token a row's matcher forbids at -inf (rows without one as they
    are); the same tensor when no row has a matcher, else a new one."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    import xgrammar

    out = logits.clone()
    mask = xgrammar.allocate_token_bitmask(len(rows), out.shape[1])
    for j, i in enumerate(rows):
        matchers[i].fill_next_token_bitmask(mask, j)
    sub = out[rows].float().cpu()
    xgrammar.apply_token_bitmask_inplace(sub, mask)
    out[rows] = sub.to(out.dtype).to(out.device)
    return out
