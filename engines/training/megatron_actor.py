"""The Megatron-core actor: a GPTModel (local layer spec) with tensor and pipeline parallelism,
built from an HF config of a supported family (`parallel/families/`) and loaded from its
safetensors. The PPO loop, SFT step, metrics and drift are `ActorBase`'s
(`engines/training/actor.py`); this file supplies the pipelined forward/backward, the
vocab-parallel logprobs and the model-parallel optimizer step.

- TP: column/row-parallel layers and a vocab-parallel output layer. Logprobs and entropy are
  computed over the vocabulary shards with Megatron's reduce-from-TP-region mapping (all-reduce
  forward, identity backward): the loss is replicated on the TP ranks, each gets its own shard's
  gradient. Padded vocabulary entries are masked out, so values match the HF model's.
- PP: an all-forward-then-all-backward schedule over point-to-point sends of the hidden states
  ([seq, batch, hidden]); the last stage computes logprobs and the loss, and its logprobs are
  broadcast to the other stages. (megatron-core's own pipeline schedules allocate on "cuda"
  unconditionally, so they cannot run on CPU; this one runs on both.)
- DP: rows of the batch are split over the data-parallel replicas; losses are divided by the
  global token (or sequence) count, so summing gradients over DP gives the mini-batch gradient.
- The optimizer is torch AdamW over each rank's shard, with the gradient norm reduced over the
  model-parallel group (each replicated tensor counted once) for clipping.

On CPU megatron-core 0.16 needs three stand-ins, applied by `cpu_shims()`: a `current_device`
that names the CPU, a null fork for the CUDA RNG tracker (dropout is 0 here, so its streams are
never drawn from), and an explicit attention mask (ours always is). The tracker itself is seeded
on both devices alike (`seed_parallel_rng`), so a missing seed shows on CPU too.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from engines.training.actor import ActorBase, LossFn, adamw
from engines.training.batch import MicroBatch
from engines.training.config import ActorConfig
from parallel.mesh import recv_tensor, send_tensor

if TYPE_CHECKING:
    from parallel.mesh import TrainMesh

_NEG = -1e30  # logit of padded vocabulary entries: exp() is 0, and 0 * _NEG stays finite


def cpu_shims() -> None:
    """Let megatron-core's local modules run on CPU (see the module docstring); idempotent."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    @contextlib.contextmanager
    def _no_fork(*_a: Any, **_k: Any) -> Iterator[None]:
        yield

    mrandom.get_cuda_rng_tracker().fork = _no_fork


def seed_parallel_rng(seed: int, tp_rank: int) -> None:
    """Seed megatron-core's RNG tracker the way its layers expect before they run: the data-parallel
    stream (`seed`), the model-parallel one (seed + 2718 + TP rank: each TP rank its own, every DP
    replica alike) and the expert one. On CUDA this is megatron-core's own
    `model_parallel_cuda_manual_seed` (without it the first forward fails: "cuda rng state
    model-parallel-rng is not added"); on CPU, which has no CUDA generator to hold, the same names
    and seeds as CPU generator states (dropout is 0 here, so they are never drawn from)."""
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank)
        return
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    for name, value in ((mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed),
                        (mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank),
                        (mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)):
        tracker.seeds_.add(value)
        tracker.states_[name] = torch.Generator().manual_seed(value).get_state()


def vocab_parallel_stats(logits: torch.Tensor, targets: torch.Tensor, vocab: int, tp_rank: int,
                         want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[target] and the entropy, for logits split over the TP ranks by vocab
    ([..., V/tp] on each rank). Differentiable; values identical on every TP rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

    z = logits.float()
    vp = z.shape[-1]
    start = tp_rank * vp
    if start + vp > vocab:  # the padded tail of the vocabulary is not part of the model
        ids = torch.arange(start, start + vp, device=z.device)
        z = torch.where(ids >= vocab, torch.full_like(z, _NEG), z)
    m = z.detach().max(dim=-1, keepdim=True).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    zs = z - m
    lse = reduce(zs.exp().sum(-1)).log()
    local = targets - start
    here = (local >= 0) & (local < vp)
    picked = torch.where(here, zs.gather(-1, local.clamp(0, vp - 1).unsqueeze(-1)).squeeze(-1), 0.0)
    lp = reduce(picked) - lse
    ent = None
    if want_entropy:
        p = (zs - lse.unsqueeze(-1)).exp()
        ent = lse - reduce((p * zs).sum(-1))
    return lp, ent


def _into_main_grad(p: torch.Tensor) -> None:
    """Post-accumulate hook of a below-fp32 parameter: move its gradient into the fp32 main grad."""
    p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
    p.grad = None


class MegatronActor(ActorBase):
    def __init__(self, cfg: ActorConfig, model: str, dtype: str = "float32", temperature: float = 1.0,
                 seed: int = 0, progress: bool = True) -> None:
        from transformers import AutoConfig

        from parallel.mesh import init_training_mesh
        from parallel.reshard import DecoderLayout

        if cfg.backend != "megatron":
            raise ValueError(f"MegatronActor got actor.backend={cfg.backend!r}; set actor.backend=megatron")
        super().__init__(cfg, model, dtype, temperature, seed, progress)
        # Megatron's way: parameters in the compute dtype (no autocast: megatron-core's linear
        # layers run their own backward and do not mix dtypes), fp32 main weights and grads below
        self.param_dtype = self.compute_dtype
        self.mesh: TrainMesh = init_training_mesh(cfg.tp, cfg.pp)
        m = self.mesh
        self.rank, self.world = m.rank, m.world
        self.dp_rank, self.dp_size, self.dp_group = m.dp_rank, m.dp, m.groups["dp"]
        cpu_shims()
        seed_parallel_rng(seed, m.tp_rank)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.hf_config = AutoConfig.from_pretrained(model)
        self.layout: DecoderLayout = DecoderLayout.from_hf_config(self.hf_config)
        self.layout.check(cfg.tp, cfg.pp)
        torch.manual_seed(seed)
        self.model = self._build().to(self.device)
        self._load_hf(Path(model))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # sharding=optimizer: AdamW state in DP ranges (engines/training/zero.py); parameters below
        # fp32 always step through it, for its fp32 main weights (the whole tensor when unsharded)
        self.zero: Any = None
        sharded = cfg.sharding == "optimizer" and m.dp > 1
        if sharded or self.param_dtype != torch.float32:
            from engines.training.zero import ShardedAdamW

            self.zero = ShardedAdamW(self.params, m.dp_rank if sharded else 0, m.dp if sharded else 1,
                                     m.groups["dp"], cfg.lr, cfg.weight_decay)
            self.optimizer = self.zero.optimizer  # this rank's shard: what set_lr and checkpoints see
        else:
            self.optimizer = adamw(self.params, cfg.lr, cfg.weight_decay)
        self._sharded_optimizer = sharded
        if self.param_dtype != torch.float32:  # fp32 main grads: micro-batches accumulate without rounding
            for p in self.params:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)  # type: ignore[attr-defined]
                p.register_post_accumulate_grad_hook(_into_main_grad)

    # ------------------------------------------------------------------ model
    def _build(self) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        lay, m = self.layout, self.mesh
        family = lay.family  # norm, activation, biases, positions: parallel/families/<model_type>.py
        tcfg = TransformerConfig(
            num_layers=lay.num_layers, hidden_size=lay.hidden, num_attention_heads=lay.heads,
            num_query_groups=lay.groups, kv_channels=lay.head_dim, ffn_hidden_size=lay.ffn,
            **family.transformer_flags(lay), attention_dropout=0.0, hidden_dropout=0.0,
            tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp, params_dtype=self.param_dtype,
            pipeline_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=False,
            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False)
        return GPTModel(tcfg, family.layer_spec(),
                        vocab_size=lay.padded_vocab(m.tp), max_sequence_length=lay.max_positions,
                        pre_process=m.first_stage, post_process=m.last_stage,
                        # tied + pipelined: two copies (first and last stage) whose gradients
                        # _reduce_and_step all-reduces; megatron's own set-up of that moves them to "cuda"
                        share_embeddings_and_output_weights=lay.tied and m.pp == 1, parallel_output=True,
                        **family.model_flags(lay))

    def _load_hf(self, path: Path) -> None:
        from safetensors import safe_open

        from parallel.reshard import hf_to_megatron

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}; the Megatron actor loads HF safetensors checkpoints")
        handles = [safe_open(str(f), "pt") for f in files]
        where = {k: h for h in handles for k in h.keys()}

        def get(name: str) -> torch.Tensor:
            if name not in where:
                raise KeyError(f"{path} has no tensor {name!r}; is it a {self.layout} checkpoint?")
            return where[name].get_tensor(name).float()

        m = self.mesh
        state = hf_to_megatron(get, self.layout, m.tp_rank, m.tp, m.pp_rank, m.pp)
        own = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or extra:
            raise RuntimeError(f"HF -> Megatron conversion mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
        for k, t in state.items():
            if tuple(own[k].shape) != tuple(t.shape):
                raise RuntimeError(f"{k}: converted shape {tuple(t.shape)} != model shape {tuple(own[k].shape)}")
        self.model.load_state_dict(state, strict=False)

    def megatron_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}

    # ------------------------------------------------------------------ micro-batches
    def _mask(self, attn: torch.Tensor) -> torch.Tensor:
        """[b, 1, s, s] bool, True = not attended: the future and padding keys."""
        s = attn.shape[1]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        return (causal[None, None] | ~attn.bool()[:, None, None, :]).to(self.device)

    # ------------------------------------------------------------------ pipeline
    def _pipeline(self, micro: list[MicroBatch], want_entropy: bool, grad: bool, temperature: float, bar: tqdm,
                  loss_fn: LossFn | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Forward every micro-batch through this rank's stage, then (grad) backward in reverse.
        Returns (logprobs, entropy) per micro-batch on the last stage, [] elsewhere."""
        m = self.mesh
        prev = m.rank_of(m.tp_rank, m.pp_rank - 1, m.dp_rank) if not m.first_stage else None
        nxt = m.rank_of(m.tp_rank, m.pp_rank + 1, m.dp_rank) if not m.last_stage else None
        saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        results = []
        for mb in micro:
            if mb.pixel_values is not None:
                raise NotImplementedError("the megatron actor trains text models only; train a vision-language "
                                          "model with actor.backend=torch")
            b, s = mb.input_ids.shape
            inp = None
            if prev is not None:
                inp = recv_tensor((s, b, self.layout.hidden), self.param_dtype, prev, self.device)
                inp.requires_grad_(grad)
            self.model.set_input_tensor(inp)
            pos = torch.arange(s, device=self.device)[None].expand(b, s)
            with torch.set_grad_enabled(grad):
                out = self.model(mb.input_ids.to(self.device) if m.first_stage else None, pos,
                                 self._mask(mb.attention_mask))
            if nxt is not None:
                send_tensor(out.detach().to(self.param_dtype), nxt)
                saved.append((inp, out))
            else:
                k = mb.targets.shape[1]
                logits = out[:, mb.first:mb.first + k]
                if temperature != 1.0:
                    logits = logits.float() / temperature
                with torch.set_grad_enabled(grad):
                    lp, ent = vocab_parallel_stats(logits, mb.targets.to(self.device), self.layout.vocab,
                                                   m.tp_rank, want_entropy)
                results.append((lp.detach(), None if ent is None else ent.detach()))
                if grad:
                    assert loss_fn is not None
                    saved.append((inp, loss_fn(mb, lp, ent)))
            bar.update(1)
        if grad:
            for inp, out in reversed(saved):
                if nxt is None:
                    out.backward()
                else:
                    g = recv_tensor(tuple(out.shape), self.param_dtype, nxt, self.device)
                    out.backward(g.to(out.dtype))
                if prev is not None:
                    assert inp is not None and inp.grad is not None
                    send_tensor(inp.grad, prev)
        self.model.set_input_tensor(None)
        return results

    # ------------------------------------------------------------------ the backend hooks
    def _set_train(self, mode: bool) -> None:
        self.model.train(mode)

    def _owns_metrics(self) -> bool:
        """The loss lives on the last stage, replicated over its TP ranks: TP rank 0 counts it."""
        return self.mesh.last_stage and self.mesh.tp_rank == 0

    def _forward_backward(self, micro: list[MicroBatch], want_entropy: bool, temperature: float, loss_fn: LossFn,
                          bar: tqdm) -> None:
        self._pipeline(micro, want_entropy, True, temperature, bar, loss_fn)

    def _forward_logprobs(self, micro: list[MicroBatch], bar: tqdm) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The last stage's values, broadcast along the pipeline in one flat tensor (every stage
        knows each micro-batch's [b, k] shape)."""
        m = self.mesh
        res = self._pipeline(micro, True, False, self.temperature, bar)
        shapes = [tuple(mb.targets.shape) for mb in micro]
        sizes = [b * k for b, k in shapes]
        if m.last_stage:
            flat = torch.cat([torch.cat([lp.float().reshape(-1), ent.float().reshape(-1)]) for lp, ent in res]
                             or [torch.zeros(0)]).to(self.device)
        else:
            flat = torch.zeros(2 * sum(sizes), device=self.device)
        if m.pp > 1:
            dist.broadcast(flat, src=m.rank_of(m.tp_rank, m.pp - 1, m.dp_rank), group=m.groups["pp"])
        out, at = [], 0
        flat = flat.cpu()
        for (b, k), n in zip(shapes, sizes):
            out.append((flat[at:at + n].reshape(b, k), flat[at + n:at + 2 * n].reshape(b, k)))
            at += 2 * n
        return out

    def _optimizer_share(self) -> float:
        return 1.0 / self.mesh.dp if self._sharded_optimizer else 1.0

    def _grads(self) -> dict[int, torch.Tensor]:
        """Each trainable parameter's gradient by id: the fp32 main grad below fp32, else .grad."""
        out = {}
        for p in self.params:
            if hasattr(p, "main_grad"):
                out[id(p)] = p.main_grad
            else:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                out[id(p)] = p.grad
        return out

    def _step_optimizer(self) -> float:
        """Sum gradients over data-parallel replicas (and the tied embedding copies of the first
        and last stage), clip by the global norm, step."""
        from parallel.reshard import tp_sharded

        m = self.mesh
        grads = self._grads()
        if m.dp > 1:
            for g in grads.values():
                dist.all_reduce(g, group=m.groups["dp"])
        if m.pp > 1 and self.layout.tied and (m.first_stage or m.last_stage):
            w = (self.model.embedding.word_embeddings.weight if m.first_stage else self.model.output_layer.weight)
            dist.all_reduce(grads[id(w)], group=m.groups["embedding"])
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            if not tp_sharded(name) and m.tp_rank != 0:
                continue  # replicated over TP: count once
            if self.layout.tied and m.pp > 1 and m.last_stage and name == "output_layer.weight":
                continue  # the first stage's embedding already counts it
            sq += grads[id(p)].double().pow(2).sum()
        if m.tp * m.pp > 1:
            dist.all_reduce(sq, group=m.groups["mp"])
        norm = float(sq.sqrt())
        if self.cfg.grad_clip and norm > self.cfg.grad_clip:
            for g in grads.values():
                g.mul_(self.cfg.grad_clip / (norm + 1e-6))
        if self.zero is not None:
            self.zero.step([grads[id(p)] for p in self.params])
        else:
            self.optimizer.step()
        for p in self.params:
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        return norm

    # ------------------------------------------------------------------ weights and state
    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors of the live model, yielded on global rank 0; every rank must iterate."""
        from parallel.reshard import iter_hf_weights

        m = self.mesh
        for name, t in iter_hf_weights(self.megatron_state(), self.layout, m.groups["tp"], m.tp_rank, m.tp,
                                       m.pp_rank, m.pp, m.stage_leader, dst=0, rank=m.rank, skip=m.dp_rank != 0):
            yield name, t.to(self.compute_dtype)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard (each rank saves its own): model, optimizer, counters."""
        out = {"model": self.model.state_dict(), **self._counters(), "coords": (self.mesh.tp_rank, self.mesh.pp_rank),
               "dp": self.mesh.dp}
        if self.zero is not None:
            out["masters"] = self.zero.master_state()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = (self.mesh.tp_rank, self.mesh.pp_rank)
        if tuple(state["coords"]) != mine:
            raise ValueError(f"checkpoint shard is for (tp, pp) = {tuple(state['coords'])}, this rank is {mine}; resume "
                             "with the same actor.tp and actor.pp")
        if self._sharded_optimizer and state.get("dp") != self.mesh.dp:
            raise ValueError(f"checkpoint's optimizer is sharded over DP {state.get('dp')}, this run has DP "
                             f"{self.mesh.dp}; resume with the same number of processes")
        self.model.load_state_dict(state["model"])
        self._load_counters(state)
        if self.zero is not None:
            if "masters" in state:
                self.zero.load_master_state(state["masters"])
            else:
                self.zero.refresh()

    def save_hf(self, path: Path) -> None:
        """Gather to rank 0 and write safetensors + config + tokenizer there; every rank calls it."""
        from safetensors.torch import save_file

        from engines.models import load_tokenizer

        tensors = {name: t.cpu().contiguous() for name, t in self.named_hf_weights()}
        if self.mesh.rank != 0:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        cfg = self.hf_config.to_dict()
        cfg["torch_dtype"] = self.dtype
        self.hf_config.__class__.from_dict(cfg).save_pretrained(path)
        load_tokenizer(str(self.model_path)).save_pretrained(path)
