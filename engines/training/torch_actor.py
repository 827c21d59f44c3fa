"""The plain-torch actor: a transformers causal LM on CPU or one GPU per rank, data parallel over
the ranks torchrun starts, in one of two ways (`actor.sharding`):

  none  DDP: every rank holds the whole model, its gradients and AdamW state (16 bytes per
        parameter); gradients are synchronised on the last micro-batch of a mini-batch only
  fsdp  FSDP2 (`engines/training/fsdp.py`): weights, gradients and AdamW state sharded over the
        ranks, gathered layer by layer for compute, optionally in bf16 with fp32 master weights

With `actor.lora` only a LoRA adapter trains (`engines/training/lora.py`): the frozen base is held
once (in the compute dtype without FSDP: it needs no fp32 master), gradients and AdamW state exist
for the adapter alone, checkpoints hold the adapter, and weight sync can send the adapter alone.

The PPO loop, SFT step and metrics are `ActorBase`'s; this file only says how micro-batches go
forward and backward. Both wrappers average gradients over the ranks, so each loss is multiplied
by the world size to turn that average into the sum the global-denominator losses need.
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm import tqdm

from engines.training.actor import ActorBase, LossFn, adamw, dist_info
from engines.training.batch import MicroBatch
from engines.training.config import ActorConfig
from engines.training.hf_model import default_device, load_causal_lm, micro_logprobs
from parallel.reduce import most_over_ranks

SHARD_BYTES = 2 << 30  # HF export: safetensors files of at most this many bytes


def _dummy_micro() -> MicroBatch:
    """A one-token pass for a rank with fewer micro-batches than the others (FSDP's gathers are
    collective); its loss is multiplied by zero."""
    ids = torch.zeros((1, 2), dtype=torch.long)
    return MicroBatch(rows=torch.zeros(0, dtype=torch.long), input_ids=ids, attention_mask=torch.ones_like(ids),
                      position_ids=None, first=0, targets=ids[:, 1:], target_mask=torch.ones((1, 1), dtype=torch.bool))


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


class TorchActor(ActorBase):
    fresh: tuple[str, ...] = ()  # parameter-name prefixes `_prepare` creates (not read from the checkpoint)

    def __init__(self, cfg: ActorConfig, model: str, dtype: str = "float32", temperature: float = 1.0,
                 seed: int = 0, progress: bool = True, device: torch.device | None = None) -> None:
        if cfg.backend != "torch":
            raise ValueError(f"TorchActor got actor.backend={cfg.backend!r}; use MegatronActor for 'megatron'")
        super().__init__(cfg, model, dtype, temperature, seed, progress)
        self.rank, self.world = dist_info()
        self.dp_rank, self.dp_size = self.rank, self.world
        self.device = device or default_device()
        if getattr(cfg, "attn_implementation", "auto") == "flex_attention" and self.device.type != "cuda":
            raise ValueError(f"actor.attn_implementation=flex_attention trains on CUDA only (torch has no flex "
                             f"attention backward on {self.device.type}); use sdpa or eager here")
        torch.manual_seed(seed)
        self.fsdp = cfg.sharding == "fsdp" and self.world > 1
        self.lora = cfg.lora  # LoraConfig | None: only a LoRA adapter trains
        if self.fsdp:  # no rank ever loads the whole model: meta build, shard, read its slices
            from engines.training.fsdp import load_sharded

            self.module = load_sharded(model, self.device, self.compute_dtype, self._prepare, fresh=self.fresh,
                                       init=self._initial_value if self.lora is not None else None)
            self.params = [p for p in self.module.parameters() if p.requires_grad]
        else:  # a frozen LoRA base needs no fp32 master copy: it is held in the compute dtype
            self.module = load_causal_lm(model, torch.float32 if self.lora is None else self.compute_dtype,
                                         self.device)
            self._prepare(self.module)
        self.model: torch.nn.Module = self.module
        if not self.fsdp and self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.module, device_ids=[self.device] if self.device.type == "cuda"
                                                 else None)
        self.optimizer = adamw(self._param_groups(), cfg.lr, cfg.weight_decay)

    def _param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: one; a group with an `lr_scale` gets `set_lr`'s rate times it."""
        return [{"params": self.params}]

    def _prepare(self, module: torch.nn.Module) -> None:
        """The attention kernel, activation checkpointing and the trainable subset, set before any wrapping."""
        attention = getattr(self.cfg, "attn_implementation", "auto")  # a critic keeps the model's default
        if attention != "auto":
            module.set_attn_implementation(attention)
        packed = getattr(self.cfg, "packed_attention", "auto")  # a critic: by runs where it packs
        if packed == "runs" or (packed == "auto" and getattr(self.cfg, "shared_prefix", "off") != "off"):
            from engines.training.tree_attention import install

            self.by_runs = install(module)  # auto: runs where the model's attention is sdpa or eager
            if not self.by_runs and packed == "runs":
                raise ValueError("actor.packed_attention=runs stands in for sdpa or eager attention; this model's is "
                                 f"{module.config._attn_implementation}: set actor.packed_attention=mask")
        if self.cfg.gradient_checkpointing:
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.cfg.lora is not None:
            from engines.training.lora import add_adapter

            self.params = add_adapter(module, self.cfg.lora, str(self.model_path))
            return
        self.params = self._select_trainable(module, list(self.cfg.trainable))

    def _initial_value(self, name: str, shape: torch.Size) -> torch.Tensor | None:
        """Sharded with LoRA: the whole first value of an adapter tensor (none is in the checkpoint)."""
        from engines.training.lora import initial_value

        return initial_value(name, shape, self.seed)

    @staticmethod
    def _select_trainable(module: torch.nn.Module, patterns: list[str]) -> list[torch.nn.Parameter]:
        named = list(module.named_parameters())
        if not patterns:
            return [p for _, p in named]
        regexes = [re.compile(p) for p in patterns]
        keep = []
        for name, p in named:
            p.requires_grad_(any(rx.search(name) for rx in regexes))
            if p.requires_grad:
                keep.append(p)
        if not keep:
            raise ValueError(f"actor.trainable={patterns} matches no parameter; names look like "
                             f"{[n for n, _ in named[:3]]}")
        return keep

    def _autocast(self) -> Any:
        return nullcontext() if self.fsdp else super()._autocast()  # FSDP casts the gathered weights itself

    def _padded(self, micro: list[MicroBatch]) -> list[tuple[MicroBatch, bool]]:
        """(micro-batch, real) pairs, padded under FSDP to the most any rank has."""
        pairs = [(mb, True) for mb in micro]
        if self.fsdp:
            pairs += [(_dummy_micro(), False)] * (most_over_ranks(len(micro)) - len(micro))
        return pairs

    # ------------------------------------------------------------------ the backend hooks
    def _score(self, model: torch.nn.Module, mb: MicroBatch, temperature: float,
               want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[b, k] per-target numbers the loss works on: the policy's logprobs (and entropy)."""
        return micro_logprobs(model, mb, temperature, want_entropy)

    def _set_train(self, mode: bool) -> None:
        self.module.train(mode)

    def _forward_backward(self, micro: list[MicroBatch], want_entropy: bool, temperature: float, loss_fn: LossFn,
                          bar: tqdm) -> None:
        pairs = self._padded(micro)
        for j, (mb, real) in enumerate(pairs):
            sync = j == len(pairs) - 1 or self.world == 1
            if self.fsdp:
                self.module.set_requires_gradient_sync(sync)
            with nullcontext() if sync or self.fsdp else self.model.no_sync():
                with self._autocast():
                    lp, ent = self._score(self.model, mb.to(self.device), temperature, want_entropy)
                loss = loss_fn(mb, lp, ent) if real else lp.float().sum() * 0.0
                (loss * self.world).backward()
            if real:
                bar.update(1)

    def _forward_logprobs(self, micro: list[MicroBatch], bar: tqdm) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for mb, real in self._padded(micro):
            with self._autocast():
                lp, ent = self._score(self.module, mb.to(self.device), self.temperature, True)
            assert ent is not None
            if real:
                out.append((lp.float().cpu(), ent.float().cpu()))
                bar.update(1)
        return out

    def _step_optimizer(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    # ------------------------------------------------------------------ weights and state
    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF checkpoint names, each storage once (a tied lm_head is its embedding), in the
        compute dtype; rank 0 yields. Sharded, every rank must iterate: each tensor is gathered
        from its shards just before it is yielded, never the whole model at once. With LoRA: the
        merged weights (each adapted weight W0 + scale * B @ A) under the plain model's names."""
        named = self._full_state()
        if self.lora is not None:
            from engines.training.lora import merged_named

            named = merged_named(named, self.lora.scaling)
        for name, t in named:
            yield name, t.to(self.compute_dtype)

    def _full_state(self, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(state-dict key, whole tensor as held) of the module's tensors (`keep`: those keys only),
        each storage once; rank 0 yields, every other rank only takes part in the gathers."""
        if self.fsdp:
            from engines.training.fsdp import full_named_tensors

            for name, t in full_named_tensors(self.module, keep):
                if self.rank == 0:
                    yield name, t.detach()
            return
        if self.rank != 0:
            return
        seen: set[int] = set()
        for name, t in self.module.state_dict().items():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or (keep is not None and not keep(name)):
                continue
            seen.add(ptr)
            yield name, t.detach()

    def named_sync_weights(self, adapter: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """What the weight sync sends the engines: with LoRA and engines that apply an adapter
        (`adapter`), the adapter alone under peft's names with lora_B scaled (engines/lora.py);
        otherwise `named_hf_weights()` (merged, with LoRA)."""
        if self.lora is None or not adapter:
            return self.named_hf_weights()
        from engines.training.lora import adapter_named, is_adapter_key

        return ((n, t.to(self.compute_dtype)) for n, t in adapter_named(self._full_state(is_adapter_key),
                                                                         self.lora.scaling))

    def adapters_off(self) -> AbstractContextManager[None]:
        """Inside, the model is its base (the LoRA adapter switched off): the reference policy."""
        from engines.training.lora import adapters_off

        return adapters_off(self.module)

    def state_dict(self) -> dict[str, Any]:
        """Sharded: this rank's shards of the weights and optimizer (resume on as many ranks).
        With LoRA only the adapter is saved (under "adapter"): the base is the model it loads."""
        keep, key = self._state_keys()
        if self.fsdp:
            from engines.training.fsdp import local_state

            state = local_state(self.module, self.optimizer, keep)
            state[key] = state.pop("model")
            return {**self._counters(), **state}
        return {key: {k: v for k, v in self.module.state_dict().items() if keep is None or keep(k)},
                **self._counters()}

    def _state_keys(self) -> tuple[Callable[[str], bool] | None, str]:
        """(which state-dict keys a checkpoint holds, under what key): all as "model", or the adapter's."""
        if self.lora is None:
            return None, "model"
        from engines.training.lora import is_adapter_key

        return is_adapter_key, "adapter"

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keep, key = self._state_keys()
        if key not in state:
            saved = "a LoRA adapter" if "adapter" in state else "the whole model"
            raise ValueError(f"this checkpoint holds {saved} and this run has actor.lora="
                             f"{'null' if self.lora is None else 'set'}; resume with the actor.lora setting it was "
                             "saved with, or start in a new trainer.output_dir")
        if self.fsdp:
            from engines.training.fsdp import load_local_state

            load_local_state(self.module, self.optimizer, {**state, "model": state[key]}, keep)
            self.rl_steps, self.sft_steps = int(state["rl_steps"]), int(state["sft_steps"])
            self.set_lr(float(state["lr"]))
            return
        missing, unexpected = self.module.load_state_dict(state[key], strict=keep is None)
        lacking = [k for k in missing if keep is not None and keep(k)]
        if lacking or unexpected:
            raise ValueError(f"the checkpoint's adapter does not fit this model (missing {lacking[:3]}, unexpected "
                             f"{unexpected[:3]}); resume with the actor.lora it was saved with")
        self._load_counters(state)

    def save_hf(self, path: Path) -> None:
        """safetensors + config + generation config + tokenizer, in the compute dtype; rank 0 writes,
        in files of at most SHARD_BYTES, a sharded actor's tensors gathered one at a time. With LoRA:
        the adapter (and the merged model with actor.lora.export_merged), see `_save_lora`."""
        path = Path(path)
        if self.lora is not None:
            self._save_lora(path)
        else:
            self._write_hf(path)
        if self.rank == 0:
            self._save_tokenizer(path)

    def _save_tokenizer(self, path: Path) -> None:
        from engines.models import load_tokenizer, resolve_model

        load_tokenizer(str(self.model_path)).save_pretrained(path)
        source = resolve_model(str(self.model_path))
        for name in PROCESSOR_FILES:  # a vision-language model's image processor goes along
            if (source / name).is_file():
                (path / name).write_bytes((source / name).read_bytes())

    def _save_lora(self, path: Path) -> None:
        """The adapter as peft saves it (`PeftModel.from_pretrained(base, path)` loads it; the base
        is the run's model), and with `actor.lora.export_merged` the merged model in path/merged,
        which transformers and vLLM load as any checkpoint."""
        from engines.training.lora import adapter_config, adapter_named, is_adapter_key, save_adapter

        tensors = dict(adapter_named(self._full_state(is_adapter_key)))  # every rank gathers; rank 0 gets them
        if self.rank == 0:
            save_adapter(path, tensors, adapter_config(self.module, str(self.model_path)))
        if self.lora is not None and self.lora.export_merged:
            self._write_hf(path / "merged")
            if self.rank == 0:
                self._save_tokenizer(path / "merged")

    def _write_hf(self, path: Path) -> None:
        import json

        from safetensors.torch import save_file

        if self.rank == 0:  # transformers' save_pretrained would import DeepSpeed (through accelerate) to unwrap
            path.mkdir(parents=True, exist_ok=True)
            self.module.config.save_pretrained(path)
            if getattr(self.module, "generation_config", None) is not None:
                self.module.generation_config.save_pretrained(path)
        index: dict[str, str] = {}
        part: dict[str, torch.Tensor] = {}
        size = 0

        def flush() -> None:
            nonlocal part, size
            name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            save_file(part, str(path / name), metadata={"format": "pt"})
            index.update({k: name for k in part})
            part, size = {}, 0

        for name, t in self.named_hf_weights():  # every rank gathers; only rank 0 receives tensors
            nbytes = t.numel() * t.element_size()
            if part and size + nbytes > SHARD_BYTES:
                flush()  # rank 0 holds at most one file's worth of whole tensors
            part[name] = t.cpu().contiguous()
            size += nbytes
        if self.rank != 0:
            return
        if not index:  # one file: the plain single-file layout
            save_file(part, str(path / "model.safetensors"), metadata={"format": "pt"})
            return
        flush()
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
