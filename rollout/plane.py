"""The rollout side of a run: engine servers, agent workers, batches for every rank, and the
weights into the engines.

Today rank 0 holds all of it: it starts the engines of the placement plan (`parallel.mesh`) as
server processes on ipc sockets, runs the agent workers, and hands every rank the whole batch.
The other ranks only receive batches and take part in the weight export (a sharded actor
gathers its tensors collectively).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch

from engines.training.batch import Batch
from rollout.config import RolloutConfig

ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {"vllm": {}, "hf": {"max_batch_size": 64}, "sglang": {}}


class RolloutPlane:
    def __init__(self, cfg: RolloutConfig, model_dir: str, dtype: str, rank: int, world: int,
                 tools_config: Path | None = None, interaction_config: Path | None = None) -> None:
        self.cfg, self.model_dir, self.dtype, self.rank, self.world = cfg, model_dir, dtype, rank, world
        self.tools_config, self.interaction_config = tools_config, interaction_config
        self.procs: list[Any] = []
        self.addresses: list[str] = []
        self.engine_logs: list[Path] = []
        self.manager: Any = None

    def start_engines(self, run_dir: Path) -> None:
        """Rank 0: the engines of the placement plan, each on its own core slice on CPU. The plan
        is printed and written to `run_dir/placement.txt`."""
        if self.rank != 0:
            return
        from parallel.mesh import plan_placement
        from rollout.server import start_server_process

        cfg = self.cfg
        plan = plan_placement("cpu", num_engines=cfg.num_engines)
        text = plan.describe()
        if torch.cuda.is_available():  # engine placement on GPUs is not applied yet: say so
            text += "\n  (GPU box: engines are started without device assignment; CUDA_VISIBLE_DEVICES is inherited)"
        print(text, flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "placement.txt").write_text(text + "\n")
        tmp = Path(tempfile.mkdtemp(prefix="switchyard-"))
        options = {**ENGINE_DEFAULTS.get(cfg.engine, {}), "dtype": self.dtype, **cfg.engine_options}
        for slot in plan.engines:
            addr = f"ipc://{tmp}/{slot.engine_id}.sock"
            log = tmp / f"{slot.engine_id}.log"
            self.procs.append(start_server_process(cfg.engine, self.model_dir, addr, slot.engine_id, options,
                                                   log_file=log, cpu_cores=list(slot.devices)))
            self.addresses.append(addr)
            self.engine_logs.append(log)

    def start_workers(self) -> None:
        """Rank 0: the agent workers, connected to every engine."""
        if self.rank != 0:
            return
        from rollout.manager import AgentLoopManager, ManagerConfig

        r = self.cfg
        self.manager = AgentLoopManager(ManagerConfig(
            addresses=self.addresses, tokenizer=self.model_dir, num_workers=r.num_workers, n=r.n,
            sampling={"temperature": r.temperature, "top_p": r.top_p, "max_tokens": r.max_tokens},
            agent_configs={k: dict(v) for k, v in r.agent.items()}, agent_loops=dict(r.agent_loops),
            tools_config=str(self.tools_config) if self.tools_config else None,
            interaction_config=str(self.interaction_config) if self.interaction_config else None,
            policy=r.policy, ready_timeout_s=r.startup_timeout_s)).start()

    def generate(self, rows: list[dict[str, Any]], weight_version: int) -> Batch:
        """Roll out `rows` on rank 0 with weights no older than `weight_version`; every rank gets the batch."""
        batch = self.manager.generate(rows, weight_version=weight_version) if self.rank == 0 else None
        if self.world > 1:
            box = [batch]
            torch.distributed.broadcast_object_list(box, src=0)
            batch = box[0]
        return batch

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Load `named` into every engine as `version`; seconds taken. Every rank iterates
        `named` (a sharded actor gathers while it yields); rank 0 sends."""
        if self.rank != 0:
            for _ in named:
                pass
            return 0.0
        from tqdm import tqdm

        from rollout.client import GenerateClient
        from rollout.weight_sync import push_weights

        bar = tqdm(named, desc="weight sync", unit="tensor", leave=False)

        async def send() -> float:
            async with GenerateClient(self.addresses) as client:
                await client.wait_ready(timeout_s=self.cfg.startup_timeout_s)
                rep = await push_weights(client, bar, version, bucket_bytes=self.cfg.weight_bucket_mb << 20)
                return rep.seconds

        return asyncio.run(send())

    def print_engine_logs(self, tail: int = 3000) -> None:
        """The last lines of every engine's log, on stderr: what a failed run needs to be understood."""
        for log in self.engine_logs:
            if log.exists():
                print(f"--- {log.name} (last lines) ---\n{log.read_text()[-tail:]}", file=sys.stderr)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except Exception:
                p.kill()
        self.procs = []
