"""The default loop: one prompt, one reply, its text the answer the outcome scores. What `agent_name` falls back to."""

from __future__ import annotations

from typing import Any

from agent.chat import ChatEncoder
from agent.loop import AgentLoopBase, AgentLoopOutput, new_session_id
from agent.rewards import loop_reward
from agent.vision import without_pixels


class SingleTurnAgentLoop(AgentLoopBase):
    """Encode `prompt` with the chat template, generate once, score the reply."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        messages = self.prompt_messages(row)
        session_id = row.get("session_id") or new_session_id()
        encoder = ChatEncoder(self.tokenizer, vision=self.ctx.vision)
        traj = self.start_trajectory(encoder, messages)
        turns: list[dict[str, Any]] = []
        budget = int(self.config.get("max_response_tokens", sampling_params.get("max_tokens", 256)))
        params = {**sampling_params, "max_tokens": min(budget, int(sampling_params.get("max_tokens", budget)))}
        try:
            result = await self.generate(traj, params, session_id, row.get("group_id"), turns)
        finally:
            self.client.end_session(session_id)
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        reward, extra = loop_reward(self.config.get("reward_shaping"))
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids, response_ids=traj.response_ids, response_mask=traj.response_mask,
            response_logprobs=traj.response_logprobs, reward=reward, num_turns=1,
            termination="stop" if result.finish_reason == "stop" else result.finish_reason,
            turns=turns, weight_versions=[result.weight_version], request_ids=[result.request_id],
            reward_extra=extra, messages=without_pixels(messages) + [{"role": "assistant", "content": text}],
            session_id=session_id, multi_modal=traj.multi_modal(), answer_text=text)
