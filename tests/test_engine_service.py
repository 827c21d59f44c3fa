"""Engines as a service: two engine servers started on their own (tcp, CURVE keys from
`python -m rollout.service keys`), a run of launch/train.py attached to them that trains three
steps while one of them is restarted after the first, pushes every weight version to both (the
restarted one is brought back to the current version), and leaves both running. A peer without
the keys gets nothing."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout.bus.auth import TRAINER, WORKER, BusKeys  # noqa: E402
from rollout.bus.client import GenerateClient  # noqa: E402
from rollout.bus.launcher import read_endpoints, start_server_process  # noqa: E402
from test_train import REPO, TINY, _env, metrics  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(tmp: Path, port: int, name: str, keys: Path) -> subprocess.Popen:
    endpoint = tmp / f"{name}.json"
    endpoint.unlink(missing_ok=True)
    proc = start_server_process("hf", "tiny-llama", [f"tcp://127.0.0.1:{port}"], name, {"max_batch_size": 16},
                                request_log=tmp / f"{name}.jsonl", log_file=tmp / f"{name}.log", keys_file=keys,
                                endpoint_file=endpoint, cpu_threads=1)
    read_endpoints(endpoint, proc, 300, tmp / f"{name}.log")
    return proc


def _versions(addresses: list[str], keys: BusKeys) -> list[int]:
    async def main() -> list[int]:
        async with GenerateClient(addresses, keys=keys.for_role(TRAINER)) as c:
            await c.wait_ready(timeout_s=60)
            return [(await c.status(i)).weight_version for i in range(len(addresses))]

    return asyncio.run(main())


@pytest.mark.slow
def test_a_run_attaches_to_engines_it_did_not_start_and_survives_a_restart(tmp_path: Path):
    keys_file = tmp_path / "keys.json"
    made = subprocess.run([sys.executable, "-m", "rollout.service", "keys", str(keys_file)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and keys_file.stat().st_mode & 0o777 == 0o600, made.stderr
    keys = BusKeys.read(keys_file)
    ports = [_free_port(), _free_port()]
    addresses = [f"tcp://127.0.0.1:{p}" for p in ports]
    engines = [_start(tmp_path, ports[0], "svc0", keys_file), _start(tmp_path, ports[1], "svc1", keys_file)]
    out = tmp_path / "run"
    try:
        train = subprocess.Popen(
            [sys.executable, "launch/train.py", *TINY, "model.dtype=float32",  # the services' dtype
             "trainer.steps=60", "trainer.save_every=1000", f"trainer.output_dir={out}",
             f"rollout.engines=[{','.join(addresses)}]", f"rollout.engine_keys={keys_file}"],
            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 600
        while not (out / "metrics.jsonl").exists() or not any(m.get("step") == 1 for m in metrics(out)):
            assert train.poll() is None, train.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "step 1 did not finish in 600 s"
            time.sleep(0.5)
        engines[1].terminate()  # restarted between steps: it comes back at weight version 0
        engines[1].wait(60)
        engines[1] = _start(tmp_path, ports[1], "svc1", keys_file)
        back = time.time()
        log, _ = train.communicate(timeout=600)
        assert train.returncode == 0, log[-4000:]
        assert "attached to 2 engine(s)" in log
        assert all(e.poll() is None for e in engines)  # the run never stopped them
        steps = [m for m in metrics(out) if "weight_version" in m]
        assert [m["step"] for m in steps] == list(range(1, 61))
        assert steps[-1]["time"] > back + 2, "the run ended before the restarted engine was back; raise its steps"
        final = int(steps[-1]["weight_version"])
        assert _versions(addresses, keys) == [final, final]  # it was brought to the current weights
        served = [json.loads(x) for x in (tmp_path / "svc1.jsonl").read_text().splitlines()]
        served = [r for r in served if r["time"] > back]
        assert served and min(r["weight_version"] for r in served) >= 1  # it never served its base weights

        async def stranger() -> None:  # right address, keys of another deployment: the handshake fails
            async with GenerateClient(addresses[:1], keys=BusKeys.generate().for_role(WORKER)) as c:
                await c.wait_ready(timeout_s=3)

        with pytest.raises(Exception):
            asyncio.run(stranger())
    finally:
        for e in engines:
            e.terminate()
        for e in engines:
            e.wait(60)


def test_a_bf16_run_pushes_into_a_plain_fp32_engine_in_its_dtype(tmp_path: Path):
    """`python -m rollout.bus.server` with no options holds float32; a run training in bfloat16 attached
    to it learns the engine's dtype from its status and casts every push to it (the engine refuses
    tensors of another dtype), so step 1's push lands and the run exits 0."""
    address = f"ipc://{tmp_path}/plain.sock"
    log = tmp_path / "plain.log"
    endpoint = tmp_path / "plain.json"
    engine = start_server_process("hf", "tiny-llama", [address], "plain", log_file=log, endpoint_file=endpoint,
                                  cpu_threads=1)
    try:
        read_endpoints(endpoint, engine, 300, log)
        run = subprocess.run([sys.executable, "launch/train.py", *TINY, "model.dtype=bfloat16", "sft.enabled=false",
                              "trainer.steps=1", "trainer.export_hf=false", f"trainer.output_dir={tmp_path / 'run'}",
                              f"rollout.engines=[{address}]"],
                             cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        assert "the attached engines hold float32 and this run trains in model.dtype=bfloat16" in run.stdout

        async def status() -> Any:
            async with GenerateClient([address]) as c:
                await c.wait_ready(timeout_s=60)
                return await c.status(0)

        st = asyncio.run(status())
        assert st.stats["dtype"] == "float32" and st.weight_version == 1  # step 1's weights, in its own dtype
    finally:
        engine.terminate()
        engine.wait(60)
