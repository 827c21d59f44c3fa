"""Qwen2: the llama architecture with a bias on q/k/v always (its HF config has no
`attention_bias` switch; the checkpoints always carry the biases)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from parallel.families import llama


def read_layout(cfg: Any) -> dict[str, Any]:
    """Llama's layout with the QKV bias forced on."""
    return {**llama.read_layout(cfg), "qkv_bias": True}


FAMILY = replace(llama.FAMILY, model_type="qwen2", read_layout=read_layout)
