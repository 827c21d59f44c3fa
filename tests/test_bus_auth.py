"""Attacks on an engine bound on tcp: without the run's keys a peer cannot generate, sleep or push
weights, and the engine's state does not change; with the worker key it may generate but not
control; only the trainer key controls. A real server process on loopback, the echo engine."""

from __future__ import annotations

import asyncio
import numpy as np
import pytest
import zmq
import zmq.asyncio

from rollout.bus import protocol as P
from rollout.bus.auth import TRAINER, WORKER, AuthError, BusKeys, ClientKeys
from rollout.bus.client import GenerateClient, RequestFailed
from rollout.bus.launcher import read_endpoints, start_server_process

SP = {"max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def tcp_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("auth")
    keys = BusKeys.generate()
    proc = start_server_process("echo", "tiny-llama", [f"ipc://{d}/e.sock", "tcp://127.0.0.1:0"], "e0",
                                log_file=d / "e0.log", keys_file=keys.write(d / "keys.json"),
                                endpoint_file=d / "e0.json")
    try:
        ipc, tcp = read_endpoints(d / "e0.json", proc, 120, d / "e0.log")
        assert tcp.startswith("tcp://127.0.0.1:") and not tcp.endswith(":0")
        yield keys, ipc, tcp
    finally:
        proc.terminate()
        proc.wait(30)


async def _raw(address: str, msg: P.Message, curve: ClientKeys | None, timeout_s: float = 1.5):
    """One message from a bare DEALER (optionally a CURVE client with `curve`); the reply or None."""
    ctx = zmq.asyncio.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(s)
    s.connect(address)
    try:  # the send too has a deadline: with no connected pipe (a handshake refused, the reconnect not yet made) it waits
        await asyncio.wait_for(s.send_multipart(msg.encode()), timeout_s)
        return P.decode(await asyncio.wait_for(s.recv_multipart(), timeout_s))
    except asyncio.TimeoutError:
        return None
    finally:
        s.close(0)
        ctx.term()


def _stranger(server_public: str) -> ClientKeys:
    pub, sec = zmq.curve_keypair()
    return ClientKeys(server_public, pub.decode(), sec.decode())


def test_unauthenticated_peers_get_nothing_and_change_nothing(tcp_server):
    keys, ipc, tcp = tcp_server
    other = BusKeys.generate()  # a peer that knows the protocol but holds another run's keys

    async def main():
        attacks = [P.Generate(rid="g", prompt_ids=np.array([1, 2, 3], np.int32), sampling=SP), P.Sleep(rid="s"),
                   P.WeightsBegin(rid="w", weight_version=1_000_000), P.Health(rid="h")]
        replies = []
        for msg in attacks:
            replies.append(await _raw(tcp, msg, None))  # plain (NULL mechanism) peer
            replies.append(await _raw(tcp, msg, _stranger(keys.server_public)))  # unknown CURVE key
            replies.append(await _raw(tcp, msg, other.for_role(TRAINER)))  # wrong server key too
        async with GenerateClient([tcp], keys=keys.for_role(TRAINER)) as trainer:
            await trainer.wait_ready(timeout_s=60)
            status = await trainer.status(0)
        return replies, status

    replies, status = asyncio.run(main())
    assert replies == [None] * len(replies)  # not even an error: the handshake never completed
    assert status.weight_version == 0 and not status.stats["sleeping"] and not status.stats["updating"]
    assert status.stats["generated_tokens"] == 0 and status.stats["bad_frames"] == 0


def test_worker_key_generates_but_cannot_control(tcp_server):
    keys, ipc, tcp = tcp_server

    async def main():
        async with GenerateClient([tcp], keys=keys.for_role(WORKER)) as worker:
            await worker.wait_ready(timeout_s=60)
            out = await worker.generate([1, 2, 3], SP)
            refusals = []
            for msg in (P.Sleep(), P.Wake(), P.WeightsBegin(weight_version=5), P.WeightsCommit(weight_version=5)):
                with pytest.raises(RequestFailed) as err:
                    await worker.call(0, msg, timeout_s=10)
                refusals.append(err.value.code)
            after = await worker.generate([4, 5], SP)
            status = await worker.status(0)
        return out, refusals, after, status

    out, refusals, after, status = asyncio.run(main())
    assert len(out.token_ids) == 4 and len(after.token_ids) == 4
    assert refusals == ["forbidden"] * 4
    assert status.stats["refused"] >= 4 and not status.stats["sleeping"] and status.weight_version == 0


def test_trainer_key_controls_and_ipc_needs_no_key(tcp_server):
    keys, ipc, tcp = tcp_server

    async def main():
        async with GenerateClient([tcp], keys=keys.for_role(TRAINER)) as trainer, GenerateClient([ipc]) as local:
            await trainer.wait_ready(timeout_s=60)
            await local.wait_ready(timeout_s=60)
            await trainer.call(0, P.Sleep())
            asleep = (await local.status(0)).stats["sleeping"]
            await trainer.call(0, P.Wake())
            out = await local.generate([1, 2], SP)
            return asleep, out, (await trainer.status(0)).stats["sleeping"]

    asleep, out, awake_sleeping = asyncio.run(main())
    assert asleep is True and awake_sleeping is False and len(out.token_ids) == 4


def test_tcp_without_keys_is_refused_before_binding(tmp_path):
    with pytest.raises(AuthError, match="client keys"):
        GenerateClient(["tcp://127.0.0.1:5555"])
    proc = start_server_process("echo", "tiny-llama", "tcp://127.0.0.1:0", "e0", log_file=tmp_path / "log",
                                endpoint_file=tmp_path / "ep.json")
    with pytest.raises(RuntimeError, match="bus keys"):
        read_endpoints(tmp_path / "ep.json", proc, 60, tmp_path / "log")
    assert proc.wait(30) != 0


@pytest.mark.parametrize("which", ["another deployment's keys", "the right server key, a stranger's client key"])
def test_a_client_with_the_wrong_keys_is_told_within_seconds_to_check_them(tcp_server, which):
    """A trainer or worker holding keys the server was not started with learns it from the failed
    CURVE handshake within seconds (not at its start-up deadline, blaming addresses)."""
    import time

    keys, _, tcp = tcp_server
    wrong = BusKeys.generate().for_role(TRAINER) if which.startswith("another") else _stranger(keys.server_public)

    async def body() -> float:
        t0 = time.monotonic()
        async with GenerateClient([tcp], keys=wrong) as client:
            with pytest.raises(AuthError, match=r"refused this client in the CURVE handshake: its keys are not the "
                                                r"ones their servers were started with.*rollout.engine_keys"):
                await client.wait_ready(timeout_s=60)
        return time.monotonic() - t0

    assert asyncio.run(body()) < 15


def test_the_keys_file_is_private_even_when_it_replaces_a_readable_one(tmp_path):
    """`python -m rollout.service keys --force` over an existing 0644 file leaves a 0600 one."""
    import os
    import stat
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "keys.json"
    path.write_text("{}")
    os.chmod(path, 0o644)
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "rollout.service", "keys", str(path), "--force"], cwd=repo,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and BusKeys.read(path).server_public
    assert [p.name for p in tmp_path.iterdir()] == ["keys.json"]  # no temporary file left beside it


def test_a_deep_tmpdir_does_not_break_the_ipc_sockets(tmp_path, monkeypatch):
    """Unix socket paths end at 107 bytes: with a $TMPDIR that deep, a run's socket directory goes to
    /tmp instead of failing at bind (seen under pytest-xdist's deeper temp paths)."""
    import tempfile
    from pathlib import Path

    from rollout.bus.launcher import IPC_PATH_MAX, socket_dir

    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    made = socket_dir("switchyard-")
    try:
        assert made.parent == Path("/tmp") and len(str(made / "node12-engine15.sock")) <= IPC_PATH_MAX
        assert oct(made.stat().st_mode & 0o777) == "0o700"
    finally:
        made.rmdir()
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    shallow = socket_dir("switchyard-")
    assert shallow.parent == Path("/tmp")
    shallow.rmdir()


def test_a_run_attached_with_the_wrong_keys_ends_in_one_line_naming_them(tcp_server, tmp_path, capsys):
    """`launch/train.py` attached to engines started with other keys: exit 2 and one `error:` line
    about the keys, within seconds, not a traceback."""
    import time

    from launch.train import main

    _, _, tcp = tcp_server
    wrong = BusKeys.generate().write(tmp_path / "other-keys.json")
    t0 = time.monotonic()
    rc = main(["model.path=tiny-llama", "data.task=arithmetic", "sft.enabled=false", "data.val_path=null",
               f"rollout.engines=[{tcp}]", f"rollout.engine_keys={wrong}", "rollout.engine=hf", "trainer.steps=1",
               f"trainer.output_dir={tmp_path / 'run'}", "trainer.export_hf=false"])
    err = capsys.readouterr().err
    assert rc == 2 and "error:" in err and "rollout.engine_keys" in err and "Traceback" not in err, err[-3000:]
    assert time.monotonic() - t0 < 120
