"""Who may talk to whom: the job's keys, each worker's credential, and the gate that checks
every connection before a single message of it is read.

- **Node to scheduler: CURVE, always.** The scheduler's key pair and the key pair every node
  shares derive from the job secret (BLAKE2b), so only a holder of the secret completes the
  handshake, and everything on the connection is encrypted (registration, the address book
  with the workers' credentials, barriers, heartbeats).
- **Worker to server.** At registration each worker makes a fresh credential and sends it over
  that encrypted connection; the scheduler's address book gives the servers every worker's.
  By default it is a random token checked with ZeroMQ's PLAIN mechanism (the data itself is
  not encrypted: a peer must know the token of the very rank it claims). With
  ``KVSTORE_ENCRYPT=1`` it is a CURVE key pair (the servers' public keys are in the workers'
  book) and the data is encrypted as well. Either way the server's gate tags the connection
  with the rank the credential belongs to (the ZeroMQ ``User-Id`` of every message), and the
  server serves a request only when its routing identity names that same rank.
- ``KVSTORE_INSECURE=1``: no mechanism, no gate; anyone who reaches a port can join.

The gate answers ZAP requests (ZeroMQ RFC 27) from its owner's poll loop; :func:`decide` is
the decision alone, without sockets.

>>> keys = JobKeys.from_secret(b"0123456789abcdef0123")
>>> len(keys.scheduler_public), keys == JobKeys.from_secret(b"0123456789abcdef0123")
(40, True)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
from dataclasses import dataclass

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from .config import Config

log = logging.getLogger("kvstore.auth")

DOMAIN = "kvstore"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"


def _keypair(secret: bytes, purpose: bytes) -> tuple[bytes, bytes]:
    """(public, secret) CURVE keys, z85, derived from the job secret for one purpose."""
    raw = hashlib.blake2b(secret, digest_size=32, person=purpose).digest()
    secret_key = z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


@dataclass(frozen=True)
class JobKeys:
    scheduler_public: bytes
    scheduler_secret: bytes
    node_public: bytes
    node_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> JobKeys:
        return cls(*_keypair(secret, b"kvstore-sched"), *_keypair(secret, b"kvstore-node"))


@dataclass(frozen=True)
class Credential:
    """What a node proves itself with to the servers: a token, or a CURVE key pair."""

    public: str  # the token, or the z85 public key: what the scheduler's book carries
    secret: bytes = b""  # the CURVE secret key (encrypt mode only)

    @classmethod
    def make(cls, cfg: Config) -> Credential:
        if cfg.insecure:
            return cls("")
        if cfg.encrypt:
            public, secret = zmq.curve_keypair()
            return cls(public.decode(), secret)
        return cls(secrets.token_hex(32))


# ---- socket set-up
def scheduler_socket(sock: zmq.Socket, cfg: Config) -> None:
    if cfg.insecure:
        return
    keys = JobKeys.from_secret(cfg.secret)
    sock.curve_server = True
    sock.curve_secretkey = keys.scheduler_secret
    sock.curve_publickey = keys.scheduler_public
    sock.zap_domain = DOMAIN.encode()


def control_socket(sock: zmq.Socket, cfg: Config) -> None:
    if cfg.insecure:
        return
    keys = JobKeys.from_secret(cfg.secret)
    sock.curve_serverkey = keys.scheduler_public
    sock.curve_publickey = keys.node_public
    sock.curve_secretkey = keys.node_secret


def server_socket(sock: zmq.Socket, cfg: Config, own: Credential) -> None:
    if cfg.insecure:
        return
    if cfg.encrypt:
        sock.curve_server = True
        sock.curve_secretkey = own.secret
        sock.curve_publickey = own.public.encode()
    else:
        sock.plain_server = True
    sock.zap_domain = DOMAIN.encode()


def worker_socket(
    sock: zmq.Socket, cfg: Config, rank: int, own: Credential, server_public: str
) -> None:
    if cfg.insecure:
        return
    if cfg.encrypt:
        sock.curve_serverkey = server_public.encode()
        sock.curve_publickey = own.public.encode()
        sock.curve_secretkey = own.secret
    else:
        sock.plain_username = f"worker-{rank}".encode()
        sock.plain_password = own.public.encode()


# ---- the gate
def decide(request: list[bytes], allowed: dict) -> tuple[bytes, str, str]:
    """``(status, reason, user id)`` for a ZAP request's frames (after the envelope).

    ``allowed`` maps ``("CURVE", public key bytes)`` or ``("PLAIN", username)`` to
    ``(user id, password or None)``."""
    if len(request) < 6 or request[0] != b"1.0":
        return b"400", "malformed ZAP request", ""
    domain, mechanism, creds = request[2], request[5], request[6:]
    if domain != DOMAIN.encode():
        return b"400", f"unknown security domain {domain[:40]!r}", ""
    if mechanism == b"CURVE" and len(creds) == 1:
        entry = allowed.get(("CURVE", bytes(creds[0])))
        if entry is not None:
            return b"200", "OK", entry[0]
        return b"400", "unknown CURVE key (not this job's KVSTORE_SECRET)", ""
    if mechanism == b"PLAIN" and len(creds) == 2:
        entry = allowed.get(("PLAIN", bytes(creds[0])))
        if entry is not None and hmac.compare_digest(entry[1], bytes(creds[1])):
            return b"200", "OK", entry[0]
        return b"400", f"wrong credential for {bytes(creds[0])[:40]!r}", ""
    return b"400", f"mechanism {mechanism[:10]!r} not allowed", ""


class Gate:
    """The ZAP handler of one node, served from the node's own poll loop (:attr:`sock`)."""

    def __init__(self, ctx: zmq.Context, name: str):
        self.name = name
        self.sock = ctx.socket(zmq.REP)
        self.sock.linger = 0
        self.sock.bind(ZAP_ENDPOINT)
        self.allowed: dict = {}
        self.refused = 0
        self._told: set[bytes] = set()  # addresses already logged

    def allow_job(self, cfg: Config) -> None:
        """Every holder of the job secret (the scheduler's gate)."""
        public = JobKeys.from_secret(cfg.secret).node_public
        self.allowed[("CURVE", z85.decode(public))] = ("node", None)

    def allow_workers(self, cfg: Config, credentials: list[str]) -> None:
        """Worker ``r`` with ``credentials[r]`` only (a server's gate)."""
        for rank, public in enumerate(credentials):
            user = f"worker-{rank}"
            if cfg.encrypt:
                self.allowed[("CURVE", z85.decode(public.encode()))] = (user, None)
            else:
                self.allowed[("PLAIN", user.encode())] = (user, public.encode())

    def watch(self, sock: zmq.Socket) -> zmq.Socket:
        """Log the connections to ``sock`` that fail before the gate sees them (no key, or a
        key for another job), with the peer's address. Poll the returned socket and call
        :meth:`handle_event` when it is readable."""
        self._addresses: dict[int, str] = {}
        self._failed = ""
        self.monitor = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        return self.monitor

    def handle_event(self) -> None:
        event = recv_monitor_message(self.monitor)
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_ACCEPTED:
            self._addresses[value] = _peer(value)
            if len(self._addresses) > 10_000:  # fds are reused: keep the table small
                self._addresses.pop(next(iter(self._addresses)))
        elif kind == zmq.EVENT_DISCONNECTED:
            address = self._addresses.pop(value, "?")
            if self._failed:
                self._refused(address.encode(), self._failed)
                self._failed = ""
        elif kind != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # the gate itself logged those
            self._failed = "the security handshake failed (no key, or another job's key)"

    def _refused(self, address: bytes, reason: str) -> None:
        """Log a refusal, once per host (a refused peer's ZeroMQ keeps reconnecting)."""
        self.refused += 1
        host = address.rsplit(b":", 1)[0]
        if host not in self._told and len(self._told) < 1000:
            if host != b"?":  # the peer was gone before its address was read: say it again
                self._told.add(host)
            log.warning(
                "%s: refused a connection from %s: %s",
                self.name,
                address.decode(errors="replace"),
                reason,
            )

    def handle(self) -> None:
        """Answer one ZAP request (call when :attr:`sock` is readable)."""
        request = self.sock.recv_multipart()
        status, reason, user = decide(request, self.allowed)
        request_id = request[1] if len(request) > 1 else b""
        self.sock.send_multipart([b"1.0", request_id, status, reason.encode(), user.encode(), b""])
        if status != b"200":
            self._refused(request[3] if len(request) > 3 else b"?", reason)

    def close(self) -> None:
        if getattr(self, "monitor", None) is not None:
            self.monitor.close(linger=0)
        self.sock.close(linger=0)


def _peer(fd: int) -> str:
    """The address of the peer on a socket file descriptor that ZeroMQ owns (not closed)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            host, port = s.getpeername()[:2]
            return f"{host}:{port}"
    except OSError:
        return "?"
