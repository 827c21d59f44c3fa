"""Agent functions written against the OpenAI API only, for the gateway tests and `openai_agent` runs."""

from __future__ import annotations

import json
from typing import Any

from agent.tools.calculator import CalculatorError, safe_eval
from tool_model import CALCULATOR_SCHEMA


def _calc(arguments: str) -> str:
    try:
        return str(safe_eval(str(json.loads(arguments).get("expression", ""))))
    except (CalculatorError, ValueError, TypeError, AttributeError) as e:
        return f"Error: {e}"


async def chat_rounds(client: Any, messages: list[dict], rounds: int, stream: bool = False,
                      max_tokens: int = 48, temperature: float = 1.0) -> tuple[list[dict], int]:
    """Drive `rounds` model calls the way an agent framework does: run the calculator when the model
    calls it, otherwise ask it to check with the calculator. Returns the history and the calls seen."""
    calls = 0
    for _ in range(rounds):
        kw = dict(model="switchyard", messages=messages, tools=[CALCULATOR_SCHEMA], temperature=temperature,
                  max_tokens=max_tokens)
        if stream:
            content, tool_calls = "", {}
            async for chunk in await client.chat.completions.create(stream=True, **kw):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for tc in choice.delta.tool_calls or []:
                        entry = tool_calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                                 "function": {"name": "", "arguments": ""}})
                        entry["function"]["name"] += tc.function.name or ""
                        entry["function"]["arguments"] += tc.function.arguments or ""
            message = {"role": "assistant", "content": content or None,
                       **({"tool_calls": [tool_calls[k] for k in sorted(tool_calls)]} if tool_calls else {})}
        else:
            resp = await client.chat.completions.create(**kw)
            message = resp.choices[0].message.model_dump(exclude_none=True)
        messages = messages + [message]
        if message.get("tool_calls"):
            calls += len(message["tool_calls"])
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": _calc(c["function"]["arguments"])}
                         for c in message["tool_calls"]]
        else:
            messages += [{"role": "user", "content": "Check it with the calculator."}]
    return messages, calls


async def calculator_agent(base_url: str, api_key: str, row: dict) -> None:
    """Two model calls with the calculator in between; None: the row's rule reward scores the answer."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        await chat_rounds(client, list(row["prompt"]), rounds=2)
    return None


async def compressing_agent(base_url: str, api_key: str, row: dict) -> float:
    """One model call, then the history summarized into a fresh user turn and one more call: two
    segments of one sample. Returns a fixed reward so the test can recognise it on every row."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages, _ = await chat_rounds(client, list(row["prompt"]), rounds=1)
        summary = [messages[0], {"role": "user", "content": "Earlier: " + str(row["prompt"][-1]["content"])[:60]}]
        await chat_rounds(client, summary, rounds=1)
    return 0.25


async def typed_tool_agent(base_url: str, api_key: str, row: dict) -> float:
    """An agent with a tool and a typed output, as the frameworks write one (the Agents SDK's
    `Agent(tools=..., output_type=...)`): every call offers the calculator and asks for the answer
    under a schema, tool_choice unset, so the engine lets the model either call or answer. A call is
    run and the model asked again (at most 3 times, then the answer is asked for with tool_choice
    none). Scores 1.0 for an object that validates; the row's `logit_bias` (if any) goes with the calls
    after a tool's result (a model taught only to call is steered to answer once it has one)."""
    import openai
    import pydantic

    class Answer(pydantic.BaseModel):
        answer: int = pydantic.Field(ge=0, le=99999)

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": Answer.model_json_schema()}}
    # the call's argument bounded (the grammar holds it to 48 characters), so a call always closes within
    # max_tokens: an unbounded expression once ran to the limit, and a call cut there is not a call but the
    # reply's text, which no answer schema validates
    params = {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 48}},
              "required": ["expression"]}
    calculator = {**CALCULATOR_SCHEMA, "function": {**CALCULATOR_SCHEMA["function"], "parameters": params}}
    bias = {"logit_bias": row["logit_bias"]} if row.get("logit_bias") else {}
    messages = list(row["prompt"])
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        for round_ in range(4):
            last = {"tool_choice": "none"} if round_ == 3 else {}
            steer = bias if round_ else {}
            reply = await client.chat.completions.create(model="switchyard", max_tokens=128, tools=[calculator],
                                                         response_format=fmt, messages=messages, **steer, **last)
            message = reply.choices[0].message.model_dump(exclude_none=True)
            if not message.get("tool_calls"):
                break
            messages += [message] + [{"role": "tool", "tool_call_id": c["id"], "content": _calc(c["function"]["arguments"])}
                                     for c in message["tool_calls"]]
    Answer.model_validate_json(reply.choices[0].message.content)  # raises unless a valid object
    return 1.0
