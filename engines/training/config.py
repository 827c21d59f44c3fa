"""The `actor:` section of the run config, the one class both actor backends take.

What an actor is trained with (optimiser, batch geometry, parallelism) is this section; what it
is trained on (the model path, the compute dtype, the sampling temperature, the seed) comes from
other sections of the run and is passed to the actor's constructor, so no setting has two names.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from engines.config_checks import from_mapping
from engines.training.backends import ACTORS, actor_backend, with_feature

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARED_PREFIX = ("off", "on", "auto")  # actor.shared_prefix
# HF attn_implementation names; auto = the model's
ATTENTION = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")


def native_bf16(device: torch.device | str) -> str | None:
    """What multiplies bf16 natively on `device` (its name), or None: a CUDA GPU that supports it, a
    CPU with AMX tiles or AVX-512 BF16 instructions. Where None, bf16 is emulated and fp32 is faster."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.get_device_name() if torch.cuda.is_bf16_supported() else None
    if kind == "cpu":
        for unit, probe in (("AMX", "_is_amx_tile_supported"), ("AVX-512 BF16", "_is_avx512_bf16_supported")):
            if getattr(torch.cpu, probe, lambda: False)():
                return f"this CPU's {unit} instructions"
    return None


def resolve_dtype(name: str, device: torch.device | str) -> tuple[str, str]:
    """`model.dtype` as the run uses it, and why: `auto` is bfloat16 where `device` multiplies bf16
    natively (on an AVX-512 BF16 CPU the torch actor's update was 1.43x faster than fp32 on a
    3M-parameter llama and 1.86x on SmolLM2-135M: benchmarks/update_dtype.py) and float32 elsewhere."""
    if name != "auto":
        return name, "as configured"
    unit = native_bf16(device)
    if unit:
        return "bfloat16", f"model.dtype=auto: bfloat16 autocast over fp32 weights ({unit} multiply bf16)"
    return "float32", f"model.dtype=auto: float32 (no native bf16 matrix units on {torch.device(device).type})"


def compute_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config name, or an error that lists the choices."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}; choose one of {list(DTYPES)}")
    return DTYPES[name]


@dataclass
class LoraConfig:
    """`actor.lora`: train a LoRA adapter (peft) instead of every weight. The base weights stay
    frozen; each update changes only the adapter, weight sync sends only the adapter to engines that
    apply one (merged weights to the others), the reference is the base with the adapter switched
    off, and the HF export is the adapter (plus the merged model with `export_merged`)."""

    rank: int = 8
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input while training (0 keeps actor and engine logprobs equal)
    # module names (or name suffixes) of the Linear layers to adapt, as peft takes them; "all-linear" =
    # every Linear layer except the output head
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    export_merged: bool = False  # the HF export also writes the merged model (output_dir/hf/merged)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"actor.lora.rank={self.rank!r} must be a positive integer (e.g. 8, 16 or 64)")
        if not self.alpha > 0:
            raise ValueError(f"actor.lora.alpha={self.alpha!r} must be > 0 (the adapter is scaled by alpha / rank; "
                             "2 x rank is common)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"actor.lora.dropout={self.dropout!r} must be in [0, 1)")
        modules = list(self.target_modules)
        if not modules or not all(isinstance(m, str) and m.strip() for m in modules):
            raise ValueError(f"actor.lora.target_modules={modules!r} must name at least one module, e.g. "
                             "[q_proj, k_proj, v_proj, o_proj] or [all-linear]")
        if "all-linear" in modules and len(modules) > 1:
            raise ValueError(f"actor.lora.target_modules={modules!r}: 'all-linear' already takes every Linear "
                             "layer; give it alone or list module names without it")

    @property
    def scaling(self) -> float:
        """What the adapter's product B @ A is multiplied by."""
        return self.alpha / self.rank


@dataclass
class UpdateConfig:
    """How a model is updated, the keys the `actor:` and `critic:` sections share: the optimizer,
    its schedule and the batch geometry (checked by `ActorConfig`)."""

    lr: float = 1e-5  # AdamW's learning rate
    weight_decay: float = 0.0  # AdamW's weight decay
    warmup_steps: int = 0  # learning-rate warm-up over the first N updates
    grad_clip: float = 1.0  # the gradients' global norm is clipped to this
    micro_batch_size: int = 8  # rows per forward/backward
    # > 0: micro-batches by padded token count instead of row count (rows sorted by length, packed
    # while rows x (widest prompt + widest response) stays within it; a longer row goes alone)
    max_tokens_per_micro_batch: int = 0
    # the tokens rows of a micro-batch begin with alike (a GRPO group's prompt, shared earlier turns)
    # computed once, the micro-batch packed as a prefix tree (engines/training/prefix.py): off, on, or
    # auto (the default: packed where a FLOP count of tokens and attention pairs says it saves,
    # prefix.packing_pays; off where the actor or its attention takes no packed mask)
    shared_prefix: str = "auto"
    # how a packed micro-batch attends: mask (the dense [n, n] mask, in the model's sdpa or eager
    # attention), runs (each row's own tokens against its ancestors and themselves, fewer pairs:
    # engines/training/tree_attention.py), or auto (the default: runs where the model's attention is sdpa
    # or eager, else the mask). On the CPU runs took 0.90-0.96x the mask's time at the demo's shapes and
    # a quarter of it with replies as long as the prompt (benchmarks/RESULTS.md); on GPUs not yet measured
    packed_attention: str = "auto"
    ppo_mini_batch_size: int = 0  # trajectories per optimizer step; 0 = the whole batch
    ppo_epochs: int = 1  # passes over the batch per RL step
    gradient_checkpointing: bool = False  # recompute activations in the backward: less memory, more time
    trainable: list[str] = field(default_factory=list)  # parameter-name regexes to train; empty = all


@dataclass
class ActorConfig(UpdateConfig):
    """`ppo_mini_batch_size` 0 means the whole batch is one mini-batch (one optimizer step per RL
    step). `tp`/`pp` are the Megatron actor's; `gradient_checkpointing`/`trainable` the torch
    actor's. Weights are kept in float32 (the optimizer's master copy); the model's dtype is the
    compute dtype (autocast) and what engines are sent."""

    backend: str = "torch"  # the actor backend: ACTORS (engines/training/backends.py)
    tp: int = 1  # megatron: tensor parallel size
    pp: int = 1  # megatron: pipeline parallel size
    sharding: str = "none"  # what is sharded over the DP ranks: ACTORS[backend].shardings (backends.py)
    lora: LoraConfig | None = None  # train a LoRA adapter (engines/training/lora.py); None = every weight
    # torch actor: the HF attention kernel of the policy's forward and backward. auto = the model's
    # default (sdpa); eager was 1.2x faster for a bf16 update of ~200-token rows on an AVX-512 CPU
    attn_implementation: str = "auto"
    # CPU trainers: glibc keeps freed memory for the next micro-batch instead of faulting every large
    # buffer in again, handed back when the update ends (parallel/host.py; benchmarks/host_memory.py);
    # false = glibc defaults
    retain_freed_memory: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = from_mapping(LoraConfig, self.lora, "actor.lora")
        spec = actor_backend(self.backend)
        for name in ("micro_batch_size", "ppo_epochs", "tp", "pp"):
            value = getattr(self, name)
            if value is None or value < 1:
                raise ValueError(f"actor.{name}={value!r} must be a positive integer")
        if not spec.model_parallel and (self.tp, self.pp) != (1, 1):
            raise ValueError(f"actor.tp={self.tp}, actor.pp={self.pp} need a model-parallel backend "
                             f"(actor.backend={'|'.join(with_feature('model_parallel'))}); the {self.backend} actor is "
                             "data parallel only")
        if not spec.hf_options and (self.trainable or self.gradient_checkpointing):
            raise ValueError(f"actor.trainable={list(self.trainable)} / actor.gradient_checkpointing="
                             f"{self.gradient_checkpointing} are options of the {'|'.join(with_feature('hf_options'))} "
                             f"actor; the {self.backend} actor trains every parameter without recomputation: set "
                             "actor.trainable=[] actor.gradient_checkpointing=false")
        if self.sharding not in spec.shardings:
            raise ValueError(f"actor.sharding={self.sharding!r} is not allowed with actor.backend={self.backend!r}; "
                             f"choose one of {list(spec.shardings)}")
        if self.lr <= 0:
            raise ValueError(f"actor.lr={self.lr} must be > 0")
        if self.attn_implementation not in ATTENTION:
            raise ValueError(f"actor.attn_implementation={self.attn_implementation!r} is not allowed; choose one of "
                             f"{list(ATTENTION)}")
        if self.attn_implementation != "auto" and not spec.hf_options:
            raise ValueError(f"actor.attn_implementation={self.attn_implementation!r} is an option of the "
                             f"{'|'.join(with_feature('hf_options'))} actor; the {self.backend} actor has its own "
                             "attention: set actor.attn_implementation=auto")
        # YAML 1.1 reads a bare on/off (`actor.shared_prefix=off` on the command line) as a boolean
        self.shared_prefix = {"True": "on", "False": "off"}.get(str(self.shared_prefix), self.shared_prefix)
        if self.shared_prefix not in SHARED_PREFIX:
            raise ValueError(f"actor.shared_prefix={self.shared_prefix!r} is not allowed; choose one of {list(SHARED_PREFIX)}")
        if self.shared_prefix == "auto" and (not spec.shared_prefix or self.attn_implementation == "flash_attention_2"):
            self.shared_prefix = "off"  # auto packs only where the actor's attention takes a packed mask
        if self.shared_prefix != "off" and not spec.shared_prefix:
            raise ValueError(f"actor.shared_prefix={self.shared_prefix} is an option of the "
                             f"{'|'.join(with_feature('shared_prefix'))} actor; the {self.backend} actor's own model "
                             "takes no packed attention mask: set actor.shared_prefix=off")
        if self.shared_prefix != "off" and self.attn_implementation == "flash_attention_2":
            raise ValueError("actor.shared_prefix needs an attention that takes a packed mask (sdpa, eager or "
                             "flex_attention); "
                             "flash_attention_2 takes none: set actor.attn_implementation=sdpa or actor.shared_prefix=off")
        if self.packed_attention not in ("auto", "mask", "runs"):
            raise ValueError(f"actor.packed_attention={self.packed_attention!r} is not allowed; choose auto, mask or runs")
        if self.packed_attention == "runs" and self.attn_implementation not in ("auto", "sdpa", "eager"):
            raise ValueError(f"actor.packed_attention=runs stands in for sdpa or eager attention, not "
                             f"actor.attn_implementation={self.attn_implementation}; set packed_attention=mask")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"actor.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 0 "
                             "(0 = actor.micro_batch_size rows per micro-batch)")
        if self.ppo_mini_batch_size < 0:
            raise ValueError(f"actor.ppo_mini_batch_size={self.ppo_mini_batch_size} must be >= 0 (0 = the whole batch)")
        if self.lora is not None and not spec.lora:
            raise ValueError(f"actor.lora is set with actor.backend={self.backend!r}; LoRA trains on the "
                             f"{'|'.join(with_feature('lora'))} actor (actor.backend={with_feature('lora')[0]}), or "
                             "unset it (actor.lora=null)")
        if self.lora is not None and self.trainable:
            raise ValueError(f"actor.lora and actor.trainable={list(self.trainable)} both choose what trains; with "
                             "LoRA only the adapter trains: set actor.trainable=[] (or actor.lora=null)")

    def mini_batch(self, batch_size: int) -> int:
        """Trajectories per optimizer step for a batch of `batch_size`."""
        return self.ppo_mini_batch_size or batch_size

    def on_policy(self, batch_size: int) -> bool:
        """One epoch over one mini-batch: the policy being updated is the one that sampled, so the
        update's own forward can stand in for the old logprobs."""
        return self.ppo_epochs == 1 and self.mini_batch(batch_size) >= batch_size


@dataclass
class CriticConfig(UpdateConfig):
    """The `critic:` section: the value model `algorithm.advantage=gae` learns with
    (`engines/training/critic.py`). It is the policy's checkpoint (or `model`) with its vocabulary
    head replaced by a one-output value head, trained by its own AdamW on the same ranks as the
    actor. The batch geometry keys mean what they mean under `actor:`."""

    model: str = ""  # "" = the policy's checkpoint (model.path); `trainable`: the value head always trains
    sharding: str = ""  # "" = as actor.sharding; none (DDP) | fsdp
    value_clip: float = 0.5  # a value moves at most this far from its scored value per update; 0 = no clipping
    value_warmup_steps: int = 0  # the first N RL steps train the critic only (the actor waits for useful values)
    # GAE lambda of the critic's value targets, apart from algorithm.lam (the policy's advantages): with
    # 1 the targets are the returns themselves; below 1 they are bootstrapped from the critic's own values
    # and a sparse outcome reward fades (lam^k) over a long response before reaching its early tokens
    # (decoupled GAE, VC-PPO arXiv 2503.01491)
    lam: float = 1.0
    # the value head's learning rate over critic.lr: the head starts at zero on a trained body
    head_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.head_lr_scale > 0:
            raise ValueError(f"critic.head_lr_scale={self.head_lr_scale} must be > 0 (the value head's learning rate "
                             f"over critic.lr; 1 = the same)")
        if self.value_clip < 0:
            raise ValueError(f"critic.value_clip={self.value_clip} must be >= 0 (0 = no value clipping)")
        if self.value_warmup_steps < 0:
            raise ValueError(f"critic.value_warmup_steps={self.value_warmup_steps} must be >= 0")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"critic.lam={self.lam} must be in [0, 1] (GAE's lambda of the value targets; "
                             f"1 = the returns)")
        if self.sharding not in ("", *ACTORS["torch"].shardings):
            raise ValueError(f"critic.sharding={self.sharding!r} is not allowed; choose one of "
                             f"{['', *ACTORS['torch'].shardings]} ('' = as actor.sharding)")
        # the shared checks of the batch geometry and optimizer keys, and their normalized values
        self.shared_prefix = self.optim(ActorConfig()).shared_prefix

    def optim(self, actor: ActorConfig) -> ActorConfig:
        """The critic's keys as the `ActorConfig` its torch trainer takes (errors name `critic.`)."""
        try:
            shared = {f.name: getattr(self, f.name) for f in fields(UpdateConfig)}
            shared["trainable"] = [*self.trainable, r"^lm_head\."] if self.trainable else []
            return ActorConfig(backend="torch", **shared,
                               sharding=self.sharding or (actor.sharding if actor.backend == "torch" else "none"))
        except ValueError as e:
            raise ValueError(str(e).replace("actor.", "critic.")) from None
