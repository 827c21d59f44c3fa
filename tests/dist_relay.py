"""Run under `torchrun --nproc-per-node 2` by test_weight_sync.py: two "node leaders", each with
its own hf engine server process. Rank 0 is the weight source: `relay_push` broadcasts version 1
over gloo and each rank feeds its engine through shared memory; both engines must then generate
exactly as the new model does. Version 2: rank 1's copy of one bucket arrives with a flipped byte
(its slots flip it on receipt), its engine refuses it, and neither node may commit.

    torchrun --nproc-per-node 2 tests/dist_relay.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.models import load_tokenizer, resolve_model, tiny_llama  # noqa: E402
from rollout.bus import protocol as P  # noqa: E402
from rollout.bus.launcher import read_endpoints, start_server_process  # noqa: E402
from rollout.bus.control import ControlClient  # noqa: E402
from rollout.weights.shm import ShmSlots  # noqa: E402
from rollout.weights.collective import relay_push  # noqa: E402


class FlippingSlots(ShmSlots):
    """Slots that damage one byte of what they received while `flip` is set: corruption in transit."""

    flip = False

    def ref(self, i, offsets, sizes, total):
        if self.flip:
            self.buffer(i, total)[3] ^= 0xFF
            self.flip = False
        return super().ref(i, offsets, sizes, total)


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = str(resolve_model("tiny-llama"))
    tmp = Path(tempfile.mkdtemp(prefix="sy-relay-"))
    proc = start_server_process("hf", model, f"ipc://{tmp}/e.sock", f"node{rank}-engine0", log_file=tmp / "log",
                                endpoint_file=tmp / "ep.json", cpu_threads=1)
    result: dict = {"rank": rank}
    try:
        control = ControlClient(read_endpoints(tmp / "ep.json", proc, 300, tmp / "log"), None, 300)
        new = tiny_llama(load_tokenizer("tiny-llama"), seed=5)
        named = list(new.state_dict().items()) if rank == 0 else []
        slots = FlippingSlots()
        result["bytes_v1"] = relay_push(control.client, control.loop, iter(named), rank == 0, None, slots, 1,
                                        bucket_bytes=1 << 20)
        prompt = list(range(40, 70))
        reply = control.run(control.client.generate(prompt, {"max_tokens": 6, "temperature": 0, "ignore_eos": True}))
        with torch.no_grad():
            logp = torch.log_softmax(new(torch.tensor([prompt + reply.token_ids])).logits[0, len(prompt) - 1:-1], -1)
        result["v1_version"] = reply.weight_version
        result["v1_same_tokens"] = reply.token_ids == logp.argmax(-1).tolist()
        result["v1_logprob_gap"] = float((torch.tensor(reply.logprobs) - logp.max(-1).values).abs().max())

        slots.flip = rank == 1  # rank 1's first bucket of version 2 is damaged on arrival
        try:
            relay_push(control.client, control.loop, iter(named), rank == 0, None, slots, 2, bucket_bytes=1 << 20)
            result["v2_error"] = None
        except RuntimeError as e:
            result["v2_error"] = str(e)
        status = control.run(control.client.broadcast(P.LoadRequest()))
        result["v2_engine_version"] = status[0].weight_version
        slots.close()
        control.close()
    finally:
        proc.terminate()
        proc.wait(30)
    (out / f"relay{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
