"""LoRA on the torch actor (`actor.lora`): peft adapters injected into the HF model in place, so
the actor's module keeps its class, its config and its forward; only the adapter trains.

What the rest of the actor asks of it:
  add_adapter       inject the adapter (every base weight frozen), check what it adapts
  merged_named      a stream of HF-named tensors with each adapted weight merged (W0 + s B A):
                    what engines that cannot apply an adapter receive, and the merged export
  adapter_named     the adapter alone, under the names peft saves (`base_model.model.<module>.lora_A.weight`);
                    given the scale s = alpha / rank, lora_B comes multiplied by it (the weight sync's
                    form, `engines/lora.py`: an engine then adds B A without knowing alpha)
  initial_value     an adapter tensor's first value, alike on every rank (the sharded actor builds
                    its model empty and reads the base from the checkpoint, which has no adapter)
  adapters_off      a context in which the model is its base (the reference, no second copy)
  save_adapter      adapter_model.safetensors + adapter_config.json, as peft's PeftModel loads them

peft is imported only here and only when `actor.lora` is set.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from engines.lora import PREFIX
from engines.training.config import LoraConfig

INSTALL = "pip install -c <(echo torch==2.13.0) -e '.[lora]'"  # the torch pin keeps the installed torch
ADAPTER = "default"  # peft's name for the one adapter the actor trains
# state-dict keys of an adapted module, as peft names them inside the model
_BASE = re.compile(r"^(?P<path>.+)\.base_layer\.(?P<leaf>weight|bias)$")
_LORA = re.compile(rf"^(?P<path>.+)\.lora_(?P<part>[AB])\.{ADAPTER}\.weight$")


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise ImportError(f"actor.lora needs the peft package ({e}); install it with {INSTALL}") from None
    return peft


def peft_config(cfg: LoraConfig, base_model: str | None = None) -> Any:
    """peft's LoraConfig for `cfg` (bias untouched, plain alpha / rank scaling)."""
    modules: Any = "all-linear" if list(cfg.target_modules) == ["all-linear"] else list(cfg.target_modules)
    return _peft().LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=modules,
                              bias="none", base_model_name_or_path=base_model)


def lora_layers(module: torch.nn.Module) -> dict[str, Any]:
    """Module path -> peft LoRA layer, for every adapted module."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}


def add_adapter(module: torch.nn.Module, cfg: LoraConfig, base_model: str | None = None) -> list[torch.nn.Parameter]:
    """Inject a LoRA adapter into `module` in place (every base parameter frozen) and return its
    trainable parameters, in fp32 whatever the base's dtype. Only Linear layers whose weight no
    other module shares may be adapted: a tied output head merged into its embedding would change both."""
    peft = _peft()
    try:
        peft.inject_adapter_in_model(peft_config(cfg, base_model), module, adapter_name=ADAPTER)
    except ValueError as e:
        first = str(e).splitlines()[0]
        raise ValueError(f"actor.lora.target_modules={list(cfg.target_modules)}: {first}; name Linear modules of "
                         f"this model, e.g. {_linear_names(module)[:6]}, or use [all-linear]") from None
    layers = lora_layers(module)
    owners: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for path, layer in layers.items():
        base = layer.get_base_layer()
        if not isinstance(base, torch.nn.Linear) or getattr(layer, "fan_in_fan_out", False):
            raise ValueError(f"actor.lora.target_modules={list(cfg.target_modules)} adapts {path}, a "
                             f"{type(base).__name__}; LoRA here adapts torch.nn.Linear layers only: leave it out")
        if len(owners.get(id(base.weight), [])) > 1:
            raise ValueError(f"actor.lora.target_modules={list(cfg.target_modules)} adapts {path}, whose weight is "
                             f"tied to {[n for n in owners[id(base.weight)] if not n.startswith(path)]}; leave it out "
                             "(a merged update would change both)")
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"actor.lora.target_modules={list(cfg.target_modules)} adapts nothing in this model")
    for p in params:  # peft makes the adapter in its base's dtype; it trains in fp32 (its own master copy)
        if p.dtype != torch.float32:
            p.data = p.data.float()
    return params


def _linear_names(module: torch.nn.Module) -> list[str]:
    return sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)})


def is_adapter_key(name: str) -> bool:
    """A state-dict key of the adapter (not of the frozen base)."""
    return _LORA.match(name) is not None


def peft_name(key: str) -> str:
    """The name peft saves an adapter tensor under (`...q_proj.lora_A.default.weight` ->
    `base_model.model....q_proj.lora_A.weight`)."""
    m = _LORA.match(key)
    if m is None:
        raise ValueError(f"{key!r} is not a LoRA adapter key")
    return f"{PREFIX}{m['path']}.lora_{m['part']}.weight"


def adapter_named(state: Iterable[tuple[str, torch.Tensor]], scaling: float | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter tensors of a state-dict stream under peft's names; with `scaling`, each lora_B
    is multiplied by it (the form an engine adds as B A)."""
    for key, t in state:
        m = _LORA.match(key)
        if m is None:
            continue
        if scaling is not None and m["part"] == "B":
            t = t * scaling
        yield peft_name(key), t


def merged_named(state: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A state-dict stream of a model with an adapter as the plain HF model's tensors: every
    adapted weight W0 + scaling * B @ A (computed in fp32, returned in W0's dtype), the base
    layers' other tensors renamed back, adapter tensors consumed. peft orders an adapted module's
    keys base_layer, lora_A, lora_B, so each base weight waits only for its own A and B."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state:
        base, lora = _BASE.match(key), _LORA.match(key)
        if base is not None and base["leaf"] == "weight":
            waiting.setdefault(base["path"], {})["W"] = t
        elif base is not None:
            yield f"{base['path']}.{base['leaf']}", t
        elif lora is not None:
            parts = waiting.setdefault(lora["path"], {})
            parts[lora["part"]] = t
            if {"W", "A", "B"} <= parts.keys():
                w = waiting.pop(lora["path"])
                merged = w["W"].float() + scaling * (w["B"].float() @ w["A"].float())
                yield f"{lora['path']}.weight", merged.to(w["W"].dtype)
        else:
            yield key, t
    if waiting:
        raise RuntimeError(f"adapted modules {sorted(waiting)[:3]} lack their base weight or adapter in the stream")


@contextmanager
def adapters_off(module: torch.nn.Module) -> Iterator[None]:
    """The model computes as its base inside (every adapter switched off), as before after."""
    layers = list(lora_layers(module).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_config(module: torch.nn.Module, base_model: str) -> Any:
    """The injected adapter's peft config (its target modules resolved to the adapted paths), naming
    `base_model` as the model it applies to."""
    import copy

    cfg = copy.deepcopy(module.peft_config[ADAPTER])
    cfg.base_model_name_or_path = base_model
    cfg.target_modules = sorted(lora_layers(module))
    return cfg


def save_adapter(path: Path, tensors: dict[str, torch.Tensor], config: Any) -> None:
    """`path`/adapter_model.safetensors + adapter_config.json: what `PeftModel.from_pretrained(base,
    path)` (and vLLM's LoRA loader) read. `tensors` under peft's names, unscaled."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(str(path))


def initial_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor | None:
    """The first value of adapter tensor `name` as peft draws it (lora_A uniform in +-1/sqrt(in),
    lora_B zero, so the adapted model starts as its base), from a generator of the seed and the
    name: every rank of a sharded actor draws the same whole tensor. None for any other tensor."""
    m = _LORA.match(name)
    if m is None:
        return None
    if m["part"] == "B":
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)
