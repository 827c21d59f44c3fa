"""Structured output from each agent framework's own client, each in a venv of its own that has the
framework and nothing of switchyard (as a user's agent is), against the gateway on an hf engine
serving the tool-calling test model: the `openai` package (`.parse()` with a pydantic model,
`json_object`, the Responses API's `text.format`), pydantic-ai (`output_type` with a model and an
int, `NativeOutput`), LangChain (`with_structured_output` by json_schema and by function calling),
the Agents SDK (`output_type`) and the Anthropic SDK (`output_config.format`, a forced tool); and in
each, an agent with a tool and a typed output (`*_tools`: chat `.parse()` with tools, pydantic-ai
`NativeOutput` with a tool, LangChain `create_agent(tools, response_format)`, the Agents SDK's
`Agent(tools, output_type)`, Anthropic tools beside `output_config.format`), each turn decoded as a
call or the answer, the model's choice.

Each case returns a valid object (tests/framework_clients.py runs the cases and prints them); every
session's model tokens are the engine's, token for token against its request log; each turn names
the constraint it was decoded under. The venvs are built once per machine (tests/venvs.py); the test
skips only when the package index cannot be reached to build them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

CLIENTS = Path(__file__).resolve().parent / "framework_clients.py"

# each framework's venv: its package, pinned to a release these tests ran with
REQUIREMENTS = {"openai": ["openai==3.57.0"], "pydantic_ai": ["pydantic-ai-slim[openai]==2.68.0"],
                "langchain": ["langchain-openai==1.7.4", "langchain==1.5.2"], "agents": ["openai-agents==0.24.0"],
                "anthropic": ["anthropic==2.14.0"]}
# each framework's cases, and the constraint each case's turns are decoded under
BESIDE = "tool_call_or_json_schema"  # a tool and a typed output: a call or the answer, the model's choice
CASES = {"openai": {"openai_parse": "json_schema", "openai_json_object": "json_schema",
                    "openai_responses": "json_schema", "openai_tools": BESIDE},
         "pydantic_ai": {"pydantic_ai_model": "tool_call", "pydantic_ai_int": "tool_call",
                         "pydantic_ai_native": "json_schema", "pydantic_ai_tools": BESIDE},
         "langchain": {"langchain_json_schema": "json_schema", "langchain_function_calling": "tool_call",
                       "langchain_tools": BESIDE},
         "agents": {"agents_sdk": "json_schema", "agents_tools": BESIDE},
         "anthropic": {"anthropic": "json_schema", "anthropic_tool": "tool_call", "anthropic_tools": BESIDE}}
# the tiny model was taught only to call: the trainer's sampling of the `*_tools` sessions makes the
# answer's first token ('{"') likelier, so after the tool's result it answers (measured: the call
# leads the answer by ~7 nats at the first turn, by ~3 after the result)
ANSWER_BIAS = 5.0
CLIENT_DEADLINE_S = 300


@pytest.fixture(scope="module")
def framework_pythons() -> dict[str, Path]:
    from concurrent.futures import ThreadPoolExecutor

    from venvs import cached_venv

    with ThreadPoolExecutor(len(REQUIREMENTS)) as pool:  # five pips at once: their downloads overlap
        built = {name: pool.submit(cached_venv, f"client-{name}", reqs) for name, reqs in REQUIREMENTS.items()}
        return {name: future.result() for name, future in built.items()}


def test_each_framework_in_its_own_venv_gets_valid_objects_token_exact(framework_pythons, servers, tool_caller):
    from agent.gateway import Gateway
    from engines.models import load_tokenizer
    from rollout.bus.client import GenerateClient

    for framework, python in framework_pythons.items():  # the venv is the user's: no switchyard, no torch
        probe = asyncio.run(_output([python, "-c", "import importlib.util as u; "
                                     "print(u.find_spec('torch'), u.find_spec('rollout'))"]))
        assert probe.split() == ["None", "None"], (framework, probe)
    engine = servers(1, backend="hf", model=str(tool_caller))
    tokenizer = load_tokenizer(str(tool_caller))
    [brace] = tokenizer.encode('{"', add_special_tokens=False)

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        got: dict[str, Any] = {}
        async with GenerateClient(engine.addresses) as client:
            await client.wait_ready(timeout_s=300)
            gw = Gateway(client, tokenizer)
            await gw.start()
            try:
                for framework, python in framework_pythons.items():
                    keys = {case: gw.open_session(case, sampling={
                        "max_tokens": 160, "seed": 0,
                        **({"logit_bias": {str(brace): ANSWER_BIAS}} if constraint == BESIDE else {})})
                        for case, constraint in CASES[framework].items()}
                    out = await _output([python, CLIENTS, framework, gw.base_url, json.dumps(keys)])
                    got.update(json.loads(out.splitlines()[-1]))
                return got, {case: gw.close_session(case) for cases in CASES.values() for case in cases}
            finally:
                await gw.stop()

    got, sessions = asyncio.run(main())
    import pydantic

    from framework_clients import Verdict

    assert isinstance(got.pop("pydantic_ai_int"), int)
    loose = got.pop("openai_json_object")  # any object, whole: asked as the model was taught to write one
    assert loose["finish_reason"] == "stop" and isinstance(loose["object"], dict), loose
    for case, value in got.items():
        try:
            Verdict.model_validate(value)
        except pydantic.ValidationError as e:
            raise AssertionError(f"{case} returned {value!r}, not a Verdict") from e
    log = {json.loads(line)["rid"]: json.loads(line) for line in Path(engine.request_logs[0]).read_text().splitlines()}
    constraints, tool_rounds = {}, {}
    for case, conv in sessions.items():
        [seg] = conv.segments  # one request each (no retries: the first object was valid); a tool agent's
        out = seg.to_output()  # rounds continue that segment
        assert out.model_token_ids() == [t for rid in out.request_ids for t in log[rid]["token_ids"]], case
        [constraints[case]] = {t.get("constraint") for t in seg.turns if t["kind"] == "generate"}
        tool_rounds[case] = sum(t["kind"] == "tools" for t in seg.turns)
    assert constraints == {case: c for cases in CASES.values() for case, c in cases.items()}, constraints
    # each agent with tools chose the call first, ran it, and then chose the answer
    assert {case: n for case, n in tool_rounds.items() if constraints[case] == BESIDE} == {
        case: 1 for cases in CASES.values() for case, c in cases.items() if c == BESIDE}, tool_rounds


async def _output(cmd: list) -> str:
    """What `cmd` prints, run as a user's program (outside the repository, no PYTHONPATH), within
    CLIENT_DEADLINE_S; its output in the failure when it exits non-zero."""
    from tool_model import SYSTEM

    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "SY_SYSTEM": SYSTEM}
    proc = await asyncio.create_subprocess_exec(*map(str, cmd), stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, cwd=tempfile.gettempdir(), env=env)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), CLIENT_DEADLINE_S)
    except asyncio.TimeoutError:
        proc.kill()
        raise AssertionError(f"{cmd[1:3]} did not finish within {CLIENT_DEADLINE_S} s") from None
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{cmd[1:3]} exited {proc.returncode}:\n{text[-4000:]}"
    return text
