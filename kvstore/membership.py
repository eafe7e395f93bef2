"""The scheduler's side without I/O: who is in the job, their ranks, barriers, joins, deadlines.

:class:`Membership` is fed what the nodes send (``receive``: a decoded message and the
identity of the connection it came on) and the time (``tick``); each call returns the actions
to carry out, in order: :class:`Send` a message to one node, :class:`Broadcast` one to every
node of some roles, :class:`Log` a line, :class:`StallSeen` (a stall report, for the status
page), :class:`Exit` the scheduler with a status. Nothing here reads a clock, draws a random
number or touches a socket: ``now`` comes in with every event, so the tests drive it with
events alone (``tests/test_membership.py``, against a plain model). The driver,
:mod:`kvstore.scheduler`, owns the socket and executes the actions.

- Registration waits for exactly ``num_server`` servers and ``num_worker`` workers; a node of
  another job, a duplicate, one too many or one without its credential is refused. When all
  have come, each role is ranked (the launcher's hints when they form 0..n-1, else sorted by
  host, port and pid) and every node gets the address book.
- Every node has a heartbeat deadline; the first node to miss it fails the job (once). With
  ``KVSTORE_REPLICAS`` > 1 a server that misses it (or fails) is failed over instead, while a
  live replica of each of its parts is left: the epoch goes up and every node hears
  ``failover`` (the dead servers, the epoch); the server acting for a dead one's parts is the
  first live one of its chain (:func:`kvstore.sharding.replicas`). A failed-over server that
  speaks again (it was frozen) is told ``fenced`` and exits.
- Barriers per group (``worker``, ``server``, ``all``): complete once every member arrived (a
  joined worker counts as arrived); fail at once when a member finished without arriving, and
  after ``KVSTORE_ROUND_TIMEOUT`` when one is set. A barrier or join that has waited a second
  is reported to the workers waiting in it (``stall``), which restart their deadline.
- ``join``: the joined workers go on once every worker has joined or finished and every server
  has acknowledged every join.

>>> from kvstore.config import Config
>>> m = Membership(Config("scheduler", "127.0.0.1", 9091, 1, 1, "127.0.0.1", insecure=True), 0.0)
>>> reg = {"role": "server", "host": "h", "port": 1, "pid": 9, "num_server": 1, "num_worker": 1}
>>> [type(a).__name__ for a in m.receive(b"s", Message("register", 0, "server", reg), 0.1)]
['Log']
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .errors import EXIT_FAILED, EXIT_PEER_LOST
from .protocol import Message, error_reply
from .sharding import acting, replicas

GROUPS = {"worker": ("worker",), "server": ("server",), "all": ("worker", "server")}
ROLES = ("worker", "server")
STALL_FIRST = 1.0  # seconds a barrier or join waits before the waiting workers hear why


# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class Send:
    identity: bytes
    message: Message


@dataclass(frozen=True)
class Broadcast:
    """Send ``message`` to every registered node of ``roles`` but ``skip``."""

    message: Message
    roles: tuple = ROLES
    skip: bytes | None = None


@dataclass(frozen=True)
class Log:
    level: int
    text: str


@dataclass(frozen=True)
class StallSeen:
    """A server's round waits (for the status page): ``what`` names it, ``report`` is the
    server's report, ``text`` what the scheduler made of it."""

    what: str
    report: dict
    text: str


@dataclass(frozen=True)
class Exit:
    status: int


# ---------------------------------------------------------------- state


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
    left: bool = False  # an elastic job's worker that is gone (its slot may be taken again)
    store: str = ""  # a worker's store type (kvstore.create's kind, dist_ssp's bound)

    @property
    def name(self) -> str:
        where = f"{self.host}:{self.port}" if self.port else f"{self.host} pid {self.pid}"
        return f"{self.role} {self.rank if self.rank >= 0 else '?'} ({where})"


@dataclass
class _Wait:
    """A barrier of one group, or the job's join, under way."""

    started: float
    ids: dict  # identity -> request id, in arrival order
    next_report: float = 0.0  # when the waiting workers hear of it next
    next_log: float = 0.0  # when the scheduler logs it next


class Membership:
    """Registration, ranks, heartbeats, barriers and joins of one job."""

    def __init__(self, cfg, now: float):
        self.cfg = cfg
        self.started = now
        self.nodes: dict[bytes, Node] = {}
        self.ready = False
        self.barriers: dict[str, _Wait] = {}
        self.joined: dict[int, int] = {}  # worker rank -> its join request, in join order
        self.join_wait: _Wait | None = None
        self.join_acks: set = set()  # (server rank, worker rank): a server took note of a join
        self.failure = ""  # what failed the job (a deadlock): later failures are its result
        self.exited: int | None = None  # the status of the Exit returned, once one was
        self._round_logs: dict[str, float] = {}  # a stalled round -> when it is logged next
        self.epoch = 0  # one more at every failover
        self.dead: list[int] = []  # the ranks of the servers failed over, in order
        self.failover_epoch = 0  # the epoch of the last failover (a newcomer's book says)
        self.history: list[dict] = []  # the failovers: epoch, server, why (the status page)
        self.chains: list = []  # server rank -> the servers holding its parts (from the book)
        # elastic workers (KVSTORE_MIN_WORKERS): slots 0..num_worker-1, each held by at most one
        # live worker; every change of who holds them is an epoch of its own
        self.elastic = bool(getattr(cfg, "min_workers", 0))
        self.enough_since: float | None = None  # when MIN workers had registered (start-up)
        self.short_since: float | None = None  # when fewer than MIN were left (running)
        # elastic slots whose last holder finished (until a newcomer takes one): they count
        # toward MIN, each once
        self.finished: set[int] = set()
        self.queued: list = []  # (identity, register message, since): newcomers for a full job
        self.suspects: dict[bytes, float] = {}  # node -> when its connection closed
        self.handlers = {
            "heartbeat": self._on_heartbeat,
            "barrier": self._on_barrier,
            "finalize": self._on_finalize,
            "failed": self._on_failed,
            "stalled": self._on_stalled,
            "join": self._on_join,
            "joined_ack": self._on_joined_ack,
            "replica_lost": self._on_replica_lost,
        }

    # ---- cadences
    @property
    def report_every(self) -> float:
        """Seconds between stall reports to waiting workers: often enough that a worker
        waiting KVSTORE_TIMEOUT hears one before it gives up, at most every
        KVSTORE_STALL_REPORT seconds."""
        return report_every(self.cfg)

    # ---- events
    def receive(self, identity: bytes, msg: Message, now: float) -> list:
        """A message from the connection ``identity``."""
        node = self.nodes.get(identity)
        if node is not None:
            node.last_seen = now
        if msg.kind == "register":
            return self._register(identity, msg, now)
        if node is None and any(i == identity for i, _, _ in self.queued):
            return []  # a newcomer waiting for a slot: its heartbeats need no answer yet
        if node is None:
            return _refuse(
                identity,
                msg,
                f"scheduler: {msg.kind} from an unregistered node {msg.sender!r}; register first",
            )
        if node.role == "server" and node.rank in self.dead:
            return self._fence(node)
        if node.left and node.failed:  # an elastic job's worker that was given up on
            text = (
                f"{node.name} was taken out of the job ({node.failed}); its slot may be another "
                "worker's now: it must exit (the launcher starts a fresh one)"
            )
            return [Send(node.identity, Message("fenced", 0, "scheduler", {"reason": text}))]
        handler = self.handlers.get(msg.kind)
        if handler is None:
            return _refuse(identity, msg, f"scheduler: unexpected {msg.kind} from {node.name}")
        return self._done(handler(node, msg, now))

    def tick(self, now: float) -> list:
        """Deadlines: start-up, heartbeats, barriers; stall reports of barriers and joins."""
        if self.exited is not None:
            return []
        return self._done(self._check_deadlines(now) or self._report_waits(now))

    # ---- what the status page and the driver read
    def name(self, identity: bytes) -> str:
        return self.nodes[identity].name

    def identities(self, roles=ROLES, skip: bytes | None = None) -> list[bytes]:
        return [
            n.identity
            for n in self.nodes.values()
            if n.role in roles
            and n.identity != skip
            and not (n.role == "server" and n.failed)
            and not n.left
        ]

    def doing(self, rank: int) -> str:
        """What worker ``rank`` does, as far as the scheduler knows."""
        return self._doing(self._workers()[rank])

    def snapshot(self, now: float) -> dict:
        """The job as plain data (the status page's view)."""
        in_barrier = {i for wait in self.barriers.values() for i in wait.ids}
        nodes = []
        for node in self.nodes.values():
            nodes.append(
                {
                    "identity": node.identity,
                    "role": node.role,
                    "rank": node.rank,
                    "host": node.host,
                    "port": node.port,
                    "pid": node.pid,
                    "finalized": node.finalized,
                    "failed": node.failed,
                    "left": node.left,
                    "joined": node.role == "worker" and node.rank in self.joined,
                    "in_barrier": node.identity in in_barrier,
                    "heartbeat_age": now - node.last_seen,
                }
            )
        return {
            "ready": self.ready,
            "uptime": now - self.started,
            "failure": self.failure,
            "nodes": nodes,
            "barriers": {
                g: sorted(self.nodes[i].rank for i in w.ids) for g, w in self.barriers.items()
            },
            "joined": list(self.joined),
            "epoch": self.epoch,
            "failovers": [h for h in self.history if "server" in h],
            "membership": [h for h in self.history if "worker" in h],
        }

    # ---- registration
    def _register(self, identity: bytes, msg: Message, now: float) -> list:
        b = msg.body
        cfg = self.cfg
        if (b["num_server"], b["num_worker"]) != (cfg.num_server, cfg.num_worker):
            return _refuse(
                identity,
                msg,
                f"scheduler: {b['role']} at {b['host']} belongs to a different job: it expects "
                f"{b['num_server']} servers and {b['num_worker']} workers, this scheduler "
                f"{cfg.num_server} and {cfg.num_worker} (DMLC_NUM_SERVER/WORKER)",
            )
        if b["role"] not in ROLES:
            return _refuse(identity, msg, f"scheduler: cannot register role {b['role']!r}")
        if identity in self.nodes:
            node = self.nodes[identity]
            if (node.role, node.host, node.port, node.pid) == (
                b["role"],
                b["host"],
                b["port"],
                b["pid"],
            ):  # the same registration again: its link to the scheduler was tried again
                # after a handshake failed, and the first had arrived (control.py)
                return [Log(logging.INFO, f"{node.name} registered again: the same, ignored")]
            return _refuse(identity, msg, f"scheduler: duplicate registration from {node.name}")
        wanted = cfg.num_server if b["role"] == "server" else cfg.num_worker
        have = sum(n.role == b["role"] and not n.left for n in self.nodes.values())
        if self.elastic and b["role"] == "worker" and (self.ready or have < wanted):
            return self._register_elastic(identity, msg, now, have)
        if self.ready or have >= wanted:
            return _refuse(
                identity,
                msg,
                f"scheduler: too many {b['role']}s: {b['role']} at {b['host']} pid {b['pid']} "
                f"arrived but all {wanted} have registered (DMLC_NUM_"
                f"{'SERVER' if b['role'] == 'server' else 'WORKER'}={wanted})",
            )
        wrong = self._other_store(b)
        if wrong:
            return _refuse(identity, msg, wrong)
        hint, cred = b.get("rank_hint", -1), b.get("cred", "")
        needed = not cfg.insecure and (b["role"] == "worker" or cfg.encrypt)
        if not isinstance(cred, str) or len(cred) > 128 or (needed and not cred):
            return _refuse(identity, msg, "scheduler: registration without a credential")
        self.nodes[identity] = Node(
            identity,
            b["role"],
            b["host"],
            b["port"],
            b["pid"],
            now,
            hint if type(hint) is int else -1,
            cred=cred,
            store=b.get("store") if isinstance(b.get("store"), str) else "",
        )
        actions: list = [
            Log(
                logging.INFO,
                f"registered {b['role']} at {b['host']}:{b['port']} "
                f"({have + 1}/{wanted} {b['role']}s)",
            )
        ]
        if len(self.nodes) == cfg.num_server + cfg.num_worker:
            actions += self._send_book()
        return actions

    def _send_book(self) -> list:
        for role in ROLES:
            members = [n for n in self.nodes.values() if n.role == role and not n.left]
            if sorted(n.rank_hint for n in members) == list(range(len(members))):
                members.sort(key=lambda n: n.rank_hint)  # the launcher's numbering
            else:
                members.sort(key=lambda n: (n.host, n.port, n.pid))
            for rank, node in enumerate(members):
                node.rank = rank
        servers = self._ranked("server")
        workers = self._ranked("worker")
        book = [[n.host, n.port] for n in servers]
        # Servers learn every worker's credential and the other servers' (their replication
        # links), workers the servers' public keys (CURVE only: a token is never handed on).
        public = self.cfg.encrypt
        creds = {
            "server": {"workers": [n.cred for n in workers], "peers": [n.cred for n in servers]},
            "worker": {"server_keys": [n.cred if public else "" for n in servers]},
        }
        hosts = [n.host for n in servers]
        count = self.cfg.replicas
        self.chains = [replicas(s, len(servers), count, hosts) for s in range(len(servers))]
        actions: list = []
        for node in self.nodes.values():
            body = {
                "rank": node.rank,
                "servers": book,
                "num_server": self.cfg.num_server,
                "num_worker": self.cfg.num_worker,
                "replicas": self.chains if count > 1 else None,
                **creds[node.role],
            }
            if self.elastic:
                body["present"], body["epoch"] = self._present(), self.epoch
                if node.role == "server":  # a slot nobody holds yet: no credential
                    body["workers"] = [self._cred_of(r) for r in range(self.cfg.num_worker)]
            actions.append(Send(node.identity, Message("book", 0, "scheduler", body)))
        self.ready = True
        actions.append(
            Log(logging.INFO, f"all {len(self.nodes)} nodes registered; address book sent")
        )
        return actions

    # ---- heartbeats
    def suspect(self, identity: bytes, now: float) -> None:
        """The node's connection closed: unless it speaks again within two heartbeat
        intervals (ZeroMQ reconnects a live one), it is dead (a frozen process keeps its
        connection, and is found by the heartbeat timeout)."""
        if identity in self.nodes:
            self.suspects[identity] = now

    def _on_heartbeat(self, node: Node, msg: Message, now: float) -> list:
        actions: list = []
        if self.cfg.verbose:
            actions.append(Log(logging.INFO, f"heartbeat from {node.name}"))
        actions.append(Send(node.identity, Message("heartbeat", msg.id, "scheduler")))
        return actions

    # ---- barriers
    def _on_barrier(self, node: Node, msg: Message, now: float) -> list:
        group = msg.body["group"]
        if group not in GROUPS or node.role not in GROUPS[group]:
            return _refuse(
                node.identity,
                msg,
                f"scheduler: {node.name} cannot join "
                f"barrier group {group!r} (valid: worker, server, all)",
            )
        done = [
            n.name
            for n in self.nodes.values()
            if n.role in GROUPS[group] and n.finalized and not n.left
        ]
        if done:
            return _refuse(
                node.identity,
                msg,
                f"barrier({group}): {', '.join(done)} finished (closed its store) without "
                "reaching this barrier, so it can never complete",
            )
        wait = self.barriers.get(group)
        if wait is None:
            wait = self.barriers[group] = _Wait(now, {}, now + STALL_FIRST, now + self._log_every)
        wait.ids[node.identity] = msg.id
        actions: list = []
        if self.cfg.verbose:
            actions.append(
                Log(logging.INFO, f"barrier({group}): {node.name} arrived ({len(wait.ids)})")
            )
        return actions + self._barrier_check()

    def _barrier_check(self) -> list:
        """Complete the barriers every member has reached (a joined worker counts as there);
        fail at once those a finished member can never reach."""
        actions: list = []
        for group, wait in list(self.barriers.items()):
            absent = self._absent(group, wait)
            gone = [n.name for n in absent if n.finalized]
            if gone:
                del self.barriers[group]
                for identity, req_id in wait.ids.items():
                    actions += _refuse(
                        identity,
                        Message("barrier", req_id),
                        f"barrier({group}): {', '.join(gone)} finished (closed its store) "
                        "without reaching this barrier, so it can never complete",
                    )
            elif all(self._has_joined(n) for n in absent):
                del self.barriers[group]
                for identity, req_id in wait.ids.items():
                    done = Message("barrier_done", req_id, "scheduler", {"group": group})
                    actions.append(Send(identity, done))
        return actions

    def _absent(self, group: str, wait: _Wait) -> list[Node]:
        return [
            n
            for n in self.nodes.values()
            if n.role in GROUPS[group] and n.identity not in wait.ids and not n.left
        ]

    def _fail_barriers(self, text: str) -> list:
        actions: list = []
        for group, wait in list(self.barriers.items()):
            del self.barriers[group]
            for identity, req_id in wait.ids.items():
                actions.append(
                    Send(identity, error_reply(Message("barrier", req_id), "scheduler", text))
                )
        return actions

    # ---- joins
    def _on_join(self, node: Node, msg: Message, now: float) -> list:
        if node.role != "worker" or node.rank in self.joined:
            return _refuse(node.identity, msg, f"scheduler: unexpected join from {node.name}")
        self.joined[node.rank] = msg.id
        if self.join_wait is None:
            self.join_wait = _Wait(now, {}, now + STALL_FIRST, now + self._log_every)
        self.join_wait.ids[node.identity] = msg.id
        actions: list = []
        if self.cfg.verbose:
            actions.append(
                Log(
                    logging.INFO,
                    f"join: {node.name} ({len(self.joined)}/{self.cfg.num_worker})",
                )
            )
        joined = Message("worker_joined", 0, "scheduler", {"rank": node.rank})
        actions.append(Broadcast(joined, roles=("server",)))
        return actions + self._barrier_check()  # a joined worker counts as arrived

    def _on_joined_ack(self, node: Node, msg: Message, now: float) -> list:
        self.join_acks.add((node.rank, msg.body.get("rank")))
        return self._join_check()

    def _acks_missing(self) -> int:
        """Acknowledgements of the joins still due from live servers (a server failed over
        owes none)."""
        servers = [n.rank for n in self._ranked("server") if n.rank not in self.dead]
        return sum((s, r) not in self.join_acks for s in servers for r in self.joined)

    def _join_check(self) -> list:
        """Let the joined workers go once every worker has joined or finished, and every
        live server has taken note of every join."""
        if not self.joined or self._acks_missing():
            return []
        workers = self._workers()
        if any(r not in self.joined and not n.finalized for r, n in workers.items()):
            return []
        last = list(self.joined)[-1]
        actions: list = [
            Send(workers[rank].identity, Message("join_done", req_id, "scheduler", {"last": last}))
            for rank, req_id in self.joined.items()
        ]
        self.joined, self.join_acks, self.join_wait = {}, set(), None
        return actions

    # ---- the end of a node
    def _on_finalize(self, node: Node, msg: Message, now: float) -> list:
        if self.elastic and node.role == "worker" and self.ready:
            ack = Send(node.identity, Message("ack", msg.id, "scheduler"))
            return [ack, Log(logging.INFO, f"{node.name} finished")] + self._worker_left(
                node, "it finished", now
            )
        node.finalized = True
        actions: list = [
            Send(node.identity, Message("ack", msg.id, "scheduler")),
            Log(logging.INFO, f"{node.name} finished"),
        ]
        actions += self._barrier_check()  # a barrier it never reached fails now
        actions += self._join_check()
        if node.role == "worker":  # its servers can fail rounds it will never join, at once
            done = Message("worker_done", 0, "scheduler", {"rank": node.rank})
            actions.append(Broadcast(done, roles=("server",)))
        if self.ready and all(n.finalized for n in self._workers().values()):
            actions.append(Log(logging.INFO, "all workers finished; shutting servers down"))
            actions.append(Broadcast(Message("shutdown", 0, "scheduler"), roles=("server",)))
            actions.append(Exit(EXIT_FAILED if self.failure else 0))
        return actions

    def _on_failed(self, node: Node, msg: Message, now: float) -> list:
        """A node ends with an error (an uncaught exception): every other node is told who
        and why, once, and the job ends."""
        actions: list = [Send(node.identity, Message("ack", msg.id, "scheduler"))]
        reason = f"it {msg.body['reason'][:500]}"
        node.failed = reason
        if self.failure:  # a result of the failure the others were told about: end quietly
            actions.append(Log(logging.INFO, f"{node.name} stopped: {reason}"))
            node.finalized = True
            if all(n.finalized for n in self._workers().values()):
                shutdown = Message("shutdown", 0, "scheduler")
                actions += [Broadcast(shutdown, roles=("server",)), Exit(EXIT_FAILED)]
            return actions
        if self._can_fail_over(node):
            return actions + self._fail_over(node, reason)
        if self.elastic and node.role == "worker" and self.ready:
            return actions + self._worker_left(node, f"failed: {reason}", now)
        actions.append(Log(logging.ERROR, f"node failed: {node.name} failed: {reason}"))
        failure = Message("node_failed", 0, "scheduler", {"node": node.name, "reason": reason})
        actions.append(Broadcast(failure, skip=node.identity))
        actions.append(Exit(EXIT_FAILED))  # the worker's own error (its exit status says more)
        return actions

    # ---- stalls
    def _doing(self, node: Node) -> str:
        if node.finalized:
            return "has finished"
        if node.role == "worker" and node.rank in self.joined:
            return "has joined"
        if any(node.identity in wait.ids for wait in self.barriers.values()):
            return "waits in barrier()"
        return "is in no call the scheduler knows of"

    def _on_stalled(self, server: Node, msg: Message, now: float) -> list:
        """A server's round waits. Fail it at once when the wait is a certain deadlock (a
        missing worker waits in a barrier that a worker blocked on this round never reaches);
        else pass it on to the workers that wait on it, and log it every
        KVSTORE_STALL_REPORT seconds."""
        b = msg.body
        workers = self._workers()
        if server.role != "server" or not all(
            type(r) is int and r in workers for r in [*b["missing"], *b["waiting"]]
        ):
            return _refuse(server.identity, msg, "scheduler: bad stall report")
        mode = "dist_ssp" if b.get("clocks") is not None else "dist_sync"
        what = f"{mode} round {b['round']} of key {b['key']} on {server.name}"
        in_barrier = [r for r in b["missing"] if self._doing(workers[r]) == "waits in barrier()"]
        stuck = [r for r in b["waiting"] if self._doing(workers[r]) != "waits in barrier()"]
        if in_barrier and stuck:
            text = (
                f"deadlock: {what} waits for worker(s) {in_barrier} to push, but they wait in "
                f"barrier() for worker(s) {stuck}, which wait for this round: every worker "
                "must push a key the same number of times before a barrier"
            )
            came = self._newcomers()
            new = [r for r in stuck if r in came]
            if new:  # a replacement that ran its script from the start
                text += (
                    f"; worker(s) {new} came mid-job (epoch {came[new[0]]}) and started the "
                    "script over: an elastic job's script goes on from the others' state "
                    "(kvstore.elastic; README, Elastic workers)"
                )
            self.failure = self.failure or text
            fail = Message("fail_round", 0, "scheduler", {"key": b["key"], "message": text})
            return [
                Log(logging.ERROR, text),
                Send(server.identity, fail),
                *self._fail_barriers(text),
                StallSeen(what, b, text),
            ]
        parts = []
        came = self._newcomers()
        for rank, silent in zip(b["missing"], b["silent"], strict=False):
            node = workers[rank]
            since = f"silent on this key for {silent:.0f}s" if silent >= 0 else "never pushed it"
            new = f", a newcomer (epoch {came[rank]})" if rank in came else ""
            parts.append(
                f"worker {rank}{new} {since}, {self._doing(node)}, last heartbeat "
                f"{now - node.last_seen:.1f}s ago"
            )
        text = (
            f"stall: {what} has waited {b['age']:.0f}s for worker(s) {b['missing']} "
            f"(pushed by {b['present']}): {'; '.join(parts)} ({self._deadline()})"
        )
        if any(rank in came for rank in b["missing"]):
            text += (
                "; a newcomer waiting in another key's round may have come in a round apart "
                "there (README, Elastic workers: known limits): kvstore.elastic's reset avoids it"
            )
        clocks = b.get("clocks")
        behind = [r for r in workers if r not in self.joined]
        if (
            isinstance(clocks, list)
            and len(clocks) == len(workers)
            and all(type(c) is int for c in clocks)
            and b["waiting"]
            and behind
        ):
            # dist_ssp: the waiting workers are held back by the bound, not by a sync round
            slowest = min(behind, key=clocks.__getitem__)
            ahead = ", ".join(f"worker {r} at clock {clocks[r]}" for r in b["waiting"])
            text = (
                f"stall: dist_ssp holds back {ahead} on key {b['key']} ({server.name}): "
                f"the slowest, worker {slowest}, is at clock {clocks[slowest]} and the bound is "
                f"KVSTORE_STALENESS={b.get('staleness')}; {'; '.join(parts)} "
                f"({self._deadline()})"
            )
        actions: list = [StallSeen(what, b, text)]
        every = self.cfg.stall_report
        logged = bool(every and b["age"] >= every and now >= self._round_logs.get(what, 0.0))
        if logged:
            self._round_logs[what] = now + every
            if len(self._round_logs) > 1000:  # forget the oldest rounds
                del self._round_logs[next(iter(self._round_logs))]
            actions.append(Log(logging.WARNING, text))
        # the server reports at the waiting workers' cadence: each report keeps them waiting;
        # the workers log it (a warning) only when the scheduler does
        stall = Message("stall", 0, "scheduler", {"message": text, "log": logged})
        actions += [Send(workers[rank].identity, stall) for rank in b["waiting"]]
        return actions

    def _newcomers(self) -> dict:
        """{slot: the epoch its holder came}: the slots taken after the start."""
        came = {}
        for change in self.history:
            if "worker" in change:
                if change["why"] == "joined":
                    came[change["worker"]] = change["epoch"]
                else:
                    came.pop(change["worker"], None)
        return came

    def _deadline(self) -> str:
        if self.cfg.round_timeout > 0:
            return f"fails after KVSTORE_ROUND_TIMEOUT={self.cfg.round_timeout:g}s"
        return "no deadline: set KVSTORE_ROUND_TIMEOUT to fail it"

    @property
    def _log_every(self) -> float:
        return self.cfg.stall_report or float("inf")

    def _report_waits(self, now: float) -> list:
        """Tell the workers in a barrier or a join that has waited STALL_FIRST seconds who it
        waits for, every ``report_every`` seconds; log it every KVSTORE_STALL_REPORT."""
        actions: list = []
        waits = [
            (f"barrier({g})", w, [n for n in self._absent(g, w) if not self._has_joined(n)])
            for g, w in self.barriers.items()
        ]
        if self.join_wait is not None:
            missing = [
                n for r, n in self._workers().items() if r not in self.joined and not n.finalized
            ]
            waits.append(("join()", self.join_wait, missing))
        for what, wait, absent in waits:
            if now < wait.next_report:
                continue
            wait.next_report = now + self.report_every
            text = self._wait_text(what, wait, absent, now)
            logged = now >= wait.next_log
            if logged:
                wait.next_log = now + self._log_every
                actions.append(Log(logging.WARNING, text))
            stall = Message("stall", 0, "scheduler", {"message": text, "log": logged})
            for identity in wait.ids:
                node = self.nodes[identity]
                if node.role == "worker" and not node.finalized:
                    actions.append(Send(identity, stall))
        return actions

    def _wait_text(self, what: str, wait: _Wait, absent: list[Node], now: float) -> str:
        parts = [
            f"{n.role} {n.rank} {self._doing(n)}, last heartbeat {now - n.last_seen:.1f}s ago"
            for n in absent
        ]
        if parts:
            ranks = ", ".join(f"{n.role} {n.rank}" for n in absent)
            text = f"stall: {what} has waited {now - wait.started:.0f}s for {ranks}: "
            text += "; ".join(parts)
        else:  # a join whose every worker came: the servers have yet to acknowledge it
            acks = self._acks_missing()
            text = (
                f"stall: {what} has waited {now - wait.started:.0f}s for {acks} "
                "acknowledgement(s) of the joins from the servers"
            )
        if what.startswith("barrier"):
            text += f" ({self._deadline()})"
        return text

    # ---- deadlines
    def launcher_gone(self) -> list:
        """The launcher that started this scheduler is gone (killed: nobody would stop or
        watch the job): end it, every node told why."""
        text = (
            "the launcher is gone (its pipe to the scheduler closed: was launch.py killed?): "
            "ending the job"
        )
        failed = Message("node_failed", 0, "scheduler", {"node": "scheduler", "reason": text})
        return [Log(logging.ERROR, text), Broadcast(failed), Exit(EXIT_PEER_LOST)]

    def _check_deadlines(self, now: float) -> list:
        cfg = self.cfg
        if self.elastic:
            started = self._elastic_deadlines(now)
            if started:
                return started
        if not self.ready and now - self.started > cfg.start_timeout:
            missing = []
            for role, wanted in (("server", cfg.num_server), ("worker", cfg.num_worker)):
                have = sum(n.role == role for n in self.nodes.values())
                if have < wanted:
                    missing.append(f"{have} of {wanted} {role}s")
            text = (
                f"start-up timed out after {cfg.start_timeout:g}s "
                f"(KVSTORE_START_TIMEOUT): only {' and '.join(missing)} registered with "
                f"the scheduler at {cfg.root_uri}:{cfg.root_port}"
            )
            failed = Message("node_failed", 0, "scheduler", {"node": "scheduler", "reason": text})
            # a node that never came may come on a retry
            return [Log(logging.ERROR, text), Broadcast(failed), Exit(EXIT_PEER_LOST)]
        for node in self.nodes.values():
            closed = self.suspects.get(node.identity)
            if closed is not None and node.last_seen > closed:
                del self.suspects[node.identity]  # it came back (a new connection): fine
                closed = None
            gone = closed is not None and now - closed > 2 * cfg.heartbeat_interval
            if not node.finalized and (gone or now - node.last_seen > cfg.heartbeat_timeout):
                self.suspects.pop(node.identity, None)
                reason = f"{node.name} sent no heartbeat for {now - node.last_seen:.1f}s " + (
                    "and its connection closed: it died"
                    if gone
                    else f"(KVSTORE_HEARTBEAT_TIMEOUT={cfg.heartbeat_timeout:g}s): it died or hangs"
                )
                if self._can_fail_over(node):
                    return self._fail_over(node, reason)
                if self.elastic and node.role == "worker" and self.ready:
                    return self._worker_left(node, reason, now)
                node.failed = reason
                failed = Message(
                    "node_failed", 0, "scheduler", {"node": node.name, "reason": reason}
                )
                return [
                    Log(logging.ERROR, f"node failed: {reason}"),
                    Broadcast(failed, skip=node.identity),
                    Exit(EXIT_PEER_LOST),
                ]
        actions: list = []
        for group, wait in list(self.barriers.items()) if cfg.round_timeout > 0 else ():
            if now - wait.started > cfg.round_timeout:
                absent = [n.name for n in self._absent(group, wait)]
                del self.barriers[group]
                for identity, req_id in wait.ids.items():
                    actions += _refuse(
                        identity,
                        Message("barrier", req_id),
                        f"barrier({group}) timed out after {cfg.round_timeout:g}s "
                        f"(KVSTORE_ROUND_TIMEOUT): {', '.join(absent)} never arrived",
                    )
        return actions

    # ---- failover (KVSTORE_REPLICAS > 1)
    def _can_fail_over(self, node: Node) -> bool:
        """Whether the job goes on without server ``node``: every server's parts keep a live
        replica (else the job fails as without replicas)."""
        if node.role != "server" or not self.ready or self.cfg.replicas < 2 or self.failure:
            return False
        dead = {*self.dead, node.rank}
        return all(acting(s, self.chains, dead) is not None for s in range(len(self.chains)))

    def _fail_over(self, node: Node, reason: str) -> list:
        """Server ``node`` is gone: a new epoch in which the next live replica of each of its
        parts answers for them; every live node hears it."""
        node.failed, node.finalized = reason, True  # no deadline of its again
        self.dead.append(node.rank)
        self.epoch += 1
        self.failover_epoch = self.epoch
        dead = set(self.dead)
        self.history.append({"epoch": self.epoch, "server": node.rank, "why": reason})
        body = {"epoch": self.epoch, "dead": list(self.dead), "reason": reason}
        moved = ", ".join(
            f"server {acting(s, self.chains, dead)} answers for server {s}" for s in sorted(dead)
        )
        return [
            Log(logging.WARNING, f"failover to epoch {self.epoch}: {reason}; {moved}"),
            Broadcast(Message("failover", 0, "scheduler", body), skip=node.identity),
            *self._join_check(),  # a join that waited for its acknowledgement goes on
        ]

    def _on_replica_lost(self, node: Node, msg: Message, now: float) -> list:
        """A primary could not keep a backup in step (it refused or could not be sent a
        forward): that backup is failed over like a dead one, so it never answers with a
        stale copy; if that would lose a part, the job ends."""
        rank, why = msg.body.get("server"), msg.body.get("reason", "")
        victim = next((n for n in self._ranked("server") if n.rank == rank), None)
        if node.role != "server" or victim is None or rank in self.dead:
            return []
        reason = f"{victim.name} fell out of step with {node.name}'s parts: {why}"
        if self._can_fail_over(victim):
            return self._fail_over(victim, reason)
        victim.failed = reason
        failed = Message("node_failed", 0, "scheduler", {"node": victim.name, "reason": reason})
        return [
            Log(logging.ERROR, f"node failed: {reason}"),
            Broadcast(failed),
            Exit(EXIT_PEER_LOST),
        ]

    def _fence(self, node: Node) -> list:
        """A server failed over speaks again (it was frozen, not dead): it must not serve."""
        epoch = next(h["epoch"] for h in self.history if h.get("server") == node.rank)
        text = (
            f"{node.name} was failed over in epoch {epoch} (its replicas answer for its keys "
            "now) and is fenced: it must exit"
        )
        return [Send(node.identity, Message("fenced", 0, "scheduler", {"reason": text}))]

    # ---- elastic workers (KVSTORE_MIN_WORKERS; launch.py -n MIN:MAX)
    ELASTIC_GRACE = 1.0  # seconds the start waits, once MIN workers came, for the others

    def _other_store(self, body: dict) -> str:
        """Why a worker registering with another store type than the job's workers is
        refused ("" when it is not): their rounds would follow other rules."""
        store = body.get("store")
        if body.get("role") != "worker" or not isinstance(store, str) or not store:
            return ""
        first = next((n.store for n in self.nodes.values() if n.role == "worker" and n.store), "")
        if not first or first == store:
            return ""
        return (
            f"scheduler: worker at {body.get('host')} pid {body.get('pid')} creates "
            f"kvstore.create({store!r}), but this job's workers use {first!r}: every worker "
            "must create the same store type (and dist_ssp bound)"
        )

    def _present(self) -> list[int]:
        return sorted(self._workers())

    def _cred_of(self, rank: int) -> str:
        node = self._workers().get(rank)
        return node.cred if node is not None else ""

    def _register_elastic(self, identity: bytes, msg: Message, now: float, have: int) -> list:
        """A worker of an elastic job: before the start, as any; after it, into a free slot
        (its hint when free, else the lowest), told the book, and announced to every node."""
        b = msg.body
        wrong = self._other_store(b)
        if wrong:
            return _refuse(identity, msg, wrong)
        cred = b.get("cred", "")
        if not isinstance(cred, str) or len(cred) > 128 or (not self.cfg.insecure and not cred):
            return _refuse(identity, msg, "scheduler: registration without a credential")
        if have >= self.cfg.num_worker:
            if not self.ready or any(i == identity for i, _, _ in self.queued):
                return _refuse(identity, msg, f"scheduler: duplicate registration from {b['host']}")
            # every slot is held: it waits for one to free (a replacement started before its
            # predecessor's silence was noticed), up to the start-up timeout
            self.queued.append((identity, msg, now))
            return [Log(logging.INFO, f"worker at {b['host']} pid {b['pid']} waits for a slot")]
        hint = b.get("rank_hint", -1)
        node = Node(identity, "worker", b["host"], b["port"], b["pid"], now, cred=cred)
        node.store = b.get("store") if isinstance(b.get("store"), str) else ""
        node.rank_hint = hint if type(hint) is int else -1
        self.nodes[identity] = node
        if not self.ready:
            return [Log(logging.INFO, f"registered worker at {b['host']} ({have + 1} workers)")]
        taken = set(self._workers()) - {-1}
        free = [r for r in range(self.cfg.num_worker) if r not in taken]
        node.rank = node.rank_hint if node.rank_hint in free else free[0]
        self.epoch += 1
        self.finished.discard(node.rank)  # (held again: counted as present)
        enough = len(taken) + 1 + len(self.finished) >= self.cfg.min_workers
        self.short_since = None if enough else self.short_since
        self.history.append({"epoch": self.epoch, "worker": node.rank, "why": "joined"})
        servers = self._ranked("server")
        book = {
            "rank": node.rank,
            "servers": [[n.host, n.port] for n in servers],
            "num_server": self.cfg.num_server,
            "num_worker": self.cfg.num_worker,
            "replicas": self.chains if self.cfg.replicas > 1 else None,
            "server_keys": [n.cred if self.cfg.encrypt else "" for n in servers],
            "present": self._present(),
            "epoch": self.epoch,
        }
        if self.dead:  # servers failed over before it came: it sends to their replicas
            book["failover"] = {"epoch": self.failover_epoch, "dead": list(self.dead)}
        change = {"epoch": self.epoch, "present": self._present(), "joined": node.rank}
        return [
            Log(logging.INFO, f"epoch {self.epoch}: {node.name} joined"),
            Broadcast(
                Message("members", 0, "scheduler", {**change, "cred": cred}), roles=("server",)
            ),
            Broadcast(Message("members", 0, "scheduler", change), roles=("worker",), skip=identity),
            Send(identity, Message("book", 0, "scheduler", book)),
        ]

    def _worker_left(self, node: Node, why: str, now: float) -> list:
        """A worker of a running elastic job is gone (finished, failed, silent): the others go
        on without it, in a new epoch; its slot is free for a newcomer."""
        node.left = node.finalized = True
        node.failed = "" if why == "it finished" else why
        if why == "it finished":
            self.finished.add(node.rank)
        else:
            self.finished.discard(node.rank)
        self.epoch += 1
        self.history.append({"epoch": self.epoch, "worker": node.rank, "why": why})
        present = self._present()
        change = {"epoch": self.epoch, "present": present, "left": node.rank, "why": why}
        level = logging.INFO if why == "it finished" else logging.WARNING
        actions: list = [
            Log(level, f"epoch {self.epoch}: {node.name} left ({why}); {len(present)} workers"),
            Broadcast(Message("members", 0, "scheduler", change)),
        ]
        actions += self._barrier_check()  # a barrier that waited for it completes now
        if self.queued:  # a newcomer waiting for a slot takes this one
            identity, msg, _ = self.queued.pop(0)
            return actions + self._register_elastic(identity, msg, now, len(present))
        if not present and why != "it finished":  # replacements may come: wait for them
            self.short_since = now if self.short_since is None else self.short_since
        elif not present:
            actions.append(Log(logging.INFO, "every worker has finished; shutting servers down"))
            actions.append(Broadcast(Message("shutdown", 0, "scheduler"), roles=("server",)))
            actions.append(Exit(EXIT_FAILED if self.failure else 0))
        elif len(present) + len(self.finished) < self.cfg.min_workers and self.short_since is None:
            self.short_since = now  # (a worker that finished did its part: not short of it)
        return actions

    def _elastic_deadlines(self, now: float) -> list:
        """Start once MIN workers (and every server) came and the others had a moment; while
        running, fewer than MIN for the start-up timeout is an error."""
        cfg = self.cfg
        if not self.ready:
            servers = sum(n.role == "server" for n in self.nodes.values())
            workers = len([n for n in self.nodes.values() if n.role == "worker"])
            if servers == cfg.num_server and workers >= cfg.min_workers:
                if self.enough_since is None:
                    self.enough_since = now
                if now - self.enough_since >= self.ELASTIC_GRACE:
                    return self._send_book()
            return []
        for entry in [q for q in self.queued if now - q[2] > cfg.start_timeout]:
            self.queued.remove(entry)
            identity, msg, _ = entry
            return _refuse(
                identity,
                msg,
                f"scheduler: all {cfg.num_worker} worker slots stayed taken for "
                f"{cfg.start_timeout:g}s (KVSTORE_START_TIMEOUT; launch.py -n MIN:"
                f"{cfg.num_worker}): this worker is not needed",
            )
        if self.short_since is not None and now - self.short_since > cfg.start_timeout:
            have = len(self._workers())
            if have + len(self.finished) >= cfg.min_workers:  # (none left training)
                left = f"no worker left training ({len(self.finished)} finished, the last failed)"
            else:
                left = (
                    f"only {have} worker(s) left"
                    + (f" and {len(self.finished)} finished" if self.finished else "")
                    + f", fewer than the {cfg.min_workers} this elastic job needs (launch.py -n "
                    f"{cfg.min_workers}:{cfg.num_worker})"
                )
            text = f"{left}, and no newcomer within {cfg.start_timeout:g}s (KVSTORE_START_TIMEOUT)"
            self.failure = text
            failed = Message("node_failed", 0, "scheduler", {"node": "scheduler", "reason": text})
            return [Log(logging.ERROR, text), Broadcast(failed), Exit(EXIT_PEER_LOST)]
        return []

    # ---- helpers
    def _done(self, actions: list) -> list:
        """Remember an Exit: the job has ended, and no deadline fails it again."""
        for action in actions:
            if isinstance(action, Exit) and self.exited is None:
                self.exited = action.status
        return actions

    def _has_joined(self, node: Node) -> bool:
        return node.role == "worker" and node.rank in self.joined

    def _workers(self) -> dict[int, Node]:
        return {n.rank: n for n in self.nodes.values() if n.role == "worker" and not n.left}

    def _ranked(self, role: str) -> list[Node]:
        return sorted((n for n in self.nodes.values() if n.role == role), key=lambda n: n.rank)


def report_every(cfg) -> float:
    """Seconds between stall reports to a waiting worker: at most KVSTORE_STALL_REPORT
    (0: never logged, still reported), and a third of KVSTORE_TIMEOUT, so a waiting worker
    hears one well before it gives up.

    >>> from types import SimpleNamespace
    >>> report_every(SimpleNamespace(stall_report=60.0, request_timeout=600.0))
    60.0
    >>> report_every(SimpleNamespace(stall_report=0.0, request_timeout=6.0))
    2.0
    """
    third = cfg.request_timeout / 3
    return min(cfg.stall_report, third) if cfg.stall_report else third


def _refuse(identity: bytes, request: Message, text: str) -> list:
    """Log a refusal and answer ``request`` with it."""
    return [
        Log(logging.WARNING, text),
        Send(identity, error_reply(request, "scheduler", text)),
    ]
