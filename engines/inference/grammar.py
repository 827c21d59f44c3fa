"""Constrained decoding on the hf engine: a request's `json_schema` (SamplingParams) compiled into a
grammar by xgrammar, whose matcher says before each token which tokens may come next.

Why xgrammar: it is maintained, installs from wheels on CPU and GPU, and is the library vLLM and
SGLang use for their own structured outputs, so the hf engine and vLLM constrain the same way. A
token the grammar forbids gets logit -inf before sampling; the logprob recorded for the token drawn
is then of the constrained distribution, the one it was actually drawn from (what the trainer's
off-policy correction weighs against the policy). JSON is written compact (no free whitespace
between tokens: a model cannot fill its budget with blank lines). A `json_suffix` (a forced tool
call's closing) is literal text after the value, and one space may come before it (where a model
writes `"arguments": {`). Compiled grammars are kept per schema and suffix. vLLM and SGLang get
the same grammar as EBNF text (`ebnf`) when there is a suffix, their JSON-schema route otherwise.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from typing import Any

import torch

MAX_GRAMMARS = 64  # compiled schemas kept (least recently used dropped)


def grammar(schema: str, suffix: str = "") -> Any:
    """The xgrammar Grammar of compact JSON matching `schema`; with `suffix`, an optional space, the
    value, then `suffix` verbatim."""
    import xgrammar

    value = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    if not suffix:
        return value
    return xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf('root ::= " " | ""'), value,
                                   xgrammar.Grammar.from_ebnf("root ::= " + json.dumps(suffix, ensure_ascii=False)))


@functools.lru_cache(maxsize=MAX_GRAMMARS)
def ebnf(schema: str, suffix: str = "") -> str:
    """`grammar(schema, suffix)` as EBNF text, for engines that take a grammar (vLLM, SGLang; kept
    per schema and suffix: it is asked for on every such request)."""
    return str(grammar(schema, suffix))


class Grammars:
    """Matchers for one tokenizer and vocabulary (the model's, which may be padded past the tokenizer's)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, int(vocab_size), sorted(stop_ids)
        self._compiler: Any = None
        self._compiled: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, schema: str, suffix: str = "") -> Any:
        """A fresh matcher of `schema` (JSON schema text) and `suffix`; compiling them the first time."""
        import xgrammar

        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_ids or None)
                self._compiler = xgrammar.GrammarCompiler(info)
            key = (schema, suffix)
            compiled = self._compiled.pop(key, None)
            if compiled is None:
                compiled = self._compiler.compile_grammar(grammar(schema, suffix))
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_GRAMMARS:
                self._compiled.popitem(last=False)
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
