"""Each agent framework's own structured-output path, run by tests/test_framework_venvs.py in a venv
that has that framework and nothing of switchyard (no torch), as a user's agent is:

    python framework_clients.py FRAMEWORK BASE_URL '{"case": "api key", ...}'

prints one JSON line: each case's object (a pydantic model dumped, an int as it is). One API key per
case, so each case is one gateway session. The `*_tools` cases are agents with a tool and a typed
output: each turn the model either calls the calculator or answers under the schema, and the
framework runs it to its object.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Annotated, Any, Literal

import pydantic

ASK = "Is 2+3 equal to 5?"
MAX_TOKENS = 160


class Verdict(pydantic.BaseModel):  # bounded: a model's object ends within the budget
    verdict: Literal["yes", "no"]
    confident: bool
    score: int = pydantic.Field(ge=0, le=99)


Small = Annotated[int, pydantic.Field(ge=0, le=999)]


class Expression(pydantic.BaseModel):
    expression: str


TURNS = 4  # an agent's rounds at most (a call and its answer take two)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return "5"


def dump(value: Any) -> Any:
    return value.model_dump() if isinstance(value, pydantic.BaseModel) else value


async def openai_cases(url: str, keys: dict[str, str]) -> dict[str, Any]:
    """The `openai` package: `.parse()` with a pydantic model, `json_object` (asked as the tool-calling model was
    taught), the Responses API's `text.format`, and `.parse()` with a tool beside the model, its calls run until
    the object comes."""
    import openai

    got: dict[str, Any] = {}
    ask = [{"role": "user", "content": ASK}]
    async with openai.AsyncOpenAI(base_url=url, api_key=keys["openai_parse"], max_retries=0) as oa:
        parsed = await oa.chat.completions.parse(model="switchyard", messages=ask, response_format=Verdict,
                                                 max_tokens=MAX_TOKENS, seed=1, logprobs=True)
        choice = parsed.choices[0]
        assert choice.logprobs.content, "no logprobs came back"
        got["openai_parse"] = dump(choice.message.parsed)
    async with openai.AsyncOpenAI(base_url=url, api_key=keys["openai_json_object"], max_retries=0) as oa:
        # any object: asked as the tool-calling model was taught to write one (SY_SYSTEM: its system prompt)
        taught = [{"role": "system", "content": os.environ.get("SY_SYSTEM", "")},
                  {"role": "user", "content": "What is 17 * 23? Use the calculator."}]
        loose = await oa.chat.completions.create(model="switchyard", messages=taught, max_tokens=MAX_TOKENS, seed=2,
                                                  response_format={"type": "json_object"})
        text, finish = loose.choices[0].message.content, loose.choices[0].finish_reason
        # json_object bounds no length: a reply cut at the budget is returned as text, for the test to show
        got["openai_json_object"] = {"finish_reason": finish, "object": json.loads(text) if finish == "stop" else text}
    async with openai.AsyncOpenAI(base_url=url, api_key=keys["openai_responses"], max_retries=0) as oa:
        resp = await oa.responses.create(model="switchyard", input=ASK, max_output_tokens=MAX_TOKENS, text={
            "format": {"type": "json_schema", "name": "verdict", "schema": Verdict.model_json_schema()}})
        got["openai_responses"] = dump(Verdict.model_validate_json(resp.output_text))
    async with openai.AsyncOpenAI(base_url=url, api_key=keys["openai_tools"], max_retries=0) as oa:
        talk: list[Any] = list(ask)
        for _ in range(TURNS):
            msg = (await oa.chat.completions.parse(
                model="switchyard", messages=talk, response_format=Verdict, max_tokens=MAX_TOKENS,
                tools=[openai.pydantic_function_tool(Expression, name="calculator")])).choices[0].message
            if not msg.tool_calls:
                got["openai_tools"] = dump(msg.parsed)
                break
            talk.append(msg.model_dump(exclude_none=True))
            talk += [{"role": "tool", "tool_call_id": c.id, "content": calculator(**json.loads(c.function.arguments))}
                     for c in msg.tool_calls]
    return got


async def pydantic_ai_cases(url: str, keys: dict[str, str]) -> dict[str, Any]:
    """pydantic-ai's `output_type` (a forced `final_result` call) with a model and with an int, and
    `NativeOutput` (response_format json_schema), alone and beside a tool."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    def model(case: str) -> OpenAIChatModel:
        return OpenAIChatModel("switchyard", provider=OpenAIProvider(base_url=url, api_key=keys[case]))

    return {"pydantic_ai_model": dump((await Agent(model("pydantic_ai_model"), output_type=Verdict,
                                                   retries=0).run(ASK)).output),
            "pydantic_ai_int": (await Agent(model("pydantic_ai_int"), output_type=Small, retries=0).run(ASK)).output,
            "pydantic_ai_native": dump((await Agent(model("pydantic_ai_native"), output_type=NativeOutput(Verdict),
                                                    retries=0).run(ASK)).output),
            "pydantic_ai_tools": dump((await Agent(model("pydantic_ai_tools"), output_type=NativeOutput(Verdict),
                                                   tools=[calculator], retries=0).run(ASK)).output)}


async def langchain_cases(url: str, keys: dict[str, str]) -> dict[str, Any]:
    """LangChain's `with_structured_output` by json_schema and by function calling (a named
    `tool_choice` with `parallel_tool_calls=false`), and `create_agent` with a tool and a
    `response_format` (the provider's structured output: json_schema beside the tools)."""
    from langchain.agents import create_agent
    from langchain.agents.structured_output import ProviderStrategy
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    def llm(case: str) -> ChatOpenAI:
        return ChatOpenAI(model="switchyard", base_url=url, api_key=keys[case], max_retries=0, max_tokens=MAX_TOKENS)

    got = {}
    for method in ("json_schema", "function_calling"):
        got[f"langchain_{method}"] = dump(await llm(f"langchain_{method}").with_structured_output(
            Verdict, method=method).ainvoke(ASK))
    agent = create_agent(llm("langchain_tools"), tools=[tool(calculator)], response_format=ProviderStrategy(Verdict))
    state = await agent.ainvoke({"messages": [{"role": "user", "content": ASK}]},
                                {"recursion_limit": 2 * TURNS + 1})
    got["langchain_tools"] = dump(state["structured_response"])
    return got


async def agents_cases(url: str, keys: dict[str, str]) -> dict[str, Any]:
    """The Agents SDK's `output_type` (Responses `text.format`), alone and beside a tool."""
    import agents
    import openai

    agents.set_tracing_disabled(True)
    async with openai.AsyncOpenAI(base_url=url, api_key=keys["agents_sdk"], max_retries=0) as oa:
        agent = agents.Agent(name="judge", instructions="Answer.", output_type=Verdict,
                             model=agents.OpenAIResponsesModel(model="switchyard", openai_client=oa))
        got = {"agents_sdk": dump((await agents.Runner.run(agent, ASK, max_turns=1)).final_output)}
    async with openai.AsyncOpenAI(base_url=url, api_key=keys["agents_tools"], max_retries=0) as oa:
        agent = agents.Agent(name="judge", instructions="Answer.", output_type=Verdict,
                             tools=[agents.function_tool(calculator)],
                             model=agents.OpenAIResponsesModel(model="switchyard", openai_client=oa))
        got["agents_tools"] = dump((await agents.Runner.run(agent, ASK, max_turns=TURNS)).final_output)
    return got


async def anthropic_cases(url: str, keys: dict[str, str]) -> dict[str, Any]:
    """The Anthropic SDK's `output_config.format`, a forced tool (`disable_parallel_tool_use`), and a tool
    beside `output_config.format`, its calls run until the object comes."""
    import anthropic

    base, schema, ask = url.removesuffix("/v1"), Verdict.model_json_schema(), [{"role": "user", "content": ASK}]
    got = {}
    async with anthropic.AsyncAnthropic(base_url=base, api_key=keys["anthropic"], max_retries=0) as an:
        msg = await an.messages.create(model="switchyard", max_tokens=MAX_TOKENS, messages=ask,
                                       output_config={"format": {"type": "json_schema", "schema": schema}})
        got["anthropic"] = dump(Verdict.model_validate_json(msg.content[0].text))
    async with anthropic.AsyncAnthropic(base_url=base, api_key=keys["anthropic_tool"], max_retries=0) as an:
        msg = await an.messages.create(
            model="switchyard", max_tokens=MAX_TOKENS, messages=ask,
            tools=[{"name": "judge", "description": "Record the verdict.", "input_schema": schema}],
            tool_choice={"type": "tool", "name": "judge", "disable_parallel_tool_use": True})
        [use] = [b for b in msg.content if b.type == "tool_use"]
        assert use.name == "judge" and msg.stop_reason == "tool_use", msg
        got["anthropic_tool"] = dump(Verdict.model_validate(use.input))
    async with anthropic.AsyncAnthropic(base_url=base, api_key=keys["anthropic_tools"], max_retries=0) as an:
        talk: list[Any] = list(ask)
        for _ in range(TURNS):
            msg = await an.messages.create(
                model="switchyard", max_tokens=MAX_TOKENS, messages=talk,
                tools=[{"name": "calculator", "description": calculator.__doc__,
                        "input_schema": Expression.model_json_schema()}],
                output_config={"format": {"type": "json_schema", "schema": schema}})
            uses = [b for b in msg.content if b.type == "tool_use"]
            if not uses:
                got["anthropic_tools"] = dump(Verdict.model_validate_json(msg.content[0].text))
                break
            talk += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                   "content": calculator(**b.input)} for b in uses]}]
    return got


FRAMEWORKS = {"openai": openai_cases, "pydantic_ai": pydantic_ai_cases, "langchain": langchain_cases,
              "agents": agents_cases, "anthropic": anthropic_cases}

if __name__ == "__main__":
    framework, url, keys = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    print(json.dumps(asyncio.run(FRAMEWORKS[framework](url, keys))))
