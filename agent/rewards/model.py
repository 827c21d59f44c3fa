"""A reward model or an LLM judge, served by engines on the bus, scoring each finished trajectory.

    reward:
      model:
        path: Qwen/Qwen2.5-7B-Instruct   # the judge (any chat model) or a sequence-classification model
        kind: judge                      # judge: generate a verdict and read a number from it
                                         # scalar: the model's one-logit head scores the conversation
        template: "...{question}...{response}...{reference}..."
        max_score: 10                    # judge: reward = clamp(number, 0, max_score) / max_score

The run starts the model's own engine group (`rollout/reward_engines.py`: `num_engines` servers of
`engine`, hf for a judge and hf_reward for a scalar model unless named), or attaches to servers
already running (`addresses`). The policy's weight updates never reach them and they never sleep.
Each trajectory is sent to them the moment its loop ends, from the agent worker that ran it, so
judging overlaps the generation of the others; requests are routed and load-balanced over the
group like the policy's.

A judge's prompt is `template` filled with the row's last user message (`question`), the decoded
response (`response`, tool turns included) and `reward_model.ground_truth` (`reference`), as a user
message (after `system`, if set) in the judge's chat template. Its verdict is the last number in the
reply that `pattern` matches. A scalar model scores the row's prompt messages followed by the
response as the assistant's message, in its own chat template (without one: the messages' texts,
one per line).

The score is the outcome in place of the rule scorer's (outcome.py; the loop's tool, interaction
and shaping terms stay), and is logged as the reward part `model` beside `model/latency_s`. A verdict with no number scores 0
with the part `model/unparsed` 1 (the trajectory is still trained on: that is the judge's answer).
A judge that fails or misses `timeout_s` fails only its trajectory (termination "error", the
reason in its `error`). Every judgement is recorded as a "judge" turn (prompt, reply, score,
latency), which the traces show.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from agent.rewards import Outcome
from engines.config_checks import from_mapping

KINDS = ("judge", "scalar")
DEFAULT_TEMPLATE = ("Question:\n{question}\n\nReference answer: {reference}\n\nResponse to grade:\n{response}\n\n"
                    "Grade the response from 0 (wrong) to 10 (correct and complete). Reply with the number only.")
DEFAULT_ENGINE = {"judge": "hf", "scalar": "hf_reward"}


@dataclass
class RewardModelConfig:
    """`reward.model`: a judge or a scalar reward model on engines of its own."""

    path: str | None = None  # None: no reward model
    kind: str = "judge"  # judge | scalar
    engine: str | None = None  # default: hf for a judge, hf_reward for a scalar model
    num_engines: int = 1
    engine_options: dict[str, Any] = field(default_factory=dict)
    addresses: list[str] = field(default_factory=list)  # attach to these servers instead of starting any
    devices: list[int] = field(default_factory=list)  # GPU nodes: the GPUs its engines get
    template: str = DEFAULT_TEMPLATE  # judge: {question}, {response}, {reference}
    system: str = ""  # judge: a system message before the prompt
    pattern: str = r"-?\d+(?:\.\d+)?"  # judge: the verdict is the last match in the reply
    max_score: float = 10.0  # judge: reward = clamp(verdict, 0, max_score) / max_score
    max_tokens: int = 32  # judge: tokens of its reply
    temperature: float = 0.0
    timeout_s: float = 120.0  # per trajectory

    def __post_init__(self) -> None:
        if self.path is None:
            return
        if self.kind not in KINDS:
            raise ValueError(f"reward.model.kind={self.kind!r}; choose one of {KINDS}")
        if self.engine is None:
            self.engine = DEFAULT_ENGINE[self.kind]
        for name in ("num_engines", "max_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"reward.model.{name}={getattr(self, name)} must be >= 1")
        for name in ("max_score", "timeout_s"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"reward.model.{name}={getattr(self, name)} must be > 0")
        if self.temperature < 0:
            raise ValueError(f"reward.model.temperature={self.temperature} must be >= 0 (0: greedy)")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"reward.model.pattern={self.pattern!r} is not a regular expression: {e}") from None
        if self.kind == "judge":
            try:
                self.template.format(question="", response="", reference="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"reward.model.template names an unknown field {e}; it may use {{question}}, "
                                 "{response} and {reference} (write {{ and }} for literal braces)") from None

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None) -> "RewardModelConfig":
        return from_mapping(cls, dict(d or {}), "reward.model")


def question_of(row: Mapping[str, Any]) -> str:
    """The row's last user message as text."""
    for m in reversed(list(row.get("prompt") or [])):
        if isinstance(m, Mapping) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):
                return " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            return str(content or "")
    return ""


def verdict(reply: str, pattern: str, max_score: float) -> float | None:
    """The last number `pattern` finds in `reply`, clamped to [0, max_score] and scaled to [0, 1]."""
    found = re.findall(pattern, reply)
    if not found:
        return None
    last = found[-1] if isinstance(found[-1], str) else next((g for g in found[-1] if g), "")
    try:
        value = float(last)
    except ValueError:
        return None
    return min(max(value, 0.0), max_score) / max_score


class RewardModel:
    """The run's reward model in one agent worker: `await start()`, then `await score(row, out, tokenizer)`."""

    def __init__(self, cfg: RewardModelConfig, keys: Any = None) -> None:
        assert cfg.path is not None
        if not cfg.addresses:
            raise ValueError("reward.model has no engine addresses; the run starts its engines and fills them in "
                             "(rollout/reward_engines.py), or list running servers in reward.model.addresses")
        self.cfg, self.keys = cfg, keys
        self.client: Any = None
        self.encoder: Any = None

    async def start(self, timeout_s: float) -> None:
        from agent.chat import ChatEncoder
        from engines.models import load_tokenizer
        from rollout.bus.client import GenerateClient

        self.tokenizer = load_tokenizer(str(self.cfg.path))
        self.encoder = ChatEncoder(self.tokenizer) if self.cfg.kind == "judge" else None
        self.client = GenerateClient(list(self.cfg.addresses), keys=self.keys)
        await self.client.start()
        await self.client.wait_ready(timeout_s=timeout_s)

    def prompt(self, row: Mapping[str, Any], response_text: str) -> tuple[str, list[int]]:
        """What the model reads: (text shown in traces, token ids in its own chat template)."""
        if self.cfg.kind == "scalar":
            messages = [dict(m) for m in row.get("prompt") or []] + [{"role": "assistant", "content": response_text}]
            if getattr(self.tokenizer, "chat_template", None):
                out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
                return response_text, list(out["input_ids"])
            # no chat template: the messages' texts, one per line
            text = "\n".join(str(m.get("content") or "") for m in messages)
            return response_text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        rm = row.get("reward_model") if isinstance(row.get("reward_model"), Mapping) else {}
        text = self.cfg.template.format(question=question_of(row), response=response_text,
                                        reference="" if rm.get("ground_truth") is None else rm["ground_truth"])
        messages = ([{"role": "system", "content": self.cfg.system}] if self.cfg.system else []) + \
            [{"role": "user", "content": text}]
        return text, self.encoder.initial(messages)

    async def score(self, row: Mapping[str, Any], out: Any, tokenizer: Any) -> Outcome:
        """The model's outcome for `out` (outcome.py adds it to the loop's parts), its verdict as a turn."""
        assert self.client is not None, "call start() first"
        t0 = time.perf_counter()
        reply, parts, error, score = "", {}, "", 0.0
        prompt_text = ""
        try:
            response_text = tokenizer.decode(list(out.response_ids), skip_special_tokens=True)
            prompt_text, ids = self.prompt(row, response_text)
            sampling = {"max_tokens": 1} if self.cfg.kind == "scalar" else \
                {"max_tokens": self.cfg.max_tokens, "temperature": self.cfg.temperature}
            result = await asyncio.wait_for(self.client.generate(ids, sampling, session_id=f"judge-{out.session_id}"),
                                            self.cfg.timeout_s)
            if self.cfg.kind == "scalar":
                if getattr(result, "score", None) is None:
                    raise RuntimeError(f"engine {result.engine_id} returned no score; a scalar reward model needs "
                                       "an engine that scores (reward.model.engine=hf_reward)")
                score = float(result.score)
            else:
                reply = self.tokenizer.decode(list(result.token_ids), skip_special_tokens=True)
                found = verdict(reply, self.cfg.pattern, self.cfg.max_score)
                score = 0.0 if found is None else found
                parts["model/unparsed"] = 1.0 if found is None else 0.0
        except asyncio.TimeoutError:
            error = f"the reward model took longer than reward.model.timeout_s={self.cfg.timeout_s}"
        except Exception as e:  # noqa: BLE001 - a judge's failure is its trajectory's, never the step's
            error = f"the reward model failed: {type(e).__name__}: {e}"
        latency = time.perf_counter() - t0
        if error:
            score = 0.0
        turn = {"kind": "judge", "prompt": prompt_text[-4000:], "reply": reply, "score": score, "latency_s": latency,
                **({"error": error} if error else {})}
        return Outcome(score, {**parts, "model/latency_s": latency}, error, turns=[turn])

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
