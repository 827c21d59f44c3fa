"""Token-exact incremental chat encoding for multi-turn trajectories.

RL on multi-turn trajectories needs the token ids the policy is trained on to be the ids the
engine sampled. Re-rendering the whole conversation with the chat template after every turn
breaks that: decoding model tokens and encoding the text again can merge or split tokens
differently, and some templates rewrite earlier turns. So a trajectory is encoded with the
template ONCE (`ChatEncoder.initial`) and afterwards only grows at the end:

    ids = enc.initial(messages)                      # prompt, mask 0
    ids += model_ids                                 # exactly as the engine returned them, mask 1
    ids += enc.close_assistant_turn(model_ids)       # mask 0; empty unless the reply was cut
    ids += enc.turn_tokens([tool or user messages])  # mask 0; ends with the next generation prompt

`turn_tokens` learns what the template adds for new messages by rendering a fixed dummy
conversation with and without them ("diff of renders"), so it works for any template whose
rendering of earlier turns does not depend on what follows; templates that break this are
detected and refused with an error instead of producing silently wrong masks.
"""

from __future__ import annotations

from typing import Any, Sequence

from agent.vision import has_images

_DUMMY_SYSTEM = "You are a dummy system prompt used to measure the chat template."
_DUMMY_USER = "Dummy user question used to measure the chat template."
_DUMMY_ASSISTANT = "Dummy assistant answer used to measure the chat template."


class ChatTemplateError(ValueError):
    """The chat template cannot be extended by appending tokens (see the message for why)."""


class ChatEncoder:
    """Encodes the first messages of a trajectory once and the later non-assistant turns as
    suffixes, so that initial + model tokens + suffixes equals the template's own rendering.

    `tools` is the OpenAI-style function schema list handed to the template (it usually ends
    up in the system prompt, which is why the dummy conversation is rendered with the same
    tools). `end_of_turn_id` is the token that closes an assistant turn in the template;
    it defaults to the tokenizer's eos token, which is right for ChatML (`<|im_end|>`) and
    Llama 3 instruct (`<|eot_id|>`) tokenizers.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[dict[str, Any]] | None = None,
                 end_of_turn_id: int | None = None, vision: Any = None) -> None:
        self.tokenizer = tokenizer
        self.vision = vision  # agent.vision.Vision of a vision-language model: image tokens are expanded
        self.tools = list(tools) if tools else None
        eot = tokenizer.eos_token_id if end_of_turn_id is None else end_of_turn_id
        if eot is None:
            raise ChatTemplateError("the tokenizer has no eos_token_id; pass end_of_turn_id= the token id that "
                                    "closes an assistant turn in the chat template (e.g. <|im_end|>)")
        self.end_of_turn_id: int = int(eot)
        self._dummy = [{"role": "system", "content": _DUMMY_SYSTEM},
                       {"role": "user", "content": _DUMMY_USER},
                       {"role": "assistant", "content": _DUMMY_ASSISTANT}]
        base = self.render(self._dummy, add_generation_prompt=False)
        self._prefix, self._closing = self._split_dummy(base)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """The template's token ids for `messages` (with this encoder's tools); with a `vision`, each
        image part's token repeated as many times as the model has embeddings per image."""
        if self.vision is None and any(isinstance(m.get("content"), list) and has_images([m]) for m in messages):
            raise ValueError("the messages hold images but the model is text-only (its config has no vision "
                             "tower); use a vision-language model (e.g. the built-in tiny-vlm) or drop the images")
        out = self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt, return_dict=True)
        ids = list(out["input_ids"])
        return self.vision.expand(ids) if self.vision is not None else ids

    def initial(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The prompt of a trajectory: the only full render, ending with the generation prompt."""
        if not messages:
            raise ValueError("initial() needs at least one message (got an empty list)")
        return self.render(messages, add_generation_prompt=True)

    def close_assistant_turn(self, model_ids: Sequence[int]) -> list[int]:
        """What to append (mask 0) after a reply so that it ends the way the template closes an
        assistant turn. Empty when the model stopped on the end-of-turn token; otherwise (the
        reply was cut by a length limit or another stop) the template's closing tokens, which
        the model did not produce and must not be trained on."""
        if model_ids and int(model_ids[-1]) == self.end_of_turn_id:
            return []
        return list(self._closing)

    def turn_tokens(self, new_messages: Sequence[dict[str, Any]]) -> list[int]:
        """The tokens the template adds for `new_messages` (tool results or user turns) after a
        closed assistant turn, followed by the generation prompt of the next assistant turn.

        Pass all messages of one turn together: templates such as Qwen2.5's group consecutive
        tool results into one user block, so encoding them one by one would differ.
        """
        if not new_messages:
            raise ValueError("turn_tokens() needs at least one message; to only start the next assistant "
                             "turn, pass the messages that prompted it")
        for m in new_messages:
            if m.get("role") == "assistant":
                raise ValueError("turn_tokens() encodes tool/user/system messages only; assistant tokens come "
                                 f"from the engine (got an assistant message: {str(m)[:80]!r})")
        full = self.render(self._dummy + list(new_messages), add_generation_prompt=True)
        n = len(self._prefix)
        if full[:n] != self._prefix:
            at = next((i for i, (a, b) in enumerate(zip(full, self._prefix)) if a != b), min(len(full), n))
            raise ChatTemplateError(
                "the chat template renders earlier turns differently once more messages follow (first "
                f"difference at token {at}: {self._show(self._prefix[at:at + 8])} became "
                f"{self._show(full[at:at + 8])}), so the trajectory cannot be extended by appending; "
                "use a template that renders past turns independently of later ones (e.g. one that does "
                "not strip reasoning from earlier assistant turns)")
        return full[n:]

    def _split_dummy(self, base: list[int]) -> tuple[list[int], list[int]]:
        """Split the dummy render just after the assistant's end-of-turn token, and find the
        tokens between its content and that token (what `close_assistant_turn` appends)."""
        positions = [i for i, t in enumerate(base) if t == self.end_of_turn_id]
        if not positions:
            raise ChatTemplateError(
                f"the end-of-turn token id {self.end_of_turn_id} ({self._show([self.end_of_turn_id])}) does not "
                "occur in the template's rendering of an assistant turn; pass end_of_turn_id= the id of the "
                "token the template puts after assistant content")
        eot = positions[-1]
        content = self.tokenizer.encode(_DUMMY_ASSISTANT, add_special_tokens=False)
        start = _find_last(base[:eot], content)
        if start is None:
            raise ChatTemplateError(
                "the template does not render assistant content verbatim (could not find the dummy answer "
                f"before the end-of-turn token {self._show([self.end_of_turn_id])}); it cannot be extended "
                "token-exactly")
        return base[:eot + 1], base[start + len(content):eot + 1]

    def _show(self, ids: Sequence[int]) -> str:
        return repr(self.tokenizer.decode(list(ids)))


def _find_last(seq: Sequence[int], sub: Sequence[int]) -> int | None:
    """Start of the last occurrence of `sub` in `seq`, or None."""
    for i in range(len(seq) - len(sub), -1, -1):
        if list(seq[i:i + len(sub)]) == list(sub):
            return i
    return None

