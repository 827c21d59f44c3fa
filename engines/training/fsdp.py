"""FSDP2 for the torch actor: parameters, gradients and AdamW state sharded over the data-parallel
ranks (`torch.distributed.fsdp.fully_shard`), so per-rank memory for them falls as 1/DP.

Each decoder layer is its own FSDP unit (its parameters are gathered just before it runs and freed
after), the root holds the embeddings, final norm and head. With a mixed-precision dtype the
gathered parameters are cast to it for compute while the sharded master copy, the gradients'
reduction and AdamW's state stay fp32. The same calls run over gloo on CPU and NCCL on GPUs.

Collectives happen inside forward and backward, so every rank must run the same number of them:
the torch actor gives a rank with fewer rows dummy micro-batches whose loss is multiplied by zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def _layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (`model.layers`, `transformer.h`, ...), or
    of a LLaVA-style model's language model (its vision tower is sharded as one unit)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers",
                 "model.language_model.layers"):
        obj: Any = module
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    raise ValueError(f"cannot find the decoder layers of {type(module).__name__} to shard them; "
                     "use actor.sharding=none (DDP) for this model")


def shard_model(module: torch.nn.Module, compute_dtype: torch.dtype) -> torch.nn.Module:
    """Shard `module` in place over the default process group; returns it (now an FSDPModule)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mixed = None if compute_dtype == torch.float32 else compute_dtype
    policy = MixedPrecisionPolicy(param_dtype=mixed, reduce_dtype=torch.float32)
    for layer in _layers(module):
        fully_shard(layer, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    return module


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory) while their
    buffers stay real: rotary tables and the like are computed at construction and are not in
    the checkpoint."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def load_sharded(path: str, device: torch.device, compute_dtype: torch.dtype,
                 prepare: Callable[[torch.nn.Module], None] = lambda m: None,
                 fresh: tuple[str, ...] = (),
                 init: Callable[[str, torch.Size], torch.Tensor | None] | None = None) -> torch.nn.Module:
    """The HF model at `path`, sharded over the ranks without any rank ever holding all of it:
    built with meta parameters, `prepare`d (trainable flags, checkpointing, a new head), sharded,
    then each rank reads only its dim-0 slice of every tensor from the safetensors files.
    Parameters whose names start with a `fresh` prefix are not read: they start at zero (a
    critic's value head). A parameter the files lack (a LoRA adapter's) takes its dim-0 slice of
    `init(name, shape)`, its whole first value, alike on every rank."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from engines.models import is_vision_language

    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with _parameters_on_meta():
        module = auto.from_config(config, dtype=torch.float32)
    for m in module.modules():  # as load_causal_lm: chat models pad with a real token
        if isinstance(m, torch.nn.Embedding):
            m.padding_idx = None
    prepare(module)
    shard_model(module, compute_dtype)
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    module.to_empty(device=device)
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(buffers[name])
    params = dict(module.named_parameters())
    rank, world = dist.get_rank(), dist.get_world_size()
    loaded: set[str] = set()
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}; the sharded actor reads safetensors checkpoints")
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    name = _param_name(key, params)
                    p = params.get(name)
                    if p is None or name.startswith(fresh):  # startswith(()) is False
                        continue  # e.g. a tied lm_head stored twice
                    local = p.to_local() if is_dtensor(p) else p
                    if local.dim() == 0:
                        mine = st.get_tensor(key)
                    else:  # torch.chunk's rows for this rank, read from the file alone
                        rows = st.get_slice(key).get_shape()[0]
                        per = -(-rows // world)
                        mine = st.get_slice(key)[min(rows, rank * per):min(rows, (rank + 1) * per)]
                    if tuple(mine.shape) != tuple(local.shape):
                        raise ValueError(f"{key}: this rank's slice of the checkpoint has shape {tuple(mine.shape)}, "
                                         f"its shard {tuple(local.shape)}; the checkpoint does not match the config")
                    local.copy_(mine)
                    loaded.add(name)
        for name, p in params.items():
            if name.startswith(fresh):
                (p.to_local() if is_dtensor(p) else p).zero_()
                loaded.add(name)
            first = None if name in loaded or init is None else init(name, p.shape)
            if first is not None:
                local = p.to_local() if is_dtensor(p) else p
                per = -(-first.shape[0] // world)
                local.copy_(first[min(first.shape[0], rank * per):min(first.shape[0], (rank + 1) * per)])
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{path} holds no tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''}; is it "
                         "this model's checkpoint?")
    return module


# checkpoint key prefixes of LLaVA-style models as transformers saves them -> the module's names
LEGACY_PREFIXES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                   ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


def _param_name(key: str, params: dict[str, Any]) -> str:
    """The module parameter a checkpoint key holds (keys saved in a model family's older layout
    are renamed, as transformers' from_pretrained does)."""
    if key in params:
        return key
    head, _, leaf = key.rpartition(".")
    if f"{head}.base_layer.{leaf}" in params:  # a layer wrapped by a LoRA adapter (engines/training/lora.py)
        return f"{head}.base_layer.{leaf}"
    for old, new in LEGACY_PREFIXES:
        if key.startswith(old) and new + key[len(old):] in params:
            return new + key[len(old):]
    return key


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_named_tensors(module: torch.nn.Module, keep: Callable[[str], bool] | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) one at a time, on every rank (each is an all-gather of its shards), so
    no rank ever holds more than one whole tensor beyond its own shards. Tied weights once; with
    `keep`, only the names it keeps (the others are not gathered)."""
    seen: set[int] = set()
    for name, t in module.state_dict().items():
        if keep is not None and not keep(name):
            continue
        local = t.to_local() if is_dtensor(t) else t
        key = local.untyped_storage().data_ptr() if local.numel() else id(t)
        if key in seen:
            continue
        seen.add(key)
        yield name, whole(t)


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's whole value on every rank (a plain tensor as it is). Through host memory where
    NCCL does not carry the shards' device: gloo's all-gather into one tensor reads CUDA memory as if it
    were the host's (both ranks died of SIGSEGV on an H200 with two ranks on one GPU over
    `cpu:gloo,cuda:gloo`), while its list all-gather of host tensors is what it supports."""
    if not is_dtensor(t):
        return t
    from parallel.mesh import transfer_device

    if t.device.type == "cpu" or transfer_device(t.device_mesh.get_group()) is not None:
        return t.full_tensor()
    return gather_on_host(t).to(t.device)


def gather_on_host(t: Any) -> torch.Tensor:
    """`t`, a DTensor on a 1-D mesh sharded on one dimension as FSDP2 shards (torch.chunk's pieces, the
    last ranks' maybe empty) or replicated, whole in host memory: each rank's piece padded to the
    largest, one list all-gather of host tensors, the padding cut off."""
    from torch.distributed.tensor import Shard

    (placement,) = t.placements
    local = t.to_local().detach().cpu()
    if not isinstance(placement, Shard):  # replicated: every rank holds it whole
        return local
    dim, group = placement.dim, t.device_mesh.get_group()
    world = dist.get_world_size(group)
    sizes = [len(c) for c in torch.empty(t.shape[dim], device="meta").chunk(world)]
    sizes += [0] * (world - len(sizes))
    shape = list(local.shape)
    shape[dim] = max(sizes)
    piece = local.new_zeros(shape)
    piece.narrow(dim, 0, local.shape[dim]).copy_(local)
    parts = [torch.empty_like(piece) for _ in range(world)]
    dist.all_gather(parts, piece, group=group)
    return torch.cat([part.narrow(dim, 0, n) for part, n in zip(parts, sizes)], dim=dim)


def local_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """This rank's shards of the weights (`keep`: of those names only, e.g. a LoRA adapter's) and
    the optimizer state, as plain tensors (a checkpoint holds one such file per rank and resumes on
    the same number of ranks)."""
    local = lambda v: v.to_local() if isinstance(v, torch.Tensor) and is_dtensor(v) else v  # noqa: E731
    opt = optimizer.state_dict()
    return {"model": {k: local(v) for k, v in module.state_dict().items() if keep is None or keep(k)},
            "optimizer": {"state": {i: {k: local(v) for k, v in s.items()} for i, s in opt["state"].items()},
                          "param_groups": opt["param_groups"]}}


def load_local_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                     keep: Callable[[str], bool] | None = None) -> None:
    """Undo `local_state` (with the same `keep`) on a module sharded the same way."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, t in module.state_dict().items():
            if keep is None or keep(name):
                (t.to_local() if is_dtensor(t) else t).copy_(state["model"][name])
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = state["optimizer"]
    rebuilt = {}
    for i, s in saved["state"].items():
        p = params[int(i)]
        rebuilt[i] = {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                      if is_dtensor(p) and isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in s.items()}
    optimizer.load_state_dict({"state": rebuilt, "param_groups": saved["param_groups"]})


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shards only under FSDP)."""
    total = 0
    for s in optimizer.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if is_dtensor(v) else v
                total += local.numel() * local.element_size()
    return total
