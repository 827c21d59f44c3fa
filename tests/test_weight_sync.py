"""push_weights: one weight version into two real hf engine servers, verified by what they generate."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from safetensors.torch import load_file

from engines.models import load_tokenizer, tiny_llama
from rollout.bus.client import GenerateClient
from rollout.weights.codec import bucket_by_size, slot_bucket, tensor_from_raw, tensor_to_raw
from rollout.weights.bus import push_weights
from procs import pythonpath


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


def test_an_engine_back_mid_push_waits_for_the_next_version(servers):
    """An engine down when version 2 begins and back (restarted, say) before its commit gets neither
    its buckets nor its commit; a push of version 2 to it alone catches it up (the other engine holds
    version 2 and would refuse it again), and the next push reaches both."""
    srv = servers(2, backend="hf", model="tiny-llama")
    state = tiny_llama(load_tokenizer("tiny-llama"), seed=7).state_dict()

    async def main():
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            await push_weights(client, state.items(), version=1, bucket_bytes=1 << 20)
            client._down(1, "test: gone before the push")

            def named():
                client._seen(1)  # its heartbeat answers again after the begin
                yield from state.items()

            report = await push_weights(client, named(), version=2, bucket_bytes=1 << 20)
            versions = [(await client.status(i)).weight_version for i in range(2)]
            caught = await push_weights(client, state.items(), version=2, bucket_bytes=1 << 20, engines=[1])
            both = [(await client.status(i)).weight_version for i in range(2)]
            again = await push_weights(client, state.items(), version=3, bucket_bytes=1 << 20)
            return report, versions, caught, both, again, [(await client.status(i)).weight_version for i in range(2)]

    report, versions, caught, both, again, after = asyncio.run(main())
    assert report.engines == 1 and versions == [2, 1]
    assert caught.engines == 1 and both == [2, 2]
    assert again.engines == 2 and after == [3, 3]


def _slots_into_two_engines(servers, slots, seed: int, refusals: list[tuple[dict, str]]):
    """Version 1 through `slots` into two hf engines; then version 2 begins with one bucket whose slot
    has a byte flipped after its checksum (refused), the same bucket with each `refusals` change to
    its reference (refused with the message matched), a commit that must fail, and the rest of the
    model as version 2. Checks what every slot kind must do; returns the push report."""
    import pytest

    from rollout.bus import protocol as P
    from rollout.bus.client import RequestFailed

    srv = servers(2, backend="hf", model="tiny-llama")
    new = tiny_llama(load_tokenizer("tiny-llama"), seed=seed)
    prompt = list(range(60, 90))

    async def greedy(client):
        return [await client.generate(prompt, {"max_tokens": 6, "temperature": 0, "ignore_eos": True},
                                      session_id=f"g{i}") for i in range(4)]

    async def main():
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            report = await push_weights(client, new.state_dict().items(), version=1, bucket_bytes=1 << 20, slots=slots)
            before = await greedy(client)
            await client.broadcast(P.WeightsBegin(weight_version=2))
            bucket = slot_bucket(slots, 0, [("model.norm.weight", torch.zeros(new.config.hidden_size))], 2, 0)
            slots.buffer(0, bucket.ref["total"])[5] ^= 1  # one byte flipped after the checksum was taken
            with pytest.raises(RequestFailed, match="failed its checksum"):
                await client.broadcast(bucket)
            for change, match in refusals:
                bucket.ref = {**bucket.ref, **change}
                with pytest.raises(RequestFailed, match=match):
                    await client.broadcast(bucket)
            with pytest.raises(RequestFailed, match="commit of version 2 with 1 buckets, but 0"):
                await client.broadcast(P.WeightsCommit(weight_version=2, num_buckets=1))
            # the engines hold admission until a version commits: version 2 again, all but the norm weight
            rest = [(n, t) for n, t in new.state_dict().items() if n != "model.norm.weight"]
            await push_weights(client, rest, version=2, bucket_bytes=1 << 20, slots=slots)
            return report, bucket, before, await greedy(client), await client.broadcast(P.LoadRequest())

    report, bucket, before, after, status = asyncio.run(main())
    assert report.engines == 2 and report.buckets > 1
    assert {r.engine_id for r in before} == {"e0", "e1"}
    with torch.no_grad():
        ids = torch.tensor([prompt + before[0].token_ids])
        logp = torch.log_softmax(new(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    for r in before:  # the engines' logprobs equal the model's: the bytes arrived intact
        assert r.weight_version == 1 and r.token_ids == logp.argmax(-1).tolist()
        assert torch.allclose(torch.tensor(r.logprobs), logp.max(-1).values, atol=1e-4)
    # the refused bucket's zeros never reached the norm weight
    assert [(r.token_ids, r.logprobs) for r in after] == [(r.token_ids, r.logprobs) for r in before]
    assert [s.weight_version for s in status] == [2, 2]
    return report, bucket


def test_shared_memory_path_loads_every_engine_and_refuses_a_flipped_byte(servers):
    """Buckets in shared-memory slots: only their names cross the socket; both engines load the
    same slot, serve the new weights exactly; a slot with one flipped byte is refused by every
    engine and the version is not committed; a slot outside the shared-memory prefix is refused."""
    from rollout.weights.shm import ShmSlots, shm_dir

    slots = ShmSlots()
    report, _ = _slots_into_two_engines(servers, slots, 11, [({"path": "/etc/hostname"}, "only .* files are mapped")])
    assert report.path == "shm"
    mine = sorted(p.name for p in shm_dir().glob(f"switchyard-wb-{__import__('os').getpid()}-*"))
    assert len(mine) == 2  # double buffered
    slots.close()
    assert not list(shm_dir().glob(f"switchyard-wb-{__import__('os').getpid()}-*"))


def test_slot_files_of_killed_senders_are_removed(tmp_path):
    import os
    import subprocess
    import sys

    from rollout.weights.shm import PREFIX, ShmSlots

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{PREFIX}{int(dead.stdout)}-0123456789abcdef"
    live = tmp_path / f"{PREFIX}{os.getpid()}-0123456789abcdef"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    slots = ShmSlots(directory=tmp_path)
    assert not stale.exists() and live.exists()
    slots.buffer(0, 10)
    assert len(list(tmp_path.glob(f"{PREFIX}{os.getpid()}-*"))) == 2
    slots.close()
    assert [p.name for p in tmp_path.iterdir()] == [live.name]


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
                          timeout=600, env={**os.environ, "PYTHONPATH": pythonpath(repo), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    sender, receiver = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert sender["buckets"] > 1  # size-bounded buckets, not one blob
    assert receiver["same"] and receiver["tensors"] == len(load_file(f"{model}/model.safetensors"))
    assert sender["committed"] and receiver["committed"]
    assert "failed its checksum" in receiver["corruption"]
    assert not sender["second_commit"] and not receiver["second_commit"]  # one refusal: nobody bumps


def test_collective_relay_loads_both_nodes_and_commits_all_or_nothing(tmp_path):
    """Two node leaders under torchrun (gloo), each with its own hf engine server: the relayed
    version 1 makes both engines generate exactly as the new model (greedy tokens equal, logprobs
    within 1e-4: the same fp32 weights and math on both sides); in version 2 one bucket reaches
    rank 1 with a flipped byte, its engine refuses it and no node commits."""
    import json
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "tests/dist_relay.py", str(tmp_path)], cwd=repo, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": pythonpath(repo), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"relay{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["bytes_v1"] > 1 << 20  # several 1 MiB buckets arrived on both ranks
        assert r["v1_version"] == 1 and r["v1_same_tokens"] and r["v1_logprob_gap"] < 1e-4, r
        assert "was not committed on any node" in r["v2_error"], r
        assert r["v2_engine_version"] == 1, r  # neither engine bumped
    assert "failed its checksum" in ranks[1]["v2_error"]  # rank 1 says why; rank 0 points at the other node
    assert "another node failed" in ranks[0]["v2_error"]


def test_sum64_changes_with_any_flipped_byte():
    from rollout.weights.codec import sum64

    flat = torch.randint(0, 256, (1003,), dtype=torch.uint8)  # 125 words and a 3-byte tail
    base = sum64(flat)
    for i in (0, 7, 8, 500, 999, 1000, 1002):
        flat[i] ^= 1
        assert sum64(flat) != base, i
        flat[i] ^= 1
    assert sum64(flat) == base and sum64(flat[:0]) == 0


def test_buckets_by_memory_handle_load_every_engine_and_a_flipped_byte_is_refused(servers):
    """The colocated-GPU path (CUDA IPC handles of a flat bucket), run here on CPU: the same code opens
    torch's file-backed shared memory by its handle. Both engine processes open the trainer's buffer,
    check its sum64 and serve the new weights exactly; one flipped byte is refused by every engine
    and the version is not committed; a handle of another kind, or one that cannot be opened, is refused."""
    from rollout.weights.handle import HandleSlots

    slots = HandleSlots("cpu")
    report, bucket = _slots_into_two_engines(servers, slots, 12, [
        ({"handle": {"tpu": [1]}}, "neither a cpu nor a cuda handle"),
        ({"handle": {"cpu": [b"/no/manager.sock", b"/no_such_buffer", 64]}},
         "cannot open the weights bucket's cpu handle")])
    assert report.path == "handle" and bucket.checksum_alg == "sum64" and "handle" in bucket.ref and "path" not in bucket.ref
    slots.close()


def test_weights_with_a_nan_are_refused_naming_the_tensor(servers):
    """A diverged update's NaN never reaches an engine: over the bus and through shared memory the
    bucket is refused naming the tensor, and the in-process path checks the same way."""
    import pytest

    from rollout.bus.client import RequestFailed
    from rollout.bus.protocol import ProtocolError
    from rollout.weights.shm import ShmSlots
    from rollout.weights.codec import finite

    srv = servers(1, backend="hf", model="tiny-llama")
    bad = {n: t.clone() for n, t in tiny_llama(load_tokenizer("tiny-llama"), seed=3).state_dict().items()}
    bad["model.norm.weight"][3] = float("nan")
    slots = ShmSlots()

    async def main():
        async with GenerateClient(srv.addresses) as client:
            await client.wait_ready(timeout_s=300)
            for version, via in ((1, None), (2, slots)):
                with pytest.raises(RequestFailed, match="tensor 'model.norm.weight' holds 1 NaN or infinite"):
                    await push_weights(client, bad.items(), version=version, bucket_bytes=1 << 20, slots=via)

    try:
        asyncio.run(main())
    finally:
        slots.close()
    with pytest.raises(ProtocolError, match="tensor 'b' holds 2 NaN or infinite"):
        finite([("a", torch.ones(3)), ("b", torch.tensor([1.0, float("inf"), float("-inf")]))], "here")
    assert finite([("ids", torch.arange(3))], "here")  # integer tensors have nothing to check
    with pytest.raises(ProtocolError, match="tensor 'h' holds 1 NaN"):
        finite([("h", torch.tensor([1.0, float("nan"), 2.0], dtype=torch.bfloat16))], "here")
    big = torch.full((4,), 3e38)  # finite values whose sum overflows float32: finite all the same
    assert finite([("big", big), ("big_bf16", big.bfloat16())], "here")
