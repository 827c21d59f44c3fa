"""Mistral: the llama tensors and block. Its config may give `head_dim` explicitly (not
hidden / heads), which llama's reader already honours. `sliding_window` is not applied: attention
is full, which equals windowed attention for sequences no longer than the window."""

from __future__ import annotations

from dataclasses import replace

from parallel.families import llama

FAMILY = replace(llama.FAMILY, model_type="mistral")
