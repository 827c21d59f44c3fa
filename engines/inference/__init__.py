"""Inference backends behind one `Engine` protocol, chosen by name.

Backends are imported only when asked for, so `import engines.inference` works on a CPU box
without vLLM or SGLang installed.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

from engines.inference.base import (Engine, EngineDeadError, EngineStats, GenerateOutput, SamplingParams,
                                    held_dtype)


@dataclass(frozen=True)
class EngineSpec:
    """One inference backend: where its class lives and what a run may ask of it. Adding a backend
    is its module plus one entry here; config validation, placement and the in-process path read it."""

    target: str  # "module:Class", imported only when the backend is asked for
    defaults: Mapping[str, Any] = field(default_factory=dict)  # options a run starts it with (engine_options win)
    in_process: str | None = None  # the backend serving it from the trainer's process (rollout.in_process); None: no
    rollout: bool = True  # offered as rollout.engine (false: benchmarks and the in-process variants only)
    in_process_one_rank: bool = False  # its in-process variant takes torch.distributed's world as its own
    images: bool = False  # takes a vision-language prompt's pixel values (rows with images need it)
    # applies a LoRA adapter pushed as weights (engines/lora.py) on top of the base it keeps, so a LoRA
    # actor sends it the adapter alone; `adapter_option`: the engine option set to the adapter's rank
    adapters: bool = False
    adapter_option: str | None = None
    on_gpu: Mapping[str, Any] = field(default_factory=dict)  # options it needs to run on the GPUs it is given
    # the names of its options for the share of GPU memory it takes and for tensor parallelism (the plan reads them)
    memory_option: str | None = None
    tp_option: str | None = None
    # its server process gives freed host memory back and caps oneDNN's per-shape cache
    # (parallel.host.bound_freed_memory): a transformers engine on a CPU otherwise grows every step
    bounded_heap: bool = False


ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec("engines.inference.hf:HFEngine", {"max_batch_size": 64}, in_process="hf", images=True,
                     adapters=True, on_gpu={"device": "cuda"}, bounded_heap=True),  # it defaults to the CPU
    "vllm": EngineSpec("engines.inference.vllm:VLLMEngine", in_process="vllm_inproc", in_process_one_rank=True,
                       images=True, adapters=True, adapter_option="lora_rank", memory_option="gpu_memory_utilization",
                       tp_option="tensor_parallel_size"),
    "vllm_inproc": EngineSpec("engines.inference.vllm_inproc:VLLMInProcessEngine", rollout=False, images=True),
    "sglang": EngineSpec("engines.inference.sglang:SGLangEngine", memory_option="mem_fraction_static",
                         tp_option="tp_size"),  # its scheduler runs in processes of its own
    "echo": EngineSpec("engines.inference.echo:EchoEngine", rollout=False),
    # a modelled GPU's timing without a model (engines/inference/sim.py): the cluster simulator's engines
    "sim": EngineSpec("engines.inference.sim:SimEngine", rollout=False),
    # a reward model (sequence classification, one output): scores prompts, is never a policy nor weight-synced
    "hf_reward": EngineSpec("engines.inference.hf_reward:HFRewardEngine", {"max_batch_size": 64}, rollout=False,
                            on_gpu={"device": "cuda"}, bounded_heap=True),
}
BACKENDS: dict[str, str] = {name: spec.target for name, spec in ENGINES.items()}
ROLLOUT_ENGINES: tuple[str, ...] = tuple(name for name, spec in ENGINES.items() if spec.rollout)


def make_engine(backend: str, model: str, **options: Any) -> Engine:
    """Build (not start) the engine `backend` for `model` (a built-in name, HF dir or hub id)."""
    cls = engine_class(backend)
    check_options(backend, options, cls)
    return cls(model=model, **options)


def engine_class(backend: str) -> Any:
    """The class of engine `backend`, its module imported now (GPU-only packages stay lazy inside it)."""
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
    return getattr(module, cls_name)


def check_options(backend: str, options: dict[str, Any], cls: Any = None) -> None:
    """`rollout.engine_options` against the keyword arguments `backend`'s engine takes: an option of
    another engine (vllm's gpu_memory_utilization given to hf) is refused naming it, before any model loads."""
    if not options:
        return
    accepted = inspect.signature((cls or engine_class(backend)).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return  # the engine passes the rest on to its library (sglang), which names what it refuses
    unknown = sorted(set(options) - set(accepted) - {"self", "model"})
    if unknown:
        raise ValueError(f"rollout.engine_options {unknown} are not options of engine {backend!r}; its options: "
                         f"{sorted(k for k in accepted if k not in ('self', 'model'))}. Another engine's options do "
                         "not carry over: set rollout.engine_options={} or name this engine's own")

__all__ = ["BACKENDS", "check_options", "ENGINES", "ROLLOUT_ENGINES", "Engine", "EngineSpec", "EngineDeadError", "EngineStats", "GenerateOutput", "SamplingParams", "held_dtype", "make_engine"]
