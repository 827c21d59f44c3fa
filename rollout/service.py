"""Engines as a service: engine servers started on their own (another Slurm job, other machines),
which a run attaches to instead of starting its own.

    python -m rollout.service keys keys.json          # once: the CURVE keys, shared as a file
    python -m rollout.bus.server --backend vllm --model Qwen/Qwen2.5-3B-Instruct \\
        --address tcp://0.0.0.0:7100 --keys keys.json --engine-id gpu0   # per engine, anywhere
    torchrun launch/train.py rollout.engines=[tcp://node7:7100,tcp://node8:7100] \\
        rollout.engine_keys=keys.json

The run routes over them like its own engines and pushes every new weight version over the bus
(the only route that reaches a process it did not start). It never puts them to sleep and never
stops them. An engine that restarts comes back at weight version 0: before each synchronous rollout
the run asks every engine its version and, if one is behind, pushes the current weights again, so
a restarted engine serves the policy of the step and no request waits at its gate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rollout.bus.auth import BusKeys, needs_auth


def check_service(cfg: Any) -> None:
    """`rollout.engines` / `rollout.engine_keys` as the config gives them; a ValueError naming the fix."""
    bad = [a for a in cfg.engines if not isinstance(a, str) or not a.startswith(("tcp://", "ipc://"))]
    if bad:
        raise ValueError(f"rollout.engines lists {bad[0]!r}; give engine server addresses as tcp://HOST:PORT "
                         "(or ipc://PATH on this machine)")
    if any(needs_auth(a) for a in cfg.engines) and not cfg.engine_keys:
        raise ValueError("rollout.engines lists tcp addresses but rollout.engine_keys is not set; give the keys file "
                         "the servers were started with (make one with: python -m rollout.service keys PATH)")
    if cfg.engine_keys and not Path(cfg.engine_keys).is_file():
        raise ValueError(f"rollout.engine_keys={cfg.engine_keys!r} is not a file; make one with: python -m "
                         "rollout.service keys PATH, and start the engine servers with --keys PATH")
    if cfg.in_process:
        raise ValueError("rollout.in_process=true serves an engine from the trainer's process; it cannot be combined "
                         "with rollout.engines (servers started elsewhere): drop one")
    if cfg.placement == "colocated":  # under asynchronous RL `RolloutConfig` refused it already
        raise ValueError("rollout.placement=colocated puts engines to sleep during updates, which a run never does to "
                         "engines it attached to (rollout.engines); use placement=auto or split")


def service_keys(cfg: Any) -> BusKeys | None:
    """The keys the run's clients use with the attached engines (None: ipc addresses only)."""
    return BusKeys.read(cfg.engine_keys) if cfg.engine_keys else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollout.service", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    k = sub.add_parser("keys", help="write a new set of CURVE keys (JSON, mode 0600) for engines and trainers")
    k.add_argument("path", type=Path)
    k.add_argument("--force", action="store_true", help="overwrite an existing file")
    args = ap.parse_args(argv)
    if args.path.exists() and not args.force:
        print(f"{args.path} exists; pass --force to replace it (running engines keep the old keys)", file=sys.stderr)
        return 2
    args.path.parent.mkdir(parents=True, exist_ok=True)
    BusKeys.generate().write(args.path)
    print(f"wrote {args.path}: start each engine server with --keys {args.path} and the trainer with "
          f"rollout.engine_keys={args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
