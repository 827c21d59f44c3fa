"""A GSM8K tutor: checks the model's answer after each turn and asks for another try when it is
wrong, without revealing the right one — so the policy can learn to recover from its mistakes."""

from __future__ import annotations

from typing import Any

from agent.interactions.base import BaseInteraction, last_assistant_text
from agent.rewards.gsm8k import extract_answer, to_number

CORRECT = "Your answer is correct!"
WRONG = "Your answer is wrong. Please check your reasoning and try again."
NO_ANSWER = ("I could not find a numeric answer in your reply. Please try again and end your reply with "
             "the final answer as a number, like `#### <number>`.")
GAVE_UP = "Your answer is wrong, and you are out of attempts."


class Gsm8kInteraction(BaseInteraction):
    """Config: `max_retries` (default 2): how many more attempts the model gets after a wrong
    answer. The (max_retries + 1)-th wrong answer ends the interaction (done=True); a reply with
    no number counts as a wrong answer. Start kwargs: `ground_truth` (72, "72", "#### 72")."""

    default_name = "gsm8k"

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        retries = self.config.get("max_retries", 2)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"interaction {self.name!r}: max_retries={retries!r} must be an integer >= 0")
        self.max_retries = retries

    async def start(self, instance_id: str | None = None, **kwargs: Any) -> str:
        if kwargs.get("ground_truth") is None:
            raise ValueError(f"interaction {self.name!r}: start() needs ground_truth=...; put it in the dataset "
                             "row's interaction_kwargs")
        answer = to_number(kwargs["ground_truth"])  # a bad ground truth fails here, not at the first answer
        iid = await super().start(instance_id, **kwargs)
        self.instances[iid].update(answer=answer, wrong=0, solved=False, done=False)
        return iid

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]]) -> tuple[bool, str, float]:
        """(True, CORRECT, 1.0) for the right number; (False, a try-again message, 0.0) for a wrong one
        while attempts remain, (True, GAVE_UP, 0.0) after. Once done, later calls repeat done with 0.0."""
        state = self.state(instance_id)
        if state["done"]:
            return True, CORRECT if state["solved"] else GAVE_UP, 0.0
        got = extract_answer(last_assistant_text(messages), "flexible")
        if got is not None and to_number(got) == state["answer"]:
            state.update(solved=True, done=True)
            return True, CORRECT, 1.0
        state["wrong"] += 1
        if state["wrong"] > self.max_retries:
            state["done"] = True
            return True, GAVE_UP, 0.0
        return False, NO_ANSWER if got is None else WRONG, 0.0

    async def calculate_score(self, instance_id: str) -> float:
        """1.0 if any attempt was right, else 0.0: a recovered mistake scores like a first-try answer."""
        return 1.0 if self.state(instance_id)["solved"] else 0.0
