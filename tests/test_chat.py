"""ChatEncoder: incremental encoding must equal the template's full rendering, token for token.

How model token choices are isolated: every assistant turn is "generated" by tokenizing exactly
the text the template would render for that assistant message (for the hermes template: content
plus `<tool_call>` blocks with `json.dumps` arguments, as `tojson` writes them), then appending
the end-of-turn token. These are the tokens a model would emit if it chose the template's own
tokenization, so any difference between the incremental ids and `apply_chat_template(final)`
is a bug in how the encoder builds prompts and turns, and full equality is asserted. The texts
never start with whitespace, so tokenizing a reply alone splits it as the full render does (the
generation prompt's trailing newline and special tokens are pre-tokenization boundaries); a
sanity assertion checks each simulated reply against the template's render.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from agent.chat import ChatEncoder, ChatTemplateError

# A hermes tool-calling template in the style of Qwen2.5's: tools in the system prompt inside
# <tools></tools>, assistant calls as <tool_call> JSON blocks, tool results grouped into one
# user turn of <tool_response> blocks.
HERMES_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' }}
    {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls | default([]) %}
            {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

TOOLS = [
    {"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
                                      "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                     "required": ["expr"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the wiki.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                                                      "k": {"type": "integer"}}}}},
]

WORDS = ["the", "answer", "is", "42", "Paris", "x", "=", "3.14", "{", "}", "\"quoted\"", "naïve", "日本",
         "café", "<b>", "tool", "call", "result:", "\n", "  ", "-7", "sum", "(a+b)", "émoji🙂", "list:", "\t"]


@pytest.fixture(scope="module")
def smol() -> Any:
    from engines.models import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def hermes(smol: Any) -> Any:
    tok = copy.deepcopy(smol)
    tok.chat_template = HERMES_TEMPLATE
    return tok


def _text(rng: random.Random, lo: int = 1, hi: int = 12) -> str:
    """Random text that neither starts nor ends with whitespace (see the module docstring)."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return (rng.choice(["Hi", "Ok", "Result"]) + " " + " ".join(words) + " end").replace("  ", " ")


def _tool_call(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.5:
        args: dict[str, Any] = {"expr": f"{rng.randint(0, 99)} * {rng.randint(0, 99)}"}
        return {"type": "function", "function": {"name": "calc", "arguments": args}}
    args = {"query": _text(rng, 1, 4), "k": rng.randint(1, 5), "nested": {"a": [1, "}{"]}}
    return {"type": "function", "function": {"name": "search", "arguments": args}}


def _hermes_block(call: dict[str, Any]) -> str:
    fn = call["function"]
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False) + \
        "\n</tool_call>"


def _assistant(rng: random.Random, hermes_template: bool) -> tuple[dict[str, Any], str]:
    """A random assistant message and the text a model emits after the generation prompt."""
    content = _text(rng) if rng.random() < 0.7 else ""
    calls = [_tool_call(rng) for _ in range(rng.choice([0, 0, 1, 1, 2, 3]))]
    if not hermes_template:  # SmolLM's template has no tool_calls field: calls live in the content
        content = "\n".join([content] * bool(content) + [_hermes_block(c) for c in calls])
        return {"role": "assistant", "content": content}, content
    if not content and not calls:  # this template renders an empty reply without the prompt's newline,
        content = _text(rng)        # a quirk of Qwen2.5's template too; no appending encoder can match it
    rendered = ("\n" + content if content else "") + "".join("\n" + _hermes_block(c) for c in calls)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, rendered[1:]  # the first newline belongs to the template's generation prompt


def _observations(rng: random.Random) -> list[dict[str, Any]]:
    if rng.random() < 0.6:
        return [{"role": "tool", "content": _text(rng)} for _ in range(rng.randint(1, 3))]
    return [{"role": "user", "content": _text(rng)}]


@pytest.mark.parametrize("template", ["smollm2", "hermes"])
def test_incremental_encoding_equals_full_render(template: str, smol: Any, hermes: Any) -> None:
    tok = hermes if template == "hermes" else smol
    eos = tok.eos_token_id
    for seed in range(200):
        rng = random.Random(seed)
        tools = TOOLS if template == "hermes" and rng.random() < 0.8 else None
        enc = ChatEncoder(tok, tools=tools)
        messages: list[dict[str, Any]] = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.5 else []
        messages.append({"role": "user", "content": _text(rng)})
        ids = enc.initial(messages)
        mask = [0] * len(ids)
        turns = rng.randint(1, 5)
        for turn in range(turns):
            message, model_text = _assistant(rng, template == "hermes")
            model_ids = tok.encode(model_text, add_special_tokens=False) + [eos]
            # sanity: the simulated reply is exactly the template's tokens for this message
            before = enc.render(messages, add_generation_prompt=True)
            after = enc.render(messages + [message], add_generation_prompt=False)
            assert after[:len(before) + len(model_ids)] == before + model_ids, f"seed {seed}: bad simulation"
            assert enc.close_assistant_turn(model_ids) == []
            ids += model_ids
            mask += [1] * len(model_ids)
            messages.append(message)
            if turn == turns - 1 and rng.random() < 0.5:
                break  # the trajectory ends on the model's reply
            new = _observations(rng)
            added = enc.turn_tokens(new)
            ids += added
            mask += [0] * len(added)
            messages += new
        ends_on_model = messages[-1]["role"] == "assistant"
        full = enc.render(messages, add_generation_prompt=not ends_on_model)
        if ends_on_model:  # the template closes the last turn with a trailer (a newline) nobody generates
            trailer = full[len(ids):]
            assert tok.decode(trailer).strip() == "", f"seed {seed}: trailer {tok.decode(trailer)!r}"
            full = full[:len(ids)]
        assert ids == full, f"seed {seed}:\n{tok.decode(ids)!r}\n!=\n{tok.decode(full)!r}"
        assert len(mask) == len(ids) and sum(mask) > 0


@pytest.mark.parametrize("template", ["smollm2", "hermes"])
def test_truncated_reply_is_closed_by_template_tokens(template: str, smol: Any, hermes: Any) -> None:
    """A reply cut by a length limit has no end-of-turn token: close_assistant_turn supplies the
    template's closing tokens (mask 0) so the next turn lines up with a render of the cut text."""
    tok = hermes if template == "hermes" else smol
    enc = ChatEncoder(tok, tools=TOOLS if template == "hermes" else None)
    messages = [{"role": "user", "content": "What is 6 times 7? Use the calculator."}]
    ids = enc.initial(messages)
    reply = tok.encode("Let me compute this carefully with the calculator tool before answering",
                       add_special_tokens=False)
    cut = reply[:7]
    assert tok.encode(tok.decode(cut), add_special_tokens=False) == cut  # a clean cut, so the render is comparable
    closing = enc.close_assistant_turn(cut)
    assert closing == [tok.eos_token_id]
    assert enc.close_assistant_turn(cut + closing) == []
    new = [{"role": "tool", "content": "error: no tool call found"}]
    ids += cut + closing + enc.turn_tokens(new)
    final = messages + [{"role": "assistant", "content": tok.decode(cut)}] + new
    assert ids == enc.render(final, add_generation_prompt=True)
    assert tok.decode(enc.turn_tokens(new)).endswith("<|im_start|>assistant\n")  # ready for the next reply


def test_turn_tokens_groups_consecutive_tool_results(hermes: Any) -> None:
    """Qwen-style templates wrap a run of tool results in one user turn: pass them together."""
    enc = ChatEncoder(hermes, tools=TOOLS)
    both = hermes.decode(enc.turn_tokens([{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]))
    assert both == ("\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_template_that_rewrites_past_turns_is_refused(smol: Any) -> None:
    """A template that drops earlier assistant content (as reasoning templates do with their
    thinking) cannot be extended by appending; the encoder must say so instead of mis-masking."""
    tok = copy.deepcopy(smol)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    enc = ChatEncoder(tok)
    with pytest.raises(ChatTemplateError, match="renders earlier turns differently"):
        enc.turn_tokens([{"role": "user", "content": "next"}])


def test_bad_arguments_are_named(smol: Any) -> None:
    enc = ChatEncoder(smol)
    with pytest.raises(ValueError, match="assistant"):
        enc.turn_tokens([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="at least one"):
        enc.turn_tokens([])
    with pytest.raises(ChatTemplateError, match="end_of_turn_id"):
        ChatEncoder(smol, end_of_turn_id=smol.convert_tokens_to_ids("hello"))
