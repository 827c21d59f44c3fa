"""The wire format: every message round-trips, and bad input only ever raises ProtocolError."""

import random

import msgpack
import numpy as np
import pytest

from garbage import garbage_frames
from rollout.bus import protocol as P


def _roundtrip(msg: P.Message) -> P.Message:
    frames = [bytes(f) for f in msg.encode()]  # as they arrive from a socket
    return P.decode(frames)


def test_generate_and_result_round_trip_with_raw_frames():
    ids = np.arange(8192, dtype=np.int32)
    g = _roundtrip(P.Generate(rid="r1", prompt_ids=ids, sampling={"max_tokens": 4}, session_id="s", group_id="g",
                              min_weight_version=3))
    assert isinstance(g, P.Generate) and g.rid == "r1" and g.session_id == "s" and g.group_id == "g"
    assert g.min_weight_version == 3 and g.sampling == {"max_tokens": 4}
    np.testing.assert_array_equal(g.prompt_ids, ids)
    # ids travel as one raw little-endian int32 frame, not msgpack integers
    frames = P.Generate(rid="r1", prompt_ids=ids).encode()
    assert len(frames) == 2 and bytes(frames[1]) == ids.astype("<i4").tobytes()

    lp = np.linspace(-5, 0, 7, dtype=np.float32)
    r = _roundtrip(P.Result(rid="r1", token_ids=[5, 6, 7, 8, 9, 10, 11], logprobs=lp, finish_reason="length",
                            weight_version=2, engine_id="e0", cached_prompt_tokens=16, load=3))
    assert isinstance(r, P.Result)
    assert r.token_ids.tolist() == [5, 6, 7, 8, 9, 10, 11] and r.logprobs.tolist() == lp.tolist()
    assert (r.finish_reason, r.weight_version, r.engine_id, r.cached_prompt_tokens, r.load) == ("length", 2, "e0", 16, 3)


@pytest.mark.parametrize("msg", [
    P.Abort(rid="a"), P.LoadRequest(rid="l"), P.Health(rid="h"), P.Sleep(rid="s"), P.Sleep(rid="s2", level=2),
    P.Wake(rid="w"),
    P.Status(rid="st", engine_id="e1", weight_version=4, stats={"waiting": 2, "running": 3}),
    P.Ack(rid="k", of="sleep", weight_version=1), P.Error(rid="e", code="bad_frame", message="x"),
    P.WeightsBegin(rid="b", weight_version=2), P.WeightsCommit(rid="c", weight_version=2, num_buckets=3),
])
def test_control_messages_round_trip(msg):
    assert _roundtrip(msg) == msg


def test_fields_travel_by_their_names_and_a_missing_one_takes_its_default():
    assert msgpack.unpackb(P.Sleep(rid="s", level=2).encode()[0])["level"] == 2
    head = msgpack.unpackb(P.WeightsBegin(rid="b", weight_version=3).encode()[0])
    assert head == {"v": P.PROTOCOL_VERSION, "t": "weights_begin", "rid": "b", "weight_version": 3, "preempt": False}
    bare = P.decode([msgpack.packb({"v": P.PROTOCOL_VERSION, "t": "sleep", "rid": "s"})])
    assert isinstance(bare, P.Sleep) and bare.level == 1
    with pytest.raises(P.ProtocolError, match="weights_begin.weight_version must be int, got str"):
        P.decode([msgpack.packb({**head, "weight_version": "3"})])
    with pytest.raises(P.ProtocolError, match="weights_begin.preempt must be bool, got int"):
        P.decode([msgpack.packb({**head, "preempt": 1})])
    with pytest.raises(P.ProtocolError, match=r"sleep level 3 is not one of \(1, 2\)"):
        P.decode([msgpack.packb({"v": P.PROTOCOL_VERSION, "t": "sleep", "rid": "s", "level": 3})])
    with pytest.raises(P.ProtocolError, match="sleep level 0"):
        P.Sleep(rid="s", level=0)  # refused where it is made, not only where it arrives


def test_status_load_is_waiting_plus_running():
    assert P.Status(stats={"waiting": 2, "running": 3}).load == 5


def test_weight_bucket_round_trip_and_checksum():
    import torch

    from rollout.weights.codec import iter_buckets, tensors_from_bucket

    named = [(f"layer.{i}.weight", torch.randn(64, 32)) for i in range(5)] + [("bias", torch.randn(3).bfloat16())]
    buckets = list(iter_buckets(named, version=7, bucket_bytes=64 * 32 * 4 * 2))
    assert len(buckets) == 3  # two full-size tensors per bucket, the small bf16 one rides along
    got = []
    for b in buckets:
        got += tensors_from_bucket(P.decode([bytes(f) for f in b.encode()]))
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    bad = buckets[0]
    bad.frames[0] = bytes(bad.frames[0])[:-1] + b"\x00"
    with pytest.raises(P.ProtocolError, match="checksum"):
        tensors_from_bucket(bad)


def test_decode_never_raises_anything_but_protocol_error():
    rng = random.Random(0)
    rejected = 0
    for _ in range(5000):
        frames = garbage_frames(rng)
        try:
            P.decode(frames)
        except P.ProtocolError:
            rejected += 1
    assert rejected > 4500  # a few header mutations stay valid (e.g. an empty session id)


def test_unknown_version_names_both_versions():
    with pytest.raises(P.ProtocolError, match="unsupported protocol version 1; this peer speaks 2"):
        P.decode([msgpack.packb({"v": 1, "t": "health", "rid": "x"})])


@pytest.mark.parametrize("alg", ["xxh3", "crc32"])
def test_both_checksums_catch_a_flipped_byte_and_say_which_they_are(alg: str):
    import torch

    from rollout.weights.codec import bucket_from_tensors, checksum, tensors_from_bucket

    b = bucket_from_tensors([("w", torch.randn(256))], version=1, index=0)
    b.checksum_alg, b.checksum = alg, checksum(b.frames, alg)
    back = P.decode([bytes(f) for f in b.encode()])
    assert back.checksum_alg == alg and torch.equal(tensors_from_bucket(back)[0][1], tensors_from_bucket(b)[0][1])
    raw = bytearray(bytes(back.frames[0]))
    raw[100] ^= 0x01
    back.frames[0] = bytes(raw)
    with pytest.raises(P.ProtocolError, match=f"checksum \\({alg}"):
        tensors_from_bucket(back)
    with pytest.raises(P.ProtocolError, match="unknown checksum 'md5'"):
        checksum(b.frames, "md5")
