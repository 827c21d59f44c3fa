"""Malformed bus messages, shared by the protocol fuzz test and the live-server test."""

import random

import msgpack
import numpy as np

from rollout.bus import protocol as P


def garbage_frames(rng: random.Random) -> list[bytes]:
    """One malformed multipart message: random bytes, truncated msgpack, wrong versions..."""
    good = [bytes(f) for f in P.Generate(rid="x", prompt_ids=np.arange(10, dtype=np.int32)).encode()]
    kind = rng.randrange(8)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 64))]
    if kind == 1:
        return [good[0][: rng.randrange(len(good[0]))], good[1]]  # truncated msgpack
    if kind == 2:
        return [msgpack.packb({"v": rng.choice([0, 1, 99, "2", None, True, 2.0]), "t": "generate", "rid": "x"}), good[1]]
    if kind == 3:
        return [msgpack.packb({"v": 2, "t": rng.choice(["nope", "", 5, None, {}, [1]]), "rid": "x"})]
    if kind == 4:
        return [good[0]]  # missing payload frame
    if kind == 5:
        return [good[0], good[1][:-1]]  # ids not a multiple of 4 bytes
    if kind == 6:
        return [msgpack.packb(rng.choice([[1, 2], "str", 3, None, {"v": 1}]))]
    head = msgpack.unpackb(good[0])
    head[rng.choice(list(head))] = rng.choice([None, [], {}, "x", -1])
    return [msgpack.packb(head), good[1]]
