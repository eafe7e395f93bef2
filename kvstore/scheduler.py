"""The scheduler: registration, rank assignment, barriers, heartbeats, shutdown.

One :class:`Scheduler` owns one ROUTER socket and runs one poll loop. It waits for exactly
``DMLC_NUM_SERVER`` servers and ``DMLC_NUM_WORKER`` workers, gives each a rank (the launcher's
``KVSTORE_RANK`` when every node of a role has a distinct one, else sorted by host and port,
or host and pid for workers) and the address book, then answers heartbeats and
barriers. A node silent for ``KVSTORE_HEARTBEAT_TIMEOUT`` is declared dead: every other node is
told which one (role, rank, address) and the job ends with status 1. When every worker has
finalised, the servers are told to shut down and the scheduler exits 0.

Heartbeats carry each node's counters (:mod:`kvstore.metrics`); the scheduler keeps the latest
per node and, unless ``KVSTORE_STATUS_PORT=0``, publishes a view of the job to its HTTP
endpoint (:mod:`kvstore.status`: the status page and ``/metrics``), which runs in its own
threads and never blocks this loop.

Run it alone with ``DMLC_ROLE=scheduler ... python -m kvstore.scheduler``.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import zmq

from . import auth, status, transport
from . import metrics as node_metrics
from .config import Config, bind_host, setup_logging, warn_if_insecure
from .errors import EXIT_CONFIG, EXIT_FAILED, EXIT_PEER_LOST
from .protocol import Message, ProtocolError, decode, error_reply, request_id

log = logging.getLogger("kvstore.scheduler")

_GROUPS = {"worker": ("worker",), "server": ("server",), "all": ("worker", "server")}


@dataclass
class Node:
    identity: bytes
    role: str
    host: str
    port: int
    pid: int
    last_seen: float
    rank_hint: int = -1
    rank: int = -1
    finalized: bool = False
    cred: str = ""  # a worker's token or a node's CURVE public key (see kvstore.auth)
    failed: str = ""  # why it failed, once it has
    metrics: dict | None = None  # its counters, from its last heartbeat (kvstore.metrics)

    @property
    def name(self) -> str:
        where = f"{self.host}:{self.port}" if self.port else f"{self.host} pid {self.pid}"
        return f"{self.role} {self.rank if self.rank >= 0 else '?'} ({where})"


class Scheduler:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.status: status.StatusServer | None = None  # started once the port is bound
        self.gate = None
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
        self.nodes: dict[bytes, Node] = {}
        self.started = time.monotonic()
        self.ready = False
        self.barriers: dict[str, dict] = {}  # group -> {"ids": {identity: request id}, "t0"}
        # kind -> handler(node, msg) for registered nodes; may return the exit status
        self.handlers = {
            "heartbeat": self._on_heartbeat,
            "barrier": self._barrier,
            "finalize": self._finalize,
            "failed": self._on_failed,
            "stalled": self._on_stalled,
            "join": self._on_join,
            "joined_ack": self._on_joined_ack,
        }
        self.failure = ""  # what failed the job (a deadlock): later failures are its result
        self.joined: dict[int, bytes] = {}  # worker rank -> its join request, in join order
        self.join_acks = 0  # servers' acks of the joins so far
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

    # ---- sending
    def _send(self, identity: bytes, msg: Message) -> None:
        if self.cfg.verbose >= 2:
            log.debug("send %s to %s", msg.kind, identity)
        try:
            transport.send(self.sock, msg, route=identity)
        except zmq.ZMQError as exc:  # gone, or not reading (queue full): never wait for it
            log.info("could not send %s to %r: %s", msg.kind, identity, exc.strerror)

    def _error(self, identity, request, text) -> None:
        log.warning("%s", text)
        self._send(identity, error_reply(request, "scheduler", text))

    def _broadcast(self, msg: Message, roles=("worker", "server"), skip=None) -> None:
        for node in self.nodes.values():
            if node.role in roles and node.identity != skip:
                self._send(node.identity, msg)

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
        tick = max(0.005, self.cfg.heartbeat_interval / 4)
        while True:
            events = dict(poller.poll(tick * 1000))
            if self.gate is not None and self.gate.sock in events:
                self.gate.handle()
            if self.gate is not None and self.gate.monitor in events:
                self.gate.handle_event()
            for _ in range(64 if self.sock in events else 0):
                try:
                    identity, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                status = self._handle(identity, frames)
                if status is not None:
                    return status
            status = self._check_deadlines()
            if status is not None:
                return status
            if self.status is not None and time.monotonic() >= self._next_view:
                self.publish()

    def publish(self, ended: str = "") -> None:
        """Hand the status page a fresh view of the job (plain data; a reference swap)."""
        now = time.monotonic()
        self._next_view = now + status.PUBLISH_EVERY
        try:
            self.status.publish(status.job_view(self, now, ended))
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

    def workers_by_rank(self) -> dict[int, Node]:
        return {n.rank: n for n in self.nodes.values() if n.role == "worker"}

    def _handle(self, identity: bytes, frames) -> int | None:
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            bad = Message("error", request_id(frames))
            self._error(identity, bad, f"scheduler: bad message from {identity!r:.60}: {exc}")
            return None
        try:
            return self._dispatch(identity, msg)
        except Exception as exc:  # the scheduler never dies of what a peer sent
            log.exception("scheduler: %s from %r failed", msg.kind, identity)
            self._error(identity, msg, f"scheduler: {msg.kind} refused: {type(exc).__name__}")
            return None

    def _dispatch(self, identity: bytes, msg: Message) -> int | None:
        if self.cfg.verbose >= 2:
            log.debug("recv %s from %s", msg.kind, msg.sender or identity)
        node = self.nodes.get(identity)
        if node is not None:
            node.last_seen = time.monotonic()
        if msg.kind == "register":
            self._register(identity, msg)
            return None
        if node is None:
            self._error(
                identity,
                msg,
                f"scheduler: {msg.kind} from an unregistered node {msg.sender!r}; register first",
            )
            return None
        handler = self.handlers.get(msg.kind)
        if handler is None:
            self._error(identity, msg, f"scheduler: unexpected {msg.kind} from {node.name}")
            return None
        return handler(node, msg)

    def _on_heartbeat(self, node: Node, msg: Message) -> None:
        if self.cfg.verbose:
            log.info("heartbeat from %s", node.name)
        if "m" in msg.body:
            try:
                node.metrics = node_metrics.clean(msg.body["m"])
            except ValueError as exc:  # counters are never worth a refused heartbeat
                if node.metrics is not None or self.cfg.verbose:
                    log.warning("bad metrics from %s: %s", node.name, exc)
                node.metrics = None
        self._send(node.identity, Message("heartbeat", msg.id, "scheduler"))

    def _on_join(self, node: Node, msg: Message) -> None:
        if node.role != "worker" or node.rank in self.joined:
            return self._error(node.identity, msg, f"scheduler: unexpected join from {node.name}")
        self.joined[node.rank] = msg.id
        if self.cfg.verbose:
            log.info("join: %s (%d/%d)", node.name, len(self.joined), self.cfg.num_worker)
        joined = Message("worker_joined", 0, "scheduler", {"rank": node.rank})
        self._broadcast(joined, roles=("server",))
        self._barrier_check()  # a joined worker counts as arrived in a worker barrier

    def _on_joined_ack(self, node: Node, msg: Message) -> None:
        self.join_acks += 1
        self._join_check()

    def _join_check(self) -> None:
        """Let the joined workers go once every worker has joined or finished, and every
        server has taken note of every join."""
        if not self.joined or self.join_acks < len(self.joined) * self.cfg.num_server:
            return
        workers = {n.rank: n for n in self.nodes.values() if n.role == "worker"}
        if any(r not in self.joined and not n.finalized for r, n in workers.items()):
            return
        last = list(self.joined)[-1]
        for rank, req_id in self.joined.items():
            self._send(
                workers[rank].identity, Message("join_done", req_id, "scheduler", {"last": last})
            )
        self.joined, self.join_acks = {}, 0

    def _register(self, identity: bytes, msg: Message) -> None:
        b = msg.body
        if (b["num_server"], b["num_worker"]) != (self.cfg.num_server, self.cfg.num_worker):
            return self._error(
                identity,
                msg,
                (
                    f"scheduler: {b['role']} at {b['host']} belongs to a different job: it expects "
                    f"{b['num_server']} servers and {b['num_worker']} workers, this scheduler "
                    f"{self.cfg.num_server} and {self.cfg.num_worker} (DMLC_NUM_SERVER/WORKER)"
                ),
            )
        if b["role"] not in ("server", "worker"):
            return self._error(identity, msg, f"scheduler: cannot register role {b['role']!r}")
        if identity in self.nodes:
            return self._error(
                identity, msg, f"scheduler: duplicate registration from {self.nodes[identity].name}"
            )
        wanted = self.cfg.num_server if b["role"] == "server" else self.cfg.num_worker
        have = sum(n.role == b["role"] for n in self.nodes.values())
        if self.ready or have >= wanted:
            return self._error(
                identity,
                msg,
                (
                    f"scheduler: too many {b['role']}s: {b['role']} at {b['host']} pid {b['pid']} "
                    f"arrived but all {wanted} have registered (DMLC_NUM_"
                    f"{'SERVER' if b['role'] == 'server' else 'WORKER'}={wanted})"
                ),
            )
        hint, cred = b.get("rank_hint", -1), b.get("cred", "")
        needed = not self.cfg.insecure and (b["role"] == "worker" or self.cfg.encrypt)
        if not isinstance(cred, str) or len(cred) > 128 or (needed and not cred):
            return self._error(identity, msg, "scheduler: registration without a credential")
        self.nodes[identity] = Node(
            identity,
            b["role"],
            b["host"],
            b["port"],
            b["pid"],
            time.monotonic(),
            hint if type(hint) is int else -1,
            cred=cred,
        )
        log.info(
            "registered %s at %s:%d (%d/%d %ss)",
            b["role"],
            b["host"],
            b["port"],
            have + 1,
            wanted,
            b["role"],
        )
        if len(self.nodes) == self.cfg.num_server + self.cfg.num_worker:
            self._send_book()

    def _send_book(self) -> None:
        for role in ("server", "worker"):
            members = [n for n in self.nodes.values() if n.role == role]
            if sorted(n.rank_hint for n in members) == list(range(len(members))):
                members.sort(key=lambda n: n.rank_hint)  # the launcher's numbering
            else:
                members.sort(key=lambda n: (n.host, n.port, n.pid))
            for rank, node in enumerate(members):
                node.rank = rank
        servers = sorted(
            (n for n in self.nodes.values() if n.role == "server"), key=lambda n: n.rank
        )
        book = [[n.host, n.port] for n in servers]
        workers = sorted(
            (n for n in self.nodes.values() if n.role == "worker"), key=lambda n: n.rank
        )
        # Servers learn every worker's credential, workers the servers' public keys (CURVE).
        creds = {
            "server": {"workers": [n.cred for n in workers]},
            "worker": {"server_keys": [n.cred for n in servers]},
        }
        for node in self.nodes.values():
            body = {
                "rank": node.rank,
                "servers": book,
                "num_server": self.cfg.num_server,
                "num_worker": self.cfg.num_worker,
                **creds[node.role],
            }
            self._send(node.identity, Message("book", 0, "scheduler", body))
        self.ready = True
        log.info("all %d nodes registered; address book sent", len(self.nodes))

    def _barrier(self, node: Node, msg: Message) -> None:
        group = msg.body["group"]
        if group not in _GROUPS or node.role not in _GROUPS[group]:
            return self._error(
                node.identity,
                msg,
                f"scheduler: {node.name} cannot join "
                f"barrier group {group!r} (valid: worker, server, all)",
            )
        done = [n.name for n in self.nodes.values() if n.role in _GROUPS[group] and n.finalized]
        if done:
            return self._error(
                node.identity,
                msg,
                f"barrier({group}): {', '.join(done)} finished (closed its store) without "
                "reaching this barrier, so it can never complete",
            )
        state = self.barriers.setdefault(group, {"ids": {}, "t0": time.monotonic()})
        state["ids"][node.identity] = msg.id
        if self.cfg.verbose:
            log.info("barrier(%s): %s arrived (%d)", group, node.name, len(state["ids"]))
        self._barrier_check()

    def _barrier_check(self) -> None:
        """Complete the barriers every member has reached (a joined worker counts as there);
        fail at once those a finished member can never reach."""
        joined = {
            n.identity for n in self.nodes.values() if n.role == "worker" and n.rank in self.joined
        }
        for group, state in list(self.barriers.items()):
            members = [n for n in self.nodes.values() if n.role in _GROUPS[group]]
            absent = [n for n in members if n.identity not in state["ids"]]
            gone = [n.name for n in absent if n.finalized]
            if gone:
                del self.barriers[group]
                for identity, req_id in state["ids"].items():
                    self._error(
                        identity,
                        Message("barrier", req_id),
                        f"barrier({group}): {', '.join(gone)} finished (closed its store) "
                        "without reaching this barrier, so it can never complete",
                    )
            elif all(n.identity in joined for n in absent):
                del self.barriers[group]
                for identity, req_id in state["ids"].items():
                    done = Message("barrier_done", req_id, "scheduler", {"group": group})
                    self._send(identity, done)

    def _doing(self, node: Node) -> str:
        if node.finalized:
            return "has finished"
        if node.rank in self.joined:
            return "has joined"
        if any(node.identity in b["ids"] for b in self.barriers.values()):
            return "waits in barrier()"
        return "is in no call the scheduler knows of"

    def _on_stalled(self, server: Node, msg: Message) -> None:
        """A server's round waits. Fail it at once when the wait is a certain deadlock (a
        missing worker waits in a barrier that a worker blocked on this round never reaches);
        else report it, every KVSTORE_STALL_REPORT seconds, to the log and to the workers
        that wait on it."""
        b = msg.body
        workers = {n.rank: n for n in self.nodes.values() if n.role == "worker"}
        if server.role != "server" or not all(
            type(r) is int and r in workers for r in [*b["missing"], *b["waiting"]]
        ):
            return self._error(server.identity, msg, "scheduler: bad stall report")
        what = f"dist_sync round {b['round']} of key {b['key']} on {server.name}"
        in_barrier = [r for r in b["missing"] if self._doing(workers[r]) == "waits in barrier()"]
        stuck = [r for r in b["waiting"] if self._doing(workers[r]) != "waits in barrier()"]
        if in_barrier and stuck:
            text = (
                f"deadlock: {what} waits for worker(s) {in_barrier} to push, but they wait in "
                f"barrier() for worker(s) {stuck}, which wait for this round: every worker "
                "must push a key the same number of times before a barrier"
            )
            log.error("%s", text)
            self.failure = self.failure or text
            self._send(
                server.identity,
                Message("fail_round", 0, "scheduler", {"key": b["key"], "message": text}),
            )
            self._fail_barriers(text)
            self._note_stall(what, b, text)
            return None
        now = time.monotonic()
        parts = []
        for rank, silent in zip(b["missing"], b["silent"], strict=False):
            node = workers[rank]
            since = f"silent on this key for {silent:.0f}s" if silent >= 0 else "never pushed it"
            parts.append(
                f"worker {rank} {since}, {self._doing(node)}, last heartbeat "
                f"{now - node.last_seen:.1f}s ago"
            )
        deadline = (
            f"fails after KVSTORE_ROUND_TIMEOUT={self.cfg.round_timeout:g}s"
            if self.cfg.round_timeout > 0
            else "no deadline: set KVSTORE_ROUND_TIMEOUT to fail it"
        )
        text = (
            f"stall: {what} has waited {b['age']:.0f}s for worker(s) {b['missing']} "
            f"(pushed by {b['present']}): {'; '.join(parts)} ({deadline})"
        )
        self._note_stall(what, b, text)
        if b["age"] < self.cfg.stall_report or not self.cfg.stall_report:
            return None
        log.warning("%s", text)
        for rank in b["waiting"]:
            self._send(workers[rank].identity, Message("stall", 0, "scheduler", {"message": text}))
        return None

    def _note_stall(self, what: str, report: dict, text: str) -> None:
        """Keep a stall report for the status page, with the waiting workers' call counts:
        it shows until one of them gets further."""
        now = time.monotonic()
        if what not in self.stalls:
            self.stalls_seen += 1
            if len(self.stalls) >= 100:  # keep the newest
                del self.stalls[min(self.stalls, key=lambda k: self.stalls[k]["at"])]
        workers = self.workers_by_rank()
        calls = {
            rank: sum(workers[rank].metrics["calls"].values()) if workers[rank].metrics else 0
            for rank in report["waiting"]
        }
        first = self.stalls.get(what, {}).get("first", time.time())
        self.stalls[what] = {
            "text": text,
            "age": float(report["age"]),
            "at": now,
            "first": first,
            "calls": calls,
        }

    def _fail_barriers(self, text: str) -> None:
        for group, state in list(self.barriers.items()):
            del self.barriers[group]
            for identity, req_id in state["ids"].items():
                self._send(identity, error_reply(Message("barrier", req_id), "scheduler", text))

    def _on_failed(self, node: Node, msg: Message) -> int:
        """A node ends with an error (an uncaught exception): every other node is told who
        and why, once, and the job ends."""
        self._send(node.identity, Message("ack", msg.id, "scheduler"))
        reason = f"it {msg.body['reason'][:500]}"
        node.failed = reason
        if self.failure:  # a result of the failure the others were told about: end quietly
            log.info("%s stopped: %s", node.name, reason)
            return self._finalize_quietly(node)
        log.error("node failed: %s failed: %s", node.name, reason)
        failure = Message("node_failed", 0, "scheduler", {"node": node.name, "reason": reason})
        self._broadcast(failure, skip=node.identity)
        return EXIT_FAILED  # the worker's own error (its exit status says more)

    def _finalize_quietly(self, node: Node) -> int | None:
        node.finalized = True
        if all(n.finalized for n in self.nodes.values() if n.role == "worker"):
            self._broadcast(Message("shutdown", 0, "scheduler"), roles=("server",))
            return EXIT_FAILED  # after a deadlock
        return None

    def _finalize(self, node: Node, msg: Message) -> int | None:
        node.finalized = True
        self._send(node.identity, Message("ack", msg.id, "scheduler"))
        log.info("%s finished", node.name)
        self._barrier_check()  # a barrier this node never reached fails now, not at a deadline
        self._join_check()
        if node.role == "worker":  # its servers can fail rounds it will never join, at once
            done = Message("worker_done", 0, "scheduler", {"rank": node.rank})
            self._broadcast(done, roles=("server",))
        workers = [n for n in self.nodes.values() if n.role == "worker"]
        if self.ready and all(n.finalized for n in workers):
            log.info("all workers finished; shutting servers down")
            self._broadcast(Message("shutdown", 0, "scheduler"), roles=("server",))
            return EXIT_FAILED if self.failure else 0
        return None

    def _check_deadlines(self) -> int | None:
        now = time.monotonic()
        if not self.ready and now - self.started > self.cfg.start_timeout:
            missing = []
            for role, wanted in (("server", self.cfg.num_server), ("worker", self.cfg.num_worker)):
                have = sum(n.role == role for n in self.nodes.values())
                if have < wanted:
                    missing.append(f"{have} of {wanted} {role}s")
            text = (
                f"start-up timed out after {self.cfg.start_timeout:g}s "
                f"(KVSTORE_START_TIMEOUT): only {' and '.join(missing)} registered with "
                f"the scheduler at {self.cfg.root_uri}:{self.cfg.root_port}"
            )
            log.error("%s", text)
            self._broadcast(
                Message("node_failed", 0, "scheduler", {"node": "scheduler", "reason": text})
            )
            return EXIT_PEER_LOST  # a node that never came may come on a retry
        for node in self.nodes.values():
            if not node.finalized and now - node.last_seen > self.cfg.heartbeat_timeout:
                reason = (
                    f"{node.name} sent no heartbeat for {now - node.last_seen:.1f}s "
                    f"(KVSTORE_HEARTBEAT_TIMEOUT={self.cfg.heartbeat_timeout:g}s): "
                    "it died or hangs"
                )
                node.failed = reason
                log.error("node failed: %s", reason)
                self._broadcast(
                    Message("node_failed", 0, "scheduler", {"node": node.name, "reason": reason}),
                    skip=node.identity,
                )
                return EXIT_PEER_LOST
        for group, state in list(self.barriers.items()) if self.cfg.round_timeout > 0 else ():
            if now - state["t0"] > self.cfg.round_timeout:
                arrived = set(state["ids"])
                absent = [
                    n.name
                    for n in self.nodes.values()
                    if n.role in _GROUPS[group] and n.identity not in arrived
                ]
                del self.barriers[group]
                for identity, req_id in state["ids"].items():
                    self._error(
                        identity,
                        Message("barrier", req_id),
                        (
                            f"barrier({group}) timed out after {self.cfg.round_timeout:g}s "
                            f"(KVSTORE_ROUND_TIMEOUT): {', '.join(absent)} never arrived"
                        ),
                    )
        return None


def main() -> int:
    try:
        cfg = Config.from_env()
    except ValueError as exc:
        print(f"kvstore.scheduler: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(cfg.verbose, "scheduler")
    warn_if_insecure(cfg, log)
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
