"""Run under `torchrun --nproc-per-node 2` by test_weight_sync.py: rank 0 broadcasts weights in
buckets over gloo, rank 1 loads them into a real in-process hf engine; then the sender's checksum
is sabotaged and the receiver must refuse the bucket and vote against the commit.

    torchrun --nproc-per-node 2 tests/dist_weights.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollout.weights.collective as ws  # noqa: E402
from rollout.weights.inproc import load_into_engine  # noqa: E402
from rollout.bus.protocol import ProtocolError  # noqa: E402


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from safetensors.torch import load_file

    new = {k: v + 0.01 * (i + 1) for i, (k, v) in enumerate(sorted(load_file(f"{model}/model.safetensors").items()))}
    result: dict = {"rank": rank}
    if rank == 0:
        buckets = list(ws.broadcast_buckets(sorted(new.items()), src=0, bucket_bytes=1 << 20))
        result["buckets"] = len(buckets)
        result["committed"] = ws.commit_everywhere(True)
        ws.checksum = lambda frames, alg="crc32": 0  # a bucket corrupted on the way: the receiver must notice
        list(ws.broadcast_buckets(sorted(new.items())[:1], src=0))
        result["second_commit"] = ws.commit_everywhere(True)
    else:
        from engines.inference.hf import HFEngine

        async def receive() -> dict:
            engine = HFEngine(model)
            await engine.start()
            got = [t for bucket in ws.broadcast_buckets(None, src=0, bucket_bytes=1 << 20) for t in bucket]
            rep = await load_into_engine(engine, got, bucket_bytes=1 << 20)
            state = engine.model.state_dict()
            same = all(torch.equal(state[k], v) for k, v in new.items())
            await engine.close()
            return {"tensors": len(got), "same": same, "loaded_bytes": rep.bytes}

        result.update(asyncio.run(receive()))
        result["committed"] = ws.commit_everywhere(result["same"])
        try:
            list(ws.broadcast_buckets(None, src=0))
            result["corruption"] = "not detected"
        except ProtocolError as e:
            result["corruption"] = str(e)
        result["second_commit"] = ws.commit_everywhere(False)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
