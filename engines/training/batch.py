"""The training batch: what rollout hands the trainer and every actor and reference consumes.

It lives with the training engines, not with rollout, because it is the contract between the
two: rollout builds it (`pad_outputs` from finished trajectories), the actors read it, and the
engines must not import from rollout. Prompts are left-padded and responses right-padded, so
prompt and response meet at column P for every row; the real lengths are kept explicitly
(`prompt_lengths`, `response_lengths`), and `micro_batch` cuts a few rows down to their own
widest prompt and response, the window every forward pass uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engines.training.trajectory import AgentLoopOutput


@dataclass
class MicroBatch:
    """A few rows cut to what a forward pass needs. The logits at columns [first, first + k) of
    `input_ids` predict `targets` ([b, k]); `target_mask` says which targets are real (not
    padding, not an unlabelled SFT token). `position_ids` is None where positions simply count
    from 0 (right-padded SFT rows). Packed by shared prefix (`engines/training/prefix.py`), the rows
    are one sequence ([1, s], a [1, 1, s, s] mask) and `target_at` ([b, k]) says which position's
    logits score each target."""

    rows: torch.Tensor  # [b] indices into the batch the micro-batch was cut from
    input_ids: torch.Tensor  # [b, s]
    attention_mask: torch.Tensor  # [b, s]
    position_ids: torch.Tensor | None  # [b, s]
    first: int
    targets: torch.Tensor  # [b, k]
    target_mask: torch.Tensor  # [b, k] bool
    pixel_values: torch.Tensor | None = None  # [n, C, H, W]: the rows' images, in the order of their image tokens
    target_at: torch.Tensor | None = None  # [b, k] packed positions whose logits score the targets
    prefix_tree: Any = None  # packed: its runs (engines/training/tree_attention.py PrefixTree)

    @property
    def tokens(self) -> int:
        """The token positions its forward computes for real: padding not counted, and packed by
        shared prefix each shared token once (what a FLOP count of the forward is proportional to)."""
        if self.target_at is not None:
            return int(self.input_ids.shape[1])
        return int(self.attention_mask.sum())

    def to(self, device: torch.device) -> "MicroBatch":
        pos = None if self.position_ids is None else self.position_ids.to(device)
        pv = None if self.pixel_values is None else self.pixel_values.to(device)
        at = None if self.target_at is None else self.target_at.to(device)
        return MicroBatch(self.rows, self.input_ids.to(device), self.attention_mask.to(device), pos, self.first,
                          self.targets.to(device), self.target_mask.to(device), pv, at, self.prefix_tree)

    def model_inputs(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Inputs beyond the token ids a forward pass takes: the images of a vision-language model
        (in `dtype`, the model's)."""
        return {} if self.pixel_values is None else {"pixel_values": self.pixel_values.to(dtype or torch.float32)}


@dataclass
class Batch:
    """Padded trajectories. Rows with `valid` False ended with termination "error" (a loop or
    engine failure, not a model behaviour): they are dropped from the loss (`loss_mask`) and from
    their group's baseline. `reward_extra` lists hold NaN where a row's loop did not report that key."""

    prompts: torch.Tensor  # [B, P] long
    responses: torch.Tensor  # [B, R] long
    response_mask: torch.Tensor  # [B, R] long, 1 = model token
    rollout_logprobs: torch.Tensor  # [B, R] float32, 0 where mask is 0
    attention_mask: torch.Tensor  # [B, P + R] long
    position_ids: torch.Tensor  # [B, P + R] long
    prompt_lengths: torch.Tensor  # [B] long: real prompt tokens (right-aligned at column P)
    response_lengths: torch.Tensor  # [B] long: real response tokens (from column P on)
    rewards: torch.Tensor  # [B] float32
    group_index: torch.Tensor  # [B] long: rows with equal index are samples of one prompt
    valid: torch.Tensor  # [B] bool
    num_turns: list[int]
    termination: list[str]
    weight_versions: list[list[int]]
    reward_extra: dict[str, list[float]]
    request_ids: list[list[str]]
    session_ids: list[str]
    errors: list[str]
    turns: list[list[dict[str, Any]]]
    global_size: int = 0  # > 0: this is one data-parallel rank's shard of a batch of that many rows
    version_segments: list[list[list[int]]] = field(default_factory=list)  # per row: [version, tokens] runs
    pixel_values: list[torch.Tensor | None] = field(default_factory=list)  # per row: [n, C, H, W] or None; [] = none
    # [B, R] float32: at the last token of the turn that earned it, the part of `rewards` that turn
    # earned on its own (tool step rewards, interaction turn scores); zeros where nothing was attached
    turn_rewards: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.turn_rewards is None:
            self.turn_rewards = torch.zeros(self.responses.shape, dtype=torch.float32, device=self.responses.device)

    def __len__(self) -> int:
        return int(self.prompts.shape[0])

    @property
    def is_shard(self) -> bool:
        return self.global_size > 0

    @property
    def total_rows(self) -> int:
        """Rows of the whole step's batch, on every rank (mini-batch sizes count these)."""
        return self.global_size or len(self)

    def shard(self, rows: torch.Tensor, global_size: int | None = None) -> Batch:
        """`rows` of this batch as a data-parallel shard (tensors and per-row lists alike)."""
        idx = rows.tolist()
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        tensors = {name: getattr(self, name)[rows] for name in TENSOR_FIELDS}
        return Batch(**tensors, num_turns=pick(self.num_turns), termination=pick(self.termination),
                     weight_versions=pick(self.weight_versions),
                     reward_extra={k: pick(v) for k, v in self.reward_extra.items()},
                     request_ids=pick(self.request_ids), session_ids=pick(self.session_ids), errors=pick(self.errors),
                     turns=pick(self.turns), global_size=global_size or self.total_rows,
                     version_segments=pick(self.version_segments) if self.version_segments else [],
                     pixel_values=pick(self.pixel_values) if self.pixel_values else [])

    @property
    def prompt_width(self) -> int:
        """P: the column where every response starts."""
        return int(self.prompts.shape[1])

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.responses], dim=1)

    @property
    def loss_mask(self) -> torch.Tensor:
        """`response_mask` with invalid rows zeroed: what a policy loss should average over."""
        return self.response_mask * self.valid.to(self.response_mask.dtype)[:, None]

    @property
    def real_responses(self) -> torch.Tensor:
        """[B, R] bool: columns that hold a response token (model's or the loop's), not padding."""
        return torch.arange(self.responses.shape[1])[None, :] < self.response_lengths[:, None]

    def micro_batch(self, rows: torch.Tensor) -> MicroBatch:
        """`rows` cut to their own widest prompt and response (a batch is padded to the widest
        trajectory of the whole step). At least one response column is kept, so a pass over rows
        whose responses are all empty still has a shape every pipeline stage agrees on."""
        p = self.prompt_width
        plen, rlen = self.prompt_lengths[rows], self.response_lengths[rows]
        if len(rows) and int(plen.min()) < 1:
            raise ValueError("a trajectory has an empty prompt; every row needs at least one prompt token")
        begin = p - (int(plen.max()) if len(rows) else 0)
        end = max(1, int(rlen.max()) if len(rows) else 0)
        ids = torch.cat([self.prompts[rows, begin:], self.responses[rows, :end]], dim=1)
        pixels = [self.pixel_values[i] for i in rows.tolist() if self.pixel_values and self.pixel_values[i] is not None]
        return MicroBatch(rows=rows, input_ids=ids, attention_mask=self.attention_mask[rows, begin:p + end],
                          position_ids=self.position_ids[rows, begin:p + end], first=p - begin - 1,
                          targets=self.responses[rows, :end], target_mask=torch.arange(end)[None, :] < rlen[:, None],
                          pixel_values=torch.cat(pixels) if pixels else None)

    def metrics(self) -> dict[str, float]:
        """Rollout numbers for the step log; rewards and lengths over valid rows only."""
        v = self.valid
        resp_len = self.response_lengths.float()
        nan = float("nan")
        m: dict[str, float] = {
            "rollout/trajectories": float(len(self)), "rollout/invalid": float((~v).sum()),
            "rollout/reward_mean": float(self.rewards[v].mean()) if v.any() else nan,
            "rollout/reward_std": float(self.rewards[v].std()) if v.sum() > 1 else nan,
            "rollout/response_length_mean": float(resp_len[v].mean()) if v.any() else nan,
            "rollout/response_length_max": float(resp_len.max()) if len(self) else nan,
            "rollout/model_tokens_mean": float(self.response_mask[v].sum(1).float().mean()) if v.any() else nan,
            "rollout/tokens": float(self.attention_mask.sum()),  # prompt and response tokens: what an update reads
            "rollout/num_turns_mean": sum(self.num_turns) / max(1, len(self.num_turns)),
        }
        for t in sorted(set(self.termination)):
            m[f"rollout/termination/{t}"] = float(self.termination.count(t))
        tool_turns = [t for ts in self.turns for t in ts if t.get("kind") == "tools"]
        for key in ("calls", "failed", "timeouts", "parse_errors"):
            m[f"rollout/tool_{key}"] = float(sum(int(t.get(key, 0)) for t in tool_turns))
        m["rollout/tool_calls_per_trajectory"] = m["rollout/tool_calls"] / max(1, len(self))
        if self.turn_rewards is not None:  # rewards attached to turns (turn_grpo credits them per turn)
            m["rollout/turn_rewards_per_trajectory"] = float((self.turn_rewards != 0).sum()) / max(1, len(self))
        gen = [float(t["latency_s"]) for ts in self.turns for t in ts if t.get("kind") == "generate"]
        if gen:
            m["rollout/generate_latency_mean_s"] = sum(gen) / len(gen)
            m["rollout/generate_latency_max_s"] = max(gen)
        for key, vals in self.reward_extra.items():
            x = torch.tensor(vals, dtype=torch.float64)
            m[f"rollout/reward_extra/{key}"] = float(x.nanmean()) if len(x) else nan
        return m


TRUNCATED = ("length", "token_budget")  # terminations where a token limit cut the response


def filter_overlong(batch: Batch) -> dict[str, float]:
    """Over-long filtering (DAPO): trajectories cut by a token limit leave the loss and their
    group's baseline (like invalid rows), instead of being trained as if they had ended."""
    cut = torch.tensor([t in TRUNCATED for t in batch.termination], dtype=torch.bool)
    batch.valid &= ~cut
    return {"rollout/overlong_filtered": float(cut.sum())}


def equal_rewards(outputs: Sequence[AgentLoopOutput]) -> bool:
    """Whether a GRPO group carries no signal: every sample has the same reward."""
    return len({float(o.reward) for o in outputs}) <= 1


TENSOR_FIELDS = ("prompts", "responses", "response_mask", "rollout_logprobs", "attention_mask", "position_ids",
                 "prompt_lengths", "response_lengths", "rewards", "group_index", "valid", "turn_rewards")


def group_shards(group_index: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Row indices of `parts` data-parallel shards, split at group boundaries (a GRPO group's
    baseline needs all its samples on one rank), as even in groups as possible."""
    groups = torch.unique(group_index)
    return [torch.nonzero(torch.isin(group_index, g)).flatten() for g in torch.tensor_split(groups, parts)]


def segments_of(o: Any) -> list[Any]:
    """The output itself (without its extra segments) and each extra segment as an output of its type."""
    extra = list(getattr(o, "extra_segments", None) or [])
    if not extra:
        return [o]
    import dataclasses

    return [dataclasses.replace(o, extra_segments=[])] + [
        type(o)(**d) if isinstance(d, dict) else d for d in extra]


def _cut_failed(o: Any) -> Any:
    """A failed trajectory (termination "error") is never trained on: it keeps its last prompt token
    and no response, so a prompt the engine refused (a 10 MB row: 1.7M tokens) cannot size the padded
    batch, nor the attention mask of every pass that reads it."""
    import dataclasses

    if o.termination != "error" or not dataclasses.is_dataclass(o) or (len(o.prompt_ids) <= 1 and not o.response_ids):
        return o
    changes: dict[str, Any] = {"prompt_ids": list(o.prompt_ids[-1:]), "response_ids": [], "response_mask": [],
                               "response_logprobs": []}
    changes.update({k: type(getattr(o, k))() for k in ("turn_rewards", "multi_modal") if hasattr(o, k)})
    return dataclasses.replace(o, **changes)


def pad_outputs(outputs: Sequence[AgentLoopOutput], pad_id: int, group_index: Sequence[int],
                prompt_length: int | None = None, response_length: int | None = None) -> Batch:
    """Pad trajectories into a Batch. Fixed `prompt_length`/`response_length` give static shapes;
    a trajectory longer than them is an error (cutting it would train on a different sequence
    than the one sampled), so raise the loop's token budget instead. An output with
    `extra_segments` (a sample recorded as several token sequences, e.g. a client that edited its
    history) becomes one row per segment, each in the sample's group with the sample's reward."""
    if len(group_index) != len(outputs):
        raise ValueError(f"group_index has {len(group_index)} entries for {len(outputs)} outputs; give one per output")
    if any(getattr(o, "extra_segments", None) for o in outputs):
        flat = [(seg, g) for o, g in zip(outputs, group_index) for seg in segments_of(o)]
        outputs, group_index = [seg for seg, _ in flat], [g for _, g in flat]
    outputs = [_cut_failed(o) for o in outputs]
    for i, o in enumerate(outputs):
        try:
            o.check()
        except AssertionError as e:
            raise ValueError(f"output {i} is inconsistent: {e}") from None
    plens = [len(o.prompt_ids) for o in outputs]
    rlens = [len(o.response_ids) for o in outputs]
    p, r = max(plens, default=0), max(rlens, default=0)
    for name, got, fixed in (("prompt_length", p, prompt_length), ("response_length", r, response_length)):
        if fixed is not None and got > fixed:
            raise ValueError(f"{name}={fixed} but a trajectory has {got} tokens; raise {name} or lower the "
                             "loops' token budgets (max_response_tokens)")
    p, r = prompt_length if prompt_length is not None else p, response_length if response_length is not None else r
    b = len(outputs)
    prompts = torch.full((b, p), int(pad_id), dtype=torch.long)
    responses = torch.full((b, r), int(pad_id), dtype=torch.long)
    response_mask = torch.zeros((b, r), dtype=torch.long)
    logprobs = torch.zeros((b, r), dtype=torch.float32)
    attention = torch.zeros((b, p + r), dtype=torch.long)
    turn_rewards = torch.zeros((b, r), dtype=torch.float32)
    for i, (o, lp, lr) in enumerate(zip(outputs, plens, rlens)):
        for position, value in getattr(o, "turn_rewards", None) or ():
            if not 0 < int(position) <= lr:
                raise ValueError(f"output {i} attaches a turn reward at response position {position} but its response "
                                 f"has {lr} tokens; a turn reward goes at 1..{lr} (the tokens before it earned it)")
            turn_rewards[i, int(position) - 1] += float(value)
        if lp:
            prompts[i, p - lp:] = torch.tensor(o.prompt_ids, dtype=torch.long)
        if lr:
            responses[i, :lr] = torch.tensor(o.response_ids, dtype=torch.long)
            response_mask[i, :lr] = torch.tensor(o.response_mask, dtype=torch.long)
            logprobs[i, :lr] = torch.tensor(o.response_logprobs, dtype=torch.float32)
        attention[i, p - lp:p + lr] = 1
    keys = sorted({k for o in outputs for k in o.reward_extra})
    return Batch(
        prompts=prompts, responses=responses, response_mask=response_mask, rollout_logprobs=logprobs,
        attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
        prompt_lengths=torch.tensor(plens, dtype=torch.long), response_lengths=torch.tensor(rlens, dtype=torch.long),
        rewards=torch.tensor([float(o.reward) for o in outputs], dtype=torch.float32),
        group_index=torch.tensor(list(group_index), dtype=torch.long),
        valid=torch.tensor([o.termination != "error" for o in outputs], dtype=torch.bool),
        num_turns=[o.num_turns for o in outputs], termination=[o.termination for o in outputs],
        weight_versions=[list(o.weight_versions) for o in outputs],
        reward_extra={k: [float(o.reward_extra.get(k, float("nan"))) for o in outputs] for k in keys},
        request_ids=[list(o.request_ids) for o in outputs], session_ids=[o.session_id for o in outputs],
        errors=[o.error for o in outputs], turns=[list(o.turns) for o in outputs],
        version_segments=[[list(s) for s in getattr(o, "version_segments", [])] for o in outputs],
        pixel_values=_pixel_values(outputs), turn_rewards=turn_rewards)


def _pixel_values(outputs: Sequence[Any]) -> list[torch.Tensor | None]:
    """Per row, the pixel values of its images (`multi_modal["pixel_values"]`); [] when no row has any."""
    found = [(getattr(o, "multi_modal", None) or {}).get("pixel_values") for o in outputs]
    if all(pv is None for pv in found):
        return []
    return [None if pv is None else torch.as_tensor(pv, dtype=torch.float32) for pv in found]
