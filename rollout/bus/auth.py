"""Who may talk to an engine: CURVE keys for every tcp bind of the bus.

Threat model. An engine's tcp socket is reachable by every host on the cluster network; any peer
that can send a `sleep`, a weight bucket or a version jump could stall or corrupt the run. So a
server that binds tcp runs ZMQ's CURVE mechanism (encrypted, each peer proves it holds a secret
key) behind a ZAP handler that admits exactly two client keys, both made by the launcher for
this run and never written to the run directory:

  trainer  may generate and send control messages (sleep, wake, weight updates)
  worker   (agent workers) may generate, abort and read load reports; nothing else

An unknown key fails the handshake: the server never reads a byte of its messages, so it learns
nothing about the model either. ipc sockets stay without CURVE: they live in a directory only
the run's user can open (mode 0700), which is the same trust boundary as the processes themselves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.utils import z85

log = logging.getLogger("switchyard.auth")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
TRAINER, WORKER = "trainer", "worker"
CONTROL_ROLES = (TRAINER,)  # roles allowed to send sleep / wake / weights


class AuthError(RuntimeError):
    """Keys are missing or malformed where a tcp bind needs them."""


@dataclass(frozen=True)
class BusKeys:
    """One run's CURVE keys (z85 text). Engines need the server pair and both client public keys;
    a client needs the server public key and its own pair."""

    server_public: str
    server_secret: str
    trainer_public: str
    trainer_secret: str
    worker_public: str
    worker_secret: str

    @staticmethod
    def generate() -> "BusKeys":
        if not zmq.has("curve"):
            raise AuthError("this pyzmq/libzmq has no CURVE support, which tcp binds of the bus require; "
                            "install a pyzmq wheel built with libsodium (the PyPI wheels are)")
        pairs = [zmq.curve_keypair() for _ in range(3)]
        return BusKeys(*(k.decode() for pair in pairs for k in pair))

    def for_role(self, role: str) -> "ClientKeys":
        if role == TRAINER:
            return ClientKeys(self.server_public, self.trainer_public, self.trainer_secret)
        if role == WORKER:
            return ClientKeys(self.server_public, self.worker_public, self.worker_secret)
        raise AuthError(f"unknown bus role {role!r}; choose {TRAINER!r} or {WORKER!r}")

    def roles(self) -> dict[bytes, str]:
        """Client public key (z85) -> role, what the server's ZAP handler admits."""
        return {self.trainer_public.encode(): TRAINER, self.worker_public.encode(): WORKER}

    def write(self, path: Path) -> Path:
        """Save for an engine process, readable by this user only: written to a new file of mode 0600
        beside `path` and renamed over it, so a file that was there (of any mode) is replaced whole
        and no reader ever sees the secrets world-readable or half written."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self), f)
            os.chmod(tmp, 0o600)  # whatever the umask
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    @staticmethod
    def read(path: str | Path) -> "BusKeys":
        try:
            return BusKeys(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise AuthError(f"cannot read bus keys from {path}: {e}; the launcher writes this file") from None


@dataclass(frozen=True)
class ClientKeys:
    server_public: str
    public: str
    secret: str

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client of a server holding `server_public` (before connect)."""
        sock.curve_serverkey = self.server_public.encode()
        sock.curve_publickey = self.public.encode()
        sock.curve_secretkey = self.secret.encode()


def needs_auth(address: str) -> bool:
    """tcp (and any other network transport) needs CURVE; ipc and inproc do not."""
    return not address.startswith(("ipc://", "inproc://"))


def secure_server(sock: zmq.Socket, keys: BusKeys) -> None:
    """Make `sock` a CURVE server (before bind); the ZAP handler decides who gets in."""
    sock.curve_server = True
    sock.curve_publickey = keys.server_public.encode()
    sock.curve_secretkey = keys.server_secret.encode()
    sock.zap_domain = b"switchyard"


async def zap_handler(ctx: zmq.asyncio.Context, keys: BusKeys, ready: asyncio.Event) -> None:
    """Answer ZAP requests for every CURVE socket of `ctx`: 200 with the role as User-Id for the
    run's two client keys, 400 for anything else. Runs until cancelled."""
    roles = keys.roles()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(ZAP_ENDPOINT)
    ready.set()
    try:
        while True:
            frames = await sock.recv_multipart()
            version, request_id = (frames + [b"", b""])[:2]
            mechanism = frames[5] if len(frames) > 5 else b""
            role = None
            if mechanism == b"CURVE" and len(frames) == 7:
                role = roles.get(z85.encode(frames[6]))
            if role is None:
                log.warning("refused a %s peer at %s: unknown key", mechanism.decode(errors="replace"),
                            frames[3].decode(errors="replace") if len(frames) > 3 else "?")
                await sock.send_multipart([version, request_id, b"400", b"unknown key", b"", b""])
            else:
                await sock.send_multipart([version, request_id, b"200", b"OK", role.encode(), b""])
    finally:
        sock.close(0)


async def watch_handshakes(sock: zmq.asyncio.Socket, address: str, engine_id: str) -> None:
    """Log the clients that fail the CURVE handshake on `sock` (the first, then every 100th): they hold
    other keys than this server's. Runs until cancelled."""
    from zmq.utils.monitor import parse_monitor_message

    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    failed = 0
    try:
        while True:
            parse_monitor_message(await mon.recv_multipart())
            if failed % 100 == 0:
                log.warning("engine %s: a client failed the CURVE handshake on %s (%d so far): it holds other keys "
                            "than this server's; give it the keys file this server was started with", engine_id,
                            address, failed + 1)
            failed += 1
    finally:
        mon.close(0)


def role_of(frame: zmq.Frame) -> str | None:
    """The role the ZAP handler gave the sender of `frame`, or None (ipc: no CURVE)."""
    try:
        uid = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return uid or None
