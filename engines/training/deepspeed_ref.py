"""The frozen reference policy under DeepSpeed ZeRO-3: its parameters are partitioned over the
training ranks, so a reference as large as the actor costs each rank 1/N of it.

Why ZeRO-3 for a model that never trains: the reference is only ever run forward, once per
step, and spends the rest of the step idle; partitioned, it leaves the memory to the actor.
Each layer's parameters are gathered just before its forward and released after it.

Runs on GPUs (NCCL) and, with DeepSpeed's CPU accelerator, on CPU over gloo (tested). ZeRO-3's
gathers are collectives, so every rank must run the same number of forward passes: a rank with
fewer rows than the others repeats one of its rows and discards the result.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from engines.training.actor import gather_rows
from engines.training.batch import Batch
from engines.training.config import compute_dtype
from engines.training.hf_model import default_device, response_logprobs
from parallel.mesh import process_group_backend
from parallel.reduce import most_over_ranks


def _import_deepspeed() -> Any:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError("reference.backend=deepspeed needs DeepSpeed: `bash launch/install.sh` installs it "
                          "(pip install --no-build-isolation deepspeed, after torch), or set "
                          "reference.backend=torch") from e
    return deepspeed


def ensure_process_group() -> None:
    """DeepSpeed needs a process group even for one process; make a one-rank gloo group when
    the trainer runs without torchrun (and the LOCAL_RANK DeepSpeed reads, which torchrun sets)."""
    if "LOCAL_RANK" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        os.environ["LOCAL_RANK"] = "0"  # `python launch/train.py`: one process; zero.Init fails without it
    if dist.is_initialized():
        return
    store = os.path.join(tempfile.mkdtemp(prefix="switchyard-pg-"), "store")
    dist.init_process_group(process_group_backend(torch.cuda.is_available()), init_method=f"file://{store}",
                            rank=0, world_size=1)


class DeepSpeedReference:
    def __init__(self, model: str, dtype: str = "float32", temperature: float = 1.0,
                 micro_batch_size: int = 8) -> None:
        deepspeed = _import_deepspeed()
        from transformers.integrations import HfDeepSpeedConfig

        from engines.models import load_pretrained

        ensure_process_group()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = default_device()
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": dtype == "bfloat16"},
            "fp16": {"enabled": dtype == "float16"},
            "wall_clock_breakdown": False,
        }
        # alive while loading, transformers builds the model inside zero.Init and loads each
        # rank's partition instead of materialising the whole model on every rank. It is global
        # while it lives (every later from_pretrained would be partitioned too), so drop it after.
        hf_ds_config = HfDeepSpeedConfig(config)
        module = load_pretrained(model, compute_dtype(dtype))
        del hf_ds_config
        self.engine, *_ = deepspeed.initialize(model=module, config=config, dist_init_required=False)
        self.engine.eval()
        self.engine.module.requires_grad_(False)

    def local_numel(self) -> int:
        """Parameter elements this rank holds (about 1/world of the model under ZeRO-3)."""
        return sum(int(getattr(p, "ds_tensor", p).numel()) for p in self.engine.module.parameters())

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        n, r = len(batch), batch.responses.shape[1]
        if batch.is_shard:  # this rank's rows only; ZeRO-3 gathers are collective, so all ranks take
            local = torch.arange(n)  # as many forward passes as the rank with the most rows
            steps = math.ceil(most_over_ranks(n) / self.micro_batch_size)
        else:
            local = torch.tensor_split(torch.arange(n), self.world)[self.rank]
            steps = math.ceil(math.ceil(n / self.world) / self.micro_batch_size)
        out = []
        for i in range(steps):
            mb = local[i * self.micro_batch_size:(i + 1) * self.micro_batch_size]
            real = len(mb)
            if real == 0:  # keep the collectives in step with ranks that have more rows
                mb = local[:1] if len(local) else torch.tensor([0])
            lp = response_logprobs(self.engine, batch, mb, self.temperature, self.device)
            if real:
                out.append(lp)
        lp = torch.cat(out) if out else torch.zeros(0, r)
        return lp if batch.is_shard else gather_rows(lp, n, self.world)
