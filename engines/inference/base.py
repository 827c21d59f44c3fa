"""The one interface every inference backend implements.

Agent loops never see an engine directly: they talk to an EngineServer over the bus
(`rollout/`), and the server drives exactly one object that satisfies `Engine`. Keeping the
contract token-in/token-out (ids in, ids + logprobs out) is what lets the trainer learn from
exactly the tokens the model produced.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Protocol, runtime_checkable
from engines.config_checks import from_mapping

if TYPE_CHECKING:  # torch is heavy; the bus and the router never need it
    import torch

FINISH_REASONS = ("stop", "length", "abort")


class EngineDeadError(RuntimeError):
    """The backend cannot serve any more requests; its server exits so clients fail over."""


SLEEP_LEVELS = (1, 2)  # 1: free the KV cache, keep the weights; 2: discard the weights too


def check_sleep_level(level: int) -> None:
    """Every backend refuses unknown levels the same way, before it pauses anything."""
    if type(level) is not int or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level {level!r} is not one of {SLEEP_LEVELS}: use 1 to keep the weights "
                         f"(KV cache freed) or 2 to discard them until the next weight update")


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0
MAX_PENALTY, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS = 2.0, 100.0, 20  # OpenAI's ranges


def _int(name: str, value: Any, low: int | None = None) -> None:
    if type(value) is not int:  # bool and float are refused: top_k=1.5 or max_tokens=True is a bug
        raise ValueError(f"{name}={value!r} must be an integer")
    if low is not None and value < low:
        raise ValueError(f"{name}={value} must be >= {low}")


def _real(name: str, value: Any, bound: float | None = None) -> None:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if bound is not None and not -bound <= value <= bound:
        raise ValueError(f"{name}={value!r} must be in [{-bound:g}, {bound:g}]")


def _logit_bias(value: Any) -> dict[int, float]:
    """{token id: bias} with int keys; JSON and msgpack maps carry the ids as strings ("123")."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias={value!r:.100} must be a map of token ids to biases")
    out: dict[int, float] = {}
    for key, bias in value.items():
        tid = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if type(tid) is not int or tid < 0:
            raise ValueError(f"logit_bias key {key!r} must be a token id (a non-negative integer, or its digits "
                             f"as a string)")
        _real(f"logit_bias[{key!r}]", bias, MAX_LOGIT_BIAS)
        out[tid] = float(bias)
    return out


def call_options(calls: str) -> list[tuple[str, str, str]]:
    """`json_calls` text (a JSON list of [opening, JSON schema of the arguments, closing]) as
    (opening, schema text, closing) triples; a ValueError naming what is malformed."""
    try:
        items = json.loads(calls)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_calls is not valid JSON ({e}); send a list of [opening, schema, closing]") from None
    if not isinstance(items, list) or not items:
        raise ValueError(f"json_calls={calls!r:.80} must be a non-empty list of [opening, schema, closing]")
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and item[0]
                and isinstance(item[1], dict) and isinstance(item[2], str)):
            raise ValueError(f"json_calls[{i}]={item!r:.80} must be [opening (non-empty text), schema (a JSON "
                             "object), closing (text)]")
        out.append((item[0], json.dumps(item[1]), item[2]))
    return out


@dataclass
class SamplingParams:
    """Per-request sampling. `logprobs` are always returned for every generated token.

    Logprobs are of the temperature-scaled distribution before top-k/top-p truncation,
    i.e. log_softmax(logits / temperature) (raw logits when temperature == 0), which is what
    the actor recomputes during training.

    OpenAI's logits adjustments, applied before temperature: `logit_bias` ({token id: bias in
    [-100, 100]}) is added to those tokens' logits; `presence_penalty` and `frequency_penalty` (each
    in [-2, 2]) subtract `presence * (count > 0) + frequency * count` from the logit of every token
    this request has generated so far (`count` times; prompt tokens do not count). They change
    what is sampled, and the logprobs are then of that adjusted distribution on every engine (the
    behaviour probabilities of an off-policy rollout, which `algorithm.loss.off_policy` weighs
    against the policy the trainer recomputes). `top_logprobs` (0..20) also returns, per generated
    token, the k most likely tokens and their logprobs under that same distribution.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int = 0
    # a JSON schema (as text) the output must match, by constrained decoding; '{"type": "object"}'
    # for any JSON object (OpenAI's response_format json_object); "" = unconstrained
    json_schema: str = ""
    # text that must follow the JSON value, when json_schema is set (a forced tool call's closing,
    # e.g. '}\n</tool_call>'); "" = the output ends with the value
    json_suffix: str = ""
    # JSON text of a list of [opening, JSON schema, closing]: with json_schema, the output is either
    # the value under json_schema (the final answer) or one of these tool calls (its opening, an
    # optional space, arguments under its schema, its closing); the model chooses, nothing is
    # forced; "" = the output is the json_schema value (and json_suffix) only
    json_calls: str = ""

    def __post_init__(self) -> None:
        """Every field checked for type and range, so a request that would poison a batch (a
        temperature that overflows the logits, a fractional top_k, a string of stop ids) fails
        alone at the bus boundary instead of inside a batched step with its batch-mates."""
        _int("max_tokens", self.max_tokens, low=1)
        _real("temperature", self.temperature)
        if self.temperature != 0 and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature!r} must be 0 (greedy) or in [{MIN_TEMPERATURE}, "
                             f"{MAX_TEMPERATURE}]; smaller values overflow the scaled logits")
        _real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        _int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or >= 1")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a list of token ids")
        for t in self.stop_token_ids:
            _int("stop_token_ids[]", t, low=0)
        self.stop_token_ids = list(self.stop_token_ids)
        if type(self.ignore_eos) is not bool:
            raise ValueError(f"ignore_eos={self.ignore_eos!r} must be true or false")
        if self.seed is not None:
            _int("seed", self.seed, low=0)
        _real("frequency_penalty", self.frequency_penalty, MAX_PENALTY)
        _real("presence_penalty", self.presence_penalty, MAX_PENALTY)
        self.logit_bias = _logit_bias(self.logit_bias)
        _int("top_logprobs", self.top_logprobs, low=0)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={self.top_logprobs} must be at most {MAX_TOP_LOGPROBS}")
        if not isinstance(self.json_schema, str):
            raise ValueError(f"json_schema={self.json_schema!r:.80} must be a JSON schema as text")
        if self.json_schema:
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON ({e}); send the schema as JSON text") from None
            if not isinstance(schema, dict):
                raise ValueError(f"json_schema={self.json_schema!r:.80} must be a JSON object (a schema)")
        if not isinstance(self.json_suffix, str):
            raise ValueError(f"json_suffix={self.json_suffix!r:.80} must be text")
        if self.json_suffix and not self.json_schema:
            raise ValueError(f"json_suffix={self.json_suffix!r:.80} needs a json_schema: it is the text after the "
                             "JSON value the schema describes")
        if not isinstance(self.json_calls, str):
            raise ValueError(f"json_calls={self.json_calls!r:.80} must be text (a JSON list of [opening, schema, "
                             "closing])")
        if self.json_calls:
            if not self.json_schema:
                raise ValueError(f"json_calls={self.json_calls!r:.80} needs a json_schema: the calls are the "
                                 "alternatives to the JSON value it describes")
            if self.json_suffix:
                raise ValueError(f"json_calls={self.json_calls!r:.80} with json_suffix={self.json_suffix!r:.40}: a "
                                 "suffix closes a forced call, the calls are offered beside the answer; send one")
            call_options(self.json_calls)

    def to_dict(self) -> dict[str, Any]:
        """A dict for the bus: msgpack maps take string keys only, so logit_bias ids go as strings."""
        d = asdict(self)
        d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        return from_mapping(cls, d, "sampling")


@dataclass
class GenerateOutput:
    """What one generate call returns: the engine's own tokens, never re-tokenized text."""

    token_ids: list[int]  # or a 1-D int array: the server sends either as raw int32 bytes
    logprobs: list[float]  # or a 1-D float array
    finish_reason: str  # one of FINISH_REASONS
    cached_prompt_tokens: int = 0  # prompt tokens the engine served from its prefix cache
    score: float | None = None  # a reward model's scalar for the whole prompt (hf_reward); None for generations
    # with SamplingParams.top_logprobs = k > 0: per generated token the k most likely token ids [n, k]
    # and their logprobs [n, k], most likely first (lists of lists or 2-D arrays); None otherwise
    top_ids: Any = None
    top_logprobs: Any = None


@dataclass
class EngineStats:
    """Load and cache figures an engine reports; the router balances on `waiting + running`.

    `generated_tokens` counts every token sampled so far, those of requests still running included
    (hf, vllm, the in-process vllm; sglang counts a reply when it ends): a load report that moves
    while long replies decode."""

    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    sleeping: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Engine(Protocol):
    """A backend the EngineServer drives. All methods run on the server's asyncio loop."""

    async def start(self) -> None:
        """Load the model; called once before any other method."""

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        """Generate for one request; many calls run concurrently and are batched inside.
        `prompt_ids` is a list or, from the server, a read-only int32 array (`id_list` makes a list)."""

    async def abort(self, request_id: str) -> None:
        """Stop a running request; its generate() returns with finish_reason 'abort'."""

    async def update_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Load one bucket of HF-named tensors into the live model (may be called many times).
        The tensors may be views of a shared-memory slot that is refilled once this returns: copy
        what must outlive the call."""

    async def finish_weight_update(self) -> None:
        """All buckets of one version have arrived: apply what was staged (vLLM reloads here)."""

    async def sleep(self, level: int = 1) -> None:
        """Pause generation and give memory back while a colocated trainer needs it.

        level 1: free the KV cache and keep the weights (on CUDA they may move to host RAM);
        wake() alone makes the engine usable again. level 2: also discard the weights, so the
        memory they held is free too (vLLM's sleep level 2); only worth it when a new version
        is about to be sent anyway. Any other level raises ValueError (see check_sleep_level).
        """

    async def wake(self) -> None:
        """Take the memory back. After a level-2 sleep the weights have memory again but
        undefined values until update_weights() + finish_weight_update() load a whole version;
        the server admits no generation before that commit."""

    def stats(self) -> EngineStats:
        """Current load; must be cheap, it is called for every reply."""

    async def close(self) -> None:
        """Release everything; the engine is not used again."""


def held_dtype(engine: Any) -> str | None:
    """The dtype name ("float32", "bfloat16") an engine holds its weights in, which a weight push must
    arrive in: its `dtype` attribute (a torch dtype or a name; sglang keeps it among its `kwargs`).
    None where it has none (echo) or leaves it to the model's config ("auto")."""
    dtype = getattr(engine, "dtype", None) or getattr(engine, "kwargs", {}).get("dtype")
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    return None if name in (None, "auto") else name


def id_list(prompt_ids: Any) -> list[int]:
    """Token ids as a Python list of ints: what engine APIs take. The server hands engines the
    int32 array it decoded from the request's frame (read-only, valid during the call); an engine
    that needs a list converts it here, one that can use the array (echo) does not pay for it."""
    return prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
