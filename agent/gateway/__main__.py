"""Serve the gateway on its own: `python -m agent.gateway --bus ADDRESS --tokenizer MODEL [options]`.

For agents that run outside the training job (another machine, another language): they point their
OpenAI client at the printed URL. Beyond loopback, give `--api-key` (requests without one get 401).
It stops when the process that started it is gone (a script killed with -9 leaves no gateway behind);
`--detach` keeps it running on its own (under nohup or a service manager).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


async def serve(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from agent.gateway.server import Gateway, is_loopback
    from engines.models import resolve_model
    from rollout.bus.client import GenerateClient

    if not is_loopback(args.host) and not args.api_key:
        raise SystemExit(f"--host {args.host} is beyond loopback: give --api-key KEY (clients send it as "
                         "`Authorization: Bearer KEY`), or bind 127.0.0.1")
    from agent.vision import Vision

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.tokenizer))
    vision = Vision.from_model(resolve_model(args.tokenizer))
    async with GenerateClient(args.bus) as client:
        await client.wait_ready(timeout_s=args.ready_timeout_s)
        gw = Gateway(client, tokenizer, model_name=args.model_name, tool_parser=args.tool_parser, host=args.host,
                     port=args.port, api_keys=args.api_key, max_inflight=args.max_inflight,
                     max_context=args.max_context, vision=vision, max_body_mb=args.max_body_mb,
                     max_sessions=args.max_sessions, max_session_bytes=args.max_session_mb << 20,
                     max_total_bytes=args.max_total_mb << 20, grammar_budget_s=args.grammar_budget_s,
                     max_schema_kb=args.max_schema_kb)
        url = await gw.start()
        print(f"switchyard gateway: {url} (model {args.model_name!r}, {len(args.bus)} engine(s))", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if args.parent:
            from parallel.lifetime import watch_parent

            def gone() -> None:
                print(f"switchyard gateway: the process that started it ({args.parent}) is gone; stopping",
                      file=sys.stderr, flush=True)
                loop.call_soon_threadsafe(stop.set)

            watch_parent(gone, parent=args.parent, every_s=0.5)
        await stop.wait()
        await gw.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m agent.gateway", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bus", action="append", required=True, help="an engine server's address (repeat for more)")
    ap.add_argument("--tokenizer", required=True, help="the served model (name or path): its tokenizer and template")
    ap.add_argument("--model-name", default="switchyard", help="what clients send as `model`")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: any free port")
    ap.add_argument("--api-key", action="append", default=[], help="accepted key (repeat for more)")
    ap.add_argument("--tool-parser", default="hermes", help="the model family's tool-call format")
    ap.add_argument("--max-context", type=int, default=None,
                    help="prompt + reply tokens; longer prompts get 413 (default: the model's max_position_embeddings)")
    ap.add_argument("--max-body-mb", type=int, default=32, help="request bodies over this get 413 before they are read")
    ap.add_argument("--max-sessions", type=int, default=1024,
                    help="sessions clients open by themselves (key or X-Session-Id); the least recently used go first")
    ap.add_argument("--max-session-mb", type=int, default=256,
                    help="recorded conversation per session: a client's own sessions lose their oldest segments "
                         "past it, a trained one gets 413")
    ap.add_argument("--max-total-mb", type=int, default=2048,
                    help="what clients' own sessions hold together; the least recently used are forgotten past it")
    ap.add_argument("--max-inflight", type=int, default=256, help="running requests before 429")
    ap.add_argument("--grammar-budget-s", type=float, default=10.0,
                    help="seconds an output schema may take to compile; one over it gets 400")
    ap.add_argument("--max-schema-kb", type=int, default=1024, help="output schemas over this get 413")
    ap.add_argument("--ready-timeout-s", type=float, default=300.0)
    ap.add_argument("--detach", action="store_true",
                    help="keep serving after the process that started it is gone (default: stop with it)")
    args = ap.parse_args(argv)
    import os

    args.parent = None if args.detach else os.getppid()
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
