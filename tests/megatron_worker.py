"""Run under torchrun by test_megatron.py: the Megatron actor at a given TP x PP on gloo.

    torchrun --nproc-per-node N tests/megatron_worker.py MODEL_DIR OUT_DIR TP PP [ADDRESS]

Writes OUT_DIR/result.pt from rank 0: the HF export before any update (round trip), the
logprobs and entropy of a fixed batch, the HF export after one SGD step on a fixed loss, and,
when an engine ADDRESS is given, the weights pushed into that engine as version 1.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batches import advantages_for, make_batch  # noqa: E402

from engines.training.losses import LossConfig  # noqa: E402
from engines.training.config import ActorConfig  # noqa: E402
from engines.training.megatron_actor import MegatronActor  # noqa: E402


def main() -> None:
    model, out, tp, pp = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    address = sys.argv[5] if len(sys.argv) > 5 else None
    torch.set_num_threads(1)
    actor = MegatronActor(ActorConfig(backend="megatron", tp=tp, pp=pp, lr=1.0, grad_clip=1e9, micro_batch_size=3),
                          model, temperature=0.8, progress=False)
    rank = actor.mesh.rank
    import torch.distributed as tdist
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()  # what megatron-core's layers fork from: (TP rank, seeds, stream names) per rank
    rng = [None] * actor.mesh.world
    tdist.all_gather_object(rng, (actor.mesh.tp_rank, sorted(tracker.seeds_), sorted(tracker.get_states())))
    before = {k: v.clone() for k, v in actor.named_hf_weights()}
    batch = make_batch(1000, n=8)
    lp, ent = actor.compute_logprobs(batch)
    probe = make_batch(1000, n=1, seed=5)  # its prompt is what the engine continues after the sync
    actor.optimizer = torch.optim.SGD(actor.params, lr=1.0)  # the weight change is the gradient itself
    metrics = actor.update(batch, advantages_for(batch), None, None, LossConfig(agg="seq-mean-token-mean"))
    after = {k: v.clone() for k, v in actor.named_hf_weights()}
    engine: dict = {}
    if address:
        import torch.distributed as dist

        from agent.loop import AgentLoopOutput
        from rollout.bus.client import GenerateClient
        from engines.training.batch import pad_outputs
        from rollout.weights.bus import push_weights

        prompt = probe.prompts[0][probe.attention_mask[0, :probe.prompts.shape[1]].bool()].tolist()

        async def push_and_generate() -> dict:
            async with GenerateClient([address]) as client:
                await client.wait_ready(timeout_s=300)
                rep = await push_weights(client, after.items(), 1, bucket_bytes=1 << 20)
                r = await client.generate(prompt, {"temperature": 0.8, "max_tokens": 12, "seed": 3},
                                          min_weight_version=1)
                return {"version": rep.version, "tokens": r.token_ids, "logprobs": r.logprobs,
                        "weight_version": r.weight_version}

        box = [asyncio.run(push_and_generate()) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        engine = box[0]
        seq = pad_outputs([AgentLoopOutput(prompt_ids=prompt, response_ids=engine["tokens"],
                                           response_mask=[1] * len(engine["tokens"]),
                                           response_logprobs=engine["logprobs"], reward=0.0, num_turns=1,
                                           termination="stop")], 0, [0])
        engine["actor_after"] = actor.compute_logprobs(seq)[0][0]
    # one SFT step (SGD) on calculator traces, compared with the torch actor's by the test
    from launch.data.arithmetic import arithmetic_rows
    from launch.data.sft import build_sft_examples, sft_batches
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    b = next(sft_batches(build_sft_examples(arithmetic_rows(8, seed=3), tok), 8, tok.eos_token_id, shuffle=False))
    sft = actor.sft_step(b["input_ids"].clamp(max=999), b["labels"].clamp(max=999), b["attention_mask"])
    after_sft = {k: v.clone() for k, v in actor.named_hf_weights()}
    if rank == 0:
        torch.save({"sft": sft, "after_sft": after_sft, "before": before, "after": after, "logprobs": lp, "entropy": ent, "metrics": metrics,
                    "mesh": actor.mesh.describe(), "engine": engine, "rng": rng}, out / "result.pt")
    # leave together and tear the groups down before exit: a rank that exits while the others
    # still hold gloo connections was seen to abort at interpreter shutdown ("terminate called
    # without an active exception"), failing the run after its work was done
    dist.barrier()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
