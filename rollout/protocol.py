"""The bus's only wire format: one msgpack header frame plus raw binary frames.

A message is a ZMQ multipart: frame 0 is a msgpack map `{"v": version, "t": type, ...}`;
token ids, logprobs and weight tensors follow as raw little-endian frames, never as msgpack
lists, so an 8k-token prompt costs one memcpy instead of 8k msgpack integers. Every decode
failure raises `ProtocolError`; the server turns it into an `Error` reply and keeps serving.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # headers are small; anything bigger is garbage or abuse
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def _ids(frame: bytes | memoryview, what: str, dtype: np.dtype = _I32) -> np.ndarray:
    buf = memoryview(frame)
    if buf.nbytes % dtype.itemsize:
        raise ProtocolError(f"{what} frame has {buf.nbytes} bytes, not a multiple of {dtype.itemsize}")
    return np.frombuffer(buf, dtype=dtype)


def _as_bytes(a: Any, dtype: np.dtype) -> bytes | memoryview:
    arr = np.ascontiguousarray(a, dtype=dtype)
    return memoryview(arr).cast("B")


def _xxh3(frames: list[bytes | memoryview]) -> int:
    import xxhash

    h = xxhash.xxh3_64()
    for f in frames:
        h.update(f)
    return h.intdigest()


def _crc32(frames: list[bytes | memoryview]) -> int:
    crc = 0
    for f in frames:
        crc = zlib.crc32(f, crc)
    return crc


# payload checksums by name: xxh3 (~13 GB/s here) where the xxhash package is installed, CRC32
# (~2.3 GB/s here, measured side by side on 64 MiB) otherwise; a bucket says which one it carries
CHECKSUMS = {"xxh3": _xxh3, "crc32": _crc32}
try:
    import xxhash  # noqa: F401

    DEFAULT_CHECKSUM = "xxh3"
except ImportError:
    DEFAULT_CHECKSUM = "crc32"


def checksum(frames: list[bytes | memoryview], alg: str = "crc32") -> int:
    """The `alg` checksum over the payload frames of a weight bucket, checked by the receiver."""
    if alg not in CHECKSUMS:
        raise ProtocolError(f"unknown checksum {alg!r}; this peer knows {sorted(CHECKSUMS)}")
    if alg == "xxh3" and DEFAULT_CHECKSUM != "xxh3":
        raise ProtocolError("the sender checksummed with xxh3 but this peer lacks the xxhash package; pip install "
                            "xxhash")
    return CHECKSUMS[alg](frames)


@dataclass
class Message:
    """Base of all messages. Subclasses declare TYPE, header fields and payload frames."""

    TYPE: ClassVar[str] = ""
    NUM_FRAMES: ClassVar[int] = 0  # payload frames after the header; -1 = any number
    rid: str = ""

    def header(self) -> dict[str, Any]:
        return {"rid": self.rid}

    def payload(self) -> list[bytes | memoryview]:
        return []

    def encode(self) -> list[bytes | memoryview]:
        head = {"v": PROTOCOL_VERSION, "t": self.TYPE, **self.header()}
        return [msgpack.packb(head, use_bin_type=True), *self.payload()]

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> "Message":
        return cls(rid=head["rid"])


@dataclass
class Generate(Message):
    TYPE: ClassVar[str] = "generate"
    NUM_FRAMES: ClassVar[int] = -1  # the prompt ids, then the pixel values when the prompt holds images
    prompt_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, _I32))
    sampling: dict[str, Any] = field(default_factory=dict)
    session_id: str = ""
    group_id: str = ""
    min_weight_version: int = 0
    pixel_values: np.ndarray | None = None  # [n, C, H, W] float32: the images behind the image tokens

    def header(self) -> dict[str, Any]:
        # "mwv" is the oldest weight version the caller accepts; "wv" in replies is the version used
        head = {"rid": self.rid, "sid": self.session_id, "gid": self.group_id,
                "sp": self.sampling, "mwv": self.min_weight_version}
        if self.pixel_values is not None:
            head["pv"] = list(self.pixel_values.shape)
        return head

    def payload(self) -> list[bytes | memoryview]:
        ids = [_as_bytes(self.prompt_ids, _I32)]
        return ids if self.pixel_values is None else ids + [_as_bytes(self.pixel_values, _F32)]

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> "Generate":
        shape = head.get("pv")
        if len(frames) != (1 if shape is None else 2):
            raise ProtocolError(f"generate carries the prompt ids{'' if shape is None else ' and pixel values'} "
                                f"({1 if shape is None else 2} frames), got {len(frames)} frames")
        ids = _ids(frames[0], "prompt_ids")
        if ids.size == 0:
            raise ProtocolError("generate with an empty prompt: send at least one token id")
        sp = head.get("sp", {})
        if not isinstance(sp, dict):
            raise ProtocolError(f"sampling params must be a map, got {type(sp).__name__}")
        pv = None
        if shape is not None:
            if not isinstance(shape, list) or len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in shape):
                raise ProtocolError(f"pixel values shape must be 4 positive ints [n, C, H, W], got {shape!r}")
            pv = _ids(frames[1], "pixel_values", _F32)
            if pv.size != int(np.prod(shape)):
                raise ProtocolError(f"pixel values frame holds {pv.size} floats, shape {shape} needs {int(np.prod(shape))}")
            pv = pv.reshape(shape)
        return cls(rid=head["rid"], prompt_ids=ids, sampling=sp, session_id=str(head.get("sid", "")),
                   group_id=str(head.get("gid", "")), min_weight_version=int(head.get("mwv", 0)), pixel_values=pv)


@dataclass
class Result(Message):
    TYPE: ClassVar[str] = "result"
    NUM_FRAMES: ClassVar[int] = 2
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, _I32))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, _F32))
    finish_reason: str = "stop"
    weight_version: int = 0
    engine_id: str = ""
    cached_prompt_tokens: int = 0
    load: int = 0  # waiting + running on the engine when this reply left

    def header(self) -> dict[str, Any]:
        return {"rid": self.rid, "fr": self.finish_reason, "wv": self.weight_version,
                "eid": self.engine_id, "cached": self.cached_prompt_tokens, "load": self.load}

    def payload(self) -> list[bytes | memoryview]:
        return [_as_bytes(self.token_ids, _I32), _as_bytes(self.logprobs, _F32)]

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> "Result":
        ids, lps = _ids(frames[0], "token_ids"), _ids(frames[1], "logprobs", _F32)
        if ids.size != lps.size:
            raise ProtocolError(f"result has {ids.size} token ids but {lps.size} logprobs")
        return cls(rid=head["rid"], token_ids=ids, logprobs=lps, finish_reason=str(head["fr"]),
                   weight_version=int(head["wv"]), engine_id=str(head["eid"]),
                   cached_prompt_tokens=int(head.get("cached", 0)), load=int(head.get("load", 0)))


@dataclass
class Error(Message):
    """Reply to anything the server could not do; `rid` is empty when the frame was unreadable."""

    TYPE: ClassVar[str] = "error"
    code: str = "bad_request"
    message: str = ""

    def header(self) -> dict[str, Any]:
        return {"rid": self.rid, "code": self.code, "msg": self.message}

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> "Error":
        return cls(rid=head["rid"], code=str(head.get("code", "")), message=str(head.get("msg", "")))


@dataclass
class Abort(Message):
    TYPE: ClassVar[str] = "abort"


@dataclass
class LoadRequest(Message):
    """Ask for a Status; sent periodically by every client (it doubles as the heartbeat)."""

    TYPE: ClassVar[str] = "load"


@dataclass
class Health(Message):
    TYPE: ClassVar[str] = "health"


@dataclass
class Status(Message):
    """Reply to `load` and `health`: the engine's identity, weight version and load."""

    TYPE: ClassVar[str] = "status"
    engine_id: str = ""
    weight_version: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    def header(self) -> dict[str, Any]:
        return {"rid": self.rid, "eid": self.engine_id, "wv": self.weight_version, "stats": self.stats}

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> "Status":
        return cls(rid=head["rid"], engine_id=str(head["eid"]), weight_version=int(head["wv"]),
                   stats=dict(head.get("stats", {})))

    @property
    def load(self) -> int:
        return int(self.stats.get("waiting", 0)) + int(self.stats.get("running", 0)) + int(self.stats.get("gated", 0))


SLEEP_LEVELS = (1, 2)


@dataclass
class Sleep(Message):
    """Give memory back while the trainer runs; `level` says how much (vLLM's sleep levels).

    Level 1 frees the KV cache and keeps the weights (a CUDA engine may park them in host RAM),
    so wake alone makes the engine usable again. Level 2 also discards the weights: after wake
    the engine serves nothing until a whole new weight version is committed, which is what a
    colocated engine wants when the trainer is about to send one anyway.
    """

    TYPE: ClassVar[str] = "sleep"
    level: int = 1

    def __post_init__(self) -> None:
        _check_sleep_level(self.level)

    def header(self) -> dict[str, Any]:
        return {"rid": self.rid, "lvl": self.level}

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> Sleep:
        return cls(rid=head["rid"], level=int(head.get("lvl", 1)))  # senders before levels mean 1


def _check_sleep_level(level: Any) -> None:
    if type(level) is not int or level not in SLEEP_LEVELS:  # True == 1 must not pass
        raise ProtocolError(f"sleep level {level!r} is not one of {SLEEP_LEVELS}: use 1 to keep the "
                            f"weights (KV cache freed) or 2 to discard them until the next weight update")


@dataclass
class Wake(Message):
    TYPE: ClassVar[str] = "wake"


@dataclass
class Ack(Message):
    """Reply to sleep, wake and the weight-update messages once they took effect."""

    TYPE: ClassVar[str] = "ack"
    of: str = ""
    weight_version: int = 0

    def header(self) -> dict[str, Any]:
        return {"rid": self.rid, "of": self.of, "wv": self.weight_version}

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> "Ack":
        return cls(rid=head["rid"], of=str(head.get("of", "")), weight_version=int(head.get("wv", 0)))


@dataclass
class WeightsBegin(Message):
    """Start loading weight version `version`; generation pauses until the commit. `preempt`:
    requests running now stop at once and reply with finish_reason "preempted" and the tokens
    they have (the client continues them on the new weights); otherwise they finish first."""

    TYPE: ClassVar[str] = "weights_begin"
    version: int = 0
    preempt: bool = False

    def header(self) -> dict[str, Any]:
        return {"rid": self.rid, "ver": self.version, "pre": self.preempt}

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> "WeightsBegin":
        return cls(rid=head["rid"], version=int(head["ver"]), preempt=bool(head.get("pre", False)))


@dataclass
class WeightsBucket(Message):
    """A size-bounded group of HF-named tensors, one raw frame each, with a checksum over them.

    With `shm` set the bytes are not in the message: they lie in a shared-memory slot on the
    engine's node (`rollout.shm`: path, byte offsets and sizes of each tensor, total bytes) or in a
    buffer on the sender's device named by its memory handle instead of a path (`rollout.handles`),
    the checksum covers the slot's `total` bytes, and `frames` is empty."""

    TYPE: ClassVar[str] = "weights_bucket"
    NUM_FRAMES: ClassVar[int] = -1
    version: int = 0
    index: int = 0
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)  # torch dtype names, e.g. "float32"
    shapes: list[list[int]] = field(default_factory=list)
    crc: int = 0
    frames: list[bytes | memoryview] = field(default_factory=list)
    alg: str = "crc32"  # which CHECKSUMS entry `crc` is
    shm: dict[str, Any] | None = None  # {"path" or "handle", "offsets", "sizes", "total"}: bytes not in frames

    def header(self) -> dict[str, Any]:
        head = {"rid": self.rid, "ver": self.version, "idx": self.index, "names": self.names,
                "dtypes": self.dtypes, "shapes": self.shapes, "crc": self.crc, "alg": self.alg}
        if self.shm is not None:
            head["shm"] = self.shm
        return head

    def payload(self) -> list[bytes | memoryview]:
        return list(self.frames)

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> "WeightsBucket":
        names, dtypes, shapes = list(head["names"]), list(head["dtypes"]), list(head["shapes"])
        shm = head.get("shm")
        if shm is not None:
            if frames or not isinstance(shm, dict) or not {"offsets", "sizes", "total"} <= shm.keys() \
                    or not ("path" in shm) ^ ("handle" in shm) \
                    or not len(names) == len(dtypes) == len(shapes) == len(shm["offsets"]) == len(shm["sizes"]):
                raise ProtocolError(f"weights bucket in shared memory must carry no frames, a path or a handle, and "
                                    f"one offset and size per name ({len(names)} names, {len(frames)} frames, shm {shm!r:.200})")
        elif not len(names) == len(dtypes) == len(shapes) == len(frames):
            raise ProtocolError(f"weights bucket lists {len(names)} names, {len(dtypes)} dtypes, "
                                f"{len(shapes)} shapes and carries {len(frames)} tensor frames")
        return cls(rid=head["rid"], version=int(head["ver"]), index=int(head["idx"]), names=names,
                   dtypes=dtypes, shapes=[list(map(int, s)) for s in shapes], crc=int(head["crc"]),
                   alg=str(head.get("alg", "crc32")), frames=list(frames), shm=shm)


@dataclass
class WeightsCommit(Message):
    TYPE: ClassVar[str] = "weights_commit"
    version: int = 0
    num_buckets: int = 0

    def header(self) -> dict[str, Any]:
        return {"rid": self.rid, "ver": self.version, "n": self.num_buckets}

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> "WeightsCommit":
        return cls(rid=head["rid"], version=int(head["ver"]), num_buckets=int(head["n"]))


MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m for m in (Generate, Result, Error, Abort, LoadRequest, Health, Status, Sleep, Wake,
                        Ack, WeightsBegin, WeightsBucket, WeightsCommit)
}


def decode(frames: list[bytes | memoryview]) -> Message:
    """Parse one multipart message; raise ProtocolError (never anything else) when it is bad."""
    if not frames:
        raise ProtocolError("empty message: expected a msgpack header frame")
    head_frame = frames[0]
    if memoryview(head_frame).nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame of {memoryview(head_frame).nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        head = msgpack.unpackb(head_frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"header frame is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(head, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(head).__name__}")
    version = head.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1 must not pass
        raise ProtocolError(f"unsupported protocol version {version!r}; this peer speaks {PROTOCOL_VERSION}")
    mtype = head.get("t")
    cls = MESSAGES.get(mtype) if isinstance(mtype, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {head.get('t')!r}; known: {sorted(MESSAGES)}")
    if not isinstance(head.get("rid"), str):
        raise ProtocolError(f"{cls.TYPE} needs a string 'rid', got {head.get('rid')!r}")
    payload = list(frames[1:])
    if cls.NUM_FRAMES >= 0 and len(payload) != cls.NUM_FRAMES:
        raise ProtocolError(f"{cls.TYPE} carries {cls.NUM_FRAMES} payload frames, got {len(payload)}")
    try:
        return cls.from_parts(head, payload)
    except ProtocolError:
        raise
    except Exception as e:  # missing key, wrong type inside the header
        raise ProtocolError(f"malformed {cls.TYPE} header ({type(e).__name__}: {e})") from None


def request_id_of(frames: list[bytes | memoryview]) -> str:
    """Best-effort rid of an undecodable message, so its error reply can still be matched."""
    try:
        head = msgpack.unpackb(frames[0], raw=False)
        rid = head.get("rid") if isinstance(head, dict) else None
        return rid if isinstance(rid, str) else ""
    except Exception:
        return ""
