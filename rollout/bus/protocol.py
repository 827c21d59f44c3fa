"""The bus's only wire format: one msgpack header frame plus raw binary frames.

A message is a ZMQ multipart: frame 0 is a msgpack map `{"v": version, "t": type, ...}` holding
the message's fields by their names in code; arrays (token ids, logprobs, pixel values) follow as
raw little-endian frames, never as msgpack lists, so an 8k-token prompt costs one memcpy instead of
8k msgpack integers. Each message is one dataclass declaration: its plain fields go in the header,
its `frame(...)` fields travel as raw frames (the header carries each one's shape), and one generic
encoder and decoder serve them all. Every decode failure raises `ProtocolError`; the server turns
it into an `Error` reply and keeps serving.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

PROTOCOL_VERSION = 2
MAX_HEADER_BYTES = 1 << 20  # headers are small; anything bigger is garbage or abuse
RESERVED = ("v", "t")  # header keys of the envelope, never field names
SLEEP_LEVELS = (1, 2)


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def frame(dtype: str | None, rank: int = 1, optional: bool = False) -> Any:
    """A field sent as one raw frame: an array of `dtype` ("<i4", "<f4") with `rank` dimensions
    (its shape goes in the header under the field's name); `dtype=None` declares a list of raw
    byte frames instead (all the frames after the typed ones)."""
    meta = {"frame": None if dtype is None else np.dtype(dtype), "rank": rank, "optional": optional}
    if optional:
        return field(default=None, metadata=meta)
    return field(default_factory=list if dtype is None else (lambda: np.zeros((0,) * rank, dtype)), metadata=meta)


# header field types by their annotation: what a decoded value must be (bool is not an int here)
_KINDS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "bool": (bool,), "float": (float, int),
                                       "dict": (dict,), "list": (list,)}


def _kind(annotation: str) -> tuple[tuple[type, ...], bool]:
    optional = annotation.endswith("| None")
    base = annotation.removesuffix("| None").strip().split("[", 1)[0]
    return _KINDS[base], optional


def _array(buf: bytes | memoryview, dtype: np.dtype, shape: Any, name: str) -> np.ndarray:
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(f"{name} shape must be a list of non-negative ints, got {shape!r:.100}")
    view = memoryview(buf)
    count = math.prod(shape)
    if view.nbytes != count * dtype.itemsize:
        raise ProtocolError(f"{name} frame has {view.nbytes} bytes, shape {shape} of {dtype} needs "
                            f"{count * dtype.itemsize}")
    arr = np.frombuffer(view, dtype=dtype)
    return arr if len(shape) == 1 else arr.reshape(shape)


@dataclass(frozen=True)
class _Plan:
    """A message class's fields sorted once by how they travel (decoding and encoding run per request,
    so they must not walk `dataclasses.fields` and parse annotations every time)."""

    head: tuple[tuple[str, tuple[type, ...], bool, str], ...]  # (name, accepted types, None allowed, annotation)
    typed: tuple[tuple[str, np.dtype, int, bool], ...]  # (name, dtype, rank, optional): one raw frame each
    tail: str | None  # the field holding all remaining raw frames, if any


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        head, typed, tail = [], [], None
        for f in dataclasses.fields(cls):
            if "frame" not in f.metadata:
                head.append((f.name, *_kind(str(f.type)), str(f.type)))
            elif f.metadata["frame"] is None:
                tail = tail or f.name
            else:
                typed.append((f.name, f.metadata["frame"], f.metadata["rank"], f.metadata["optional"]))
        plan = _PLANS[cls] = _Plan(tuple(head), tuple(typed), tail)
    return plan


@dataclass
class Message:
    """Base of all messages: a TYPE and a request id. Subclasses declare their fields and may
    check them in `check` (called where a message is made and where it is decoded)."""

    TYPE: ClassVar[str] = ""
    rid: str = ""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ProtocolError when the fields do not make a valid message."""

    def encode(self) -> list[bytes | memoryview]:
        plan = _plan(type(self))
        head: dict[str, Any] = {"v": PROTOCOL_VERSION, "t": self.TYPE}
        for name, _, _, _ in plan.head:
            head[name] = getattr(self, name)
        frames: list[bytes | memoryview] = [b""]
        for name, dtype, rank, _ in plan.typed:
            value = getattr(self, name)
            if value is None:
                continue
            arr = np.ascontiguousarray(value, dtype=dtype)
            if arr.size == 0 and arr.ndim != rank:  # an empty list of rows: [] is shape (0,)
                arr = arr.reshape((0,) * rank)
            head[name] = list(arr.shape)
            frames.append(memoryview(arr).cast("B") if arr.size else b"")
        if plan.tail is not None:
            frames += list(getattr(self, plan.tail))
        frames[0] = msgpack.packb(head, use_bin_type=True)
        return frames

    @classmethod
    def from_parts(cls, head: dict[str, Any], frames: list[bytes | memoryview]) -> "Message":
        plan = _plan(cls)
        values: dict[str, Any] = {}
        for name, kinds, optional, annotation in plan.head:
            if name not in head:
                continue  # the declared default
            value = head[name]
            if value is None and optional:
                values[name] = None
            elif not isinstance(value, kinds) or (type(value) is bool and bool not in kinds):
                raise ProtocolError(f"{cls.TYPE}.{name} must be {annotation}, got {type(value).__name__}")
            else:
                values[name] = value
        used = 0  # the typed frames come first, in declaration order
        for name, dtype, rank, optional in plan.typed:
            if name in head:
                if used >= len(frames):
                    raise ProtocolError(f"{cls.TYPE} names a {name} frame but carries no frame for it")
                arr = _array(frames[used], dtype, head[name], f"{cls.TYPE}.{name}")
                used += 1
                if arr.ndim != rank:
                    raise ProtocolError(f"{cls.TYPE}.{name} must have {rank} dimension(s), got shape {head[name]}")
                values[name] = arr
            elif not optional:
                raise ProtocolError(f"{cls.TYPE} must carry {name} (a raw frame, its shape in the header)")
        if plan.tail is not None:
            values[plan.tail], used = list(frames[used:]), len(frames)
        if used < len(frames):
            raise ProtocolError(f"{cls.TYPE} carries {len(frames) - used} frame(s) more than its fields name")
        return cls(**values)


@dataclass
class Generate(Message):
    """Generate from `prompt_ids`; `min_weight_version` is the oldest weight version the caller
    accepts; `pixel_values` [n, C, H, W] are the images behind the prompt's image tokens."""

    TYPE: ClassVar[str] = "generate"
    prompt_ids: np.ndarray = frame("<i4")
    sampling: dict[str, Any] = field(default_factory=dict)
    session_id: str = ""
    group_id: str = ""
    min_weight_version: int = 0
    pixel_values: np.ndarray | None = frame("<f4", rank=4, optional=True)

    def check(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ProtocolError("generate with an empty prompt: send at least one token id")
        if self.pixel_values is not None and 0 in np.shape(self.pixel_values):
            raise ProtocolError(f"pixel values shape must be 4 positive ints [n, C, H, W], got "
                                f"{list(np.shape(self.pixel_values))}")


@dataclass
class Result(Message):
    TYPE: ClassVar[str] = "result"
    token_ids: np.ndarray = frame("<i4")
    logprobs: np.ndarray = frame("<f4")
    finish_reason: str = "stop"
    weight_version: int = 0
    engine_id: str = ""
    cached_prompt_tokens: int = 0
    load: int = 0  # waiting + running on the engine when this reply left
    score: float | None = None  # a reward model's score of the prompt (engine hf_reward); None for generations
    # with sampling top_logprobs = k > 0: per token the k most likely ids and their logprobs, [n, k] each
    top_ids: np.ndarray | None = frame("<i4", rank=2, optional=True)
    top_logprobs: np.ndarray | None = frame("<f4", rank=2, optional=True)

    def check(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ProtocolError(f"result has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")
        if (self.top_ids is None) != (self.top_logprobs is None) or (self.top_ids is not None and not (
                np.shape(self.top_ids) == np.shape(self.top_logprobs) and len(self.top_ids) == len(self.token_ids))):
            raise ProtocolError(f"result top_ids {list(np.shape(self.top_ids))} and top_logprobs "
                                f"{list(np.shape(self.top_logprobs))} must both be [n, k] for its {len(self.token_ids)} "
                                f"tokens, or both absent")


@dataclass
class Error(Message):
    """Reply to anything the server could not do; `rid` is empty when the frame was unreadable."""

    TYPE: ClassVar[str] = "error"
    code: str = "bad_request"
    message: str = ""


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

    @property
    def load(self) -> int:
        return int(self.stats.get("waiting", 0)) + int(self.stats.get("running", 0)) + int(self.stats.get("gated", 0))


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

    def check(self) -> None:
        if type(self.level) is not int or self.level not in SLEEP_LEVELS:  # True == 1 must not pass
            raise ProtocolError(f"sleep level {self.level!r} is not one of {SLEEP_LEVELS}: use 1 to keep the "
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


@dataclass
class WeightsBegin(Message):
    """Start loading `weight_version`; generation pauses until the commit. `preempt`: requests
    running now stop at once and reply with finish_reason "preempted" and the tokens they have
    (the client continues them on the new weights); otherwise they finish first."""

    TYPE: ClassVar[str] = "weights_begin"
    weight_version: int = 0
    preempt: bool = False


@dataclass
class WeightsBucket(Message):
    """A size-bounded group of HF-named tensors with a checksum over their bytes.

    The bytes ride as one raw frame per tensor (`frames`), or lie in a buffer on the engine's
    node that `ref` names (rollout/weights/: a shared-memory slot by `path`, or a buffer by its
    memory `handle`; with byte `offsets` and `sizes` per tensor and the `total`), and then
    `frames` is empty and the checksum covers the buffer's `total` bytes. `checksum_alg` names
    the checksum (rollout/weights/codec.py: xxh3, crc32, or sum64 on the buffer's device)."""

    TYPE: ClassVar[str] = "weights_bucket"
    weight_version: int = 0
    index: int = 0
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)  # torch dtype names, e.g. "float32"
    shapes: list[list[int]] = field(default_factory=list)
    checksum: int = 0
    checksum_alg: str = "crc32"
    ref: dict[str, Any] | None = None  # {"path" or "handle", "offsets", "sizes", "total"}: bytes not in frames
    frames: list[bytes | memoryview] = frame(None)

    def check(self) -> None:
        names, dtypes, shapes, ref = self.names, self.dtypes, self.shapes, self.ref
        if ref is not None:
            if self.frames or not {"offsets", "sizes", "total"} <= ref.keys() or not ("path" in ref) ^ ("handle" in ref) \
                    or not len(names) == len(dtypes) == len(shapes) == len(ref["offsets"]) == len(ref["sizes"]):
                raise ProtocolError(f"a weights bucket in a buffer must carry no frames, a path or a handle, and one "
                                    f"offset and size per name ({len(names)} names, {len(self.frames)} frames, "
                                    f"ref {ref!r:.200})")
        elif not len(names) == len(dtypes) == len(shapes) == len(self.frames):
            raise ProtocolError(f"weights bucket lists {len(names)} names, {len(dtypes)} dtypes, "
                                f"{len(shapes)} shapes and carries {len(self.frames)} tensor frames")
        if not all(isinstance(s, list) and all(type(d) is int for d in s) for s in shapes):
            raise ProtocolError(f"weights bucket shapes must be lists of ints, got {shapes!r:.200}")


@dataclass
class WeightsCommit(Message):
    TYPE: ClassVar[str] = "weights_commit"
    weight_version: int = 0
    num_buckets: int = 0


@dataclass
class WeightsDigest(Message):
    """Ask for a digest of every tensor the engine serves now (engines/weight_digest.py): sent after a
    commit, it is answered in order after it, and the trainer compares it with what it sent. `names`:
    only these HF tensors (a push that checks a share of them); empty: all."""

    TYPE: ClassVar[str] = "weights_digest"
    names: list[str] = field(default_factory=list)


@dataclass
class Digest(Message):
    """Reply to `weights_digest`: per HF tensor name its (s . v, ||v||) as one [n, 2] float64 frame;
    `available` false: the engine cannot take one (a backend without it, tensor parallelism)."""

    TYPE: ClassVar[str] = "digest"
    weight_version: int = 0
    available: bool = True
    names: list[str] = field(default_factory=list)
    values: np.ndarray = frame("<f8", rank=2)

    def check(self) -> None:
        if np.shape(self.values) not in ((len(self.names), 2), (0, 0)) or (self.names and len(self.values) == 0):
            raise ProtocolError(f"digest lists {len(self.names)} names but values of shape {list(np.shape(self.values))}; "
                                f"expected [{len(self.names)}, 2]")


MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m for m in (Generate, Result, Error, Abort, LoadRequest, Health, Status, Sleep, Wake,
                        Ack, WeightsBegin, WeightsBucket, WeightsCommit, WeightsDigest, Digest)
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
    try:
        return cls.from_parts(head, list(frames[1:]))
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
