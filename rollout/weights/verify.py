"""After a push: does every engine serve what was sent? The source takes a digest of each tensor as
the route consumes it (`DigestTap`), then asks every engine for the digest of what it now serves
(`weights_digest`, answered after the commit) and names each tensor whose copy differs by more than
its dtype's noise (engines/weight_digest.py). The engines' digests are taken with their own kernels
where they have them, so a stale copy a kernel keeps (vLLM's tied output head on CPU) is named too."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from engines.weight_digest import compare, of_tensor
from rollout.bus.protocol import Digest, WeightsDigest

if TYPE_CHECKING:
    import torch


class DigestTap:
    """Passes the named tensors through unchanged, keeping the digest of each as the engines get it
    (cast to their dtype); of every `every`-th tensor only when `every` > 1, starting at the
    `offset`-th (a push that checks a rotating share)."""

    def __init__(self, named: Iterable[tuple[str, "torch.Tensor"]], dtype: "torch.dtype | None", every: int = 1,
                 offset: int = 0) -> None:
        self.named, self.dtype, self.every, self.offset = named, dtype, max(1, every), offset % max(1, every)
        self.sent: dict[str, tuple[float, float]] = {}

    def __iter__(self) -> Iterator[tuple[str, "torch.Tensor"]]:
        for i, (name, t) in enumerate(self.named):
            if i % self.every == self.offset:
                self.sent[name] = of_tensor(t if self.dtype is None else t.to(self.dtype))
            yield name, t

    def asked(self, tied: bool) -> list[str]:
        """The names to ask the engines for: all (an empty list) when every tensor was digested, else
        those digested, with the output head where it is the embedding (an engine's own copy of it)."""
        if self.every == 1:
            return []
        names = sorted(self.sent)
        if tied and any(n.endswith("embed_tokens.weight") for n in names):
            names.append("lm_head.weight")
        return names


def tied_embeddings(model_dir: str) -> bool:
    """Whether the model's output head is its input embedding (config.json's tie_word_embeddings)."""
    config = Path(model_dir) / "config.json"
    if not config.exists():
        return False
    data = json.loads(config.read_text())
    text = data.get("text_config") or {}
    return bool(data.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def check_engines(control: Any, sent: dict[str, tuple[float, float]], dtype: str, tied: bool,
                  engines: list[int] | None = None, timeout_s: float = 120.0, names: list[str] | None = None
                  ) -> dict[str, Any]:
    """Ask each engine (of `engines`) for its digest (of `names` only, when given) and compare. Returns
    `compared` (tensors compared on every engine that could tell), `unavailable` (engines that could
    not), and `mismatched`: {engine index: [(tensor name, relative difference), ...]} for engines whose
    copy differs."""
    replies = control.run(control.client.broadcast(WeightsDigest(names=list(names or [])), timeout_s, only=engines,
                                                   skip_down=True))
    out: dict[str, Any] = {"compared": 0, "unavailable": 0, "mismatched": {}}
    for i, reply in zip(control.client.live(engines), replies):
        if not isinstance(reply, Digest) or not reply.available:
            out["unavailable"] += 1
            continue
        held = {n: (float(v[0]), float(v[1])) for n, v in zip(reply.names, reply.values)}
        bad, compared = compare(sent, held, dtype, tied)
        out["compared"] = max(out["compared"], compared)
        if bad:
            out["mismatched"][i] = bad
    return out


def warn_mismatched(mismatched: dict[int, list[tuple[str, float]]], version: int, dtype: str) -> None:
    """The loud warning naming each engine's differing tensors."""
    from engines.weight_digest import TOLERANCE

    for engine, bad in mismatched.items():
        names = ", ".join(f"{n} ({rel:.1e})" for n, rel in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        print(f"WARNING: after the push of weight version {version}, engine {engine} serves {len(bad)} tensor(s) that "
              f"differ from what the trainer sent (relative difference above {TOLERANCE.get(dtype, 2e-5):.0e} for "
              f"{dtype}): {names}. It samples from another policy than the one trained; check how that engine "
              "loads these tensors.", file=sys.stderr, flush=True)
