"""Optional MLflow tracing of finished trajectories, for looking at what the policy actually did.

A reward curve says that something changed; a trace says what: the prompt, every generation
(its tokens, logprobs, request id, engine, latency), every tool round (calls, failures,
timeouts) and interaction turn, the final token ids and mask the trainer will see, the reward.
Tracing is off by default and costs nothing then: `mlflow` is imported only when it is enabled.

Traces are written after a trajectory ends (the loops stay free of tracing code), so span
durations are the measured latencies of each turn, placed one after another from the
trajectory's start. Sampling is by GRPO group: a traced group is traced whole, which is what
one needs to compare the n answers to one prompt.

A failure to write a trace is logged and counted, never raised: observability must not stop
a rollout.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import urlparse

if TYPE_CHECKING:
    from agent.loop import AgentLoopOutput

log = logging.getLogger("switchyard.traces")

SPAN_TYPES = {"generate": "LLM", "tools": "TOOL", "interaction": "AGENT"}


@dataclass
class TraceConfig:
    """`tracking_uri` None means MLflow's own default (MLFLOW_TRACKING_URI or its local store);
    `sample_rate` is the fraction of GRPO groups traced (1.0 = every trajectory)."""

    enabled: bool = False
    tracking_uri: str | None = None
    experiment: str = "switchyard-rollouts"
    sample_rate: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.sample_rate) <= 1.0:
            raise ValueError(f"tracing.sample_rate={self.sample_rate} must be in [0, 1]")
        if not self.experiment:
            raise ValueError("tracing.experiment is empty; name the MLflow experiment, e.g. 'switchyard-rollouts'")


class TracingUnavailable(RuntimeError):
    """Tracing is enabled but MLflow cannot be used; raised at start-up, not mid-rollout."""


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as e:
        raise TracingUnavailable("tracing.enabled is true but mlflow is not installed: `pip install mlflow` "
                                 "(or `pip install mlflow-skinny`), or set tracing.enabled=false") from e
    return mlflow


def _artifact_location(tracking_uri: str | None) -> str | None:
    """Beside the database for a sqlite store; MLflow would otherwise use ./mlruns in the cwd."""
    if not tracking_uri or not tracking_uri.startswith("sqlite:///"):
        return None
    db = Path(urlparse(tracking_uri).path)
    return str(db.parent / "mlartifacts")


def prepare_experiment(cfg: TraceConfig) -> str | None:
    """Check MLflow and create the experiment once, in the parent, before workers start.

    Workers racing to create one experiment (and the database tables) would collide; given the
    id they only append traces. Returns None when tracing is off.
    """
    if not cfg.enabled:
        return None
    _import_mlflow()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    if exp is not None:
        return str(exp.experiment_id)
    try:
        return str(client.create_experiment(cfg.experiment, artifact_location=_artifact_location(cfg.tracking_uri)))
    except Exception:
        exp = client.get_experiment_by_name(cfg.experiment)  # created meanwhile by another process
        if exp is None:
            raise
        return str(exp.experiment_id)


def should_trace(key: str, sample_rate: float) -> bool:
    """A stable decision per key (the group id): every worker and every sample of a group agree."""
    if sample_rate >= 1.0:
        return True
    if sample_rate <= 0.0:
        return False
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return h / 2.0 ** 64 < sample_rate


class TrajectoryTracer:
    """Writes one MLflow trace per sampled trajectory; a no-op when tracing is disabled.

    Construct it in the process that records (an agent worker): MLflow's trace exporter follows
    the process-wide tracking URI, which this sets. `record_trajectory` blocks for a few
    milliseconds (export itself is asynchronous in MLflow), so async callers run it in a thread.
    """

    def __init__(self, cfg: TraceConfig, experiment_id: str | None = None) -> None:
        self.cfg = cfg
        self.enabled = bool(cfg.enabled)
        self.recorded = 0
        self.failed = 0
        self._client: Any = None
        self._mlflow: Any = None
        self.experiment_id = experiment_id
        if not self.enabled:
            return
        self._mlflow = _import_mlflow()
        if cfg.tracking_uri:
            self._mlflow.set_tracking_uri(cfg.tracking_uri)
        if self.experiment_id is None:
            self.experiment_id = prepare_experiment(cfg)
        from mlflow import MlflowClient

        self._client = MlflowClient()

    def record_trajectory(self, output: "AgentLoopOutput", row: Mapping[str, Any], start_ns: int | None = None,
                          end_ns: int | None = None) -> str | None:
        """Trace `output` (produced from dataset `row`); returns the trace id, or None when not traced."""
        if not self.enabled:
            return None
        if not should_trace(str(row.get("group_id") or output.session_id), self.cfg.sample_rate):
            return None
        try:
            trace_id = self._record(output, row, start_ns, end_ns)
        except Exception:
            self.failed += 1
            log.warning("could not trace trajectory %s (tracing failures never stop a rollout)", output.session_id,
                        exc_info=True)
            return None
        self.recorded += 1
        return trace_id

    def flush(self) -> None:
        """Wait until MLflow's background exporter has written every trace (call before exit)."""
        if self.enabled and hasattr(self._mlflow, "flush_trace_async_logging"):
            try:
                self._mlflow.flush_trace_async_logging()
            except Exception:
                log.warning("flushing MLflow traces failed", exc_info=True)

    # ---------------------------------------------------------------- building the trace
    def _record(self, out: "AgentLoopOutput", row: Mapping[str, Any], start_ns: int | None,
                end_ns: int | None) -> str:
        end_ns = end_ns or time.time_ns()
        busy_ns = sum(int(float(t.get("latency_s", 0.0)) * 1e9) for t in out.turns)
        start_ns = start_ns or end_ns - busy_ns
        prompt = list(row.get("prompt") or [])
        reward_model = row.get("reward_model") or {}
        tags = {"session_id": out.session_id, "group_id": str(row.get("group_id") or ""),
                "agent_name": str(row.get("agent_name") or ""), "termination": out.termination,
                "data_source": str(row.get("data_source") or "")}
        root = self._client.start_trace(
            "trajectory", span_type="AGENT", experiment_id=self.experiment_id, start_time_ns=start_ns, tags=tags,
            inputs={"messages": prompt, "ground_truth": reward_model.get("ground_truth")},
            attributes={**tags, "reward": float(out.reward), "num_turns": int(out.num_turns), "error": out.error,
                        "reward_extra": dict(out.reward_extra), "weight_versions": list(out.weight_versions),
                        "request_ids": list(out.request_ids), "prompt_ids": list(out.prompt_ids),
                        "response_ids": list(out.response_ids), "response_mask": list(out.response_mask),
                        "response_logprobs": list(out.response_logprobs)})
        after = out.messages[len(prompt):] if out.messages[:len(prompt)] == prompt else list(out.messages)
        replies, followers = _segments(after)
        cursor, pos, gen = start_ns, 0, -1
        for turn in out.turns:
            kind = str(turn.get("kind", "turn"))
            dur = int(float(turn.get("latency_s", 0.0)) * 1e9)
            outputs: dict[str, Any] = {}
            if kind == "generate":
                gen += 1
                ids, lps, pos = _model_slice(out, pos, int(turn.get("tokens", 0)))
                outputs = {"token_ids": ids, "logprobs": lps, "text": replies[gen] if gen < len(replies) else None}
            elif 0 <= gen < len(followers):
                outputs = {"messages": followers[gen]}
            span = self._client.start_span(kind, trace_id=root.trace_id, parent_id=root.span_id,
                                           span_type=SPAN_TYPES.get(kind, "UNKNOWN"), attributes=dict(turn),
                                           start_time_ns=cursor)
            failed = kind == "tools" and int(turn.get("failed", 0)) > 0
            self._client.end_span(root.trace_id, span.span_id, outputs=outputs, status="ERROR" if failed else "OK",
                                  end_time_ns=min(cursor + dur, max(end_ns, cursor)))
            cursor = min(cursor + dur, end_ns)
        self._client.end_trace(root.trace_id, outputs={"reward": float(out.reward), "termination": out.termination,
                                                       "messages": after},
                               status="ERROR" if out.termination == "error" else "OK", end_time_ns=end_ns)
        return str(root.trace_id)


def _segments(messages: list[dict[str, Any]]) -> tuple[list[str], list[list[dict[str, Any]]]]:
    """Split the messages after the prompt at each assistant reply: generation k wrote reply k,
    and the turn that follows it (tools or interaction) added followers k."""
    replies: list[str] = []
    followers: list[list[dict[str, Any]]] = []
    for m in messages:
        if m.get("role") == "assistant":
            replies.append(str(m.get("content", "")))
            followers.append([])
        elif followers:
            followers[-1].append(m)
    return replies, followers


def _model_slice(out: "AgentLoopOutput", pos: int, count: int) -> tuple[list[int], list[float], int]:
    """The next `count` mask-1 tokens from response position `pos` (skipping the loop's mask-0 glue)."""
    while pos < len(out.response_mask) and out.response_mask[pos] == 0:
        pos += 1
    end = pos + count
    return list(out.response_ids[pos:end]), list(out.response_logprobs[pos:end]), end
