"""The OpenAI-compatible gateway: the real `openai` client against an hf engine (streaming and not,
tool rounds), token-exact recording checked against the engine's request log, forks on edited
history and on n > 1, OpenAI-style errors, and one GRPO step of an `openai_agent` through train.py."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
openai = pytest.importorskip("openai")

from agent.gateway import Gateway  # noqa: E402
from gateway_agent import chat_rounds  # noqa: E402
from test_tool_agent import GSM8K, _server_log, _tokenizer, check_against_server  # noqa: E402
from test_tool_agent_states import ScriptedClient, tok  # noqa: E402,F401
from tool_model import SYSTEM, gsm8k_rows  # noqa: E402


async def _with_gateway(addresses: list[str], tokenizer: Any, body, **kw: Any):
    from rollout.bus.client import GenerateClient

    async with GenerateClient(addresses) as client:
        await client.wait_ready(timeout_s=300)
        gw = Gateway(client, tokenizer, **kw)
        await gw.start()
        try:
            return await body(gw)
        finally:
            await gw.stop()


def test_openai_client_tool_rounds_streaming_and_not_are_token_exact(servers, tool_caller):  # noqa: F811
    srv = servers(1, backend="hf", model=str(tool_caller))
    tokenizer = _tokenizer(tool_caller)
    rows = gsm8k_rows(GSM8K / "test.jsonl", 6)

    async def body(gw: Gateway):
        two = asyncio.Semaphore(2)  # the tiny model calls tools less reliably in large padded batches

        async def one(row: dict, stream: bool):
            async with two:
                return await talk(row, stream)

        async def talk(row: dict, stream: bool):
            key = gw.open_session()
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as client:
                # greedy: the tool calls the tiny model was taught, whichever machine trained it
                messages, calls = await chat_rounds(client, list(row["prompt"]), rounds=3, stream=stream,
                                                    temperature=0.0)
            return gw.close_session(key), messages, calls
        return await asyncio.gather(*(one(r, stream=i % 2 == 1) for i, r in enumerate(rows)),
                                    langchain_openai_conversation(gw, rows[0]))

    *results, lc = asyncio.run(_with_gateway(srv.addresses, tokenizer, body))
    sent = _server_log(srv.request_logs)
    import importlib.util
    assert (lc is None) == (importlib.util.find_spec("langchain_openai") is None)
    if lc is not None:  # langchain-openai's ChatOpenAI, when it is installed
        assert len(lc.segments) == 1
        check_against_server(lc.segments[0].to_output(), sent)
    assert sum(calls for _, _, calls in results) >= 3, [m for _, m, _ in results]  # tool rounds really ran
    for conv, messages, _ in results:
        assert len(conv.segments) == 1  # an append-only history stays one trajectory
        out = conv.segments[0].to_output()
        assert out.num_turns == 3
        check_against_server(out, sent)  # mask-1 tokens = what the engine sent, in order


async def langchain_openai_conversation(gw: Gateway, row: dict):
    """Two calls of ChatOpenAI with the calculator bound; the recorded Conversation, or None
    without langchain-openai."""
    try:
        from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
        from langchain_openai import ChatOpenAI
    except ImportError:
        return None
    from gateway_agent import _calc
    from tool_model import CALCULATOR_SCHEMA

    key = gw.open_session()
    llm = ChatOpenAI(model="switchyard", base_url=gw.base_url, api_key=key, temperature=1.0, max_tokens=48,
                     max_retries=0).bind_tools([CALCULATOR_SCHEMA])
    messages: list = [SystemMessage(row["prompt"][0]["content"]), HumanMessage(row["prompt"][1]["content"])]
    ai = await llm.ainvoke(messages)
    messages.append(ai)
    import json
    messages += ([ToolMessage(_calc(json.dumps(c["args"])), tool_call_id=c["id"]) for c in ai.tool_calls]
                 or [HumanMessage("Check it with the calculator.")])
    await llm.ainvoke(messages)
    return gw.close_session(key)


def test_edited_history_forks_into_token_exact_segments(servers, tool_caller):  # noqa: F811
    srv = servers(1, backend="hf", model=str(tool_caller))
    tokenizer = _tokenizer(tool_caller)
    row = gsm8k_rows(GSM8K / "test.jsonl", 1)[0]

    async def body(gw: Gateway):
        key = gw.open_session()
        async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as client:
            messages, _ = await chat_rounds(client, list(row["prompt"]), rounds=2)
            # context compression: the client summarizes the first exchange and goes on
            edited = [messages[0], {"role": "user", "content": "Summary so far: " + row["prompt"][1]["content"][:80]}]
            edited, _ = await chat_rounds(client, edited, rounds=2)
            # and continues the original history too: that is the first segment again
            await chat_rounds(client, messages, rounds=1)
        return gw.close_session(key)

    conv = asyncio.run(_with_gateway(srv.addresses, tokenizer, body))
    sent = _server_log(srv.request_logs)
    assert len(conv.segments) == 2
    assert [s.to_output().num_turns for s in conv.segments] == [3, 2]
    for seg in conv.segments:
        check_against_server(seg.to_output(), sent)
    assert conv.segments[1].traj.prompt_ids != conv.segments[0].traj.prompt_ids


def test_n_choices_become_segments_and_the_continued_one_grows(tok):  # noqa: F811
    replies = ["#### 41", "#### 42", "#### 43"]
    client = ScriptedClient(tok, replies)

    async def body():
        gw = Gateway(client, tok)
        await gw.start()
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as oa:
                msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "6*7?"}]
                r = await oa.chat.completions.create(model="switchyard", messages=msgs, n=2)
                assert [c.message.content for c in r.choices] == ["#### 41", "#### 42"]
                second = msgs + [r.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
                r2 = await oa.chat.completions.create(model="switchyard", messages=second)
                assert r2.choices[0].message.content == "#### 43"
            return gw.sessions["k"]
        finally:
            await gw.stop()

    conv = asyncio.run(body())
    assert len(conv.segments) == 2
    first, second = (s.to_output() for s in conv.segments)
    assert first.num_turns == 1 and second.num_turns == 2 and first.prompt_ids == second.prompt_ids
    assert client.prompts[2][:len(client.prompts[0])] == client.prompts[0]  # continued, not re-rendered


class _SlowClient(ScriptedClient):
    async def generate(self, prompt_ids: Any, sampling: dict, **kw: Any):
        await asyncio.sleep(0.5)
        return await super().generate(prompt_ids, sampling, **kw)


def test_bad_requests_get_openai_style_errors(tok):  # noqa: F811
    async def body():
        gw = Gateway(_SlowClient(tok, ["ok"]), tok, max_context=64, max_inflight=1)
        await gw.start()
        far = Gateway(ScriptedClient(tok, ["ok"]), tok, host="0.0.0.0", api_keys=["secret"])
        await far.start()
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as oa:
                ok = [{"role": "user", "content": "hi"}]
                other = await oa.chat.completions.create(model="gpt-4", messages=ok)  # one model: served, named
                assert other.model == "switchyard"
                # every request field is honoured, refused naming it, or accepted and ignored on purpose
                for extra, match in ((dict(extra_body={"made_up_param": 1}), "made_up_param is not a request field"),
                                     (dict(reasoning_effort="high"), "reasoning_effort='high' is not supported"),
                                     (dict(extra_body={"min_p": 0.1}), "min_p is not supported by the engines"),
                                     (dict(modalities=["text", "audio"]), "modalities="),
                                     (dict(extra_body={"top_k": 0}), "top_k=0 must be a positive integer")):
                    with pytest.raises(openai.BadRequestError, match=match) as e:
                        await oa.chat.completions.create(model="switchyard", messages=ok, **extra)
                    assert e.value.param == next(iter(extra.get("extra_body", extra))), e.value.param
                fine = await oa.chat.completions.create(model="switchyard", messages=ok, user="u1", store=False,
                                                        service_tier="auto", extra_body={"top_k": 5})
                assert fine.choices[0].message.content == "ok"
                with pytest.raises(openai.BadRequestError, match=r"messages\[0\]: role 'robot'"):
                    await oa.chat.completions.create(model="switchyard", messages=[{"role": "robot", "content": "x"}])
                with pytest.raises(openai.BadRequestError, match="tool_choice='required' is not supported"):
                    await oa.chat.completions.create(model="switchyard", messages=ok, tool_choice="required")
                with pytest.raises(openai.APIStatusError, match="context") as e:
                    await oa.chat.completions.create(model="switchyard",
                                                     messages=[{"role": "user", "content": "word " * 200}])
                assert e.value.status_code == 413
                slow = [oa.chat.completions.create(model="switchyard", messages=ok) for _ in range(2)]
                got = await asyncio.gather(*slow, return_exceptions=True)
                assert sum(isinstance(g, openai.RateLimitError) for g in got) == 1, got
            port = far.base_url.rsplit(":", 1)[1]
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}", api_key="wrong", max_retries=0) as oa:
                with pytest.raises(openai.AuthenticationError, match="unknown API key"):
                    await oa.chat.completions.create(model="switchyard", messages=[{"role": "user", "content": "x"}])
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}", api_key="secret", max_retries=0) as oa:
                assert (await oa.models.list()).data[0].id == "switchyard"
                r = await oa.chat.completions.create(model="switchyard", messages=[{"role": "user", "content": "x"}])
                assert r.choices[0].message.content == "ok"
        finally:
            await gw.stop()
            await far.stop()

    asyncio.run(body())


@pytest.mark.skipif(not (GSM8K / "train.jsonl").exists(), reason="needs the GSM8K jsonl beside the repository")
def test_one_grpo_step_of_an_openai_client_agent_through_train_py(tmp_path: Path, monkeypatch, tool_caller: Path):
    import json

    from test_train import metrics, train

    from engines.models import load_tokenizer

    tests_dir = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")]))
    # an agent with a tool and a typed output (tests/gateway_agent.py): the engine decodes each reply as
    # a calculator call or the answer under the schema, the model choosing; the tool-calling model leans
    # to the call, a bias on the answer's first token lets it answer after a round
    [brace] = load_tokenizer(str(tool_caller)).encode('{"', add_special_tokens=False)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({**r, "logit_bias": {str(brace): 5}}) + "\n"
                            for r in gsm8k_rows(GSM8K / "train.jsonl", 4, agent_name="openai_agent")))
    out = tmp_path / "run"
    proc = train([f"model.path={tool_caller}", "data.val_path=null", "rollout.engine=hf", "rollout.in_process=true",
                  "sft.enabled=false", "data.task=rows", f"data.train_path={rows}",
                  "data.prompts_per_step=2", "rollout.n=2", "trainer.steps=1",
                  "rollout.agent.openai_agent.agent_function=gateway_agent.typed_tool_agent",
                  f"trainer.output_dir={out}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = metrics(out)[-1]
    assert m["rollout/trajectories"] == 4 and m["rollout/invalid"] == 0 and "rollout/termination/error" not in m, m
    # every sample ended in an object that validates (a reply that is not one fails the trajectory), and
    # the step trained on what the engine decoded under the union
    assert m["rollout/reward_mean"] == 1.0 and m["actor/optimizer_steps"] >= 1, m
    assert m["rollout/num_turns_mean"] >= 2, m  # a calculator round, then the answer
    # an agent that compresses its history: each sample is two segments, both trained on
    out2 = tmp_path / "run2"
    proc = train(["model.path=tiny-llama", "data.val_path=null", "rollout.engine=hf", "rollout.in_process=true",
                  "sft.enabled=false", "data.task=gsm8k",
                  f"data.train_path={GSM8K / 'train.jsonl'}", "data.agent_name=openai_agent",
                  "data.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=24", "trainer.steps=1",
                  "rollout.agent.openai_agent.agent_function=gateway_agent.compressing_agent",
                  f"trainer.output_dir={out2}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = metrics(out2)[-1]
    assert m["rollout/trajectories"] == 8 and m["rollout/num_turns_mean"] == 1, m  # 4 samples x 2 segments
    assert m["rollout/reward_mean"] == 0.25 and m["rollout/invalid"] == 0, m


def test_standalone_gateway_process_serves_the_openai_client(servers):
    """`python -m agent.gateway` in front of an engine server: an OpenAI client gets a reply; the
    process refuses to bind beyond loopback without a key, stops cleanly on SIGTERM, and stops within
    seconds once the process that started it is killed."""
    import subprocess

    srv = servers(1, backend="echo", model="echo")
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "agent.gateway", "--bus", srv.addresses[0], "--tokenizer", "tiny-llama"]
    refused = subprocess.run([*cmd, "--host", "0.0.0.0"], cwd=repo, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "give --api-key" in refused.stderr
    proc = subprocess.Popen([*cmd, "--port", "0"], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "switchyard gateway: http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        client = openai.OpenAI(base_url=line.split()[2], api_key="any", max_retries=0)
        r = client.chat.completions.create(model="switchyard", messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=5, logprobs=True)
        assert r.usage.completion_tokens == 5 and len(r.choices[0].logprobs.content) == 5
        assert r.choices[0].finish_reason == "length"
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    # started by a script that is then killed with -9: the gateway notices and stops (no --detach)
    import shlex
    import time

    import psutil

    script = subprocess.Popen(["bash", "-c", f"{shlex.join([*cmd, '--port', '0'])} & wait"], cwd=repo,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "switchyard gateway: http://127.0.0.1:" in script.stdout.readline()
        (gateway,) = psutil.Process(script.pid).children()
        script.kill()
        script.wait(10)
        t0 = time.monotonic()

        def running() -> bool:  # an orphan's exit may leave a zombie until init reaps it: that is gone too
            try:
                return gateway.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        while running() and time.monotonic() - t0 < 10:  # it looks twice a second; stopping takes a moment
            time.sleep(0.1)
        assert not running(), "the gateway outlived the process that started it by 10 s"

    finally:
        for p in psutil.Process().children(recursive=True):
            try:  # a gateway reparented to this process (a subreaper) may be a zombie: reap it
                if p.status() == psutil.STATUS_ZOMBIE:
                    p.wait(1)
                elif "agent.gateway" in " ".join(p.cmdline()):
                    p.kill()
            except psutil.Error:
                pass


def test_a_client_opened_session_keeps_only_its_latest_segments(tok):  # noqa: F811
    """Sessions no agent loop opened (a bare key or X-Session-Id) are recorded but never trained on:
    a long-lived gateway keeps only their latest segments instead of growing without bound."""
    from agent.gateway.server import IMPLICIT_SEGMENTS

    async def body():
        gw = Gateway(ScriptedClient(tok, ["ok"]), tok)
        await gw.start()
        try:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="shared", max_retries=0) as oa:
                for i in range(IMPLICIT_SEGMENTS + 5):  # every new conversation is a new segment
                    await oa.chat.completions.create(model="switchyard", messages=[{"role": "user", "content": f"q{i}"}])
            return gw.sessions["shared"]
        finally:
            await gw.stop()

    conv = asyncio.run(body())
    assert len(conv.segments) == IMPLICIT_SEGMENTS
    assert conv.segments[-1].held[0]["content"] == f"q{IMPLICIT_SEGMENTS + 4}"  # the newest survive


def test_session_memory_is_bounded_per_session_and_in_total(tok):  # noqa: F811
    """max_session_bytes: a client's own session drops its least recently used segments, a trained
    session (opened by an agent loop) is refused with 413 instead; max_total_bytes: client sessions
    together, the least recently used forgotten. GET /stats counts each."""
    import httpx

    async def body():
        gw = Gateway(ScriptedClient(tok, ["ok"]), tok)
        await gw.start()
        text = "x" * 500

        async def ask(key: str, content: str) -> None:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=key, max_retries=0) as oa:
                await oa.chat.completions.create(model="switchyard", messages=[{"role": "user", "content": content}])

        try:
            await ask("mine", f"0{text}")
            one = gw.sessions["mine"].nbytes()  # one segment's size; the bounds in those units
            gw.max_session_bytes, gw.max_total_bytes = int(2.5 * one), int(6.5 * one)
            for i in range(1, 6):
                await ask("mine", f"{i}{text}")
            mine = gw.sessions["mine"]
            assert mine.nbytes() <= gw.max_session_bytes and len(mine.segments) == 2, [x.nbytes() for x in mine.segments]
            assert mine.segments[-1].held[0]["content"].startswith("5")  # the newest stay
            for k in range(4):  # other clients' sessions: the total stays bounded, the least recently used go
                for i in range(2):
                    await ask(f"c{k}", f"{k}{i}{text}")
            held = sum(gw.sessions[x].nbytes() for x in gw.sessions)
            assert held <= gw.max_total_bytes and {"mine", "c0"}.isdisjoint(gw.sessions) and "c3" in gw.sessions, held
            key = gw.open_session()  # trained on: never trimmed, refused past the bound
            for i in range(3):
                await ask(key, f"{i}{text}")
            with pytest.raises(openai.APIStatusError) as e:
                await ask(key, text)
            assert e.value.status_code == 413 and "max_session_bytes" in e.value.message
            assert len(gw.sessions[key].segments) == 3
            async with httpx.AsyncClient() as http:
                stats = (await http.get(gw.base_url.removesuffix("/v1") + "/stats")).json()
            assert stats["trimmed_segments"] == 4 and stats["evicted_sessions"] == 2, stats  # mine, then c0
            assert stats["refused_session_bytes"] == 1 and stats["trained_sessions"] == 1, stats
        finally:
            await gw.stop()

    asyncio.run(body())
