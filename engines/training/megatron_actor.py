"""The Megatron-core actor: a GPTModel (local layer spec) with tensor and pipeline parallelism,
built from an HF llama/qwen2 config and loaded from its safetensors, behind the same interface
as the torch actor (`engines/training/base.py`).

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
never drawn from), and an explicit attention mask (ours always is).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from engines.training.losses import IGNORE_INDEX, LossConfig, compute_loss
from engines.training.torch_actor import _ADDITIVE, DTYPES, ActorConfig, _denominator

if TYPE_CHECKING:
    from parallel.mesh import TrainMesh
    from rollout.manager import Batch

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


@dataclass
class MegatronActorConfig(ActorConfig):
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"actor.tp={self.tp}, actor.pp={self.pp}: both must be >= 1")


@dataclass
class _Micro:
    """One micro-batch as every stage sees it: trimmed ids, positions, padding mask, and which
    logits score which targets (positions [start, start + targets.shape[1]))."""

    ids: torch.Tensor
    attn: torch.Tensor
    start: int
    targets: torch.Tensor
    rows: torch.Tensor  # batch row indices


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


class MegatronActor:
    def __init__(self, cfg: MegatronActorConfig) -> None:
        from transformers import AutoConfig

        from parallel.mesh import init_training_mesh
        from parallel.reshard import DecoderLayout

        self.cfg = cfg
        self.mesh: TrainMesh = init_training_mesh(cfg.tp, cfg.pp)
        cpu_shims()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.compute_dtype = DTYPES[cfg.dtype]
        self.hf_config = AutoConfig.from_pretrained(cfg.model)
        self.layout: DecoderLayout = DecoderLayout.from_hf_config(self.hf_config)
        self.layout.check(cfg.tp, cfg.pp)
        torch.manual_seed(cfg.seed)
        self.model = self._build().to(self.device)
        self._load_hf(Path(cfg.model))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.rl_steps = self.sft_steps = 0
        self._lr = cfg.lr

    # ------------------------------------------------------------------ model
    def _build(self) -> torch.nn.Module:
        import torch.nn.functional as F
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        lay, m = self.layout, self.mesh
        tcfg = TransformerConfig(
            num_layers=lay.num_layers, hidden_size=lay.hidden, num_attention_heads=lay.heads,
            num_query_groups=lay.groups, kv_channels=lay.head_dim, ffn_hidden_size=lay.ffn,
            normalization="RMSNorm", layernorm_epsilon=lay.norm_eps, gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, add_qkv_bias=lay.qkv_bias, attention_dropout=0.0, hidden_dropout=0.0,
            tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp, params_dtype=torch.float32,
            pipeline_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=False,
            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False)
        return GPTModel(tcfg, get_gpt_layer_local_spec(normalization="RMSNorm"),
                        vocab_size=lay.padded_vocab(m.tp), max_sequence_length=lay.max_positions,
                        pre_process=m.first_stage, post_process=m.last_stage,
                        # tied + pipelined: two copies (first and last stage) whose gradients
                        # _reduce_and_step all-reduces; megatron's own set-up of that moves them to "cuda"
                        share_embeddings_and_output_weights=lay.tied and m.pp == 1, position_embedding_type="rope",
                        rotary_base=int(lay.rope_theta), parallel_output=True)

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
    def _local_rows(self, n: int) -> torch.Tensor:
        return torch.tensor_split(torch.arange(n), self.mesh.dp)[self.mesh.dp_rank]

    def _rl_micro(self, batch: "Batch", rows: torch.Tensor) -> list[_Micro]:
        out = []
        p = batch.prompts.shape[1]
        for mb in rows.split(self.cfg.micro_batch_size):
            attn = batch.attention_mask[mb]
            plen, rlen = attn[:, :p].sum(1), attn[:, p:].sum(1)
            end = max(1, int(rlen.max()))
            begin = p - int(plen.max())
            ids = torch.cat([batch.prompts[mb, begin:], batch.responses[mb, :end]], dim=1)
            out.append(_Micro(ids, attn[:, begin:p + end], p - begin - 1, batch.responses[mb, :end], mb))
        return out

    def _mask(self, attn: torch.Tensor) -> torch.Tensor:
        """[b, 1, s, s] bool, True = not attended: the future and padding keys."""
        s = attn.shape[1]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        return (causal[None, None] | ~attn.bool()[:, None, None, :]).to(self.device)

    def _autocast(self) -> Any:
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    # ------------------------------------------------------------------ pipeline
    def _pipeline(self, micro: list[_Micro], want_entropy: bool, grad: bool,
                  loss_fn: Callable[[_Micro, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
                  desc: str = "", temperature: float | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Forward every micro-batch through this rank's stage, then (grad) backward in reverse.
        Returns (logprobs, entropy) per micro-batch on the last stage, [] elsewhere. Logits are
        divided by the sampling temperature (RL) unless `temperature` says otherwise (SFT: 1)."""
        temp = self.cfg.temperature if temperature is None else temperature
        m = self.mesh
        prev = m.rank_of(m.tp_rank, m.pp_rank - 1, m.dp_rank) if not m.first_stage else None
        nxt = m.rank_of(m.tp_rank, m.pp_rank + 1, m.dp_rank) if not m.last_stage else None
        saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
        results = []
        bar = tqdm(total=len(micro), desc=desc, unit="micro-batch", leave=False,
                   disable=not desc or not self.cfg.progress or m.rank != 0)
        for mb in micro:
            b, s = mb.ids.shape
            inp = None
            if prev is not None:
                inp = torch.empty((s, b, self.layout.hidden), dtype=torch.float32, device=self.device)
                dist.recv(inp, src=prev)
                inp.requires_grad_(grad)
            self.model.set_input_tensor(inp)
            pos = torch.arange(s, device=self.device)[None].expand(b, s)
            with torch.set_grad_enabled(grad), self._autocast():
                out = self.model(mb.ids.to(self.device) if m.first_stage else None, pos, self._mask(mb.attn))
            if nxt is not None:
                dist.send(out.detach().float().contiguous(), dst=nxt)
                saved.append((inp, out))
            else:
                k = mb.targets.shape[1]
                logits = out[:, mb.start:mb.start + k]
                if temp != 1.0:
                    logits = logits.float() / temp
                with torch.set_grad_enabled(grad):
                    lp, ent = vocab_parallel_stats(logits, mb.targets.to(self.device), self.layout.vocab,
                                                   m.tp_rank, want_entropy)
                results.append((lp.detach(), None if ent is None else ent.detach()))
                if grad:
                    assert loss_fn is not None
                    saved.append((inp, loss_fn(mb, lp, ent)))
            bar.update(1)
        bar.close()
        if grad:
            for inp, out in reversed(saved):
                if nxt is None:
                    out.backward()
                else:
                    g = torch.empty(out.shape, dtype=torch.float32, device=self.device)
                    dist.recv(g, src=nxt)
                    out.backward(g.to(out.dtype))
                if prev is not None:
                    assert inp is not None and inp.grad is not None
                    dist.send(inp.grad.contiguous(), dst=prev)
        self.model.set_input_tensor(None)
        return results

    def _share(self, per_micro: list[torch.Tensor], micro: list[_Micro], n: int, r: int) -> torch.Tensor:
        """Every rank gets the [n, r] tensor: the last stage's rows, broadcast along the pipeline,
        then gathered over the data-parallel replicas."""
        m = self.mesh
        local_rows = torch.cat([mb.rows for mb in micro]) if micro else torch.zeros(0, dtype=torch.long)
        local = torch.zeros(len(local_rows), r)
        if m.last_stage:
            at = 0
            for t in per_micro:
                local[at:at + t.shape[0], :t.shape[1]] = t.float().cpu()
                at += t.shape[0]
        if m.pp > 1:
            local = local.to(self.device)
            dist.broadcast(local, src=m.rank_of(m.tp_rank, m.pp - 1, m.dp_rank), group=m.groups["pp"])
            local = local.cpu()
        full = torch.zeros(n, r)
        if m.dp > 1:
            per = math.ceil(n / m.dp)
            padded = torch.zeros(per, r)
            padded[:len(local)] = local
            parts = [torch.empty_like(padded) for _ in range(m.dp)]
            dist.all_gather(parts, padded.to(self.device) if self.device.type == "cuda" else padded,
                            group=m.groups["dp"])
            sizes = [len(s) for s in torch.tensor_split(torch.arange(n), m.dp)]
            local = torch.cat([p.cpu()[:k] for p, k in zip(parts, sizes)])
            local_rows = torch.arange(n)
        full[local_rows] = local
        return full

    # ------------------------------------------------------------------ actor interface
    @torch.no_grad()
    def compute_logprobs(self, batch: "Batch") -> tuple[torch.Tensor, torch.Tensor]:
        self.model.eval()
        micro = self._rl_micro(batch, self._local_rows(len(batch)))
        res = self._pipeline(micro, want_entropy=True, grad=False, desc="logprobs")
        r = batch.responses.shape[1]
        lp = self._share([x[0] for x in res], micro, len(batch), r)
        ent = self._share([x[1] for x in res], micro, len(batch), r)
        resp = batch.attention_mask[:, batch.prompts.shape[1]:].bool()
        return torch.where(resp, lp, 0.0), torch.where(resp, ent, 0.0)

    def set_lr(self, lr: float) -> None:
        self._lr = float(lr)
        for g in self.optimizer.param_groups:
            g["lr"] = self._lr

    def update(self, batch: "Batch", advantages: torch.Tensor, old_logprobs: torch.Tensor | None,
               ref_logprobs: torch.Tensor | None, loss: LossConfig) -> dict[str, float]:
        n = len(batch)
        mini = self.cfg.ppo_mini_batch_size or n
        if old_logprobs is None and (mini < n or self.cfg.ppo_epochs > 1):
            raise ValueError("update(old_logprobs=None) is only valid for one epoch over one mini-batch")
        if min(mini, n) < self.mesh.dp:
            raise ValueError(f"a mini-batch of {min(mini, n)} trajectories cannot be split over {self.mesh.dp} "
                             "data-parallel replicas")
        self.rl_steps += 1
        warm = self.cfg.warmup_steps
        self.set_lr(self.cfg.lr * (min(1.0, self.rl_steps / warm) if warm > 0 else 1.0))
        self.model.train()
        mask = batch.loss_mask
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.rl_steps)
        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)
        norms: list[float] = []
        drift = [0.0, 0.0, 0.0]
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(n, generator=gen) if (mini < n or self.cfg.ppo_epochs > 1) else torch.arange(n)
            for s in range(0, n, mini):
                idx = order[s:s + mini]
                denom = _denominator(mask[idx], loss.agg)
                if denom == 0:
                    continue
                rows = torch.tensor_split(idx, self.mesh.dp)[self.mesh.dp_rank]

                def loss_fn(mb: _Micro, lp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
                    k = lp.shape[1]
                    pick = lambda t: None if t is None else t[mb.rows, :k].to(self.device)  # noqa: E731
                    msk = pick(mask)
                    old = pick(old_logprobs)
                    if old is None:
                        old = lp.detach()
                        gap = (pick(batch.rollout_logprobs) - old).abs()[msk.bool()]
                        if gap.numel():
                            drift[0] += float(gap.sum())
                            drift[1] += gap.numel()
                            drift[2] = max(drift[2], float(gap.max()))
                    value, met = compute_loss(loss, lp, old, pick(advantages), msk, pick(ref_logprobs), ent, denom)
                    tokens = float(msk.sum())
                    for key, v in met.items():
                        sums[key] += v if key in _ADDITIVE else v * tokens
                        weights[key] += 0.0 if key in _ADDITIVE else tokens
                    return value

                self._pipeline(self._rl_micro(batch, rows), loss.entropy_coef > 0, True, loss_fn, desc="update")
                norms.append(self._reduce_and_step())
        out = self._reduce_metrics(sums, weights, len(norms))
        if old_logprobs is None:
            out.update(self._reduce_drift(drift))
        out.update({"grad_norm": sum(norms) / max(1, len(norms)), "lr": self._lr, "optimizer_steps": float(len(norms))})
        return out

    def sft_step(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, float]:
        self.model.train()
        self.sft_steps += 1
        denom = float((labels[:, 1:] != IGNORE_INDEX).sum())
        if denom == 0:
            raise ValueError("an SFT batch has no labelled token (all labels are -100); check the traces")
        micro = []
        for mb in self._local_rows(len(input_ids)).split(self.cfg.micro_batch_size):
            width = int(attention_mask[mb].sum(1).max())
            micro.append(_Micro(input_ids[mb, :width], attention_mask[mb, :width], 0, labels[mb, 1:width], mb))
        total = [0.0]

        def loss_fn(mb: _Micro, lp: torch.Tensor, _ent: torch.Tensor | None) -> torch.Tensor:
            keep = mb.targets.to(self.device) != IGNORE_INDEX
            value = -torch.where(keep, lp, 0.0).sum() / denom
            total[0] += float(value.detach())
            return value

        # -100 targets lie outside every vocab shard (logprob 0, masked by loss_fn)
        self._pipeline(micro, False, True, loss_fn, temperature=1.0)
        norm = self._reduce_and_step()
        t = torch.tensor([total[0] if self.mesh.last_stage and self.mesh.tp_rank == 0 else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        return {"loss": float(t[0]), "grad_norm": norm}

    # ------------------------------------------------------------------ reductions
    def _reduce_and_step(self) -> float:
        """Sum gradients over data-parallel replicas (and the tied embedding copies of the first
        and last stage), clip by the global norm, step."""
        from parallel.reshard import tp_sharded

        m = self.mesh
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if m.dp > 1:
            for p in self.params:
                dist.all_reduce(p.grad, group=m.groups["dp"])
        if m.pp > 1 and self.layout.tied and (m.first_stage or m.last_stage):
            w = (self.model.embedding.word_embeddings.weight if m.first_stage else self.model.output_layer.weight)
            dist.all_reduce(w.grad, group=m.groups["embedding"])
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            if not tp_sharded(name) and m.tp_rank != 0:
                continue  # replicated over TP: count once
            if self.layout.tied and m.pp > 1 and m.last_stage and name == "output_layer.weight":
                continue  # the first stage's embedding already counts it
            sq += p.grad.double().pow(2).sum()
        if m.tp * m.pp > 1:
            dist.all_reduce(sq, group=m.groups["mp"])
        norm = float(sq.sqrt())
        if self.cfg.grad_clip and norm > self.cfg.grad_clip:
            for p in self.params:
                p.grad.mul_(self.cfg.grad_clip / (norm + 1e-6))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _reduce_metrics(self, sums: dict[str, float], weights: dict[str, float], steps: int) -> dict[str, float]:
        """Metrics live on the last stage (one copy per TP rank); reduce over the last stage's
        TP-rank-0 of every DP replica by summing from exactly those ranks."""
        keys = sorted(set(sums) | set(weights)) or []
        keys_all: list[Any] = [None] * self.mesh.world
        dist.all_gather_object(keys_all, keys)
        keys = sorted({k for ks in keys_all for k in ks})
        if not keys:
            return {}
        count = self.mesh.last_stage and self.mesh.tp_rank == 0
        t = torch.tensor([[sums.get(k, 0.0) if count else 0.0 for k in keys],
                          [weights.get(k, 0.0) if count else 0.0 for k in keys]], dtype=torch.float64)
        dist.all_reduce(t)
        out = {}
        for i, k in enumerate(keys):
            den = float(steps) if k in _ADDITIVE else float(t[1, i])
            out[k] = float(t[0, i] / den) if den > 0 else 0.0
        return out

    def _reduce_drift(self, drift: list[float]) -> dict[str, float]:
        count = self.mesh.last_stage and self.mesh.tp_rank == 0
        t = torch.tensor(drift[:2] if count else [0.0, 0.0], dtype=torch.float64)
        top = torch.tensor([drift[2] if count else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return {"drift_mean": float(t[0] / t[1]) if t[1] > 0 else 0.0, "drift_max": float(top[0])}

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
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "rl_steps": self.rl_steps,
                "sft_steps": self.sft_steps, "lr": self._lr, "coords": (self.mesh.tp_rank, self.mesh.pp_rank)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = (self.mesh.tp_rank, self.mesh.pp_rank)
        if tuple(state["coords"]) != mine:
            raise ValueError(f"checkpoint shard is for (tp, pp) = {tuple(state['coords'])}, this rank is {mine}; resume "
                             "with the same actor.tp and actor.pp")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rl_steps, self.sft_steps = int(state["rl_steps"]), int(state["sft_steps"])
        self.set_lr(float(state["lr"]))

    def save_hf(self, path: Path) -> None:
        """Gather to rank 0 and write safetensors + config + tokenizer there; every rank calls it."""
        from safetensors.torch import save_file
        from transformers import AutoTokenizer

        tensors = {name: t.cpu().contiguous() for name, t in self.named_hf_weights()}
        if self.mesh.rank != 0:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        cfg = self.hf_config.to_dict()
        cfg["torch_dtype"] = self.cfg.dtype
        self.hf_config.__class__.from_dict(cfg).save_pretrained(path)
        AutoTokenizer.from_pretrained(self.cfg.model).save_pretrained(path)
