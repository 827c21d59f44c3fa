"""switchyard's entry point: GRPO/PPO on agent rollouts.

    torchrun --nproc-per-node N launch/train.py [config.yaml] [key.sub=value ...]
    python launch/train.py                      # N = 1, launch/configs/cpu_demo.yaml

One RL step: rollout (agent loops on the engines, over the bus) -> rewards -> reference and old
logprobs -> advantages -> update -> weight sync into the engines -> metrics -> checkpoint.
Rank 0 runs the engine servers and the agent loops; every rank holds the actor and takes its
share of each batch (DDP over gloo on CPU, NCCL on GPUs). Kill it at any point and run the same
command again: it continues from the last complete checkpoint in `trainer.output_dir`.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install

from launch.config import Config, ConfigError, load_config, resolve_path  # noqa: E402

ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {"vllm": {}, "hf": {"max_batch_size": 64}, "sglang": {}}
REWARD_KEY = "rollout/reward_mean"
CONSOLE_KEYS = (REWARD_KEY, "rollout/tool_calls_per_trajectory", "rollout/response_length_mean", "drift/mean",
                "actor/pg_loss", "time/rollout_s", "time/update_s", "time/step_s")


class Run:
    """Everything one training process holds; built in the order that fails cheapest first."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.out = Path(cfg.trainer.output_dir)
        self.procs: list[Any] = []
        self.manager: Any = None
        self.addresses: list[str] = []
        self.version = 0  # the weight version the engines hold

    # ------------------------------------------------------------------ set-up
    def build_data(self) -> None:
        """Rows and tools, validated before any model loads."""
        try:
            self._build_data()
        except (OSError, ValueError) as e:  # RowError, a missing file, a bad generator knob
            raise ConfigError(f"data: {e}") from None

    def _build_data(self) -> None:
        from agent.interactions import load_interactions
        from agent.loop import AgentLoopRegistry
        from agent.tools import load_tools
        from launch.data.rows import RowStream, validate_rows

        cfg = self.cfg
        self.tools = load_tools(resolve_path(cfg.rollout.tools_config)) if cfg.rollout.tools_config else {}
        inter = load_interactions(resolve_path(cfg.rollout.interaction_config)) if cfg.rollout.interaction_config else {}
        if cfg.data.task == "arithmetic":
            from launch.data.arithmetic import ArithmeticConfig, arithmetic_rows

            acfg = ArithmeticConfig(max_value=cfg.data.max_operand, min_ops=cfg.data.num_ops, max_ops=cfg.data.num_ops)
            rows = arithmetic_rows(4096, "train", cfg.data.seed, acfg)
        else:
            from launch.data import rows_from_source

            rows = rows_from_source(str(resolve_path(cfg.data.train_path)), "train")
        for r in rows:
            r.setdefault("agent_name", cfg.data.agent_name)
        validate_rows(rows, AgentLoopRegistry(cfg.rollout.agent_loops).names, set(self.tools), set(inter))
        self.rows = rows
        self.stream = RowStream(rows, seed=cfg.data.seed)

    def build_models(self) -> None:
        import torch

        from engines.models import resolve_model
        from engines.training.torch_actor import TorchActor, TorchActorConfig, make_reference

        cfg = self.cfg
        if not torch.cuda.is_available():  # ranks on one box share its cores (torchrun would give each 1)
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if self.rank == 0:
            self.model_dir = resolve_model(cfg.model.path)  # fetch/convert once, before other ranks read it
        self.barrier()
        self.model_dir = resolve_model(cfg.model.path)
        a = cfg.actor
        common = dict(model=str(self.model_dir), dtype=cfg.model.dtype, lr=a.lr, weight_decay=a.weight_decay,
                      warmup_steps=a.warmup_steps, grad_clip=a.grad_clip, micro_batch_size=a.micro_batch_size,
                      ppo_mini_batch_size=a.ppo_mini_batch_size or None, ppo_epochs=a.ppo_epochs,
                      temperature=cfg.rollout.temperature, seed=cfg.trainer.seed)
        if a.backend == "megatron":
            from engines.training.megatron_actor import MegatronActor, MegatronActorConfig

            self.actor = MegatronActor(MegatronActorConfig(tp=a.tp, pp=a.pp, **common))
            if self.rank == 0:
                print(self.actor.mesh.describe(), flush=True)
        else:
            self.actor = TorchActor(TorchActorConfig(gradient_checkpointing=a.gradient_checkpointing,
                                                     trainable=list(a.trainable) or None, **common))
        loss = cfg.algorithm.loss
        self.ref = None
        if loss.kl_coef > 0:
            self.ref = make_reference(cfg.reference.backend, str(self.model_dir), dtype=cfg.model.dtype,
                                      temperature=cfg.rollout.temperature, micro_batch_size=a.micro_batch_size)

    def barrier(self) -> None:
        import torch

        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def start_engines(self) -> None:
        from rollout.server import cpu_slices, start_server_process

        cfg = self.cfg.rollout
        tmp = Path(tempfile.mkdtemp(prefix="switchyard-"))
        self.engine_logs = [tmp / f"engine{i}.log" for i in range(cfg.num_engines)]
        cores = cpu_slices(cfg.num_engines)
        options = {**ENGINE_DEFAULTS.get(cfg.engine, {}), "dtype": self.cfg.model.dtype, **cfg.engine_options}
        for i in range(cfg.num_engines):
            addr = f"ipc://{tmp}/engine{i}.sock"
            self.procs.append(start_server_process(cfg.engine, str(self.model_dir), addr, f"engine{i}", options,
                                                   log_file=self.engine_logs[i], cpu_cores=cores[i]))
            self.addresses.append(addr)

    def start_manager(self) -> None:
        from rollout.manager import AgentLoopManager, ManagerConfig

        r = self.cfg.rollout
        self.manager = AgentLoopManager(ManagerConfig(
            addresses=self.addresses, tokenizer=str(self.model_dir), num_workers=r.num_workers, n=r.n,
            sampling={"temperature": r.temperature, "top_p": r.top_p, "max_tokens": r.max_tokens},
            agent_configs={k: dict(v) for k, v in r.agent.items()}, agent_loops=dict(r.agent_loops),
            tools_config=str(resolve_path(r.tools_config)) if r.tools_config else None,
            interaction_config=str(resolve_path(r.interaction_config)) if r.interaction_config else None,
            router_policy=r.policy, ready_timeout_s=r.startup_timeout_s)).start()

    def push_weights(self) -> float:
        """Load the actor's weights into every engine as the next version; rank 0 sends."""
        from tqdm import tqdm

        named = self.actor.named_hf_weights()  # every rank takes part (gathers), rank 0 gets tensors
        if self.rank != 0:
            for _ in named:
                pass
            self.version += 1
            return 0.0
        from rollout.client import GenerateClient
        from rollout.weight_sync import push_weights

        named = tqdm(named, desc="weight sync", unit="tensor", leave=False)

        async def send() -> float:
            async with GenerateClient(self.addresses) as client:
                await client.wait_ready(timeout_s=self.cfg.rollout.startup_timeout_s)
                rep = await push_weights(client, named, self.version + 1,
                                         bucket_bytes=self.cfg.rollout.weight_bucket_mb << 20)
                return rep.seconds

        seconds = asyncio.run(send())
        self.version += 1
        return seconds

    # ------------------------------------------------------------------ phases
    def sft(self) -> None:
        """Supervised warm-up on the project's own tool-call traces, laid out exactly like rollouts."""
        from tqdm import tqdm

        from engines.models import load_tokenizer
        from launch.data.sft import build_sft_examples, sft_batches

        cfg = self.cfg
        tok = load_tokenizer(str(self.model_dir))
        turns = int(cfg.rollout.agent.get("tool_agent", {}).get("max_assistant_turns", 3))
        schemas = {name: t.tool_schema for name, t in self.tools.items()}
        examples = build_sft_examples(self.rows[:cfg.sft.examples], tok, schemas, max_calls=max(1, turns - 1))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        bar = tqdm(total=cfg.sft.steps, desc="sft", unit="step", disable=self.rank != 0)
        done, epoch = 0, 0
        self.actor.set_lr(cfg.sft.lr)
        while done < cfg.sft.steps:
            for b in sft_batches(examples, cfg.sft.batch_size, pad, seed=epoch):
                m = self.actor.sft_step(b["input_ids"], b["labels"], b["attention_mask"])
                done += 1
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.3f}")
                if done >= cfg.sft.steps:
                    break
            epoch += 1
        bar.close()
        self.actor.set_lr(cfg.actor.lr)

    def rollout(self, rows: list[dict[str, Any]]) -> Any:
        import torch

        batch = self.manager.generate(rows, weight_version=self.version) if self.rank == 0 else None
        if self.world > 1:
            box = [batch]
            torch.distributed.broadcast_object_list(box, src=0)
            batch = box[0]
        return batch

    def step(self, step: int) -> dict[str, Any]:
        import torch

        from engines.training.losses import kl_penalty
        from rollout.advantages import compute_advantages

        cfg = self.cfg
        t0 = time.perf_counter()
        batch = self.rollout(self.stream.next_batch(cfg.data.prompts_per_step))
        t_rollout = time.perf_counter() - t0
        mask = batch.loss_mask.float()
        loss_cfg = cfg.algorithm.loss
        ref_lp = self.ref.compute_logprobs(batch) if self.ref is not None else None
        kl_in_reward = ref_lp is not None and not loss_cfg.use_kl_loss
        total = len(batch)
        # on-policy (one epoch, one mini-batch, no KL in the reward): the update's own forward
        # gives the old logprobs, saving a whole pass over the batch
        on_policy = (cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size in (0, total)
                     and not kl_in_reward)
        old_lp = None
        drift: dict[str, float] = {}
        if not on_policy:
            old_lp, _ = self.actor.compute_logprobs(batch)
            diff = (batch.rollout_logprobs - old_lp).abs() * mask
            drift = {"drift/mean": float(diff.sum() / mask.sum().clamp(min=1)), "drift/max": float(diff.max())}
        rewards = batch.rewards.clone() * batch.valid
        kl_reward = 0.0
        if kl_in_reward:  # KL in the reward, per sequence
            kl = (kl_penalty(old_lp, ref_lp, "k1") * mask).sum(1)
            rewards = rewards - loss_cfg.kl_coef * kl
            kl_reward = float(kl.mean())
        kwargs = {"norm_by_std": cfg.algorithm.norm_by_std} if cfg.algorithm.advantage == "grpo" else {}
        # a failed trajectory (loop or engine error, not model behaviour) gets a group of its own:
        # advantage 0, and it does not move its siblings' baseline
        groups = torch.where(batch.valid, batch.group_index, -1 - torch.arange(len(batch)))
        adv = compute_advantages(cfg.algorithm.advantage, rewards, mask, group_index=groups, **kwargs)
        t1 = time.perf_counter()
        upd = self.actor.update(batch, adv, old_lp, ref_lp, loss_cfg)
        t_update = time.perf_counter() - t1
        if on_policy:
            drift = {"drift/mean": upd.pop("drift_mean"), "drift/max": upd.pop("drift_max")}
        t_sync = self.push_weights()
        return {**batch.metrics(), **{f"actor/{k}": v for k, v in upd.items()}, **drift, "kl_in_reward": kl_reward,
                "weight_version": self.version, "time/rollout_s": t_rollout, "time/update_s": t_update,
                "time/sync_s": t_sync, "time/step_s": time.perf_counter() - t0,
                "data/epoch": self.stream.position[0], "data/index": self.stream.position[1]}

    @property
    def sharded(self) -> bool:
        """Megatron ranks hold different shards: each saves and loads its own."""
        return self.cfg.actor.backend == "megatron"

    def save(self, ckpt: Any, step: int) -> None:
        common = {"data": self.stream.state_dict(), "version": self.version}
        if self.sharded:
            ckpt.save(step, common if self.rank == 0 else None, shard=self.actor.state_dict(), rank=self.rank,
                      barrier=self.barrier)
        elif self.rank == 0:
            ckpt.save(step, {**common, "actor": self.actor.state_dict()})

    def load(self, ckpt: Any, path: Path) -> int:
        state = ckpt.load(path, rank=self.rank if self.sharded else None)
        self.actor.load_state_dict(state["shard"] if self.sharded else state["actor"])
        self.stream.load_state_dict(state["data"])
        self.version = int(state["version"])
        return int(state["step"])

    def check_sizes(self) -> None:
        """Batch shapes that cannot be split over the ranks fail before any model loads."""
        total = self.cfg.data.prompts_per_step * self.cfg.rollout.n
        mini = self.cfg.actor.ppo_mini_batch_size or total
        a = self.cfg.actor
        if self.world % (a.tp * a.pp):
            raise ConfigError(f"actor.tp={a.tp} x actor.pp={a.pp} does not divide the {self.world} ranks; start "
                              f"torchrun with a multiple of {a.tp * a.pp} processes")
        dp = self.world // (a.tp * a.pp)
        if mini < dp:
            raise ConfigError(f"actor.ppo_mini_batch_size (or data.prompts_per_step x rollout.n) = {mini} "
                              f"trajectories cannot be split over {dp} data-parallel ranks; raise it to >= {dp}")

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except Exception:
                p.kill()


def train(cfg: Config) -> dict[str, Any]:
    from launch.checkpoint import Checkpointer
    from launch.metrics import MetricsLogger, plot_rewards

    run = Run(cfg)
    run.check_sizes()
    run.build_data()
    run.build_models()
    ckpt = Checkpointer(run.out)
    latest = ckpt.latest() if cfg.trainer.resume else None
    start = 0
    if latest is not None:
        start = run.load(ckpt, latest)
        print(f"resuming from {latest} (step {start}, data position {run.stream.position})", flush=True)
    logger = MetricsLogger(run.out, cfg.trainer.wandb_project, resume_step=start) if run.rank == 0 else None
    try:
        if run.rank == 0:
            run.start_engines()
        if latest is None and cfg.sft.enabled:
            run.sft()
            run.save(ckpt, 0)
        if run.rank == 0:
            run.start_manager()
        if latest is not None or cfg.sft.enabled:
            run.push_weights()  # engines start from the base model; bring them to the actor
        for step in range(start + 1, cfg.trainer.steps + 1):
            metrics = run.step(step)
            if logger is not None:
                logger.log(step, metrics, console=CONSOLE_KEYS)
            if step % cfg.trainer.save_every == 0 or step == cfg.trainer.steps:
                run.save(ckpt, step)
            run.barrier()
        summary: dict[str, Any] = {}
        if logger is not None:
            hist = [h for h in logger.history() if h.get(REWARD_KEY) is not None]
            first, last = hist[:5], hist[-5:]
            if hist:
                summary = {"steps": len(hist),
                           "reward_first5": sum(h[REWARD_KEY] for h in first) / len(first),
                           "reward_last5": sum(h[REWARD_KEY] for h in last) / len(last)}
            png = plot_rewards(logger.history(), run.out / "reward_curve.png", key=REWARD_KEY)
            summary["plot"] = str(png) if png else None
            summary["metrics"] = str(logger.path)
        if cfg.trainer.export_hf:
            run.actor.save_hf(run.out / "hf")  # every rank: a sharded actor gathers to rank 0, which writes
            if logger is not None:
                summary["hf_export"] = str(run.out / "hf")
        return summary
    except BaseException:
        if run.rank == 0:
            for log in getattr(run, "engine_logs", []):
                if log.exists():
                    print(f"--- {log.name} (last lines) ---\n{log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        run.close()
        if logger is not None:
            logger.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    path = argv.pop(0) if argv and "=" not in argv[0] else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        cfg = load_config(path, argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        summary = train(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if summary:
        print("SUMMARY " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
