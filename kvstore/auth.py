"""Who may talk to whom: the job's keys, each worker's credential, and the gate that checks
every connection before a single message of it is read.

- **Node to scheduler: CURVE, always.** The scheduler's key pair and the key pair every node
  shares derive from the job secret (BLAKE2b), so only a holder of the secret completes the
  handshake, and everything on the connection is encrypted (registration, the address book
  with the workers' credentials, barriers, heartbeats).
- **Worker to server.** At registration each worker makes a fresh credential and sends it over
  that encrypted connection; the scheduler's address book gives the servers every worker's.
  By default it is a random token that never crosses the network: the data connection has no
  ZeroMQ mechanism (NULL), the gate names each connection (``conn-<n>``, the ZeroMQ
  ``User-Id`` of its every message), and the worker proves its token on each connection by
  answering a fresh challenge: ``hello`` is answered with a random ``challenge``, and ``auth``
  carries :func:`proof`, an HMAC of that challenge and the rank under the token. A sniffer
  learns one proof, good for one connection that is already proved; the data itself is not
  encrypted. With ``KVSTORE_ENCRYPT=1`` the credential is a CURVE key pair (the servers'
  public keys are in the workers' book), the gate tags the connection with the rank the key
  belongs to, and the data is encrypted as well. Either way a server serves a request only
  when its routing identity names the rank the connection proved.
- ``KVSTORE_INSECURE=1``: no mechanism, no gate, no challenge; anyone who reaches a port can
  join.

The gate answers ZAP requests (ZeroMQ RFC 27) from its owner's poll loop; :func:`decide` is
the decision alone, without sockets, and :func:`check_proof` the server's check of an
``auth``.

>>> keys = JobKeys.from_secret(b"0123456789abcdef0123")
>>> len(keys.scheduler_public), keys == JobKeys.from_secret(b"0123456789abcdef0123")
(40, True)
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import secrets
import socket
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from .config import Config
from .transport import monitor_event

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
    # else NULL: with a ZAP domain the gate still sees (and names) every connection
    sock.zap_domain = DOMAIN.encode()


def worker_socket(
    sock: zmq.Socket, cfg: Config, rank: int, own: Credential, server_public: str
) -> None:
    if cfg.insecure:
        return
    if cfg.encrypt:  # by default NULL: the token is proved by answer(), never sent
        sock.curve_serverkey = server_public.encode()
        sock.curve_publickey = own.public.encode()
        sock.curve_secretkey = own.secret


# ---- the challenge on a default-mode data connection
class Refused(ValueError):
    """A request refused for want of a proof: said to the peer, logged once per host."""


_PROOF_CONTEXT = b"kvstore data connection proof v1\0"


def challenge() -> str:
    """A server's fresh challenge for one connection: 32 hex characters."""
    return secrets.token_hex(16)


def proof(token: str, challenge: str, rank: int, role: str = "worker") -> str:
    """HMAC-SHA256 under a worker's token of one connection's challenge and the rank it
    claims, hex: it shows the token without revealing it, and is good for that connection
    and that rank only.

    >>> len(proof("tok", "00" * 16, 3)), proof("tok", "00" * 16, 3) == proof("tok", "00" * 16, 4)
    (64, False)
    """
    message = _PROOF_CONTEXT + challenge.encode() + b"\0" + f"{role}-{rank}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def check_proof(token: str, challenge: str | None, rank: int, given, role: str = "worker") -> str:
    """Why ``given`` does not prove ``token`` for this connection's ``challenge`` and
    ``rank``, or ``""`` when it does.

    >>> check_proof("tok", "ab", 0, proof("tok", "ab", 0)), check_proof("tok", None, 0, "x")[:9]
    ('', 'auth befo')
    """
    if challenge is None:
        return "auth before hello: no challenge is open on this connection"
    if not isinstance(given, str) or len(given) != 64 or not given.isascii():
        return "auth needs body {'proof': 64 hex characters}"
    if not token or not hmac.compare_digest(proof(token, challenge, rank, role), given):
        return (
            f"wrong proof for {role}-{rank}: not that rank's credential, or a proof replayed "
            "from another connection"
        )
    return ""


def answer(hello_reply: dict, own: Credential, rank: int, role: str = "worker") -> dict | None:
    """A worker's (or a server's, on a replication link) ``auth`` body for a server's reply
    to ``hello``; None when the server asks for no proof (encrypted or insecure jobs)."""
    issued = hello_reply.get("challenge")
    if not isinstance(issued, str):
        return None
    return {"proof": proof(own.public, issued, rank, role)}


# ---- the gate
def decide(request: list[bytes], allowed: dict, serial: int = 0) -> tuple[bytes, str, str]:
    """``(status, reason, user id)`` for a ZAP request's frames (after the envelope).

    ``allowed`` maps ``("CURVE", public key bytes)`` to ``(user id, None)``; with an entry
    ``("NULL",)``, a NULL connection is let in and named ``conn-<serial>``: the caller gives
    each connection its own ``serial``, and the connection proves itself afterwards."""
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
    if mechanism == b"NULL" and not creds and ("NULL",) in allowed:
        return b"200", "OK", f"conn-{serial}"
    return b"400", f"mechanism {mechanism[:10]!r} not allowed", ""


class Gate:
    """The ZAP handler of one node, served from the node's own poll loop (:attr:`sock`)."""

    def __init__(self, ctx: zmq.Context, name: str):
        self.name = name
        self.sock = ctx.socket(zmq.REP)
        self.sock.linger = 0
        self.sock.bind(ZAP_ENDPOINT)
        self.allowed: dict = {}
        self.tokens: list[str] = []  # worker r's token (default mode, a server's gate)
        self.peer_tokens: list[str] = []  # server r's token (default mode, replication links)
        self._serials = itertools.count(1)  # names NULL connections: conn-1, conn-2, ...
        self.refused = 0
        self._told: set[bytes] = set()  # addresses already logged
        self.closed: list[str] = []  # peer addresses whose connection closed (watch())

    def allow_job(self, cfg: Config) -> None:
        """Every holder of the job secret (the scheduler's gate)."""
        public = JobKeys.from_secret(cfg.secret).node_public
        self.allowed[("CURVE", z85.decode(public))] = ("node", None)

    def allow_servers(self, cfg: Config, credentials: list[str]) -> None:
        """The other servers' replication links (a server's gate): their CURVE keys, or (by
        default) their tokens, proved on each connection as a worker's are."""
        if not cfg.encrypt:
            self.peer_tokens = list(credentials)
            return
        for rank, public in enumerate(credentials):
            self.allowed[("CURVE", z85.decode(public.encode()))] = (f"server-{rank}", None)

    def allow_worker(self, cfg: Config, rank: int, credential: str) -> None:
        """Slot ``rank`` of an elastic job has a new worker: its credential replaces the old."""
        if not cfg.encrypt:
            if rank < len(self.tokens):
                self.tokens[rank] = credential
            return
        name = f"worker-{rank}"
        for entry in [k for k, v in self.allowed.items() if v[0] == name]:
            del self.allowed[entry]
        if credential:
            self.allowed[("CURVE", z85.decode(credential.encode()))] = (name, None)

    def allow_workers(self, cfg: Config, credentials: list[str]) -> None:
        """Worker ``r`` with ``credentials[r]`` only (a server's gate): its CURVE key, or (by
        default) any connection, which the server serves once it proves ``r``'s token."""
        if not cfg.encrypt:
            self.tokens = list(credentials)
            self.allowed[("NULL",)] = ("conn", None)
            return
        for rank, public in enumerate(credentials):
            if public:  # an elastic job's slot nobody holds yet has none
                self.allowed[("CURVE", z85.decode(public.encode()))] = (f"worker-{rank}", None)

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
        kind, value = monitor_event(self.monitor)
        if kind == zmq.EVENT_ACCEPTED:
            self._addresses[value] = address_of(value)
            if len(self._addresses) > 10_000:  # fds are reused: keep the table small
                self._addresses.pop(next(iter(self._addresses)))
        elif kind == zmq.EVENT_DISCONNECTED:
            address = self._addresses.pop(value, "?")
            if address != "?" and len(self.closed) < 10_000:
                self.closed.append(address)
            if self._failed:
                self.refuse(address.encode(), self._failed)
                self._failed = ""
        elif kind != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # the gate itself logged those
            self._failed = "the security handshake failed (no key, or another job's key)"

    def refuse(self, address: bytes, reason: str) -> None:
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
        status, reason, user = decide(request, self.allowed, next(self._serials))
        request_id = request[1] if len(request) > 1 else b""
        self.sock.send_multipart([b"1.0", request_id, status, reason.encode(), user.encode(), b""])
        if status != b"200":
            self.refuse(request[3] if len(request) > 3 else b"?", reason)

    def close(self) -> None:
        if getattr(self, "monitor", None) is not None:
            self.monitor.close(linger=0)
        self.sock.close(linger=0)


def address_of(fd: int, peer: bool = True) -> str:
    """``host:port`` of the peer (else of this end) of a connection on a file descriptor that
    ZeroMQ owns (not closed); "?" when it is gone. The scheduler's gate names a connection
    by its peer, and a node tells the scheduler its own end, so that the two match."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            host, port = (s.getpeername() if peer else s.getsockname())[:2]
            return f"{host}:{port}"
    except OSError:
        return "?"
