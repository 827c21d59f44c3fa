"""push_weights: one weight version into two real hf engine servers, verified by what they generate."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from safetensors.torch import load_file

from engines.models import load_tokenizer, tiny_llama
from rollout.client import GenerateClient
from rollout.weight_sync import bucket_by_size, push_weights, tensor_from_raw, tensor_to_raw


def test_buckets_flush_before_the_tensor_that_would_overflow():
    sizes = {"a": 40, "b": 40, "c": 20, "d": 4, "huge": 200, "e": 8}  # bytes, as float32 tensors
    named = [(n, torch.zeros(b // 4)) for n, b in sizes.items()]
    got = [[n for n, _ in bucket] for bucket in bucket_by_size(named, bucket_bytes=100)]
    # a+b+c fill the limit exactly (not over); d would take it over; huge is alone, not joined by d or e
    assert got == [["a", "b", "c"], ["d"], ["huge"], ["e"]]
    assert list(bucket_by_size([("big", torch.zeros(50))], bucket_bytes=8)) and not list(bucket_by_size([], 8))


def test_raw_bytes_round_trip_keeps_dtype_and_shape():
    for t in (torch.randn(3, 5).bfloat16(), torch.tensor(2.5), torch.zeros(0, 4, dtype=torch.int64)):
        raw, dtype, shape = tensor_to_raw(t)
        assert raw.dtype == torch.uint8 and raw.numel() == t.numel() * t.element_size()
        for back in (tensor_from_raw(raw, dtype, shape), tensor_from_raw(bytes(raw.numpy()), dtype, shape)):
            assert back.dtype == t.dtype and torch.equal(back, t)


def test_push_weights_reaches_every_engine(servers):
    srv = servers(2, backend="hf", model="tiny-llama")
    new = tiny_llama(load_tokenizer("tiny-llama"), seed=7)
    prompt = list(range(100, 140))

    async def main():
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            report = await push_weights(client, new.state_dict().items(), version=1, bucket_bytes=1 << 20)
            replies = [await client.generate(prompt, {"max_tokens": 8, "temperature": 0, "ignore_eos": True},
                                             session_id=f"s{i}") for i in range(6)]
            return report, replies

    report, replies = asyncio.run(main())
    assert report.engines == 2 and report.buckets > 1 and report.version == 1
    assert {r.engine_id for r in replies} == {"e0", "e1"}  # both engines answered, both on version 1
    with torch.no_grad():
        ids = torch.tensor([prompt + replies[0].token_ids])
        logp = torch.log_softmax(new(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    for r in replies:
        assert r.weight_version == 1 and r.token_ids == logp.argmax(-1).tolist()
        assert torch.allclose(torch.tensor(r.logprobs), logp.max(-1).values, atol=1e-4)


def test_broadcast_to_an_in_process_engine_verifies_and_commits_all_or_nothing(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from engines.models import resolve_model

    repo = Path(__file__).resolve().parents[1]
    model = str(resolve_model("tiny-llama"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "tests/dist_weights.py", model, str(tmp_path)], cwd=repo, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    sender, receiver = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert sender["buckets"] > 1  # size-bounded buckets, not one blob
    assert receiver["same"] and receiver["tensors"] == len(load_file(f"{model}/model.safetensors"))
    assert sender["committed"] and receiver["committed"]
    assert "failed its checksum" in receiver["corruption"]
    assert not sender["second_commit"] and not receiver["second_commit"]  # one refusal: nobody bumps
