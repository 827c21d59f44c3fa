"""The plan check: what a config would start on N nodes of G GPUs, checked without loading a model
or touching a GPU.

    python launch/train.py RECIPE --plan [--nodes N --gpus-per-node G --gpu-memory-gb 80
                                          --engine-gpus-per-node E --model-config config.json]

It prints the process layout (trainer ranks and their TP/PP/DP groups, engine groups and their
GPUs), the weight route the engines get, the buckets and bytes of one weight sync, the projected
memory per GPU and the command that starts the run, and fails naming the fix when the plan cannot
divide (heads by TP, GPUs by engine TP) or cannot fit. The model's shape comes from its
`config.json` (a local directory, or `--model-config PATH`) or, for the common families, from a
table of their published shapes, so the plan needs no hub access and no weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 2**30


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a decoder: its config.json numbers."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    head_dim: int = 0  # 0: hidden / heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def parameters(self) -> int:
        attn = self.hidden * self.hd * (2 * self.heads + 2 * self.kv_heads)  # q, o; k, v
        layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each adaptable Linear of one decoder layer, by module name."""
        q, kv = self.heads * self.hd, self.kv_heads * self.hd
        return {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.ffn), "up_proj": (self.hidden, self.ffn),
                "down_proj": (self.ffn, self.hidden)}

    def adapter_parameters(self, rank: int, targets: list[str]) -> int:
        """A LoRA adapter's parameters: r x (in + out) per adapted Linear of every layer
        (`all-linear`: every one of them)."""
        per_layer = sum(rank * (i + o) for name, (i, o) in self.linears().items()
                        if "all-linear" in targets or any(name == t or name.endswith(t) for t in targets))
        return self.layers * per_layer

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.hd * dtype_bytes


# published config.json shapes (hidden, layers, heads, kv heads, ffn, vocab, tied[, head_dim])
SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape(896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": Shape(1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-3b": Shape(2048, 36, 16, 2, 11008, 151936, True),
    "qwen2.5-7b": Shape(3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": Shape(5120, 48, 40, 8, 13824, 152064, False),
    "qwen2.5-32b": Shape(5120, 64, 40, 8, 27648, 152064, False),
    "qwen2.5-72b": Shape(8192, 80, 64, 8, 29568, 152064, False),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 3072, 151936, True, 128),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 6144, 151936, True, 128),
    "qwen3-4b": Shape(2560, 36, 32, 8, 9728, 151936, True, 128),
    "qwen3-8b": Shape(4096, 36, 32, 8, 12288, 151936, False, 128),
    "qwen3-14b": Shape(5120, 40, 40, 8, 17408, 151936, False, 128),
    "qwen3-32b": Shape(5120, 64, 64, 8, 25600, 151936, False, 128),
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 8192, 128256, True),
    "llama-3.2-3b": Shape(3072, 28, 24, 8, 8192, 128256, True),
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 14336, 128256, False),
    "llama-3.1-70b": Shape(8192, 80, 64, 8, 28672, 128256, False),
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, True),
}


def _key(name: str) -> str:
    base = name.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in ("-instruct", "-chat", "-base"):
        base = base.removesuffix(suffix)
    return base.replace("meta-llama-", "llama-")


def shape_from_config(cfg: dict[str, Any]) -> Shape:
    return Shape(int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"]),
                 int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]), int(cfg["intermediate_size"]),
                 int(cfg["vocab_size"]), bool(cfg.get("tie_word_embeddings", False)), int(cfg.get("head_dim") or 0))


def model_shape(path: str, config_file: str | None = None) -> Shape:
    """The shape of `path`: `config_file`, the directory's config.json, or the table of families."""
    for candidate in ([Path(config_file)] if config_file else []) + [Path(path).expanduser() / "config.json"]:
        if candidate.is_file():
            return shape_from_config(json.loads(candidate.read_text()))
    if _key(path) in SHAPES:
        return SHAPES[_key(path)]
    raise ValueError(f"model.path={path!r}: no config.json there and not a family the plan knows "
                     f"({sorted(SHAPES)}); pass --model-config path/to/config.json")


@dataclass
class Plan:
    lines: list[str]
    errors: list[str]


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def make_plan(cfg: Any, recipe: str | None, nodes: int, gpus: int, gpu_gb: float,
              config_file: str | None = None, engine_gpus: int = 0) -> Plan:
    """The plan of config `cfg` on `nodes` x `gpus` GPUs of `gpu_gb` GiB each (`engine_gpus` per node
    hold the engines in split placement: ENGINE_GPUS_PER_NODE of launch/slurm/train.sbatch)."""
    from engines.inference import ENGINES
    from engines.training.backends import ACTORS
    from parallel.mesh import plan_placement
    from rollout.weights.link import Placement
    from rollout.weights.routes import choose

    lines: list[str] = []
    errors: list[str] = []
    shape = model_shape(cfg.model.path, config_file)
    params = shape.parameters()
    a, r = cfg.actor, cfg.rollout
    attached = list(r.engines)  # engines as a service: on GPUs of their own, reached over the bus
    placement = "attached" if attached else "colocated" if r.placement in ("auto", "cpu") else r.placement
    spec = ENGINES[r.engine]
    mem_opt, tp_opt = spec.memory_option or "gpu_memory_utilization", spec.tp_option or "tensor_parallel_size"
    engine_tp = int(r.engine_options.get(tp_opt, 1))
    util = float(r.engine_options.get(mem_opt, 0.5 if placement == "colocated" else 0.9))
    train_per_node = gpus if placement in ("colocated", "attached") else gpus - (engine_gpus or gpus // 2)
    world = nodes * train_per_node
    lines.append(f"model {cfg.model.path}: {params / 1e9:.2f}B parameters, {shape.layers} layers, hidden {shape.hidden}, "
                 f"{shape.heads} heads / {shape.kv_heads} KV heads")
    # the trainer
    mp = a.tp * a.pp
    if world % mp:
        errors.append(f"actor.tp={a.tp} x actor.pp={a.pp} does not divide the {world} training GPUs; pick TP x PP "
                      f"dividing {world}")
    if a.tp > 1 and (shape.heads % a.tp or shape.kv_heads % a.tp):
        errors.append(f"actor.tp={a.tp} must divide the model's {shape.heads} heads and {shape.kv_heads} KV heads; "
                      f"use actor.tp in {[t for t in (1, 2, 4, 8) if shape.heads % t == 0 and shape.kv_heads % t == 0]}")
    if a.pp > 1 and shape.layers % a.pp:
        errors.append(f"actor.pp={a.pp} must divide the model's {shape.layers} layers")
    dp = max(1, world // mp)
    lines.append(f"trainer: {world} rank(s) on {nodes} node(s) x {train_per_node} GPU(s); {a.backend} actor, TP {a.tp} x "
                 f"PP {a.pp} x DP {dp}, sharding {a.sharding}")
    # the engines
    if shape.heads % engine_tp or (engine_tp > gpus and not attached):
        errors.append(f"rollout.engine_options.{tp_opt}={engine_tp} must divide the model's {shape.heads} "
                      f"heads and fit a node's {gpus} GPUs")
    if attached:
        lines.append(f"  engines: {len(attached)} attached server(s) (rollout.engines) on GPUs of their own, sized "
                     f"where they run (python -m rollout.service); none on the trainer's GPUs")
    else:
        try:
            pp_plan = plan_placement(placement, nodes=nodes, devices_per_node=gpus,
                                     train_devices=None if placement == "colocated" else world, rollout_tp=engine_tp)
            lines += ["  " + x for x in pp_plan.describe().splitlines()]
        except ValueError as e:
            errors.append(f"engine placement: {e}")
    route = choose(Placement(in_process=bool(r.in_process), weight_path="bus" if attached else r.weight_path,
                             nodes=nodes, engines_on_my_gpu=placement == "colocated" and nodes == 1 and engine_tp == 1
                             and gpus == 1))
    engine_bytes = params * dtype_bytes(cfg.model.dtype)
    lora = getattr(a, "lora", None)
    adapter = shape.adapter_parameters(lora.rank, list(lora.target_modules)) if lora is not None else 0
    # engines that apply a pushed adapter get only it (engines/lora.py); the others the merged weights
    adapters_travel = adapter and ENGINES[r.engine].adapters and not r.in_process and not r.engines \
        and not (placement == "colocated" and (r.sleep_level or (1 if lora is not None else 2)) == 2)
    sync_bytes = adapter * dtype_bytes(cfg.model.dtype) if adapters_travel else engine_bytes
    buckets = math.ceil(sync_bytes / (r.weight_bucket_mb << 20))
    lines.append(f"weight sync: route {route}, {sync_bytes / GB:.3g} GiB in {buckets} bucket(s) of "
                 f"{r.weight_bucket_mb} MiB per step" + (f" (the LoRA adapter, {adapter / 1e6:.1f}M parameters)"
                                                         if adapters_travel else ""))
    # memory per GPU
    if lora is None:
        actor = params * ACTORS[a.backend].state_bytes(a.sharding, dp, mp)
    else:  # a frozen base (compute dtype; fp32 when FSDP-sharded), the adapter trained
        shard = dp if a.sharding == "fsdp" else 1
        base = params * (4 if a.sharding == "fsdp" else dtype_bytes(cfg.model.dtype))
        actor = (base + adapter * 16) / shard
    from engines.training.advantages import ESTIMATORS

    if ESTIMATORS[cfg.algorithm.advantage].values:  # the critic: a second model trained beside the actor
        critic_sharding = cfg.critic.sharding or a.sharding
        actor += params * ACTORS["torch"].state_bytes(critic_sharding, dp, 1)
        lines.append("critic: the policy's size, trained on the trainer's GPUs (counted with the actor below)")
    ref = 0.0
    if cfg.algorithm.loss.kl_coef > 0 and lora is None:  # with LoRA the reference is the actor's own base
        ref = params * dtype_bytes(cfg.model.dtype) / (world if cfg.reference.backend == "deepspeed" else 1)
    engine_weights = engine_bytes / engine_tp
    engine_total = 0.0 if attached else util * gpu_gb * GB
    kv = engine_total - engine_weights
    engine_text = "engine 0 (attached elsewhere)" if attached else (
        f"engine {engine_total / GB:.1f} GiB ({mem_opt} {util}: weights {engine_weights / GB:.1f}, KV cache "
        f"{max(kv, 0) / GB:.1f} GiB = {int(max(kv, 0) / max(shape.kv_bytes_per_token(2), 1) * engine_tp):,} tokens)")
    lines.append(f"memory per GPU ({gpu_gb:.0f} GiB): actor {actor / GB:.1f} GiB (weights, gradients, AdamW; activations "
                 f"on top), reference {ref / GB:.1f} GiB, {engine_text}")
    if kv <= 0 and not attached:
        errors.append(f"the engine's share ({util} x {gpu_gb:.0f} GiB) does not even hold its weights "
                      f"({engine_weights / GB:.1f} GiB); raise rollout.engine_options.{mem_opt} or {tp_opt}")
    reward = _reward_model(cfg, gpus, train_per_node, lines, errors)  # GPU -> the reward model's bytes on it
    trainer_gpu = actor + ref + (engine_total if placement == "colocated" else 0.0)
    resident = max([trainer_gpu + reward.get(d, 0.0) for d in range(train_per_node)]
                   + [engine_total + reward.get(d, 0.0) for d in range(train_per_node, gpus)])
    if resident > gpu_gb * GB:
        fixes = ("shard the actor (actor.sharding=fsdp, or megatron with actor.tp) over more GPUs, lower "
                 f"rollout.engine_options.{mem_opt}, or use more GPUs")
        errors.append(f"{resident / GB:.1f} GiB per GPU does not fit {gpu_gb:.0f} GiB: {fixes}")
    else:
        lines.append(f"fits: {resident / GB:.1f} of {gpu_gb:.0f} GiB per GPU before activations")
    target = recipe or "CONFIG"
    split = f"ENGINE_GPUS_PER_NODE={gpus - train_per_node} " if placement == "split" else ""
    if nodes > 1 or split:
        lines.append(f"start: {split}sbatch --nodes {nodes} --gpus-per-node {gpus} launch/slurm/train.sbatch {target}")
    else:
        lines.append(f"start: torchrun --nproc-per-node {train_per_node} launch/train.py {target}")
    return Plan(lines, errors)


def _reward_model(cfg: Any, gpus: int, train_per_node: int, lines: list[str], errors: list[str]) -> dict[int, float]:
    """Places and sizes `reward.model`'s engines: their GPUs (`reward.model.devices`, split over
    `num_engines` as rollout/reward_engines.py does) and the bytes of weights each of a node's GPUs
    holds for them (empty when they are attached or run on the CPU)."""
    from engines.inference import ENGINES

    m = cfg.reward.model
    if m.path is None:
        return {}
    if m.addresses:
        lines.append(f"reward model ({m.kind}) {m.path}: {len(m.addresses)} attached server(s) "
                     "(reward.model.addresses), none on these GPUs")
        return {}
    try:
        rshape = model_shape(str(m.path))
    except ValueError as e:
        errors.append(f"reward.model.path: {e}")
        return {}
    n = int(m.num_engines)
    weights = rshape.parameters() * dtype_bytes(cfg.model.dtype)
    devices = [int(d) for d in m.devices]
    bad = [d for d in devices if not 0 <= d < gpus]
    if bad:
        errors.append(f"reward.model.devices={devices}: {bad} not on a node of {gpus} GPUs (0..{gpus - 1})")
        return {}
    if not devices:
        if ENGINES[str(m.engine)].on_gpu:
            lines.append(f"reward model ({m.kind}) {m.path}: {n} x {m.engine} with no reward.model.devices: they run "
                         "on the CPU; name GPUs in reward.model.devices to put them on one")
        return {}
    shares = [devices[i * len(devices) // n:(i + 1) * len(devices) // n] or devices for i in range(n)]
    per_gpu: dict[int, float] = {}
    for share in shares:  # each engine's weights spread over its share (tensor parallel), its KV cache beside them
        for d in share:
            per_gpu[d] = per_gpu.get(d, 0.0) + weights / len(share)
    where = ", ".join(f"GPU {d}: {b / GB:.1f} GiB" for d, b in sorted(per_gpu.items()))
    lines.append(f"reward model ({m.kind}) {m.path}: {rshape.parameters() / 1e9:.2f}B parameters, {n} x {m.engine} on "
                 f"GPUs {devices} ({where} of weights, KV cache on top)"
                 + ("; shares the trainer's GPUs" if any(d < train_per_node for d in per_gpu) else ""))
    return per_gpu


def plan_main(path: str | None, argv: list[str]) -> int:
    """`train.py ... --plan`: print the plan (exit 0) or what is wrong with it (exit 2)."""
    import argparse

    from launch.config import ConfigError, load_config

    ap = argparse.ArgumentParser(prog="launch/train.py CONFIG --plan", add_help=False)
    ap.add_argument("--plan", action="store_true")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0)
    ap.add_argument("--engine-gpus-per-node", type=int, default=0, help="split placement: GPUs per node for engines")
    ap.add_argument("--model-config", default=None, help="the model's config.json, when model.path has none")
    opts, overrides = ap.parse_known_args(argv)
    try:
        cfg = load_config(path, overrides)
        plan = make_plan(cfg, path, opts.nodes, opts.gpus_per_node, opts.gpu_memory_gb, opts.model_config,
                         opts.engine_gpus_per_node)
    except (ConfigError, ValueError) as e:
        print(f"plan error: {e}")
        return 2
    print("\n".join(plan.lines))
    if plan.errors:
        print("\n".join(f"plan error: {e}" for e in plan.errors))
        return 2
    print("plan ok")
    return 0
