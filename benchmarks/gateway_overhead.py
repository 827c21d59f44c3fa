"""What the OpenAI-compatible gateway adds per request on top of the bus, measured side by side.

One echo engine server (answers instantly, so every millisecond is transport and bookkeeping);
the gateway runs as `python -m agent.gateway` in its own process, as a deployment would. Three
clients send the same chat (a ~500-token user message, 64-token replies) at concurrency 1 and 64:
the bus client with the rendered prompt ids (no HTTP, no template), raw HTTP POSTs to the gateway
(template, recording, parsing, JSON), and the `openai` package through the gateway (what an agent
framework pays), on the chat route and on the Responses route, and the `anthropic` package on the
Messages route. Every request opens its own session (X-Session-Id), as a new trajectory does.

    python benchmarks/gateway_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, machine  # noqa: E402

REPLY_TOKENS = 64
MESSAGES = [{"role": "user", "content": " ".join(f"word{i % 97}" for i in range(250))}]


async def level(call: Callable[[], Awaitable[None]], n: int, concurrency: int) -> dict[str, float]:
    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            t0 = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    wall = time.perf_counter() - t0
    lat.sort()
    return {"p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "req_s": n / wall}


async def measure(address: str, url: str, counts: dict[int, int]) -> dict[str, Any]:
    import aiohttp
    import anthropic
    import openai
    from transformers import AutoTokenizer

    from engines.models import resolve_model
    from rollout.bus.client import GenerateClient

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-llama"))
    prompt = list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"])
    body = {"model": "switchyard", "messages": MESSAGES, "max_tokens": REPLY_TOKENS}
    out: dict[str, Any] = {"prompt_tokens": len(prompt)}
    async with GenerateClient([address]) as client, aiohttp.ClientSession() as http, \
            openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0) as oa, \
            anthropic.AsyncAnthropic(base_url=url.removesuffix("/v1"), api_key="bench", max_retries=0) as an:
        await client.wait_ready(timeout_s=120)

        async def bus() -> None:
            r = await client.generate(prompt, {"max_tokens": REPLY_TOKENS}, session_id=uuid.uuid4().hex)
            assert len(r.token_ids) == REPLY_TOKENS

        async def raw() -> None:
            async with http.post(f"{url}/chat/completions", json=body,
                                 headers={"X-Session-Id": uuid.uuid4().hex}) as resp:
                data = await resp.json()
                assert resp.status == 200 and data["usage"]["completion_tokens"] == REPLY_TOKENS, data

        async def sdk() -> None:
            r = await oa.chat.completions.create(extra_headers={"X-Session-Id": uuid.uuid4().hex}, **body)
            assert r.usage.completion_tokens == REPLY_TOKENS

        async def responses() -> None:
            r = await oa.responses.create(model="switchyard", input=MESSAGES[0]["content"],
                                          max_output_tokens=REPLY_TOKENS,
                                          extra_headers={"X-Session-Id": uuid.uuid4().hex})
            assert r.usage is not None and r.usage.output_tokens == REPLY_TOKENS

        async def messages() -> None:
            r = await an.messages.create(model="switchyard", messages=MESSAGES, max_tokens=REPLY_TOKENS,
                                         extra_headers={"X-Session-Id": uuid.uuid4().hex})
            assert r.usage.output_tokens == REPLY_TOKENS

        sides = {"bus": bus, "gateway_http": raw, "gateway_openai": sdk, "gateway_responses": responses,
                 "gateway_messages": messages}
        for name, call in sides.items():  # warm up each path (template cache, connections)
            await level(call, 32, 8)
        for c, n in counts.items():
            out[str(c)] = {name: await level(call, n, c) for name, call in sides.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="100 / 256 requests instead of 400 / 1024")
    ap.add_argument("--requests", type=int, default=None, help="requests at each level (overrides the mode)")
    ap.add_argument("--out", default=str(RESULTS / "gateway_overhead.json"))
    args = ap.parse_args()
    counts = {1: 100, 64: 256} if args.quick else {1: 400, 64: 1024}
    if args.requests:
        counts = {c: args.requests for c in counts}

    from rollout.bus.launcher import start_server_process

    tmp = Path(tempfile.mkdtemp(prefix="switchyard-gw-"))
    address = f"ipc://{tmp}/echo0.sock"
    server = start_server_process("echo", "echo", address, "echo0", log_file=tmp / "server.log", cpu_threads=1)
    gw = subprocess.Popen([sys.executable, "-m", "agent.gateway", "--bus", address, "--tokenizer", "tiny-llama",
                           "--port", "0", "--max-inflight", "1024"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = gw.stdout.readline() if gw.stdout else ""
        if "switchyard gateway:" not in line:
            raise SystemExit(f"the gateway did not start (said {line!r}); see its stderr above")
        url = line.split()[2]
        t0 = time.perf_counter()
        res = asyncio.run(measure(address, url, counts))
        res["elapsed_s"] = time.perf_counter() - t0
    finally:
        gw.terminate()
        server.terminate()
        for p in (gw, server):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    res.update(machine=machine(), reply_tokens=REPLY_TOKENS, counts=counts,
               measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"\n{res['prompt_tokens']}-token prompt, {REPLY_TOKENS}-token replies, echo engine; latency in ms")
    names = {"bus": "bus", "gateway_http": "chat (HTTP)", "gateway_openai": "chat (openai)",
             "gateway_responses": "responses (openai)", "gateway_messages": "messages (anthropic)"}
    print("| concurrency | path | p50 | p99 | added p50 vs bus | req/s |")
    print("|---|---|---|---|---|---|")
    for c in counts:
        r = res[str(c)]
        for key, label in names.items():
            x = r[key]
            print(f"| {c} | {label} | {x['p50_ms']:.2f} | {x['p99_ms']:.2f} | "
                  f"{x['p50_ms'] - r['bus']['p50_ms']:.2f} | {x['req_s']:.0f} |")
    added = {c: res[str(c)]["gateway_http"]["p50_ms"] - res[str(c)]["bus"]["p50_ms"] for c in counts}
    print("RESULT " + " ".join(f"added_ms_c{c}={v:.2f}" for c, v in added.items()))


if __name__ == "__main__":
    main()
