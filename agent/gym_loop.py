"""Environments with `reset()` and `step(action)`: a gym-style loop, so an environment of the OpenEnv
or gymnasium kind trains without an agent framework.

    rollout:
      agent:
        gym_agent:
          env: my_envs.Wordle            # a class or factory, by dotted path (or path/to/file.py:Name)
          env_kwargs: {max_guesses: 6}   # given to it, with the row's `env_kwargs` on top
          max_steps: 8
          max_response_tokens: 2048

One environment instance per trajectory. `reset(**row_kwargs)` returns the first observation;
`step(action)` takes the model's reply as text and returns `(observation, reward, done, info)` or
gymnasium's `(observation, reward, terminated, truncated, info)`. Either may be `async def`; a
`close()` is called at the end if the environment has one. An observation is a string (a user
message), a message dict, or a list of message dicts (the row's `prompt` messages come first, so a
system prompt or task description can live in the dataset). Each reply is generated from the
trajectory's exact tokens; observations are appended as template tokens (mask 0).

The trajectory's reward is the sum of the step rewards; each step's reward is also attached to the
turn that earned it (`turn_rewards`), so `algorithm.advantage=turn_grpo` credits it per turn while
outcome estimators see the total. The parts logged are `env` (the sum) and `env_steps`.
A reply cut by the turn's `max_tokens` is still the step's action (the template's closing tokens are
added as mask 0). Terminations: "env_done", "max_steps", "token_budget" (the response budget is
spent), "abort", "error" (the environment raised: the trajectory is not trained on).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from agent.chat import ChatEncoder
from agent.loop import AgentLoopBase, AgentLoopOutput, new_session_id
from engines.config_checks import from_mapping

log = logging.getLogger("switchyard.gym")


@dataclass
class GymAgentConfig:
    env: str = ""  # "package.module.Name" or "path/to/file.py:Name": a class or a factory
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    max_steps: int = 8
    max_response_tokens: int = 2048  # the whole response: replies and observations

    def __post_init__(self) -> None:
        if not self.env:
            raise ValueError("gym_agent.env is not set; name the environment class as package.module.Name or "
                             "path/to/file.py:Name")
        for name in ("max_steps", "max_response_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"gym_agent.{name}={getattr(self, name)} must be >= 1")

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> "GymAgentConfig":
        return from_mapping(cls, dict(d), "gym_agent")


def load_env(spec: str) -> Callable[..., Any]:
    """The class or factory `spec` names (a dotted path, or a file path and a name after ':')."""
    if ":" in spec:
        from agent.rewards.function import load_function

        try:
            return load_function(spec)
        except ValueError as e:
            raise ValueError(str(e).replace("reward.function", "gym_agent.env")) from None
    from agent.dotted import import_dotted

    env = import_dotted(spec, "gym_agent.env")
    if not callable(env):
        raise ValueError(f"gym_agent.env={spec!r} is not a class or a factory")
    return env


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def as_messages(observation: Any) -> list[dict[str, Any]]:
    """An observation as chat messages: a string is a user message."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, Mapping) and "role" in observation:
        return [dict(observation)]
    if isinstance(observation, list) and all(isinstance(m, Mapping) and "role" in m for m in observation):
        return [dict(m) for m in observation]
    raise TypeError(f"the environment returned an observation of type {type(observation).__name__}; return a string "
                    "(a user message), a message dict or a list of message dicts")


def unpack_step(result: Any) -> tuple[Any, float, bool]:
    """(observation, reward, done) from a 4-tuple (gym) or a 5-tuple (gymnasium: terminated or truncated)."""
    if not isinstance(result, tuple) or len(result) not in (4, 5):
        raise TypeError(f"step() returned {type(result).__name__}; return (observation, reward, done, info) or "
                        "(observation, reward, terminated, truncated, info)")
    done = bool(result[2]) or (len(result) == 5 and bool(result[3]))
    reward = float(result[1])
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise ValueError(f"step() returned the reward {result[1]!r}; rewards must be finite")
    return result[0], reward, done


class GymAgentLoop(AgentLoopBase):
    """Reset, then reply / step until the environment says done."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.cfg = GymAgentConfig.from_mapping(self.config)
        self.make_env = load_env(self.cfg.env)  # a bad path fails at start-up

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        session_id = row.get("session_id") or new_session_id()
        encoder = ChatEncoder(self.tokenizer, vision=self.ctx.vision)
        messages = [dict(m) for m in row.get("prompt") or []]
        turns: list[dict[str, Any]] = []
        versions: list[int] = []
        request_ids: list[str] = []
        turn_rewards: list[list[float]] = []
        total, steps, termination, error = 0.0, 0, "max_steps", ""
        env, traj = None, None
        try:
            env = await _maybe(self.make_env(**self.cfg.env_kwargs))
            first = await _maybe(env.reset(**dict(row.get("env_kwargs") or {})))
            if isinstance(first, tuple):  # gymnasium: (observation, info)
                first = first[0]
            messages += as_messages(first)
            traj = self.start_trajectory(encoder, messages)
            while steps < self.cfg.max_steps:
                remaining = self.cfg.max_response_tokens - len(traj)
                params = {**sampling_params, "max_tokens": min(remaining, int(sampling_params.get("max_tokens",
                                                                                                    remaining)))}
                result = await self.generate(traj, params, session_id, row.get("group_id"), turns)
                versions.append(result.weight_version)
                request_ids.append(result.request_id)
                ids = result.token_ids[:-1] if result.token_ids and result.token_ids[-1] == encoder.end_of_turn_id \
                    else result.token_ids
                action = self.tokenizer.decode(ids, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": action})
                if result.finish_reason == "abort" or len(traj) >= self.cfg.max_response_tokens:
                    termination = "abort" if result.finish_reason == "abort" else "token_budget"
                    break  # a reply cut by the turn's max_tokens is still the step's action
                traj.add_context(encoder.close_assistant_turn(result.token_ids))
                observation, reward, done = unpack_step(await _maybe(env.step(action)))
                steps += 1
                total += reward
                turns.append({"kind": "env", "step": steps, "reward": reward, "done": done})
                if reward:
                    turn_rewards.append([len(traj), reward])
                if done:
                    termination = "env_done"
                    break
                new = as_messages(observation)
                ids = encoder.turn_tokens(new)
                if len(traj) + len(ids) >= self.cfg.max_response_tokens:
                    termination = "token_budget"
                    break
                traj.add_context(ids)
                messages += new
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # an environment's failure is its trajectory's
            log.exception("gym trajectory %s failed", session_id)
            termination, error = "error", f"{type(e).__name__}: {e}"
        finally:
            self.client.end_session(session_id)
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    await _maybe(close())
                except Exception:
                    log.exception("gym trajectory %s: the environment's close() failed", session_id)
        if traj is None:  # failed before the first observation: keep the row's prompt so the group lines up
            out = AgentLoopOutput.failed(encoder.initial(messages) if messages else [], error, session_id, messages)
            return out
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids, response_ids=traj.response_ids, response_mask=traj.response_mask,
            response_logprobs=traj.response_logprobs, reward=total if termination != "error" else 0.0,
            num_turns=len(versions), termination=termination, turns=turns, weight_versions=versions,
            request_ids=request_ids, reward_extra={"env": total, "env_steps": float(steps)}, messages=messages,
            session_id=session_id, error=error, turn_rewards=turn_rewards if termination != "error" else [])
