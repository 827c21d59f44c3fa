"""Model families: everything the Megatron path knows about one HF architecture, one file each.

A family file `parallel/families/<model_type>.py` defines `FAMILY`, a `Family`: how to read the
`DecoderLayout` fields from the HF config, the megatron-core flags that build the same network,
and the tensor table. The table is the single statement of the HF <-> Megatron correspondence;
`parallel/reshard.py` reads it in both directions, so an import and an export can never disagree.
`family_for` finds the file by the config's `model_type`, so adding a family is adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# a `parallel.reshard.DecoderLayout`; named loosely here because reshard reads the families, not the reverse
Layout = Any

PARTS = ("embedding", "layer", "final")
KINDS = ("replicated", "vocab", "col", "row", "qkv:q", "qkv:k", "qkv:v", "fc1:gate", "fc1:up")


@dataclass(frozen=True)
class TensorRow:
    """One HF tensor and where it lives in Megatron.

    Names are templates: in a "layer" row `{i}` is the global layer index in `hf` and the index
    local to the pipeline stage in `megatron`. Rows sharing a Megatron name are fused (q, k and v
    into linear_qkv; gate and up into linear_fc1). `shape` names `DecoderLayout` attributes, one
    per dimension, so the HF shape follows from the layout. `when` names a `DecoderLayout` flag
    without which the tensor does not exist (e.g. "qkv_bias"). `tied_to` is the HF tensor this one
    equals when embeddings are tied: it is then absent from the checkpoint, and a pipelined last
    stage keeps its own copy cut from `tied_to`.
    """

    hf: str
    megatron: str
    part: str  # one of PARTS: the first stage, every stage's layers, or the last stage
    kind: str  # one of KINDS: how the tensor is split over TP ranks
    shape: tuple[str, ...]
    when: str = ""
    tied_to: str = ""

    def __post_init__(self) -> None:
        if self.part not in PARTS or self.kind not in KINDS:
            raise ValueError(f"tensor row {self.hf!r}: part {self.part!r} / kind {self.kind!r} not in {PARTS} / "
                             f"{KINDS}")


@dataclass(frozen=True)
class Family:
    """A model family. The callables take the HF config or the `DecoderLayout`; megatron-core is
    imported only inside `layer_spec`, so the weight conversion works without it."""

    model_type: str
    read_layout: Callable[[Any], dict[str, Any]]  # DecoderLayout fields (all but model_type) from an HF config
    transformer_flags: Callable[[Layout], dict[str, Any]]  # TransformerConfig keywords
    model_flags: Callable[[Layout], dict[str, Any]]  # GPTModel keywords
    layer_spec: Callable[[], Any]  # the megatron-core ModuleSpec of one decoder layer
    tensors: tuple[TensorRow, ...]


def supported_families() -> list[str]:
    """The model_types that have a family file, found on disk so the list is never stale."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def family_for(model_type: str) -> Family:
    """The family serving an HF `model_type`, from `parallel/families/<model_type>.py`."""
    module = f"{__name__}.{model_type}"
    family: Family | None = None
    if model_type.isidentifier() and not model_type.startswith("_"):
        try:
            family = importlib.import_module(module).FAMILY
        except ModuleNotFoundError as e:
            if e.name != module:  # the family file exists but imports something missing
                raise
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not supported by the Megatron path; supported: "
                         f"{', '.join(supported_families())}. Use the torch actor, or add "
                         f"parallel/families/{model_type}.py declaring its FAMILY (see llama.py)")
    if family.model_type != model_type:
        raise ValueError(f"parallel/families/{model_type}.py declares model_type {family.model_type!r}; they "
                         "must match")
    return family
