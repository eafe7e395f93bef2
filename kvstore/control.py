"""A node's link to the scheduler: registration, heartbeats, barriers, failure notices.

The link runs in its own thread and owns the DEALER socket to the scheduler, so heartbeats go
out while the node computes. The node's own thread talks to it through an inproc PAIR socket
(:attr:`Control.pipe`), which it polls beside its data sockets: a node failure or a shutdown
wakes it at once. Messages on the pipe are ordinary protocol messages.

Each heartbeat carries the node's counters (:attr:`Control.metrics`, a
:class:`~kvstore.metrics.NodeMetrics` the node's threads update; off with
``KVSTORE_METRICS=0``), so reporting them costs no message of its own.
:attr:`Control.tracer` is the worker's timeline file (``KVSTORE_TIMELINE``), or None.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import socket
import threading
import time

import zmq

from . import auth
from .config import Config
from .errors import AuthError, KVStoreError, PeerLostError
from .metrics import NodeMetrics
from .protocol import Message, decode, encode
from .timeline import Tracer
from .transport import monitor_event

log = logging.getLogger("kvstore.control")
_ids = itertools.count(1)


class Control:
    def __init__(
        self, ctx: zmq.Context, cfg: Config, role: str, port: int, cred: str = "", store: str = ""
    ):
        self.cfg, self.role, self.port, self.cred = cfg, role, port, cred
        self.store = store  # a worker's store type: every worker of a job must use the same
        self.ctx = ctx
        # DMLC_PS_ROOT_URI may be a name that resolves only later (Kubernetes): wait for it
        self.address = f"tcp://{resolve_scheduler(cfg)}:{cfg.root_port}"
        self.metrics = NodeMetrics(role) if cfg.metrics else None
        self.tracer = Tracer(cfg.timeline, role) if cfg.timeline and role == "worker" else None
        endpoint = f"inproc://kvstore-control-{id(self)}"
        self.pipe = ctx.socket(zmq.PAIR)  # belongs to the node's thread
        self.pipe.bind(endpoint)
        self._endpoint = endpoint
        self._conn = ""  # this end's address on the scheduler connection
        self._thread = threading.Thread(
            target=self._run, name=f"kvstore-{role}-control", daemon=True
        )
        self._thread.start()

    # ---- the node's side
    def send(self, kind: str, body: dict | None = None) -> int:
        msg_id = next(_ids)
        self.pipe.send_multipart(encode(Message(kind, msg_id, self.role, body or {})))
        return msg_id

    def recv(self) -> Message:
        return decode(self.pipe.recv_multipart())

    def wait(self, what: str, kinds: tuple, timeout: float) -> Message:
        """Block for the next message of ``kinds`` on the pipe; errors and failures raise."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pipe.poll(left * 1000):
                raise PeerLostError(
                    f"{what}: no answer from the scheduler at "
                    f"{self.cfg.scheduler_address} within {timeout:g}s"
                )
            msg = self.recv()
            if msg.kind in kinds:
                return msg
            raise_for(msg, what)

    def close(self, finalize: bool, failed: str = "") -> None:
        """Tell the scheduler this node is done (when ``finalize``) or that it failed (with
        ``failed``, the reason), then stop the thread."""
        if (finalize or failed) and self._thread.is_alive():
            try:
                if failed:
                    self.send("failed", {"reason": failed})
                else:
                    self.send("finalize")
                self.wait("finalize", ("ack",), min(5.0, self.cfg.request_timeout))
            except KVStoreError as exc:
                log.info("finalize: %s", exc)
        if self._thread.is_alive():
            self.send("command", {"name": "stop"})
            self._thread.join(5)
        self.pipe.close(linger=0)
        if self.tracer is not None:
            self.tracer.close()

    # ---- the link thread
    def _run(self) -> None:
        cfg = self.cfg
        peer = self.ctx.socket(zmq.PAIR)
        peer.connect(self._endpoint)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.IDENTITY, f"{self.role}-{os.getpid()}-{id(self)}".encode())
        sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        auth.control_socket(sock, cfg)
        if self.address.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        monitor = None
        if not cfg.insecure:  # a refused key fails at once, not at the start-up deadline;
            # watched before connecting: a handshake that fails at once (a connection that
            # met itself) was missed, and nothing connected again until the deadline
            watch = _HANDSHAKE_FAILED | zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            monitor = sock.get_monitor_socket(watch)
        sock.connect(self.address)
        register = encode(
            Message(
                "register",
                0,
                self.role,
                {
                    "role": self.role,
                    "host": cfg.node_host,
                    "port": self.port,
                    "num_server": cfg.num_server,
                    "num_worker": cfg.num_worker,
                    "pid": os.getpid(),
                    "rank_hint": cfg.rank_hint,
                    "cred": self.cred,
                    "store": self.store,
                },
            )
        )
        sock.send_multipart(register)
        log.info("%s registering with the scheduler at %s", self.role, cfg.scheduler_address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(peer, zmq.POLLIN)
        if monitor is not None:
            poller.register(monitor, zmq.POLLIN)
        next_beat = time.monotonic()
        silence = Silence(next_beat)
        waited = 0.0  # the longest the last turn's poll could wait
        registered = finalizing = refused = False
        failed = 0  # handshakes failed in a row
        try:
            while True:
                now = time.monotonic()
                silent = silence.turn(now, waited)
                if now >= next_beat:
                    try:  # never wait for a scheduler that does not read
                        beat = Message("heartbeat", 0, self.role, self._heartbeat_body())
                        sock.send_multipart(encode(beat), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                    next_beat = now + cfg.heartbeat_interval
                if registered and not finalizing and silent > cfg.heartbeat_timeout:
                    peer.send_multipart(encode(_scheduler_failed(cfg, silent)))
                    registered = False  # say it once
                waited = max(0.0, next_beat - time.monotonic())
                events = dict(poller.poll(waited * 1000))
                if monitor is not None and monitor in events:
                    event, value = monitor_event(monitor)
                    if event == zmq.EVENT_CONNECTED:
                        # this end's address, which the scheduler's gate sees as the peer's:
                        # told with the heartbeats, so a closed connection names its node
                        self._conn = auth.address_of(value, peer=False)
                        next_beat = time.monotonic()  # say it now
                    elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        failed = 0
                    elif not registered and not refused:
                        # a refused key fails every try (~0.1 s apart); one failure alone
                        # may be a connection lost mid-handshake (reset, or one that met
                        # itself: a port of the ephemeral range that nobody listens on yet
                        # can connect to itself), tried again here: after a protocol error
                        # ZeroMQ does not reconnect by itself
                        failed += 1
                        if failed >= _REFUSALS:
                            refused = True  # ZeroMQ retries; say it once
                            peer.send_multipart(encode(_key_refused(cfg)))
                        else:
                            log.info("handshake with the scheduler failed; connecting again")
                            sock.disconnect(self.address)  # (what it held is gone)
                            sock.connect(self.address)
                            sock.send_multipart(register, zmq.NOBLOCK)
                if sock in events:
                    frames = sock.recv_multipart()
                    silence.heard(time.monotonic())
                    msg = decode(frames)
                    if cfg.verbose and msg.kind != "heartbeat":
                        log.info("%s from the scheduler", msg.kind)
                    if msg.kind == "book":
                        registered = True
                        if self.tracer is not None:
                            self.tracer.rank = msg.body["rank"]
                    if msg.kind != "heartbeat":
                        peer.send_multipart(frames)
                if peer in events:
                    frames = peer.recv_multipart()
                    msg = decode(frames)
                    if msg.kind == "command" and msg.body["name"] == "stop":
                        return
                    finalizing |= msg.kind == "finalize"
                    if cfg.verbose:
                        log.info("%s to the scheduler", msg.kind)
                    sock.send_multipart(frames)
        finally:
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close()
            peer.close(linger=0)

    def _heartbeat_body(self) -> dict:
        body = {"conn": self._conn} if self._conn else {}
        if self.metrics is None:
            return body
        try:
            return {**body, "m": self.metrics.snapshot()}
        except Exception:  # counters are worth less than the heartbeat itself
            log.exception("metrics snapshot failed; heartbeats go on without metrics")
            self.metrics = None
            return {}


_STALL = 0.1  # s: a turn of the link's loop this much later than its poll allowed: a stall


class Silence:
    """How long the scheduler has been silent while this link's thread could hear it.

    :meth:`turn` at the top of each turn of the link's loop, with the longest the previous
    turn's poll could wait: a turn later than that by more than :data:`_STALL` means this
    process was not running (stopped, frozen, starved of CPU). The scheduler's silence
    meanwhile says nothing (it answers the next heartbeat, perhaps with ``fenced``), so that
    time is not counted: a node paused for a moment neither blames the scheduler nor stops.
    :meth:`heard` when the scheduler's message arrives.
    """

    def __init__(self, now: float):
        self.last_heard = self.last_turn = now

    def turn(self, now: float, waited: float) -> float:
        """The silence counted until ``now``."""
        stalled = now - self.last_turn - waited
        if stalled > _STALL:
            self.last_heard = min(now, self.last_heard + stalled)
        self.last_turn = now
        return now - self.last_heard

    def heard(self, now: float) -> None:
        self.last_heard = now


def resolve_scheduler(cfg: Config, sleep=time.sleep, clock=time.monotonic) -> str:
    """The scheduler's IP address: DMLC_PS_ROOT_URI itself when it is one, else the name
    resolved with getaddrinfo, retried (0.1 s doubling to 2 s apart) until the start-up
    deadline (KVSTORE_START_TIMEOUT): a Kubernetes headless service's record appears only
    once the scheduler's pod is ready. Then a :class:`PeerLostError` naming the host.

    >>> resolve_scheduler(Config.from_env({...}))  # doctest: +SKIP
    '10.244.1.7'
    """
    host = cfg.root_uri
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        return f"[{ip}]" if ip.version == 6 else str(ip)
    except ValueError:
        pass
    started = clock()
    delay, tries = 0.1, 0
    while True:
        tries += 1
        try:
            found = socket.getaddrinfo(host, cfg.root_port, type=socket.SOCK_STREAM)
            v4 = [a[4][0] for a in found if a[0] == socket.AF_INET]
            v6 = [a[4][0] for a in found if a[0] == socket.AF_INET6]
            if v4 or v6:
                if tries > 1:
                    log.info("scheduler host %r resolved after %.1fs", host, clock() - started)
                return v4[0] if v4 else f"[{v6[0]}]"
            error = "no IPv4 or IPv6 address"
        except OSError as exc:
            error = exc.strerror or str(exc)
        left = started + cfg.start_timeout - clock()
        if left <= 0:
            raise PeerLostError(
                f"cannot resolve the scheduler's host {host!r} (DMLC_PS_ROOT_URI): waited "
                f"{clock() - started:.1f}s, {tries} tries (KVSTORE_START_TIMEOUT="
                f"{cfg.start_timeout:g}s); last error: {error}"
            )
        if tries == 1:
            log.info("scheduler host %r does not resolve yet (%s); retrying", host, error)
        sleep(min(delay, left))
        delay = min(2.0, delay * 2)


def _scheduler_failed(cfg: Config, silent: float) -> Message:
    node = f"scheduler ({cfg.root_uri}:{cfg.root_port})"
    reason = f"the scheduler sent nothing for {silent:.1f}s"
    return Message("node_failed", 0, "control", {"node": node, "reason": reason})


_REFUSALS = 3  # handshakes failed in a row that mean the scheduler refuses this key
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _key_refused(cfg: Config) -> Message:
    node = f"scheduler ({cfg.root_uri}:{cfg.root_port})"
    reason = (
        "it refused this process's key: every process of a job needs the same KVSTORE_SECRET "
        "(launch.py gives its processes one; started by hand, export the same value "
        "everywhere), or KVSTORE_INSECURE=1 everywhere"
    )
    return Message("node_failed", 0, "control", {"node": node, "reason": reason, "auth": True})


def raise_for(msg: Message, what: str) -> None:
    """Turn an error or failure notice into a :class:`KVStoreError` (a lost peer: a
    :class:`PeerLostError`; a refused key: an :class:`AuthError`); ignore anything else."""
    if msg.kind == "error":
        raise KVStoreError(f"{what}: {msg.body['message']}")
    if msg.kind == "node_failed":
        kind = AuthError if msg.body.get("auth") else PeerLostError
        raise kind(f"{what}: {msg.body['node']} failed: {msg.body['reason']}")
    if msg.kind == "shutdown":
        raise PeerLostError(f"{what}: the scheduler ended the job")
    if msg.kind == "fenced":
        raise PeerLostError(f"{what}: {msg.body['reason']}")
