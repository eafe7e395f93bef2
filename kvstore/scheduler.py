"""The scheduler: registration, rank assignment, barriers, heartbeats, shutdown.

What the scheduler decides lives in :mod:`kvstore.membership` (no I/O: events in, actions
out); this module is its driver. One :class:`Scheduler` owns one ROUTER socket and runs one
poll loop: it hands each message and the time to the state machine and carries out the
actions it returns (send, broadcast, log, exit). The job waits for exactly
``DMLC_NUM_SERVER`` servers and ``DMLC_NUM_WORKER`` workers, ranks them (the launcher's hints
when they form 0..n-1, else sorted by host, port and pid) and sends the address book, then
answers heartbeats, barriers and joins. A node silent for ``KVSTORE_HEARTBEAT_TIMEOUT`` is
declared dead: every other node is told which one (role, rank, address) and the job ends.
When every worker has finalised, the servers are told to shut down and the scheduler exits 0.

Heartbeats carry each node's counters (:mod:`kvstore.metrics`); the driver keeps the latest
per node and, unless ``KVSTORE_STATUS_PORT=0``, publishes a view of the job (the state
machine's snapshot and those counters) to its HTTP endpoint (:mod:`kvstore.status`: the status
page and ``/metrics``), which runs in its own threads and never blocks this loop.

Run it alone with ``DMLC_ROLE=scheduler ... python -m kvstore.scheduler``.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import time

import zmq

from . import auth, status, transport
from . import metrics as node_metrics
from .config import Config, bind_host, setup_logging, warn_if_insecure
from .cpu import batch
from .errors import EXIT_CONFIG, EXIT_FAILED
from .membership import Broadcast, Exit, Log, Membership, Send, StallSeen
from .protocol import Message, ProtocolError, decode, error_reply, request_id

log = logging.getLogger("kvstore.scheduler")


class Scheduler:
    """The driver of :class:`~kvstore.membership.Membership`: its socket, its loop, and the
    actions it returns carried out."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.status: status.StatusServer | None = None  # started once the port is bound
        self.gate = None
        self._peers: dict[str, bytes] = {}  # a node's connection (host:port) -> node
        if not cfg.insecure:
            self.gate = auth.Gate(self.ctx, "scheduler")
            self.gate.allow_job(cfg)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # control messages only
        auth.scheduler_socket(self.sock, cfg)
        try:
            # a name (Kubernetes: a headless service's, resolvable only once this pod is
            # ready) or another machine's address: listen on every interface
            self.sock.bind(f"tcp://{bind_host(cfg.root_uri)}:{cfg.root_port}")
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(
                f"scheduler cannot listen on {cfg.root_uri}:{cfg.root_port}: "
                f"{exc.strerror}; pick a free DMLC_PS_ROOT_PORT (launch.py --port)"
            ) from None
        self.members = Membership(cfg, time.monotonic())
        # action type -> what carries it out; an Exit ends the loop once the rest are done
        self.actions = {
            Send: lambda a: self._send(a.identity, a.message),
            Broadcast: self._broadcast,
            Log: lambda a: log.log(a.level, "%s", a.text),
            StallSeen: self._note_stall,
            Exit: lambda a: None,
        }
        self.metrics: dict[bytes, dict] = {}  # identity -> its counters, from its last heartbeat
        self.stalls: dict[str, dict] = {}  # round shown -> its last stall report, for the page
        self.stalls_seen = 0
        self._next_view = 0.0
        if cfg.status_port != 0:
            try:
                self.status = status.StatusServer(cfg)
                log.info("status page at %s", self.status.url)
            except OSError as exc:  # the job matters more than its page
                log.error(
                    "status page: cannot listen on %s:%d: %s (KVSTORE_STATUS_PORT, "
                    "KVSTORE_STATUS_ADDR); the job runs without it",
                    cfg.status_addr,
                    max(cfg.status_port, 0),
                    exc.strerror,
                )

    def close(self) -> None:
        if self.status is not None:
            self.status.close()
        if self.gate is not None:
            self.gate.close()
        self.sock.close()
        self.ctx.term()

    # ---- carrying out actions
    def _execute(self, actions: list) -> int | None:
        """Carry out ``actions`` in order; the status of an :class:`Exit` among them."""
        exit_status = None
        for action in actions:
            self.actions[type(action)](action)
            if isinstance(action, Exit) and exit_status is None:
                exit_status = action.status
        return exit_status

    def _send(self, identity: bytes, msg: Message) -> None:
        if self.cfg.verbose >= 2:
            log.debug("send %s to %s", msg.kind, identity)
        try:
            transport.send(self.sock, msg, route=identity)
        except zmq.ZMQError as exc:  # gone, or not reading (queue full): never wait for it
            log.info("could not send %s to %r: %s", msg.kind, identity, exc.strerror)

    def _broadcast(self, action: Broadcast) -> None:
        for identity in self.members.identities(action.roles, action.skip):
            self._send(identity, action.message)

    def _note_stall(self, action: StallSeen) -> None:
        """Keep a stall report for the status page, with the waiting workers' call counts:
        it shows until one of them gets further."""
        what, report = action.what, action.report
        now = time.monotonic()
        if what not in self.stalls:
            self.stalls_seen += 1
            if len(self.stalls) >= 100:  # keep the newest
                del self.stalls[min(self.stalls, key=lambda k: self.stalls[k]["at"])]
        by_rank = {
            n["rank"]: self.metrics.get(n["identity"])
            for n in self.members.snapshot(now)["nodes"]
            if n["role"] == "worker"
        }
        calls = {
            rank: sum(by_rank[rank]["calls"].values()) if by_rank.get(rank) else 0
            for rank in report["waiting"]
        }
        first = self.stalls.get(what, {}).get("first", time.time())
        self.stalls[what] = {
            "text": action.text,
            "age": float(report["age"]),
            "at": now,
            "first": first,
            "calls": calls,
        }

    # ---- the loop
    def run(self) -> int:
        """Serve until the job ends; returns the process exit status."""
        log.info(
            "scheduler listening on %s:%d for %d servers and %d workers",
            self.cfg.root_uri,
            self.cfg.root_port,
            self.cfg.num_server,
            self.cfg.num_worker,
        )
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.gate is not None:
            poller.register(self.gate.sock, zmq.POLLIN)
            poller.register(self.gate.watch(self.sock), zmq.POLLIN)
        pipe = _launcher_pipe()
        if pipe is not None:
            poller.register(pipe, zmq.POLLIN)
        tick = max(0.005, self.cfg.heartbeat_interval / 4)
        while True:
            events = dict(poller.poll(tick * 1000))
            if pipe is not None and pipe in events and not os.read(pipe, 4096):
                poller.unregister(pipe)
                return self._execute(self.members.launcher_gone())
            if self.gate is not None and self.gate.sock in events:
                self.gate.handle()
            if self.gate is not None and self.gate.monitor in events:
                self.gate.handle_event()
                self._closed_connections()
            for _ in range(64 if self.sock in events else 0):
                try:
                    identity, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                exit_status = self._handle(identity, frames)
                if exit_status is not None:
                    return exit_status
            exit_status = self._execute(self.members.tick(time.monotonic()))
            if exit_status is not None:
                return exit_status
            if self.status is not None and time.monotonic() >= self._next_view:
                self.publish()

    def publish(self, ended: str = "") -> None:
        """Hand the status page a fresh view of the job (plain data; a reference swap)."""
        now = time.monotonic()
        self._next_view = now + status.PUBLISH_EVERY
        try:
            view = status.job_view(
                self.members.snapshot(now),
                self.metrics,
                self.stalls,
                self.stalls_seen,
                self.cfg,
                now,
                ended,
            )
            self.status.publish(view)
        except Exception:  # the page is never worth the job
            log.exception("status page: building the view failed; the page stops here")
            self.status.close()
            self.status = None

    def linger(self, exit_status: int) -> None:
        """Show the job's end on the status page; after a failure keep serving it for
        KVSTORE_STATUS_LINGER seconds, so the failed node can be seen."""
        if self.status is None:
            return
        self.publish("finished" if exit_status == 0 else "failed")
        if exit_status and self.cfg.status_linger > 0:
            log.info("status page stays up %gs (KVSTORE_STATUS_LINGER)", self.cfg.status_linger)
            time.sleep(self.cfg.status_linger)

    def _closed_connections(self) -> None:
        """A node's connection closed (a killed process closes its sockets): suspect it, so
        that its silence fails it after two heartbeat intervals, not the full timeout."""
        now = time.monotonic()
        for address in self.gate.closed:
            identity = self._peers.pop(address, None)
            if identity is not None:
                self.members.suspect(identity, now)
        self.gate.closed.clear()

    def _handle(self, identity: bytes, frames) -> int | None:
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            text = f"scheduler: bad message from {identity!r:.60}: {exc}"
            log.warning("%s", text)
            self._send(
                identity, error_reply(Message("error", request_id(frames)), "scheduler", text)
            )
            return None
        if self.cfg.verbose >= 2:
            log.debug("recv %s from %s", msg.kind, msg.sender or identity)
        try:
            if msg.kind == "heartbeat" and identity in self.members.nodes:
                self._keep_metrics(identity, msg)
                conn = msg.body.get("conn")
                if (
                    isinstance(conn, str)
                    and conn != "?"
                    and len(conn) < 80
                    and len(self._peers) < 100_000
                ):
                    self._peers[conn] = identity
            return self._execute(self.members.receive(identity, msg, time.monotonic()))
        except Exception as exc:  # the scheduler never dies of what a peer sent
            log.exception("scheduler: %s from %r failed", msg.kind, identity)
            text = f"scheduler: {msg.kind} refused: {type(exc).__name__}"
            log.warning("%s", text)
            self._send(identity, error_reply(msg, "scheduler", text))
            return None

    def _keep_metrics(self, identity: bytes, msg: Message) -> None:
        if "m" not in msg.body:
            return
        try:
            self.metrics[identity] = node_metrics.clean(msg.body["m"])
        except ValueError as exc:  # counters are never worth a refused heartbeat
            if self.metrics.get(identity) is not None or self.cfg.verbose:
                log.warning("bad metrics from %s: %s", self.members.name(identity), exc)
            self.metrics[identity] = None


def _launcher_pipe() -> int | None:
    """Started by launch.py (``KVSTORE_LAUNCHER_PIPE=1``): stdin, the launcher's pipe, which
    closes when the launcher is gone. Anything else on stdin (a terminal, /dev/null: the
    variable leaked into a scheduler started by hand) is not watched."""
    if os.environ.get("KVSTORE_LAUNCHER_PIPE") != "1":
        return None
    try:
        if stat.S_ISFIFO(os.fstat(0).st_mode):
            return 0
    except OSError:  # no stdin at all
        pass
    log.warning("KVSTORE_LAUNCHER_PIPE=1 but stdin is not launch.py's pipe: not watched")
    return None


def main() -> int:
    try:
        cfg = Config.from_env()
    except ValueError as exc:
        print(f"kvstore.scheduler: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(cfg.verbose, "scheduler")
    warn_if_insecure(cfg, log)
    batch(cfg.sched_batch)
    try:
        scheduler = Scheduler(cfg)
    except OSError as exc:  # the port is taken: permanent
        log.error("%s", exc)
        print(f"kvstore.scheduler: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        exit_status = scheduler.run()
        scheduler.linger(exit_status)
        return exit_status
    finally:
        scheduler.close()


if __name__ == "__main__":
    sys.exit(main())
