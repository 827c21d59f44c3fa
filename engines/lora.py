"""A LoRA adapter as the weight sync carries it, shared by the actor that sends it and the engines
that apply it.

A push of an adapter is an ordinary weight version whose tensors are named as peft saves them,
`base_model.model.<module path>.lora_A.weight` ([rank, in]) and `...lora_B.weight` ([out, rank]),
with lora_B already multiplied by the adapter's scale (alpha / rank): an engine serves
W x + B (A x) for each adapted Linear `<module path>` without knowing alpha. Every version carries
the whole adapter and replaces the one before; the base weights stay the engine's own. A version
with any other tensor is a full weight update, after which no adapter applies.

`HookedAdapter` is how the transformers engine applies one: a forward hook on each adapted Linear
adds B (A x), with A and B held as (non-persistent) buffers of that Linear, so the model's
state-dict names, and full weight updates by them, are unchanged.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch

PREFIX = "base_model.model."
_NAME = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<part>[AB])\.weight$")


def adapter_part(name: str) -> tuple[str, str] | None:
    """(module path, "A" or "B") of an adapter tensor's name; None for any other tensor."""
    m = _NAME.match(name)
    return (m["path"], m["part"]) if m else None


def split_adapter(items: Iterable[tuple[str, "torch.Tensor"]]
                  ) -> tuple[dict[str, dict[str, "torch.Tensor"]], list[tuple[str, "torch.Tensor"]]]:
    """({module path: {"A": t, "B": t}}, the other (name, tensor) pairs) of a bucket."""
    adapter: dict[str, dict[str, "torch.Tensor"]] = {}
    rest = []
    for name, t in items:
        part = adapter_part(name)
        if part is None:
            rest.append((name, t))
        else:
            adapter.setdefault(part[0], {})[part[1]] = t
    return adapter, rest


def check_pairs(adapter: dict[str, dict[str, "torch.Tensor"]]) -> int:
    """The adapter's rank, after checking every module got an A and a B of one rank."""
    ranks = set()
    for path, parts in adapter.items():
        if set(parts) != {"A", "B"}:
            raise ValueError(f"the adapter for {path} holds only lora_{''.join(parts)}; a version must carry "
                             "lora_A and lora_B of every adapted module")
        a, b = parts["A"], parts["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"the adapter for {path} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                             "expected [rank, in] and [out, rank]")
        ranks.add(int(a.shape[0]))
    if len(ranks) > 1:
        raise ValueError(f"the adapter mixes ranks {sorted(ranks)}; one adapter has one rank")
    return ranks.pop() if ranks else 0


def _hook(module: "torch.nn.Module", args: tuple[Any, ...], output: "torch.Tensor") -> "torch.Tensor":
    import torch.nn.functional as F

    x = args[0]
    return output + F.linear(F.linear(x.to(module.lora_A.dtype), module.lora_A), module.lora_B).to(output.dtype)


def take_staged(adapter: Any) -> tuple[dict[str, dict[str, Any]], bool]:
    """(the staged adapter, whether the version also carried full weights), taken from an engine's
    adapter holder (`staged`, `full_update`), which starts the next version empty; a version that
    mixes the two is refused."""
    staged, full = adapter.staged, adapter.full_update
    adapter.staged, adapter.full_update = {}, False
    if full and staged:
        raise ValueError("a weight version mixed adapter tensors with full weights; send one or the other")
    return staged, full


class HookedAdapter:
    """The adapter a transformers model serves (see the module docstring). `stage` takes the adapter
    tensors of a bucket (checked against the model, nothing applied), `commit` swaps the staged
    version in; `clear` drops it (after a full weight update)."""

    def __init__(self, model: "torch.nn.Module") -> None:
        self.model = model
        self.staged: dict[str, dict[str, "torch.Tensor"]] = {}
        self.hooks: dict[str, Any] = {}  # module path -> its forward hook's handle
        self.full_update = False  # this version also carries other tensors

    def stage(self, items: Iterable[tuple[str, "torch.Tensor"]]) -> list[tuple[str, "torch.Tensor"]]:
        """Keep the bucket's adapter tensors for the commit; return its other tensors."""
        adapter, rest = split_adapter(items)
        modules = dict(self.model.named_modules())
        for path, parts in adapter.items():
            linear = modules.get(path)
            if linear is None or not hasattr(linear, "weight") or linear.weight.dim() != 2:
                close = [n for n in modules if n.rsplit(".", 1)[-1] == path.rsplit(".", 1)[-1]][:3]
                raise ValueError(f"adapter tensors for {path!r}, which is no Linear layer of "
                                 f"{type(self.model).__name__}; module paths look like {close}")
            out_f, in_f = linear.weight.shape
            for part, t in parts.items():
                dim, want = (1, in_f) if part == "A" else (0, out_f)
                if t.dim() != 2 or t.shape[dim] != want:
                    raise ValueError(f"lora_{part} of {path} has shape {tuple(t.shape)}; the layer is "
                                     f"[{out_f}, {in_f}], so lora_A is [rank, {in_f}] and lora_B [{out_f}, rank]")
                self.staged.setdefault(path, {})[part] = t.detach().to(linear.weight.device, linear.weight.dtype,
                                                                       copy=True)
        self.full_update = self.full_update or bool(rest)
        return rest

    def commit(self) -> None:
        """The staged adapter replaces the served one; a full update (no adapter) drops it."""
        staged, full = take_staged(self)
        if not staged:
            if full:
                self.clear()
            return
        check_pairs(staged)
        modules = dict(self.model.named_modules())
        for path in [p for p in self.hooks if p not in staged]:  # adapted before, not now: back to its base
            self._remove(modules[path], path)
        for path, parts in staged.items():
            linear = modules[path]
            linear.register_buffer("lora_A", parts["A"], persistent=False)
            linear.register_buffer("lora_B", parts["B"], persistent=False)
            if path not in self.hooks:
                self.hooks[path] = linear.register_forward_hook(_hook)

    def clear(self) -> None:
        modules = dict(self.model.named_modules())
        for path in list(self.hooks):
            self._remove(modules[path], path)

    def _remove(self, linear: "torch.nn.Module", path: str) -> None:
        self.hooks.pop(path).remove()
        for name in ("lora_A", "lora_B"):
            delattr(linear, name)

    @property
    def rank(self) -> int:
        """The served adapter's rank (0: none)."""
        modules = dict(self.model.named_modules())
        return next((int(modules[p].lora_A.shape[0]) for p in self.hooks), 0)
