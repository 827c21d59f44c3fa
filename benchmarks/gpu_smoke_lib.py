"""What the GPU smoke suite's checks share (benchmarks/gpu_smoke.py): the run's context, prompts, an
engine run, a teacher-forced forward, a one-process torch.distributed world and the FSDP2 actor on it."""

from __future__ import annotations

import asyncio
import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

BF16_LOGPROB_TOL = 1.0  # bf16 differs by kernel and batch shape; past 1 nat the weights or the math are wrong

QUESTIONS = ["What is 12 + 30?", "Name a prime number larger than 10.", "Say hello in French.",
             "Count from one to five.", "What colour is the sky?", "Write one word that rhymes with cat."]


class Skip(Exception):
    """A check that cannot run here; its message is the reason."""


@dataclass
class Ctx:
    device: str  # "cpu" or "cuda"
    model: str  # a local HF model directory
    quick: bool
    work: Path
    limits: dict[str, float] | None = None  # device_limits(), measured once
    small: str | None = None  # the model given, when --model-size built a larger one: the two-rank checks' model

    @property
    def small_model(self) -> str:
        return self.small or self.model

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def size(self, quick: int, full: int) -> int:
        return quick if self.quick else full


def prompts(ctx: Ctx, n: int) -> list[list[int]]:
    """Chat-formatted prompts of `n` short questions, as token ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ctx.model)
    out = []
    for q in (QUESTIONS * n)[:n]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def engine_outputs(ctx: Ctx, dtype: str, ps: list[list[int]], params: Any, tag: str) -> tuple[list[Any], float]:
    """Generate every prompt at once on a fresh HFEngine; (outputs, seconds generating)."""
    from engines.inference.hf import HFEngine

    async def main() -> tuple[list[Any], float]:
        engine = HFEngine(ctx.model, device=ctx.device, dtype=dtype)
        await engine.start()
        try:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*[engine.generate(f"{tag}{i}", p, params) for i, p in enumerate(ps)])
            return list(outs), time.perf_counter() - t0
        finally:
            await engine.close()

    return asyncio.run(main())


def teacher_forced(model: Any, prompt: list[int], tokens: list[int], device: Any) -> torch.Tensor:
    """log_softmax of `model`'s logits at each of `tokens` after `prompt`: [len(tokens), vocab], fp32."""
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).cpu()


def chosen(logp: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """The logprob of each token in `tokens` from a [len(tokens), vocab] table."""
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def load_model(ctx: Ctx, dtype: torch.dtype) -> Any:
    from engines.models import load_pretrained

    return load_pretrained(ctx.model, dtype).to(ctx.device).eval()


def free_memory(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def gb(n: float) -> float:
    return round(n / 2**30, 4)


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    if not out:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return out


def perturbed_model(ctx: Ctx, seed: int = 7, scale: float = 0.05) -> Any:
    """The model in fp32 with seeded noise of `scale` x each weight's std added: other weights of the
    same shapes, for a push whose arrival shows in the logprobs."""
    model = load_model(ctx, torch.float32)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for p in model.parameters():  # each storage once: a tied head moves with its embedding
            if p.numel() > 1:
                p.add_(torch.randn(p.shape).to(p.device) * (scale * float(p.float().std())))
    return model


@contextmanager
def one_rank_group(ctx: Ctx) -> Iterator[None]:
    """A torch.distributed world of one process (FSDP2 needs a process group, even of one)."""
    import torch.distributed as dist

    if ctx.cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if ctx.cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2_actor(ctx: Ctx, dtype: str, **cfg: Any) -> Any:
    """A TorchActor on FSDP2 in one process. TorchActor shards only when world > 1, so on one GPU
    its FSDP2 branch (load_sharded: meta build, fully_shard per layer, each rank reads its slices) is
    taken here by hand; everything after (forward, backward, clip, step, export) is the actor's own."""
    from engines.training.config import ActorConfig
    from engines.training.fsdp import load_sharded
    from engines.training.torch_actor import TorchActor

    config = ActorConfig(sharding="fsdp", **cfg)
    actor = TorchActor(config, ctx.model, dtype=dtype, progress=False, device=ctx.torch_device)
    actor.module = actor.model = actor.optimizer = None
    actor.params = []
    free_memory(ctx)
    actor.fsdp = True
    actor.module = actor.model = load_sharded(ctx.model, ctx.torch_device, actor.compute_dtype, actor._prepare)
    actor.params = [p for p in actor.module.parameters() if p.requires_grad]
    actor.optimizer = torch.optim.AdamW(actor.params, lr=config.lr, weight_decay=config.weight_decay)
    return actor


def rollout_batch(rows: list[tuple[list[int], list[int], list[float]]], pad_id: int, group: int) -> Any:
    """A training batch of (prompt, response, engine logprobs) rows, every response token the model's."""
    from agent.loop import AgentLoopOutput
    from engines.training.batch import pad_outputs

    outs = [AgentLoopOutput(prompt_ids=p, response_ids=r, response_mask=[1] * len(r), response_logprobs=lp,
                            reward=float(i % 2), num_turns=1, termination="length")
            for i, (p, r, lp) in enumerate(rows)]
    return pad_outputs(outs, pad_id, [i // group for i in range(len(rows))])


def pad_id(ctx: Ctx) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ctx.model)
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


# the models the suite builds on the machine itself (`--model-size`): random weights of a llama shape, the
# tokenizer of the model given, so figures mean something at a real size without a download
SIZES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8},  # 1.07B parameters with SmolLM2's 49,152-token vocabulary
    "test": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},  # the CPU form of the same build
}


def build_model(size: str, tokenizer_from: str, out: Path, device: str) -> Path:
    """A llama of shape SIZES[size] with seeded random weights and `tokenizer_from`'s tokenizer, saved
    in bf16 at `out` (built on `device`: a 1B model takes seconds on a GPU)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"--model-size {size!r}; choose one of {sorted(SIZES)}")
    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                      torch_dtype="bfloat16", **SIZES[size])
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    del model
    return out


def device_limits(ctx: Ctx) -> dict[str, float]:
    """What this device can do, measured here, so the suite's figures read as fractions of it: the
    device-to-device copy bandwidth (GB/s, bytes read) and the matmul rate (TFLOP/s) in the dtype the
    suite trains in (bf16 on a GPU, fp32 on a CPU). Cached."""
    if ctx.limits:
        return ctx.limits
    dev = ctx.torch_device

    def timed(fn: Any, reps: int) -> float:
        fn()
        if ctx.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if ctx.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    n = (1 << 30) if ctx.cuda else (64 << 20)
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    copy_s = timed(lambda: dst.copy_(src), 10 if ctx.cuda else 3)
    del src, dst
    k, dtype = (8192, torch.bfloat16) if ctx.cuda else (512, torch.float32)  # the dtype the suite trains in there
    a, b = torch.randn(k, k, device=dev, dtype=dtype), torch.randn(k, k, device=dev, dtype=dtype)
    mm_s = timed(lambda: a @ b, 20 if ctx.cuda else 4)
    del a, b
    free_memory(ctx)
    ctx.limits = {"copy_gb_per_s": round(n / copy_s / 1e9, 1), "matmul_tflops": round(2 * k**3 / mm_s / 1e12, 4),
                  "matmul_dtype": str(dtype).removeprefix("torch.")}
    return ctx.limits


def update_flops(params: int, tokens: int) -> float:
    """FLOPs of one forward and backward over `tokens` tokens of a `params`-parameter model (6 N T,
    attention left out: a lower bound)."""
    return 6.0 * params * tokens


def generate_rate(ctx: Ctx, model: Any, ps: list[list[int]], max_tokens: int) -> float:
    """Tokens per second of transformers' own `generate` on the same prompts as one left-padded batch,
    greedy, `max_tokens` new tokens each (no stop): the engine's figure beside it reads against this."""
    pad = pad_id(ctx)
    width = max(len(p) for p in ps)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps], device=ctx.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=ctx.device)
    kwargs = dict(attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                  pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids[:1], **{**kwargs, "attention_mask": mask[:1], "max_new_tokens": 2, "min_new_tokens": 2})
        if ctx.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        if ctx.cuda:
            torch.cuda.synchronize()
    return (out.shape[1] - width) * len(ps) / (time.perf_counter() - t0)
