"""A server: one shard of the keys, its socket, and the update.

One :class:`Server` owns one ROUTER socket (the workers' DEALERs connect to it) and runs one
poll loop; its link to the scheduler runs in :class:`~kvstore.control.Control`. Keys on a
server are ``(key, part)`` pairs holding flat arrays (:mod:`kvstore.sharding` cuts them).

What a request means for the rounds (who waits for what, when a sum is complete) is decided
by :class:`~kvstore.rounds.Rounds`, which has no I/O: the server checks each request, hands it
over as an event, and carries out the actions that come back: apply a value (assign, add, or
the optimizer), answer a request, fail one.

Replies never block the loop. They go out through :func:`kvstore.transport.send` without
copying the stored arrays; while a reply still reads a stored array, an update writes a fresh
buffer instead of waiting. A peer whose queue is full loses that reply (logged once).

Run it alone with ``DMLC_ROLE=server ... python -m kvstore.server``.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import re
import secrets
import sys
import time
from dataclasses import dataclass

import numpy as np
import zmq

from . import auth, channel, metrics, rowsearch, shm, transport
from . import optimizer as opt
from .compression import Compression, PullCodes, packed_size
from .config import Config, bind_host, setup_logging, warn_if_insecure
from .control import Control
from .cpu import batch
from .errors import EXIT_AUTH, EXIT_CONFIG, EXIT_FAILED, EXIT_PEER_LOST, KVStoreError, exit_code_of
from .half import add
from .memory import trim, tune_allocator
from .protocol import (
    Message,
    ProtocolError,
    decode,
    encode_frames,
    error_reply,
    internal,
    request_id,
)
from .replication import Backup, Primary
from .rounds import Apply, Fail, Reply, Rounds
from .sharding import acting
from .sparse import (
    SparseKeys,
    bounds_of,
    check_init,
    check_optimizer,
    check_states,
    dump_states,
)

log = logging.getLogger("kvstore.server")


def _spec_difference(mine, first) -> str:
    """What differs between two optimizer specs, for an error: the name, or the params."""
    if not (isinstance(mine, dict) and isinstance(first, dict)) or (
        mine.get("name") != first.get("name")
    ):
        return f"{mine!r:.100} against {first!r:.100}"
    a, b = mine.get("params") or {}, first.get("params") or {}
    names = sorted((k for k in set(a) | set(b) if a.get(k) != b.get(k)), key=str)
    differ = ", ".join(f"{k}={a.get(k)!r} against {b.get(k)!r}" for k in names)
    return f"{mine.get('name')} with {differ[:200]}"


class Unchanged(ValueError):
    """A refusal that every server gives alike, before the request changes anything: the
    worker's store stays usable (its other refusals of a push, an init, an optimizer leave
    the servers apart, and fail it)."""


_WORKER_ID = re.compile(rb"worker-(0|[1-9][0-9]{0,8})")
_SERVER_ID = re.compile(rb"server-(0|[1-9][0-9]{0,8})")
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: no enum per call
_POLLOUT, _READABLE = int(zmq.POLLOUT), int(zmq.POLLIN | zmq.POLLERR)

# A str key that starts "kvt.root<r>." holds rank r's value alone: another rank's push counts
# as zeros, so what every worker pulls is r's bytes whatever the others push (kvstore.torch's
# broadcast_object unpickles it).
_ROOT_ONLY = re.compile(r"kvt\.root(0|[1-9][0-9]{0,8})\.")


def root_only(root: int) -> str:
    """The prefix of a key only ``root``'s pushes count for."""
    return f"kvt.root{root}."


@dataclass(eq=False)
class Request:
    """A worker's request that waits for key rounds before its reply."""

    identity: bytes
    msg: Message


class Server:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.gate = None if cfg.insecure else auth.Gate(self.ctx, "server")
        # its CURVE key pair, or (by default) a token: what it proves on replication links
        self.cred = auth.Credential.make(cfg)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if cfg.min_workers:  # elastic: a newcomer in a slot takes over its identity
            self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message)
        auth.server_socket(self.sock, cfg, self.cred)
        # Workers reach it at cfg.node_host; listen there only when that is an address of this
        # machine (loopback for a job on one machine), else on every interface (a pod's
        # address behind a name, a NAT)
        where = bind_host(cfg.node_host)
        try:
            if cfg.server_port:
                self.sock.bind(f"tcp://{where}:{cfg.server_port}")
                self.port = cfg.server_port
            else:
                self.port = self.sock.bind_to_random_port(f"tcp://{where}")
        except zmq.ZMQError as exc:
            self.close_sockets()
            raise OSError(
                f"server cannot listen on {where}:{cfg.server_port or '*'}: "
                f"{exc.strerror}; free the port or change KVSTORE_SERVER_PORT"
            ) from None
        try:
            self.control = Control(self.ctx, cfg, "server", self.port, self.cred.public)
        except KVStoreError:
            self.close_sockets()
            raise
        self.num_workers = cfg.num_worker
        self.stored: dict[tuple, np.ndarray] = {}  # (key, part) -> flat value
        self.sending: dict[tuple, list] = {}  # (key, part) -> sends still reading it
        self.pull_codes = PullCodes()  # compressed pulls: each round's sum quantised once
        self.rounds = Rounds(
            self.num_workers, cfg.round_timeout, describe=_show, reproducible=cfg.reproducible
        )
        self.updater: opt.Updater | None = None
        self.optimizer_spec: dict | None = None
        # set_optimizer call by call: per call (each worker's n-th), the first spec and who
        # set it; per worker, the calls it made (kvstore.server.Server._on_optimizer)
        self._optimizer_calls: list[tuple] = []
        self._optimizer_count: dict[int, int] = {}
        self.rank = -1
        self.name = "server"
        self._lost: set[bytes] = set()  # peers told once that they lose replies
        self._last_failure = ""
        self._peer_lost = ""  # a node's failure that failed every round: replies say so
        self._ranks: dict[bytes, int] = {}  # routing identity -> rank, parsed once
        self._segments: dict[str, shm.Segment] = {}  # same-host workers' shared buffers
        self._shm_of: dict[tuple, shm.Segment] = {}  # (rank, key) -> its segment
        self._names = [f"worker-{r}" for r in range(self.num_workers)]
        self._stall_reports: dict[str, tuple] = {}  # key shown -> (round, next report, key)
        # Default mode (kvstore.auth): a connection is served once it proves a rank's token.
        self._challenges: dict[str, str] = {}  # connection (its User-Id) -> open challenge
        self._roots: dict[tuple, int] = {}  # root-only keys (see root_only) -> their root
        self._proved: dict[int, str] = {}  # rank -> the connection that proved its token
        self._connection: tuple = ("", None)  # (User-Id, first frame) of the message in hand
        # same-host workers' channels (kvstore.channel): the listener, by file descriptor
        # every connection, by routing identity the proved ones (each its own identity,
        # ``worker-<rank>/channel-<n>``: a request is answered by the way it came), by rank
        # the secrets a hello gave (valid once the connection proved its token) and those
        # now valid
        self._listener: channel.Listener | None = None
        self._channels: dict[int, channel.Channel] = {}
        self._channel_of: dict[bytes, channel.Channel] = {}
        self._channel_count = 0
        self._unproved: dict[int, float] = {}  # fd -> when accepted (proved within 10 s)
        self._listening = True  # False for a tick after an accept failed (no busy loop)
        self._offered: dict[str, tuple] = {}  # connection -> (rank, secret), till its auth
        self._secrets: dict[int, str] = {}  # rank -> a secret its channel may prove, once
        self.handlers = {
            "init": self._on_init,
            "push": self._on_push,
            "pushpull": self._on_push,
            "pull": self._on_pull,
            "optimizer": self._on_optimizer,
            "command": self._on_command,
            "hello": self._on_hello,
            "auth": self._on_auth,
        }
        # KVSTORE_REPLICAS > 1 (kvstore.replication): the chains of servers holding each
        # server's parts, the links to this server's backups, what it forwards and holds
        self.chains: list | None = None
        self.epoch = 0
        self.dead: set[int] = set()
        self.primary = Primary()
        self.backup = Backup()
        self.backup_updaters: dict[int, opt.Updater] = {}  # home server -> its keys' updater
        # home server -> (the optimizer calls that updater reflects, its spec)
        self._home_specs: dict[int, tuple] = {}
        self._peers: dict[int, zmq.Socket] = {}  # backup rank -> DEALER to it
        self._peer_ready: dict[int, bool] = {}  # its link proved (default mode: hello, auth)
        self._backlog: dict[int, list] = {}  # forwards waiting for the link to be proved
        self._targets: dict[int, list] = {}  # home server -> the live backups to forward to
        self._peer_proved: dict[int, str] = {}  # server rank -> the connection that proved it
        self._pusher = None  # (rank, request id) of the push in hand (async forwards)
        self._deferred: list = []  # requests of a later epoch than this server has seen
        self.members_epoch = 0  # an elastic job's membership epoch, as this server knows it
        self._unsent: set = set()  # keys whose forward is noted but not yet sent
        self.rows = SparseKeys()  # row-sparse keys (kvstore.sparse)
        self._owned: dict = {}  # row-sparse key -> (low, high) of its range here; None: hashed
        self.handlers.update(
            {
                "sparse_init": self._on_sparse_init,
                "sparse_push": self._on_sparse_push,
                "sparse_pull": self._on_sparse_pull,
                "sparse_rows": self._on_sparse_pull,
                "sparse_load": self._on_sparse_load,
            }
        )
        self.control_handlers = {
            "worker_done": self._on_worker_done,
            "worker_joined": self._on_worker_joined,
            "fail_round": self._on_fail_round,
            "node_failed": self._on_node_failed,
            "shutdown": self._on_shutdown,
            "failover": self._on_failover,
            "members": self._on_members,
            "fenced": self._on_fenced,
        }

    # ---- life cycle
    def run(self) -> int:
        try:
            book = self.control.wait("server start-up", ("book",), self.cfg.start_timeout + 5)
        except KVStoreError as exc:
            log.error("%s", exc)
            return exit_code_of(exc)
        self.rank = book.body["rank"]
        self.name = f"server {self.rank} ({self.cfg.node_host}:{self.port})"
        if self.gate is not None:
            self.gate.name = self.name
            workers = book.body.get("workers")
            if not isinstance(workers, list) or len(workers) != self.num_workers:
                log.error("%s: the scheduler's book lacks the workers' credentials", self.name)
                return 1
            self.gate.allow_workers(self.cfg, workers)
            self.gate.allow_servers(self.cfg, book.body.get("peers") or [])
        if "present" in book.body:  # elastic: the slots nobody holds are out of every round
            for rank in set(range(self.num_workers)) - set(book.body["present"]):
                self.rounds.leave(rank, time.monotonic())
        poller = zmq.Poller()
        if book.body.get("replicas"):
            self._start_replicas(book.body, poller)
        log.info("%s ready for %d workers", self.name, self.num_workers)
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.control.pipe, zmq.POLLIN)
        self._poller = poller
        if self.cfg.shm and self.cfg.channel and shm.available():
            try:
                self._listener = channel.Listener()
                poller.register(self._listener.fd, zmq.POLLIN)
            except OSError as exc:  # workers on this host use TCP
                log.info("%s: no same-host channel (%s)", self.name, exc)
        if self.gate is not None:
            poller.register(self.gate.sock, zmq.POLLIN)
            poller.register(self.gate.watch(self.sock), zmq.POLLIN)
        tick = min(0.1, self.cfg.round_timeout / 4) if self.cfg.round_timeout > 0 else 0.1
        next_tick = time.monotonic() + tick
        while True:
            events = dict(poller.poll(tick * 1000))
            if self.gate is not None and self.gate.sock in events:
                self.gate.handle()
            if self.gate is not None and self.gate.monitor in events:
                self.gate.handle_event()
            if self.sock in events:
                for _ in range(64):  # drain a burst before looking at anything else
                    # asked before each read, not raised: a zmq.Again per wake-up costs more
                    # (pyzmq builds it with imports and enums) than a small request's handling
                    if not self.sock.getsockopt(_EVENTS) & _POLLIN:
                        break
                    try:
                        identity, *frames = transport.recv(self.sock, transport.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(identity.bytes, frames)
            if self._listener is not None:
                self._serve_channels(events)
            for backup, peer in list(self._peers.items()):
                if peer in events:
                    self._on_peer_reply(backup, peer)
            if self.control.pipe in events:
                msg = self.control.recv()
                handler = self.control_handlers.get(msg.kind)
                status = handler(msg) if handler else None
                if status is not None:
                    return status
            now = time.monotonic()
            if now >= next_tick:
                self._execute(self.rounds.tick(now))
                self._report_stalls(now)
                if self._listener is not None:
                    self._channel_ticks(now)
                next_tick = now + tick

    def close(self) -> None:
        for segment in self._segments.values():
            segment.close()
        for chan in self._channels.values():
            chan.close()
        if self._listener is not None:
            self._listener.close()
        for peer in self._peers.values():
            peer.close(linger=0)
        self.control.close(finalize=False)
        self.close_sockets(linger=1000)

    def close_sockets(self, linger: int = 0) -> None:
        if self.gate is not None:
            self.gate.close()
        self.sock.close(linger=linger)
        self.ctx.term()

    # ---- the scheduler's notices
    def _on_members(self, msg: Message) -> None:
        """Elastic workers: a worker left (its rounds go on without it) or took a slot (its
        credential opens the slot's connection; its pushes start at each key's next round)."""
        body = msg.body
        left, joined = body.get("left"), body.get("joined")
        self.members_epoch = max(self.members_epoch, body["epoch"])
        for rank in (left, joined):
            if type(rank) is int and 0 <= rank < self.num_workers:
                self._proved.pop(rank, None)  # the slot's connection proves itself again
                self._optimizer_count.pop(rank, None)  # its next holder counts its own calls
                self._lost.discard(f"worker-{rank}".encode())
                for where in [w for w in self._shm_of if w[0] == rank]:
                    del self._shm_of[where]
                if self._listener is not None:
                    self._close_channels_of(rank, body["epoch"])
        if type(left) is int and 0 <= left < self.num_workers:
            self._execute(self.rounds.leave(left, time.monotonic()))
        if type(joined) is int and 0 <= joined < self.num_workers:
            if self.gate is not None:
                self.gate.allow_worker(self.cfg, joined, body.get("cred", ""))
            self.rounds.arrive(joined, body["epoch"])
        log.info(
            "%s: epoch %d: workers %s%s",
            self.name,
            body["epoch"],
            body["present"],
            f" (worker {left} left: {body.get('why', '')})" if left is not None else "",
        )
        deferred, self._deferred = self._deferred, []  # a newcomer's requests that waited
        for identity, frames, via in deferred:
            self._handle(identity, frames, via)

    def _on_worker_done(self, msg: Message) -> None:
        self._execute(self.rounds.finished(msg.body["rank"]))

    def _on_worker_joined(self, msg: Message) -> None:
        """The scheduler waits for this ack before it lets the workers leave ``join``, so no
        push of the next epoch can arrive before the join it follows."""
        rank = msg.body["rank"]
        self._execute(self.rounds.joined(rank, time.monotonic()))
        self.control.send("joined_ack", {"rank": rank})

    # ---- stalls: a round that waits is reported to the scheduler, which knows what the
    # missing workers are doing: it logs the stall, tells the waiting workers, and fails the
    # round at once when the wait is a certain deadlock.
    STALL_FIRST = 1.0  # seconds: the first report, early enough to catch a deadlock

    def _report_stalls(self, now: float) -> None:
        for stall in self.rounds.stalled(now, self.STALL_FIRST):
            name = _show(stall.key)
            seen = self._stall_reports.get(name)
            # the waiting workers' cadence (membership.report_every): each report the
            # scheduler passes on restarts their deadline, so one comes well within it
            third = self.cfg.request_timeout / 3
            every = min(self.cfg.stall_report, third) if self.cfg.stall_report else third
            if seen is not None and seen[0] == stall.round and now < seen[1]:
                continue
            self._stall_reports[name] = (stall.round, now + every, stall.key)
            waiting = sorted({int(_WORKER_ID.match(q.identity)[1]) for q in stall.waiting})
            body = {
                "key": name,
                "round": stall.round,
                "age": round(stall.age, 1),
                "missing": stall.missing,
                "silent": [round(x, 1) for x in stall.silent],
                "present": stall.present,
                "waiting": waiting,
            }
            if stall.clocks is not None:
                body["clocks"], body["staleness"] = stall.clocks, stall.staleness
            self.control.send("stalled", body)

    def _on_fail_round(self, msg: Message) -> None:
        seen = self._stall_reports.get(msg.body["key"])
        if seen is not None:
            self._execute(self.rounds.fail_round(seen[2], msg.body["message"]))

    def _on_node_failed(self, msg: Message) -> int:
        text = f"{msg.body['node']} failed: {msg.body['reason']}"
        log.error("%s: %s; stopping", self.name, text)
        self._peer_lost = self._last_failure = text  # said: the requests it fails say it not again
        self._execute(self.rounds.fail_all(text))
        return EXIT_AUTH if msg.body.get("auth") else EXIT_PEER_LOST

    def _on_shutdown(self, msg: Message) -> int:
        log.info("%s: shutdown", self.name)
        return 0

    # ---- sending
    def _send(self, identity: bytes, msg: Message, keys=None, track: bool = True) -> None:
        """Send without blocking; ``keys`` name the stored arrays the message carries
        (``track=False``: it carries only fresh copies)."""
        if self.rounds.entered and identity.startswith(b"worker"):  # elastic: Rounds.expect
            body = {**msg.body, "entered": [list(e) for e in self.rounds.entered.items()]}
            msg = Message(msg.kind, msg.id, msg.sender, body, msg.arrays)
        chan = self._channel_of.get(identity)
        if chan is not None:
            self._send_channel(identity, chan, msg)
            return
        try:
            sent = transport.send(self.sock, msg, route=identity, track=track)
        except zmq.Again:
            if identity not in self._lost:
                self._lost.add(identity)
                log.warning(
                    "%s: %r does not read its replies (its queue is full); dropping them",
                    self.name,
                    identity,
                )
            return
        except zmq.ZMQError as exc:  # (EHOSTUNREACH: its connection closed; said once)
            if identity not in self._lost:
                self._lost.add(identity)
                log.info(
                    "%s: no route to %s (%s): its replies are dropped",
                    self.name,
                    identity.decode(errors="replace"),
                    exc.strerror,
                )
            return
        for s in sent:  # a reply of stored arrays: updates must not write into them
            if keys is not None and keys[s.array] is not None:
                busy = self.sending.get(keys[s.array])
                if busy is None:
                    self.sending[keys[s.array]] = [s]
                else:  # a key only pulled is never applied: prune its finished sends here
                    busy[:] = [b for b in busy if not b.done]
                    busy.append(s)

    # ---- same-host channels (kvstore.channel)
    def _serve_channels(self, events: dict) -> None:
        """New connections, their proofs, requests, and queued replies to write."""
        if self._listener.fd in events:
            chans, failed = self._listener.accept(self.cfg.max_message)
            now = time.monotonic()
            for chan in chans:
                if len(self._unproved) >= 64:  # strangers' connections: never many
                    chan.close()
                    continue
                self._channels[chan.fd] = chan
                self._unproved[chan.fd] = now
                self._poller.register(chan.fd, zmq.POLLIN)
            if failed:  # (EMFILE, say: the connection waits; its readiness would spin)
                log.warning("%s: a same-host channel not accepted (%s)", self.name, failed)
                self._poller.unregister(self._listener.fd)
                self._listening = False
        for fd, chan in list(self._channels.items()):
            event = events.get(fd)
            if not event or chan.closed:  # (closed by an earlier request of this wake-up)
                continue
            if event & _POLLOUT:
                self._flush_channel(chan)
            if chan.closed or not event & _READABLE:
                continue
            if chan.rank < 0:
                self._prove_channel(chan)
                continue
            try:
                messages = chan.receive()
            except (OSError, ValueError) as exc:
                log.warning("%s: %s's channel: %s; closed", self.name, chan.identity, exc)
                self._close_channel(chan)
                continue
            for frames in messages:
                self._handle(chan.identity, frames, chan)
            if chan.closed:
                self._close_channel(chan)

    def _prove_channel(self, chan: channel.Channel) -> None:
        """A connection's first datagram: ``[rank, secret]``, a secret this server gave that
        rank's proved connection; anything else closes it."""
        try:
            data = chan.sock.recv(channel.CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        try:
            rank, secret = channel.parse_hello(data)
            mine = self._secrets.get(rank) if 0 <= rank < self.num_workers else None
            if mine is None or not hmac.compare_digest(mine.encode(), secret.encode()):
                raise ValueError(f"a channel claiming worker {rank} with a wrong secret")
        except ValueError as exc:
            if data:
                log.warning("%s: %s; closed", self.name, exc)
            self._close_channel(chan)
            return
        del self._secrets[rank]
        self._channel_count += 1
        identity = b"%s/channel-%d" % (self._names[rank].encode(), self._channel_count)
        chan.rank, chan.identity, chan.epoch = rank, identity, self.members_epoch
        del self._unproved[chan.fd]
        try:
            chan.sock.send(b"ok")
        except OSError:
            self._close_channel(chan)
            return
        self._channel_of[identity] = chan
        self._ranks[identity] = rank
        log.debug("%s: worker %d talks by its same-host channel", self.name, rank)

    def _send_channel(self, identity: bytes, chan: channel.Channel, msg: Message) -> None:
        """A reply by the channel: written now or copied and queued, never waited for."""
        try:
            queued = chan.backlog
            taken = chan.send(encode_frames(msg)[0])
        except OSError as exc:  # the worker is gone: the scheduler says what that means
            log.info("%s: %s's channel closed (%s)", self.name, identity.decode(), exc)
            self._close_channel(chan)
            return
        if not taken and identity not in self._lost:
            self._lost.add(identity)
            log.warning(
                "%s: %r does not read its replies (its channel's queue is full); dropping them",
                self.name,
                identity,
            )
        if chan.backlog and not queued:
            self._poller.modify(chan.fd, zmq.POLLIN | zmq.POLLOUT)

    def _flush_channel(self, chan: channel.Channel) -> None:
        try:
            chan.flush()
        except OSError:
            self._close_channel(chan)
            return
        if not chan.backlog:
            self._poller.modify(chan.fd, zmq.POLLIN)

    def _channel_ticks(self, now: float) -> None:
        """Close connections not proved within 10 s; listen again after a failed accept."""
        for fd in [fd for fd, t in self._unproved.items() if now - t > 10]:
            self._close_channel(self._channels[fd])
        if not self._listening:
            self._listening = True
            self._poller.register(self._listener.fd, zmq.POLLIN)

    def _close_channels_of(self, rank: int, epoch: int) -> None:
        """An elastic slot changed hands at ``epoch``: the channels its holder proved before
        are closed (a frozen worker's queued requests never count for its successor), and
        the secrets it was given are void."""
        self._secrets.pop(rank, None)
        for connection in [c for c, (r, _) in self._offered.items() if r == rank]:
            del self._offered[connection]
        for chan in list(self._channels.values()):
            if chan.rank == rank and chan.epoch < epoch:
                self._close_channel(chan)

    def _close_channel(self, chan: channel.Channel) -> None:
        self._unproved.pop(chan.fd, None)
        if self._channels.pop(chan.fd, None) is not None:
            self._poller.unregister(chan.fd)
        if self._channel_of.pop(chan.identity, None) is not None:
            self._ranks.pop(chan.identity, None)
            self._lost.discard(chan.identity)
        chan.close()

    def _error(self, identity: bytes, request: Message, text: str, unchanged=False) -> None:
        log.warning("%s: %s", self.name, text)
        self._send(identity, error_reply(request, self.name, f"{self.name}: {text}", unchanged))

    def _reply(self, req: Request) -> None:
        if req.msg.kind.startswith("sparse_"):
            self._reply_rows(req)
            return
        if req.msg.kind in ("push", "optimizer", "command") or req.msg.body.get("flush") is True:
            self._send(req.identity, Message("ack", req.msg.id, self.name))
            return
        keys = [tuple(k) for k in req.msg.body["keys"]]
        arrays, body = [self.stored[k] for k in keys], {"keys": req.msg.body["keys"]}
        if "ssp" in req.msg.body:
            self._count_staleness(req, keys)
        comp = req.msg.body.get("compression")
        coded = {}
        try:
            if comp and comp.get("pull") is True:
                coded = self._coded(keys, arrays, comp)
            elif self.pull_codes.active:  # a round answered both ways would differ
                for key in keys:
                    self.pull_codes.exact(key)
        except ValueError as exc:  # this request only: the others of its round go on
            self._fail_request(req, str(exc))
            return
        sends = keys
        if coded:  # fresh codes, not the stored arrays
            body["codes"] = [[i, header] for i, header in coded.items()]
            sends = [None if i in coded else k for i, k in enumerate(keys)]
        # a same-host worker reads big values from its shared segment, for the keys it says
        # it has no other reply in flight for (so the region is read before it is written)
        if self._shm_of:
            for i, region in self._pull_regions(req, keys).items():
                if i in coded:  # every worker reads the same codes
                    continue
                np.copyto(region.view(arrays[i].dtype), arrays[i])
                arrays[i] = arrays[i][:0]
                body.setdefault("shm", []).append(i)
        self._send(req.identity, Message("data", req.msg.id, self.name, body, arrays), sends)

    def _coded(self, keys: list, arrays: list, params) -> dict:
        """``{index: header}`` of the reply's values that go as codes (compressed pulls:
        ``arrays[index]`` replaced by them); the values that are not a round's sum go exact."""
        codec = Compression.from_params(params)
        coded = {}
        for i, key in enumerate(keys):
            codes = self.pull_codes.codes(key, arrays[i], codec, self.num_workers)
            if codes is not None:
                arrays[i], coded[i] = codes
        return coded

    def _pull_regions(self, req: Request, keys: list) -> dict:
        """{key index: pull region} of the keys a request's worker asked to read through
        their shared segment (``shm_pull``) and has one for."""
        wanted = req.msg.body.get("shm_pull")
        if not wanted or not isinstance(wanted, list):
            return {}
        rank, found = self._ranks.get(req.identity, -1), {}
        for i in wanted:
            if type(i) is int and 0 <= i < len(keys):
                segment = self._shm_of.get((rank, keys[i]))
                if segment is not None:
                    found[i] = segment.pull
        return found

    def _count_staleness(self, req: Request, keys: list) -> None:
        """``dist_ssp``: how many of the reader's rounds each read is behind."""
        rank, m = self._ranks.get(req.identity, -1), self.control.metrics
        if m is not None:
            for key in keys:
                m.stale(max(self.rounds.clock(key, rank) - self.rounds.rounds_done(key), 0))

    # ---- carrying out the rounds' actions
    def _execute(self, actions: list) -> None:
        broken: dict = {}  # keys whose round failed to apply -> why
        # with replicas: home server -> [(entry, value)] to forward, and the answers, which
        # wait until the backups hold what was forwarded (kvstore.replication)
        forwards: dict | None = None if self.chains is None else {}
        answers: list = []
        tables = self.rows.tables
        for action in actions:
            if type(action) is Apply:
                entry = None if forwards is None else self._forward(action, forwards)
                if tables and action.key in tables:
                    why = self._apply_rows(action)
                    if why:
                        broken[action.key] = why
                        if entry is not None:  # the backups must fail alike (_on_replica)
                            entry[4], entry[5]["failed"] = False, why
                    continue
                try:
                    self._apply(action, entry is not None)
                except Exception as exc:  # the updater raised, memory ran out: every request
                    # waiting on this round hears why (they follow in this list), none hangs
                    broken[action.key] = (
                        f"the round of key {_show(action.key)} could not be applied: "
                        f"{type(exc).__name__}: {exc}"
                    )
                    if entry is not None:  # the backups count the round, apply nothing
                        entry[4] = False
            elif type(action) is Reply:
                why = self._broken_for(action.request, broken) if broken else ""
                if why:  # the round it waited for was never applied: say so, do not answer
                    self._fail_request(action.request, why)
                elif forwards is None:
                    self._reply(action.request)
                else:
                    answers.append(action.request)
            elif type(action) is Fail:
                self._fail_request(action.request, action.text)
        if forwards:
            self._send_forwards(forwards)
        for request in answers:
            for ready in self.primary.answer(request, _keys_of(request)):
                self._reply(ready)

    def _fail_request(self, req: Request, text: str) -> None:
        if text != self._last_failure:  # once, not once per request
            self._last_failure = text
            log.error("%s: %s", self.name, text)
        reply = error_reply(req.msg, self.name, f"{self.name}: {text}")
        if self._peer_lost and text == self._peer_lost:
            reply.body["lost"] = True  # the worker raises PeerLostError (exit 129)
        self._send(req.identity, reply)

    @staticmethod
    def _broken_for(req: Request, broken: dict) -> str:
        """Why a request cannot be answered: a key it names whose round failed to apply."""
        for key in req.msg.body.get("keys") or ():
            why = broken.get(tuple(key))
            if why:
                return why
        return ""

    def _apply(self, action: Apply, forwarded: bool = False) -> None:
        """``stored = updater(value, stored)``; without an updater, assign a round's sum or
        add an async push. Never writes into an array a reply still reads (``forwarded``:
        nor into ``value``, which a forward to the backups reads)."""
        key, value = action.key, action.value
        old = self.stored[key]
        sends = self.sending.pop(key, None)
        busy = sends is not None and any(not s.done for s in sends)
        if self._unsent and key in self._unsent:  # a forward of this action list reads it
            busy = True
        updater = self._updater_of(key)
        if internal(key[0]):  # (key, part): the library's own keys hold sums
            updater = None
        if updater is None and not action.accumulate:
            if self._shm_of and _in_segment(value):  # a lone push through shared memory
                value = value.copy()
            self.stored[key] = value  # the round's sum becomes the value, uncopied
            self.pull_codes.summed(key)
            if not busy:
                self.rounds.give_back(key, old)
            return
        self.pull_codes.changed(key)
        target = old if old.flags.writeable and not busy else old.copy()
        if updater is not None:
            updater(key, value, target)
            if not action.accumulate and not forwarded:
                self.rounds.give_back(key, value)  # the sum's buffer serves the next round
        else:
            add(target, value, target)
        self.stored[key] = target

    # ---- requests
    def _handle(self, identity: bytes, frames, via: channel.Channel | None = None) -> None:
        """One request; ``via``: the same-host channel it came by (proved: no gate)."""
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            self._error(identity, Message("error", request_id(frames)), f"bad message: {exc}")
            return
        if self.cfg.verbose >= 2:
            log.debug(
                "%s: %s %s from %s", self.name, msg.kind, msg.body.get("keys", ""), msg.sender
            )
        if self.chains is not None:
            if identity.startswith(b"server-"):
                self._handle_peer(identity, frames, msg)
                return
            epoch = msg.body.get("epoch")
            if type(epoch) is int and epoch > self.epoch:  # sent after a failover we have
                self._deferred.append((identity, frames, via))  # not heard of yet: keep it
                return
        # an elastic job: the membership epoch the request depends on (a newcomer's arrival:
        # its credential and rounds come with that notice; or one it was told entered)
        joined = msg.body.get("mepoch")
        if type(joined) is int and joined > self.members_epoch:  # wait for that notice
            if len(self._deferred) < 10_000:
                self._deferred.append((identity, frames, via))
            else:  # never dropped in silence: the worker hears why
                self._error(
                    identity,
                    msg,
                    f"{msg.kind} refused: it depends on membership epoch {joined}, which this "
                    f"server has not heard of (it knows {self.members_epoch}) while 10000 "
                    "requests wait for it: is the scheduler alive and reachable?",
                )
            return
        try:
            if via is None:
                rank = self._worker_rank(identity, frames[0], msg.kind)
            elif msg.kind in ("hello", "auth"):
                raise ValueError(f"{msg.kind} came by the same-host channel: only by ZeroMQ")
            else:
                rank = via.rank
            handler = self.handlers.get(msg.kind)
            if handler is None:
                raise ValueError(f"unexpected message kind {msg.kind!r} from {msg.sender}")
            handler(identity, rank, msg)
        except auth.Refused as exc:  # a stranger's: logged once per host (Gate.refuse)
            self._send(identity, error_reply(msg, self.name, f"{self.name}: {exc}"))
        except Unchanged as exc:
            self._error(identity, msg, f"{msg.kind} refused: {exc}", unchanged=True)
        except (ValueError, TypeError, KeyError) as exc:
            self._error(identity, msg, f"{msg.kind} refused: {exc}")
        except Exception as exc:  # a server never dies of one bad request
            log.exception("%s: %s failed", self.name, msg.kind)
            self._error(identity, msg, f"{msg.kind} failed: {type(exc).__name__}: {exc}")

    def _worker_rank(self, identity: bytes, frame, kind: str) -> int:
        """The rank a request comes from: its routing identity, ``worker-<rank>`` exactly,
        and (authenticated) the rank whose credential opened the connection (encrypted) or
        that the connection proved (by default: only ``hello`` and ``auth`` come before)."""
        rank = self._ranks.get(identity)
        if rank is None:
            match = _WORKER_ID.fullmatch(identity)
            if match is None or int(match[1]) >= self.num_workers:
                raise ValueError(
                    f"unknown peer {identity!r:.60}: only workers 0..{self.num_workers - 1} "
                    "may talk to a server"
                )
            rank = self._ranks[identity] = int(match[1])
        if self.gate is None:
            return rank
        user = frame.get("User-Id")
        if self.cfg.encrypt:
            if user != self._names[rank]:
                raise ValueError(
                    f"{identity.decode()} refused: the connection authenticated as {user!r}"
                )
            return rank
        self._connection = (user, frame)
        if kind not in ("hello", "auth") and self._proved.get(rank) != user:
            text = (
                f"{kind} from {identity.decode()} refused: this connection has not proved "
                f"{identity.decode()}'s credential (hello, then auth; see kvstore.auth)"
            )
            self.gate.refuse(_peer_of(frame), text)
            raise auth.Refused(text)
        return rank

    def _keys(self, msg: Message) -> list[tuple]:
        keys = [tuple(k) for k in msg.body["keys"]]
        unique = set(keys)
        passive = self.backup.passive
        # set operations for the common case; a request they refuse is told about its first
        # bad key, in order
        if not unique <= self.stored.keys() or (passive and not unique.isdisjoint(passive)):
            for key in keys:
                if key not in self.stored:
                    if key in self.rows.tables:
                        raise KeyError(
                            f"key {_show(key)} is a row-sparse key here, but this request is "
                            "a dense key's: did every worker init it the same way?"
                        )
                    raise KeyError(f"key {_show(key)} was never initialised on this server")
                if passive and key in passive:
                    raise KeyError(
                        f"key {_show(key)} is a backup copy on this server: server "
                        f"{passive[key][0]} answers for it"
                    )
        if len(unique) != len(keys):
            raise ValueError("a key appears twice in one request")
        return keys

    def _on_init(self, identity, rank, msg) -> None:
        """``members``: a group's keys, which every member initialises (no barrier across all
        workers): the first init creates a key, the same init again is answered as done."""
        keys = [tuple(k) for k in msg.body["keys"]]
        members, arrivals = self._group_of(msg, rank)
        home = self._home_of(msg)
        fresh = []
        for key, array in zip(keys, msg.arrays, strict=True):
            if key not in self.stored:
                fresh.append((key, array))
                continue
            same = (
                members is not None
                and self._members_of_key(key) == members
                and self.stored[key].size == array.size
                and self.stored[key].dtype == array.dtype
            )
            if not same:
                raise ValueError(f"key {_show(key)} is already initialised")
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice in one request")
        for key, array in fresh:
            self.stored[key] = np.array(array.reshape(-1))  # our own, writable copy
            root = _ROOT_ONLY.match(key[0]) if isinstance(key[0], str) else None
            if root is not None:  # a backup copy too: it may answer for it one day
                self._roots[key] = int(root[1])
            self._enter_key(key, home, msg, members, arrivals)
        self._send(identity, Message("ack", msg.id, self.name))

    def _group_of(self, msg: Message, rank: int) -> tuple:
        """An init's group of ranks (``members``: its keys' own, initialised by every member)
        and, in an elastic job, when each member's holder came (``arrivals``), checked."""
        members = _members_of(msg.body.get("members"), rank, self.num_workers)
        arrivals = msg.body.get("arrivals")
        if arrivals is not None and (
            members is None
            or not isinstance(arrivals, list)
            or len(arrivals) != len(members)
            or any(type(a) is not int for a in arrivals)
        ):
            raise ValueError(f"arrivals: expected an int per member, got {arrivals!r:.80}")
        return members, arrivals

    def _members_of_key(self, key) -> tuple | None:
        """The group a key part was made for (None: every worker), a backup's copy too."""
        held = self.backup.passive.get(key)
        return held[1] if held else self.rounds.keys[key].members

    def _enter_key(self, key, home: int, msg: Message, members=None, arrivals=None) -> None:
        """A key part ``msg`` made here enters this server's rounds; a backup's copy of
        server ``home``'s is held out of them while its primary lives (``Backup.hold``)."""
        before = self._made_after(msg)
        if home != self.rank:
            answering = acting(home, self.chains, self.dead) == self.rank
            self.backup.hold(key, home, members, answering, arrivals, before)
            if not answering:
                return
        absent = set(self.rounds.newcomers) - set(before)
        self.rounds.add_key(key, members, arrivals=arrivals, absent=absent)

    def _made_after(self, msg: Message) -> dict:
        """The newcomers (``{slot: arrival epoch}``) an ``init``'s keys are made after: those
        whose arrival its worker knew of (its ``mepoch``: it waited here for that notice).
        The others are out of the keys' rounds until their first push, as if they came
        after (``Rounds.arrive``): each server may hear of them before or after the init,
        and every replica must decide alike."""
        known = msg.body.get("mepoch")
        known = known if type(known) is int else 0
        return {r: e for r, e in self.rounds.newcomers.items() if e <= known}

    def _grads(self, msg: Message, keys: list, rank: int) -> list:
        """The pushed gradients, checked against the stored keys and decompressed."""
        comp = msg.body.get("compression")
        codec = Compression.from_params(comp) if comp else None
        headers = msg.body.get("headers") or [None] * len(msg.arrays)
        shared = self._shared_pushes(msg, keys, rank)
        grads = []
        for i, (key, array, header) in enumerate(zip(keys, msg.arrays, headers, strict=True)):
            stored = self.stored[key]
            if i in shared:
                grads.append((key, shared[i]))
                continue
            if codec is None:
                if array.dtype != stored.dtype or array.size != stored.size:
                    raise ValueError(
                        f"key {_show(key)}: got {array.size} x {array.dtype}, "
                        f"expected {stored.size} x {stored.dtype}"
                    )
                grads.append((key, array if array.ndim == 1 else array.reshape(-1)))
                continue
            if array.dtype != np.uint8 or array.size != packed_size(codec.kind, stored.size):
                raise ValueError(
                    f"key {_show(key)}: compressed frame of {array.size} bytes, "
                    f"expected {packed_size(codec.kind, stored.size)}"
                )
            grads.append((key, codec.decode(array, header, stored.size, stored.dtype.type)))
        if self._roots:
            for i, (key, grad) in enumerate(grads):
                root = self._roots.get(key)
                if root is not None and root != rank:  # only the root's bytes count
                    grads[i] = (key, np.zeros_like(grad))
        return grads

    def _shared_pushes(self, msg: Message, keys: list, rank: int) -> dict:
        """{index: gradient} of the pushes a same-host worker left in shared memory, as
        read-only views (the worker writes the segment again only once this push is answered;
        ``_on_push`` copies those that ``dist_ssp`` answers before their round completes)."""
        entries = msg.body.get("shm")
        if not entries:
            return {}
        if not isinstance(entries, list):
            raise ValueError("shm: expected a list of [index, segment, sequence]")
        found = {}
        for entry in entries:
            if (
                not isinstance(entry, list)
                or len(entry) != 3
                or type(entry[0]) is not int
                or not 0 <= entry[0] < len(keys)
                or type(entry[2]) is not int
            ):
                raise ValueError(f"shm: bad entry {entry!r:.80}")
            index, name, seq = entry
            key, stored = keys[index], self.stored[keys[index]]
            if msg.arrays[index].dtype != stored.dtype:  # TCP refuses it too: never reinterpret
                raise ValueError(
                    f"key {_show(key)}: got {msg.arrays[index].dtype} through shared memory, "
                    f"expected {stored.dtype}"
                )
            segment = self._segments.get(name)
            if segment is None:
                segment = shm.open_for(name, rank, stored.nbytes)
                self._segments[name] = segment
            if segment.nbytes != stored.nbytes or int(segment.counters[0]) != seq:
                raise ValueError(f"shm: segment {name} does not hold push {seq} of {_show(key)}")
            # summed straight from the segment, no copy: the worker writes this region again
            # only once this push is answered (in dist_sync, after its round is applied);
            # read-only, so no round keeps it as a buffer to write into
            view = segment.push.view(stored.dtype)
            view.flags.writeable = False
            found[index] = view
            self._shm_of[(rank, key)] = segment
        return found

    def _on_hello(self, identity, rank, msg) -> None:
        """A worker asks whether it shares this process's memory: yes only when this server
        reads the nonce in the worker's probe segment (same boot id is not enough: pods on
        one node share it, not their /dev/shm). By default the reply also carries the
        challenge this connection must answer (``auth``)."""
        body = msg.body
        same = (
            self.cfg.shm
            and shm.available()
            and body["host"] == shm.host_id()
            and shm.prove(body.get("probe"), rank, body.get("nonce"))
        )
        reply = {"shm": bool(same)}
        proving = self.gate is not None and not self.cfg.encrypt
        if same and self._listener is not None:
            secret = secrets.token_hex(16)
            reply["channel"] = [channel.wire_address(self._listener.address), secret]
            if proving:  # good once this connection proves the rank's token (_on_auth)
                while len(self._offered) >= 4 * self.num_workers + 1000:  # strangers' hellos
                    self._offered.pop(next(iter(self._offered)))
                self._offered[self._connection[0]] = (rank, secret)
            else:
                self._secrets[rank] = secret
        if proving:
            connection = self._connection[0]
            self._challenges.pop(connection, None)
            while len(self._challenges) >= 4 * self.num_workers + 1000:  # strangers' hellos
                self._challenges.pop(next(iter(self._challenges)))
            reply["challenge"] = self._challenges[connection] = auth.challenge()
        self._send(identity, Message("ack", msg.id, self.name, reply))

    def _on_auth(self, identity, rank, msg) -> None:
        """A worker proves its token on this connection: an HMAC of the connection's
        challenge (kvstore.auth). The proof is good once, for this connection only."""
        if self.gate is None or self.cfg.encrypt:
            raise ValueError("this job's connections prove nothing by auth (encrypted or insecure)")
        connection, frame = self._connection
        challenge = self._challenges.pop(connection, None)
        token = self.gate.tokens[rank] if self.gate.tokens else ""
        wrong = auth.check_proof(token, challenge, rank, msg.body.get("proof"))
        if wrong:
            self.gate.refuse(_peer_of(frame), f"{identity.decode()}: {wrong}")
            raise auth.Refused(f"auth refused: {wrong}")
        self._proved[rank] = connection
        offered = self._offered.pop(connection, None)
        if offered is not None and offered[0] == rank:
            self._secrets[rank] = offered[1]
        self._send(identity, Message("ack", msg.id, self.name))

    def _check_pull_codec(self, msg: Message) -> None:
        """Refuse, on arrival, a request for compressed pulls this server cannot answer."""
        comp = msg.body.get("compression")
        if comp is None:
            return
        if not isinstance(comp, dict) or not Compression.from_params(comp).pull:
            if msg.kind == "pull":
                raise ValueError(f"pull: 'compression' must ask for compressed pulls: {comp!r:.80}")
            return
        if self.chains is not None:
            raise ValueError("compressed pulls are not available with KVSTORE_REPLICAS > 1")
        self.pull_codes.active = True

    @metrics.served
    def _on_push(self, identity, rank, msg) -> None:
        self._check_pull_codec(msg)
        grads = self._grads(msg, self._keys(msg), rank)
        sync = bool(msg.body.get("sync", True))
        staleness = _staleness(msg)
        if staleness is not None and (staleness < 0) == sync:
            raise ValueError("ssp: an unbounded (-1) dist_ssp push is async, a bounded one sync")
        # dist_ssp keeps a push past its answer, and the worker may then write its segment
        if staleness is not None and staleness > 0 and self._shm_of:
            grads = [(k, g.copy() if _in_segment(g) else g) for k, g in grads]
        if "entered" in msg.body:
            self._expect(msg.body["entered"], grads)
        now = time.monotonic()
        request = Request(identity, msg)
        held = 0
        if self.chains is not None:
            grads, held = self._replicated_push(rank, msg, grads, sync)
        self._execute(self.rounds.push(request, rank, grads, sync, now, staleness, held))

    def _expect(self, entered, grads: list) -> None:
        """Elastic jobs: the newcomers the pushing worker saw in a completed round are in
        these keys' rounds from now on (Rounds.expect)."""
        if not isinstance(entered, list) or not all(
            isinstance(e, list) and len(e) == 2 and all(type(x) is int for x in e) for e in entered
        ):
            raise ValueError(f"'entered' must be [[slot, epoch], ...], got {entered!r:.60}")
        self.rounds.expect(entered, [key for key, _ in grads])

    @metrics.served
    def _on_pull(self, identity, rank, msg) -> None:
        self._check_pull_codec(msg)
        keys = self._keys(msg)
        flush = msg.body.get("flush") is True
        request = Request(identity, msg)
        self._execute(self.rounds.pull(request, rank, keys, _staleness(msg), flush))

    def _on_optimizer(self, identity, rank, msg) -> None:
        """Every worker sends its optimizer, call by call (a worker's n-th ``set_optimizer``
        is call n): the first of a call installs it, or replaces a different one (MXNet's
        way to change a schedule by hand), and the same spec again keeps the state gathered.
        Another worker's different spec in the same call is refused: the servers would keep
        whichever came last, each its own (a worker's ``rescale_grad`` from its own shard).
        A worker that joined a running elastic job (``keep``, its first call) sets one the
        job has set, the latest or an earlier one (MXNet sets one in two calls: the spec,
        then multi-precision), and goes on from that call; it never replaces the job's."""
        spec = msg.body["spec"]
        n = self._optimizer_count.get(rank, 0)
        if msg.body.get("keep") is True and self._optimizer_calls:
            same = [i for i, (s, _) in enumerate(self._optimizer_calls) if s == spec]
            if not same:
                raise ValueError(
                    f"a worker that joined the running (elastic) job sets the optimizer "
                    f"{spec!r:.120}, but the job's is {self.optimizer_spec!r:.120}: every "
                    "worker must set the same"
                )
            n = same[-1]
        if n < len(self._optimizer_calls):
            first, by = self._optimizer_calls[n]
            if spec != first:
                raise ValueError(
                    f"worker {rank} sets another optimizer than worker {by} did in the same "
                    f"call (set_optimizer number {n + 1} of each): {_spec_difference(spec, first)}"
                    "; every worker must set the same optimizer (compute rescale_grad and the "
                    "learning rate alike on every worker)"
                )
            self._optimizer_count[rank] = n + 1
            self._ack_optimizer(identity, msg)
            return
        self._optimizer_count[rank] = n + 1
        self._optimizer_calls.append((spec, rank))
        if spec != self.optimizer_spec:
            self.updater = opt.Updater(opt.from_spec(spec))
            self.optimizer_spec = spec
            log.info("%s: optimizer %s", self.name, self.updater.optimizer)
            if self.chains is not None:
                self._install_for_homes(spec)
        self._ack_optimizer(identity, msg)

    def _set_states(self, identity: bytes, rank: int, msg: Message) -> None:
        """``load_optimizer_states``: server ``home``'s part of the states. With replicas it
        comes to the server acting for ``home`` only, which loads it, then forwards it to the
        backups in its place among the rounds and answers once they hold it; a re-sent one
        they already hold is answered, not loaded again (that would undo the rounds since)."""
        home, updater = self._home_of(msg), self._updater_for(msg)
        if updater is None:  # on every server, unless a set_optimizer is on its way:
            # the worker fails its store if only some refused (DistStore._wait_for)
            raise Unchanged("no optimizer is set on the servers; call set_optimizer first")
        if len(msg.arrays) != 1:
            raise ValueError("set_states needs one state blob")
        mark = (None, home)
        if self.chains is not None:
            if home not in self._targets:
                raise ValueError(f"set_states: server {home}'s parts are loaded by their primary")
            if msg.body.get("resend") is True and self.backup.duplicate_load(mark, rank, msg.id):
                self._send(identity, Message("ack", msg.id, self.name))
                return
        why = self._load_states(updater, home, msg.arrays[0].tobytes())
        if self.chains is not None and self._targets[home]:  # (a failed one too: alike)
            states = ({"states": [rank, msg.id], "failed": why}, [msg.arrays[0]])
            self._send_forwards({home: []}, states)
            if not why:
                for ready in self.primary.answer(Request(identity, msg), [mark]):
                    self._reply(ready)
                return
        if why:
            raise RuntimeError(f"set_states failed part way ({why}): restart the job")
        self._send(identity, Message("ack", msg.id, self.name))

    def _load_states(self, updater, home: int, blob: bytes) -> str:
        """Load a state file into ``home``'s updater and tables; checked whole first (a
        ``ValueError``: nothing changed). Returns why it failed part way, if it did (memory):
        a backup loads the same and must fail alike."""
        apply = check_states(updater, self._tables_of(home), blob)
        try:
            updater.loads(blob)
            apply()
        except Exception as exc:
            log.exception("%s: set_states failed part way", self.name)
            return f"{type(exc).__name__}: {exc}"
        return ""

    def _ack_optimizer(self, identity: bytes, msg: Message) -> None:
        """With replicas, once the backups hold the optimizer installed (every worker's call:
        its next request may be a ``set_states`` that a copy needs that optimizer for)."""
        if self.chains is None:
            self._send(identity, Message("ack", msg.id, self.name))
            return
        marks = [(None, home) for home, to in self._targets.items() if to]
        for ready in self.primary.answer(Request(identity, msg), marks):
            self._reply(ready)

    def _install_for_homes(self, spec: dict) -> None:
        """With replicas, a new optimizer for the parts of the servers this one acts for
        (taken over), and forwarded to their backups, in its place among the rounds: a copy
        kept for another server installs it when that server's forward says so
        (``_on_replica``), never on a worker's call, so it updates every round with the
        optimizer its primary updated that round with (forwarded with the mark ``(None,
        home)`` as its key: no key is named None; the answers wait for it)."""
        calls = len(self._optimizer_calls)
        for home in self._targets:
            if home != self.rank:
                self._set_home_optimizer(home, calls, spec)
        control = ({"optimizer": spec, "calls": calls}, [])
        self._send_forwards({home: [] for home, to in self._targets.items() if to}, control)

    def _set_home_optimizer(self, home: int, calls: int, spec: dict) -> None:
        """The updater of ``home``'s copies: ``spec``, as of its ``calls``-th optimizer call
        (a new one when the spec differs: as the primary's own, its state starts again)."""
        if self._home_specs.get(home, (0, None))[1] != spec:
            self.backup_updaters[home] = opt.Updater(opt.from_spec(spec))
        self._home_specs[home] = (calls, spec)

    def _on_command(self, identity, rank, msg) -> None:
        name = msg.body["name"]
        if name == "get_states":
            updater = self._updater_for(msg)
            if updater is None:
                raise ValueError("no optimizer is set; call set_optimizer first")
            tables = self._tables_of(self._home_of(msg))
            blob = np.frombuffer(dump_states(updater, tables), np.uint8)
            self._send(identity, Message("ack", msg.id, self.name, {}, [blob]))
        elif name == "enter":  # kvstore.elastic's reset: a newcomer is in every round now
            self._execute(self.rounds.enter(rank, time.monotonic()))
            self._send(identity, Message("ack", msg.id, self.name))
        elif name == "set_states":
            self._set_states(identity, rank, msg)
        elif name == "stats":  # kv.server_stats(): memory, and the row-sparse keys' rows
            # with replicas: server home's parts (held as its primary, or taken over)
            tables = self._tables_of(self._home_of(msg))
            rows = [[key[0], len(t), t.nbytes] for key, t in tables.items()]
            body = {"rss": metrics.resident_bytes(), "rows": rows, "rank": self.rank}
            self._send(identity, Message("ack", msg.id, self.name, body))
        else:
            raise ValueError(f"unknown command {name!r}")

    # ---- replicas (KVSTORE_REPLICAS > 1; kvstore.replication decides, this carries it out)
    _HELLO, _AUTH = 2**62, 2**62 + 1  # request ids of a replication link's handshake

    def _start_replicas(self, book: dict, poller: zmq.Poller) -> None:
        self.chains = [list(chain) for chain in book["replicas"]]
        self._poller = poller
        self._addresses = [tuple(a) for a in book["servers"]]
        self._peer_keys = book.get("peers") or [""] * len(self._addresses)
        self._targets = {self.rank: self.chains[self.rank][1:]}
        self._connect_peers()

    def _updater_of(self, key: tuple):
        """The updater of ``key``: this server's, or for a copy of another server's part
        (kept or taken over) the one that mirrors that server's."""
        home = self.backup.home.get(key) if self.chains is not None else None
        return self.updater if home is None else self.backup_updaters.get(home)

    def _tables_of(self, home: int) -> dict:
        """The row-sparse tables of server ``home``'s parts held here."""
        homes = self.backup.home
        return {k: t for k, t in self.rows.tables.items() if homes.get(k, self.rank) == home}

    def _home_of(self, msg: Message) -> int:
        """The server whose part an ``init`` or a ``command`` is for (a backup's copy)."""
        home = msg.body.get("home", self.rank)
        if home != self.rank and (
            self.chains is None
            or type(home) is not int
            or not 0 <= home < len(self.chains)
            or self.rank not in self.chains[home]
        ):
            raise ValueError(f"home: this server keeps no copy of server {home!r:.20}'s parts")
        return home

    def _updater_for(self, msg: Message):
        home = self._home_of(msg)
        return self.updater if home == self.rank else self.backup_updaters.get(home)

    def _connect_peers(self) -> None:
        """A DEALER to every live backup this server forwards to; by default each link proves
        this server's token (hello, auth) before the first forward goes out."""
        cfg = self.cfg
        wanted = sorted({b for targets in self._targets.values() for b in targets})
        for backup in wanted:
            if backup in self._peers:
                continue
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"server-{self.rank}".encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop a forward: answers wait for its ack
            auth.worker_socket(sock, cfg, self.rank, self.cred, self._peer_keys[backup])
            host, port = self._addresses[backup]
            sock.connect(f"tcp://{host}:{port}")
            self._peers[backup] = sock
            self._backlog[backup] = []
            self._poller.register(sock, zmq.POLLIN)
            challenged = self.gate is not None and not cfg.encrypt
            self._peer_ready[backup] = not challenged
            if challenged:
                transport.send(sock, Message("hello", self._HELLO, self.name, {"host": ""}))

    def _forward(self, action: Apply, forwards: dict) -> list | None:
        """Note a round (or async push) about to be applied for the live backups of its key:
        its entry ``[key, part, accumulate, pushes held, applied]`` (None: no backups). A
        dense key's entry carries the round's input, its sum (one array, which becomes the
        stored value: tracked); a row-sparse key's carries the pushes themselves,
        ``{"pushes": [[rank, normal], ...]}`` in the order the round sums them, with their ids
        and rows (two arrays each): a backup sums them as the primary does, to the same bits
        (and when the primary could not apply them, ``"failed"`` says why: the backup must
        fail alike, or its copy is no longer the primary's)."""
        home = self.backup.home.get(action.key, self.rank)
        if not self._targets.get(home):
            return None
        held = self.primary.applied(action.key, action.accumulate, self._pusher)
        key, part = action.key
        entry = [key, part, action.accumulate, held, True]
        if action.key in self.rows.tables:
            pushes = self.rows.next_pushes(action.key, action.accumulate)
            entry.append({"pushes": [[rank, normal] for rank, _, _, normal in pushes]})
            arrays = []
            for _, ids, rows, _ in pushes:  # rows in a shared segment: copied, the worker
                # writes it again once answered, and a lost backup's forward may still be read
                arrays += [ids, rows.copy() if _in_segment(rows) else rows]
            forwards.setdefault(home, []).append((entry, action.key, arrays, False))
        else:
            forwards.setdefault(home, []).append((entry, action.key, [action.value], True))
            self._unsent.add(action.key)
        return entry

    def _send_forwards(self, forwards: dict, control: tuple | None = None) -> None:
        """Send each home's entries to its live backups. ``control``: (body fields, arrays)
        of a forward with no entries (an optimizer its primary installs now, or states it
        loads), marked ``(None, home)`` in :class:`Primary` (no key is named None)."""
        for home, items in forwards.items():
            body = {"home": home, "entries": [entry for entry, *_ in items], "epoch": self.epoch}
            keys = [key for _, key, _, _ in items]
            arrays, owners = [], []  # owners: the key of each array a reply's send reads
            for _, key, values, tracked in items:
                arrays += values
                owners += [key if tracked else None] * len(values)
            if control is not None:
                body.update(control[0])
                keys, arrays, owners = [(None, home)], list(control[1]), [None] * len(control[1])
            for backup in list(self._targets[home]):
                seq = self.primary.forwarded(backup, keys)
                msg = Message("replica", seq, self.name, body, arrays)
                if self._peer_ready.get(backup):
                    self._send_peer(backup, msg, owners)
                else:  # its link is not proved yet: a copy waits (the values move on)
                    msg.arrays = [a.copy() for a in arrays]
                    self._backlog[backup].append(msg)
        self._unsent.clear()

    def _send_peer(self, backup: int, msg: Message, owners=None) -> None:
        try:
            sent = transport.send(self._peers[backup], msg, track=owners is not None)
        except zmq.ZMQError as exc:
            self._lose_backup(backup, f"a forward to it could not be sent ({exc.strerror})")
            return
        for s in sent:  # the stored arrays it reads are not written until it is sent
            if owners[s.array] is not None:
                self.sending.setdefault(owners[s.array], []).append(s)

    def _on_peer_reply(self, backup: int, sock: zmq.Socket) -> None:
        try:
            msg = decode(sock.recv_multipart(copy=False))
        except ProtocolError as exc:
            log.error("%s: bad reply from server %d: %s", self.name, backup, exc)
            return
        if msg.kind == "error":  # its copy can no longer be trusted: it is no replica now
            self._lose_backup(backup, f"it refused a forward ({msg.body.get('message')})")
            return
        if msg.id == self._HELLO:
            body = auth.answer(msg.body, self.cred, self.rank, "server") or {"proof": ""}
            transport.send(sock, Message("auth", self._AUTH, self.name, body))
            return
        elif msg.id == self._AUTH:
            self._peer_ready[backup] = True
            for waiting in self._backlog.pop(backup, []):
                self._send_peer(backup, waiting)
            return
        else:
            released = self.primary.ack(backup, msg.id)
        for request in released:
            self._reply(request)

    def _lose_backup(self, backup: int, why: str) -> None:
        """A backup whose copies are no longer kept in step: nobody waits for it, and the
        scheduler fails it over (it is fenced), so its stale copies never answer."""
        log.error("%s: server %d is no replica any more: %s", self.name, backup, why)
        for targets in self._targets.values():
            if backup in targets:
                targets.remove(backup)
        self.control.send("replica_lost", {"server": backup, "reason": why})
        for request in self.primary.drop(backup):
            self._reply(request)

    def _handle_peer(self, identity: bytes, frames: list, msg: Message) -> None:
        """A message on another server's replication link."""
        frame = frames[0]
        match = _SERVER_ID.fullmatch(identity)
        peer = int(match[1]) if match else -1
        if not 0 <= peer < len(self.chains) or peer in self.dead:
            return  # a stranger, or a server failed over (fenced): nothing it says counts
        try:
            if self.gate is not None:
                user = frame.get("User-Id")
                if self.cfg.encrypt and user != f"server-{peer}":
                    raise auth.Refused(f"server-{peer} refused: the connection is {user!r}")
                self._connection = (user, frame)
                if not self.cfg.encrypt and msg.kind not in ("hello", "auth"):
                    if self._peer_proved.get(peer) != user:
                        raise auth.Refused(f"{msg.kind} from server-{peer}: link not proved")
            if msg.kind == "hello":
                self._on_hello(identity, peer, msg)
            elif msg.kind == "auth":
                connection, frame = self._connection
                challenge = self._challenges.pop(connection, None)
                tokens = self.gate.peer_tokens if self.gate is not None else []
                token = tokens[peer] if peer < len(tokens) else ""
                wrong = auth.check_proof(token, challenge, peer, msg.body.get("proof"), "server")
                if wrong:
                    self.gate.refuse(_peer_of(frame), f"server-{peer}: {wrong}")
                    raise auth.Refused(f"auth refused: {wrong}")
                self._peer_proved[peer] = connection
                self._send(identity, Message("ack", msg.id, self.name))
            elif msg.kind == "replica":
                epoch = msg.body.get("epoch")
                if type(epoch) is int and epoch > self.epoch:  # a failover not heard of yet:
                    self._deferred.append((identity, frames, None))  # kept whole, arrays and all
                    return
                self._on_replica(identity, peer, msg)
            else:
                raise ValueError(f"unexpected {msg.kind!r} on a replication link")
        except (ValueError, TypeError, KeyError) as exc:
            self._error(identity, msg, f"{msg.kind} from server {peer} refused: {exc}")
        except Exception as exc:  # an apply that raised: this copy is behind, say so
            log.exception("%s: %s from server %d failed", self.name, msg.kind, peer)
            self._error(identity, msg, f"{msg.kind} failed: {type(exc).__name__}: {exc}")

    def _on_replica(self, identity: bytes, peer: int, msg: Message) -> None:
        """A primary's applied rounds: apply the same inputs, in order, then acknowledge.
        Everything is checked before anything is applied."""
        home, entries = msg.body["home"], msg.body["entries"]
        if type(home) is not int or acting(home, self.chains, self.dead) != peer:
            raise ValueError(f"server {peer} does not answer for server {home!r:.20}'s parts")
        if not isinstance(entries, list):
            raise ValueError("replica: entries must be a list")
        checked, arrays = [], iter(msg.arrays)
        for entry in entries:
            if (
                not isinstance(entry, list)
                or len(entry) not in (5, 6)
                or type(entry[2]) is not bool
                or type(entry[4]) is not bool
            ):
                raise ValueError(f"replica: bad entry {entry!r:.80}")
            key = (entry[0], entry[1])
            held = self.backup.passive.get(key)
            if held is None or held[0] != home:
                raise KeyError(f"replica: key {_show(key)} is no copy of server {home}'s here")
            pushes = entry[3]
            if not isinstance(pushes, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(type(x) is int for x in p)
                for p in pushes
            ):
                raise ValueError(f"replica: bad pushes {pushes!r:.80}")
            if key in self.rows.tables:
                value = self._replica_rows(key, entry, arrays)
                if "load" in value and (entry[2] or len(pushes) != 1):
                    raise ValueError(f"replica: key {_show(key)}: a load is one worker's")
            elif len(entry) == 5:
                value, stored = next(arrays, None), self.stored[key]
                if value is None or value.dtype != stored.dtype or value.size != stored.size:
                    got = "no array" if value is None else f"{value.size} x {value.dtype}"
                    raise ValueError(f"replica: key {_show(key)}: got {got}")
                value = value.reshape(-1)
            else:
                raise ValueError(f"replica: key {_show(key)} is a dense key here, not row-sparse")
            checked.append((key, value, entry[2], pushes, entry[4]))
        states = msg.body.get("states")
        blob = next(arrays, None) if states is not None else None
        if next(arrays, None) is not None:
            raise ValueError("replica: more arrays than its entries describe")
        spec, calls = msg.body.get("optimizer"), msg.body.get("calls", 0)
        if spec is not None:  # (between the rounds around it)
            if type(calls) is not int:
                raise ValueError(f"replica: bad optimizer calls {calls!r:.20}")
            self._set_home_optimizer(home, calls, spec)
        if states is not None:  # load_optimizer_states, between the rounds around it
            failed = msg.body.get("failed", "")
            if (
                not isinstance(states, list)
                or len(states) != 2
                or not all(type(x) is int for x in states)
                or blob is None
                or type(failed) is not str
            ):
                raise ValueError(f"replica: bad states {states!r:.40}")
            updater = self.backup_updaters.get(home)
            if updater is None:
                raise ValueError(f"replica: states of server {home}'s parts, but no optimizer")
            why = self._load_states(updater, home, blob.tobytes())
            if why != failed:
                raise RuntimeError(
                    f"the copy here cannot follow its primary's load_optimizer_states (there: "
                    f"{failed or 'loaded'}; here: {why or 'loaded'})"
                )
            self.backup.loaded((None, home), *states)
        for key, value, accumulate, pushes, applied in checked:
            if key not in self.rows.tables:
                if applied:  # else the primary could not apply it either: counted, not applied
                    self._apply(Apply(key, value, accumulate))
            elif "load" in value:  # load_rows, in its place among the rounds; no round
                why = self._load_rows(key, value["load"], *value["rows"])
                if why != value["failed"]:
                    raise RuntimeError(
                        f"key {_show(key)}: the copy here cannot follow its primary's load "
                        f"(there: {value['failed'] or 'loaded'}; here: {why or 'loaded'})"
                    )
                self.backup.loaded(key, *pushes[0])
                continue
            else:  # the same apply, even of a round the primary failed (a partial apply
                # leaves the same partial state): the same outcome, or this copy is no replica
                why = self._apply_rows(Apply(key, None, accumulate), value["pushes"])
                if why != value.get("failed", ""):
                    raise RuntimeError(
                        f"key {_show(key)}: the copy here cannot follow its primary's "
                        f"(there: {value.get('failed') or 'applied'}; here: {why or 'applied'})"
                    )
            self.backup.received(key, accumulate, pushes)
        self._send(identity, Message("ack", msg.id, self.name))

    def _replica_rows(self, key: tuple, entry: list, arrays) -> dict:
        """A forwarded entry of a row-sparse key, checked: a round's ``{"pushes": [(rank,
        ids, rows, normal)], "failed": why}``, or a load's ``{"load": step, "rows": (ids,
        rows)}``."""
        table, extra = self.rows.tables[key], entry[5] if len(entry) == 6 else None
        if not isinstance(extra, dict):
            raise ValueError(f"replica: key {_show(key)}: a row-sparse entry needs a map")

        def rows_of():
            ids, rows = next(arrays, None), next(arrays, None)
            if rows is None:
                raise ValueError(f"replica: key {_show(key)}: fewer arrays than its entry says")
            self._check_rows(key, table.rows, table.dim, table.dtype, ids, rows, self._owned[key])
            return ids, rows

        if "load" in extra:
            step = extra["load"]
            if step is not None and (type(step) is not int or not 0 <= step < 2**31):
                raise ValueError(f"replica: key {_show(key)}: bad load step {step!r:.40}")
            failed = extra.get("failed", "")
            if type(failed) is not str:
                raise ValueError(f"replica: key {_show(key)}: bad load {extra!r:.80}")
            return {"load": step, "rows": rows_of(), "failed": failed}
        pushes, failed = extra.get("pushes"), extra.get("failed", "")
        if (
            not isinstance(pushes, list)
            or not all(
                isinstance(p, list) and len(p) == 2 and type(p[0]) is int and type(p[1]) is bool
                for p in pushes
            )
            or type(failed) is not str
        ):
            raise ValueError(f"replica: key {_show(key)}: bad row pushes {extra!r:.80}")
        if entry[2] and len(pushes) != 1:
            raise ValueError(f"replica: key {_show(key)}: an async push is one push")
        out = [(rank, *rows_of(), normal) for rank, normal in pushes]
        return {"pushes": out, "failed": failed}

    def _replicated_push(self, rank: int, msg: Message, grads: list, sync: bool):
        """A push under replicas: a re-sent one's keys already held are answered, not
        applied again; the rounds of the others are noted for the forwards."""
        held = 0
        if msg.body.get("resend") is True:
            fresh = [(k, g) for k, g in grads if not self.backup.duplicate(k, rank, msg.id)]
            held, grads = len(grads) - len(fresh), fresh
        self._pusher = (rank, msg.id)
        if sync:
            home_of, rounds = self.backup.home, self.rounds.keys
            for key, _ in grads:
                if self._targets.get(home_of.get(key, self.rank)):
                    self.primary.pushed(key, rank, rounds[key].pushed[rank], msg.id)
        return grads, held

    def _on_failover(self, msg: Message) -> None:
        """A new epoch: the dead servers' parts are answered for by the next live replica;
        this server stops forwarding to the dead, and takes over what is now its own."""
        epoch, dead = msg.body["epoch"], set(msg.body["dead"])
        if self.chains is None or epoch <= self.epoch:
            return
        released = []
        for backup in dead - self.dead:
            sock = self._peers.pop(backup, None)
            if sock is not None:
                self._poller.unregister(sock)
                sock.close(linger=0)
            self._backlog.pop(backup, None)
            released += self.primary.drop(backup)
        self.epoch, self.dead = epoch, dead
        mine = [h for h in range(len(self.chains)) if acting(h, self.chains, dead) == self.rank]
        self._targets = {
            h: [b for b in self.chains[h] if b != self.rank and b not in dead] for h in mine
        }
        taken = self.backup.take_over(set(mine))
        for home in mine:  # a set_optimizer its primary never forwarded (it died first,
            # or never got it): the workers' later pushes are for the one they set last
            if home != self.rank and self.optimizer_spec is not None:
                if len(self._optimizer_calls) > self._home_specs.get(home, (0, None))[0]:
                    self._set_home_optimizer(home, len(self._optimizer_calls), self.optimizer_spec)
        for key, members, rounds, arrivals in taken:  # (newcomers: as arrive left them)
            absent = self.backup.not_pushed(key, self.rounds.newcomers)
            self.rounds.add_key(key, members, rounds, arrivals, absent)
            self.primary.start(key, rounds)
        self._connect_peers()
        log.warning(
            "%s: epoch %d (%s): answering for servers %s now (%d key parts taken over)",
            self.name,
            epoch,
            msg.body["reason"],
            mine,
            len(taken),
        )
        for request in released:
            self._reply(request)
        deferred, self._deferred = self._deferred, []
        for identity, frames, via in deferred:
            self._handle(identity, frames, via)

    def _on_fenced(self, msg: Message) -> int:
        log.error("%s: %s", self.name, msg.body["reason"])
        return EXIT_PEER_LOST

    # ---- row-sparse keys (kvstore.sparse): a RowTable per (key, part = this server); the
    # rounds are Rounds' own, fed an empty array per push, while SparseKeys holds the rows
    def _row_keys(self, msg: Message, home: int | None = None) -> list[tuple]:
        """The row-sparse keys a request names, checked; ``home``: it writes server
        ``home``'s parts, copies included (else a copy is refused: its primary answers)."""
        keys = [tuple(k) for k in msg.body["keys"]]
        if not keys:  # Rounds would answer a request of no keys never
            raise ValueError(f"{msg.kind}: no keys")
        if msg.kind == "sparse_rows" and len(keys) != 1:
            raise ValueError(f"sparse_rows: one key per request, got {len(keys)}")
        for key in keys:
            if key not in self.rows.tables:
                if key in self.stored:
                    raise KeyError(
                        f"key {_show(key)} is a dense key here, but this request is a "
                        "row-sparse key's: did every worker init it the same way?"
                    )
                raise KeyError(f"row-sparse key {_show(key)} was never initialised on this server")
            if home is not None:
                if self.backup.home.get(key, self.rank) != home:
                    raise KeyError(f"key {_show(key)} is no part of server {home}'s here")
            elif key in self.backup.passive:
                raise KeyError(
                    f"key {_show(key)} is a backup copy on this server: server "
                    f"{self.backup.passive[key][0]} answers for it"
                )
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice in one request")
        return keys

    def _rows_of(self, key: tuple, ids: np.ndarray, rows=None) -> None:
        """Check a request's row ids (and rows) for ``key``: sorted, unique, in range, and
        this server's (sharding.row_server, or its range: sharding.row_bounds)."""
        table = self.rows.tables[key]
        self._check_rows(key, table.rows, table.dim, table.dtype, ids, rows, self._owned[key])

    def _check_rows(self, key: tuple, nrows: int, dim: int, dtype, ids, rows, owned) -> None:
        """``owned``: the ids this server holds, ``(low, high)``, for a range-sharded key;
        None for a hashed one."""
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise ValueError(f"key {_show(key)}: row ids must be 1-D int64, got {ids.dtype}")
        servers = self.cfg.num_server if owned is None else 1
        bad = rowsearch.check(ids, nrows, servers, key[1])
        if bad == rowsearch.ORDER:
            hint = (
                f" (the key's {nrows} rows: did every worker init it with that shape?)"
                if ids[0] < 0 or ids[-1] >= nrows
                else ""
            )
            raise ValueError(
                f"key {_show(key)}: row ids must be sorted, unique and in [0, {nrows}){hint}"
            )
        if bad == rowsearch.SERVER:
            raise ValueError(
                f"key {_show(key)}: row ids of another server (the key is sharded by "
                "hash here: did every worker init it with the same sharding?)"
            )
        if owned is not None and ids.size and (ids[0] < owned[0] or ids[-1] >= owned[1]):
            raise ValueError(  # sorted: the first and the last say it
                f"key {_show(key)}: row ids of another server (this one holds "
                f"[{owned[0]}, {owned[1]}) of the key, sharded by range: did every "
                "worker init it with the same sharding?)"
            )
        if rows is not None and (rows.dtype != dtype or rows.shape != (ids.size, dim)):
            raise ValueError(
                f"key {_show(key)}: got rows {rows.shape} x {rows.dtype}, expected "
                f"{ids.size} x {dim} x {dtype}"
            )

    def _on_sparse_init(self, identity, rank, msg) -> None:
        """Every key, meta and row set is checked before any key is made. A group's keys
        (``members``) are initialised by every member: the first init makes a key, the same
        init again (same group, shape, dtype and init spec) is answered as done."""
        keys, metas = [tuple(k) for k in msg.body["keys"]], msg.body["meta"]
        members, arrivals = self._group_of(msg, rank)
        home = self._home_of(msg)  # with replicas: a copy of server home's parts
        if len(metas) != len(keys) or len(msg.arrays) != 2 * len(keys):
            raise ValueError("sparse_init: one meta and two arrays (ids, rows) per key")
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice in one request")
        made = []
        for i, (key, meta) in enumerate(zip(keys, metas, strict=True)):
            if len(key) != 2:
                raise ValueError(f"sparse_init: a key is [key, part], got {list(key)!r:.60}")
            if key[1] != home:
                whose = "this server's" if home == self.rank else f"server {home}'s"
                raise ValueError(
                    f"part {key[1]!r:.20} of key {key[0]!r:.60} is not {whose}: "
                    f"server {home} holds part {home} of every row-sparse key"
                )
            if key in self.stored:
                raise ValueError(f"key {_show(key)} is already initialised")
            if not isinstance(meta, list) or len(meta) != 4:
                raise ValueError(f"key {_show(key)}: meta must be [rows, dim, dtype, init]")
            rows, dim, dtype, init = meta
            if type(rows) is not int or type(dim) is not int or rows < 0 or dim < 0:
                raise ValueError(f"key {_show(key)}: bad shape ({rows!r}, {dim!r})")
            dtype = np.dtype(dtype)
            if dtype.kind not in "fc":
                raise ValueError(f"key {_show(key)}: a row-sparse key holds floats, not {dtype}")
            init = check_init(init)
            table = self.rows.tables.get(key)
            if table is not None:
                if not (
                    members is not None
                    and self._members_of_key(key) == members
                    and (table.rows, table.dim, table.dtype, table.init) == (rows, dim, dtype, init)
                ):
                    raise ValueError(f"key {_show(key)} is already initialised")
                continue  # a group's key another member made
            bounds = bounds_of(init.get("sharding", "hash"), rows, self.cfg.num_server)
            owned = None if bounds is None else (bounds[key[1]], bounds[key[1] + 1])
            ids, data = msg.arrays[2 * i], msg.arrays[2 * i + 1]
            self._check_rows(key, rows, dim, dtype, ids, data, owned)
            made.append((key, rows, dim, dtype, init, ids, data, owned))
        for key, rows, dim, dtype, init, ids, data, owned in made:
            self._owned[key] = owned
            self.rows.add_key(key, rows, dim, dtype, init).assign(ids, data)
            self._enter_key(key, home, msg, members, arrivals)
        self._send(identity, Message("ack", msg.id, self.name))

    @metrics.served
    def _on_sparse_push(self, identity, rank, msg) -> None:
        keys = self._row_keys(msg)
        if len(msg.arrays) != 2 * len(keys):
            raise ValueError(f"sparse_push: {len(keys)} keys need {2 * len(keys)} arrays")
        sync = bool(msg.body.get("sync", True))
        shared = self._shared_rows(msg, keys, rank) if msg.body.get("shm") else ()
        for i, key in enumerate(keys):
            ids, data = msg.arrays[2 * i], msg.arrays[2 * i + 1]
            self._rows_of(key, ids, data)
            up = self._updater_of(key)
            if up is not None:  # refused now, not when its round is applied
                check_optimizer(up.optimizer, self.rows.tables[key].dtype)
        grads = [(key, self.rows.placeholder(self.rows.tables[key].dtype)) for key in keys]
        if "entered" in msg.body:
            self._expect(msg.body["entered"], grads)
        held = 0
        if self.chains is not None:  # a re-sent push's keys already held: answered only
            grads, held = self._replicated_push(rank, msg, grads, sync)
        before = [self.rounds.keys[key].pushed[rank] for key, _ in grads]
        actions = self.rounds.push(
            Request(identity, msg), rank, grads, sync, time.monotonic(), None, held
        )
        # the rows are filed only where the rounds took the push (not after join(), not into
        # a dead round, not with another staleness); Apply actions run after, in _execute
        index = {key: i for i, key in enumerate(keys)} if held else None
        for j, (key, _) in enumerate(grads):
            round_ = self._took(key, rank, before[j], sync, actions)
            if round_ is not None:
                i = j if index is None else index[key]
                ids, rows = msg.arrays[2 * i], msg.arrays[2 * i + 1]
                self.rows.add(key, round_, rank, ids, rows, sync, 2 * i + 1 in shared)
        self._execute(actions)

    def _shared_rows(self, msg: Message, keys: list, rank: int) -> set:
        """Put in ``msg.arrays`` the rows a same-host worker left in shared segments
        (``shm``: ``[array index, segment, sequence, segment bytes]``), as read-only views:
        the worker writes a segment again only once this push is answered, i.e. after its
        round (the view is not kept past it). A key's bigger segment replaces its last.
        Returns the indices replaced: their rows are ``0 +`` themselves (the worker wrote
        them so), a round scatters them as they are."""
        entries = msg.body["shm"]
        if not isinstance(entries, list):
            raise ValueError("shm: expected a list of [index, segment, sequence, bytes]")
        for entry in entries:
            if (
                not isinstance(entry, list)
                or len(entry) != 4
                or type(entry[0]) is not int
                or not 0 <= entry[0] < len(msg.arrays)
                or entry[0] % 2 != 1
                or type(entry[2]) is not int
                or type(entry[3]) is not int
                or entry[3] < 0
            ):
                raise ValueError(f"shm: bad entry {entry!r:.80}")
            index, name, seq, nbytes = entry
            key, ids, empty = keys[index // 2], msg.arrays[index - 1], msg.arrays[index]
            table = self.rows.tables[key]
            if empty.dtype != table.dtype or empty.shape != (0, table.dim):
                raise ValueError(
                    f"key {_show(key)}: got {empty.dtype} rows {empty.shape} through shared "
                    f"memory, expected (0, {table.dim}) x {table.dtype}"
                )
            segment = self._segments.get(name)
            if segment is None:
                segment = shm.open_for(name, rank, nbytes)
                old = self._shm_of.get((rank, key))
                if old is not None:  # its worker answered and closed it: grown
                    self._segments.pop(old.name, None)
                    old.close()
                self._segments[name] = segment
            need = ids.size * table.dim * table.dtype.itemsize
            if segment.nbytes != nbytes or need > nbytes or int(segment.counters[0]) != seq:
                raise ValueError(f"shm: segment {name} does not hold push {seq} of {_show(key)}")
            view = segment.push[:need].view(table.dtype).reshape(ids.size, table.dim)
            view.flags.writeable = False
            msg.arrays[index] = view
            self._shm_of[(rank, key)] = segment
        return {entry[0] for entry in entries}

    def _took(self, key: tuple, rank: int, before: int, sync: bool, actions: list) -> int | None:
        """The round ``Rounds.push`` took ``rank``'s push of ``key`` into (``before``: the
        rank's pushes of it before; an elastic newcomer's first push goes to the round in
        progress, not its own count), or None when it did not take it (0 for an async push
        it applies)."""
        if not sync:  # applied on arrival: an Apply for the key
            took = any(isinstance(a, Apply) and a.key == key and a.accumulate for a in actions)
            return 0 if took else None
        state = self.rounds.keys[key]
        if state.pushed[rank] <= before:
            return None
        round_ = state.pushed[rank] - 1
        if state.dead_from is not None and round_ >= state.dead_from:
            return None
        return round_

    @metrics.served
    def _on_sparse_pull(self, identity, rank, msg) -> None:
        """``sparse_pull`` (arrays: the row ids per key) and ``sparse_rows`` (the rows changed
        since a step) wait, as a pull, for the rounds this worker pushed."""
        keys = self._row_keys(msg)
        if msg.kind == "sparse_pull":
            if len(msg.arrays) != len(keys):
                raise ValueError(f"sparse_pull: {len(keys)} keys need {len(keys)} id arrays")
            for key, ids in zip(keys, msg.arrays, strict=True):
                self._rows_of(key, ids)
        elif msg.body["since"] < -1:  # -1: every stored row
            raise ValueError(f"sparse_rows: since must be a step >= -1, got {msg.body['since']}")
        self._execute(self.rounds.pull(Request(identity, msg), rank, keys))

    def _on_sparse_load(self, identity, rank, msg) -> None:
        """``load_rows``. With replicas it is forwarded like a round, in its place among
        them (a backup loads it where its primary did), and answered once the backups hold
        it; a re-sent load the acting server already holds is answered, not loaded again (it
        would undo the rounds applied since)."""
        keys = self._row_keys(msg)
        if len(msg.arrays) != 2 * len(keys):
            raise ValueError(f"sparse_load: {len(keys)} keys need {2 * len(keys)} arrays")
        step = msg.body.get("step")
        if step is not None and (type(step) is not int or not 0 <= step < 2**31):
            raise ValueError(f"sparse_load: step must be an int in [0, 2**31), got {step!r:.40}")
        for i, key in enumerate(keys):
            self._rows_of(key, msg.arrays[2 * i], msg.arrays[2 * i + 1])
        forwards: dict | None = None if self.chains is None else {}
        again, failed = msg.body.get("resend") is True, ""
        for i, key in enumerate(keys):
            if again and self.backup.duplicate_load(key, rank, msg.id):
                continue
            ids, rows = msg.arrays[2 * i], msg.arrays[2 * i + 1]
            why = self._load_rows(key, step, ids, rows)
            failed = failed or why
            home = self.backup.home.get(key, self.rank)
            if forwards is not None and self._targets.get(home):
                load = {"load": step, "failed": why} if why else {"load": step}
                entry = [key[0], key[1], False, [[rank, msg.id]], not why, load]
                forwards.setdefault(home, []).append((entry, key, [ids, rows], False))
        if forwards:
            self._send_forwards(forwards)
        if failed:
            raise RuntimeError(f"load_rows failed: {failed}")
        for ready in self.primary.answer(Request(identity, msg), keys):
            self._reply(ready)

    def _load_rows(self, key: tuple, step: int | None, ids, rows) -> str:
        """Load rows (and a step) into ``key``'s table; why it failed part way, if it did
        (MemoryError, the 2**31-row limit: the step may have moved, some rows made): a
        backup loads the same and must fail alike."""
        table = self.rows.tables[key]
        try:
            if step is not None:
                table.restore_step(step)
            table.assign(ids, rows)
        except Exception as exc:
            log.exception("%s: load_rows of %s failed", self.name, _show(key))
            return f"{type(exc).__name__}: {exc}"
        return ""

    def _apply_rows(self, action: Apply, forwarded=()) -> str:
        """A round of a row-sparse key: sum its pushes by rank, update the touched rows.
        Returns why it failed ("" when it did not): the requests waiting for it are failed
        with that (the round's pushes are dropped; the next round applies as usual).
        ``forwarded``: on a backup, the round's pushes as its primary forwarded them."""
        key, sync = action.key, not action.accumulate
        table = self.rows.tables[key]
        which = "an async push" if action.accumulate else f"round {self.rows.rounds_done[key]}"
        for rank, ids, rows, normal in forwarded or ():
            self.rows.add(key, self.rows.rounds_done[key], rank, ids, rows, sync, normal)
        up = self._updater_of(key)
        try:
            if up is None:
                self.rows.apply(key, action.accumulate)
            else:
                t = up.counts[key] = up.counts.get(key, 0) + 1
                up.num_update = max(up.num_update, t)
                lr = up.optimizer.learning_rate(up.num_update)
                self.rows.apply(key, action.accumulate, up.optimizer, t, lr)
        except Exception as exc:  # MemoryError, the 2**31-row limit: the server serves on
            log.exception("%s: applying %s of %s failed", self.name, which, _show(key))
            return (
                f"{which} of row-sparse key {_show(key)} could not be applied: "
                f"{type(exc).__name__}: {exc}"
            )
        if self.rows.grown(table):
            trim()  # the superseded index arrays: back to the kernel, not kept resident
        return ""

    def _reply_rows(self, req: Request) -> None:
        msg = req.msg
        if msg.kind == "sparse_load" or (msg.kind == "sparse_push" and not msg.body.get("pull")):
            self._send(req.identity, Message("ack", msg.id, self.name))
            return
        keys = [tuple(k) for k in msg.body["keys"]]
        body: dict = {"keys": msg.body["keys"]}
        if msg.kind != "sparse_rows":
            # a same-host worker reads them from the pull region of the key's segment (it has
            # no other reply of the key in flight), where they fit: gathered straight there;
            # a push's rows after a round without an optimizer go as a delta (the rows that
            # are not 0 + the worker's own: those other pushes touched too), by position
            regions = self._pull_regions(req, keys) if self._shm_of else {}
            pushpull = msg.kind == "sparse_push"  # the rows pushed, after the round
            arrays = []
            for i, key in enumerate(keys):
                table, region = self.rows.tables[key], regions.get(i)
                ids = msg.arrays[2 * i] if pushpull else msg.arrays[i]
                delta = table.pushed_delta(ids) if pushpull else None
                if delta is not None:
                    at, rows = delta
                    body.setdefault("delta", []).append([i, at.astype("<i4").tobytes()])
                    arrays.append(rows)
                    continue
                out, need = None, ids.size * table.dim * table.dtype.itemsize
                if region is not None and need <= region.nbytes:
                    out = region[:need].view(table.dtype).reshape(ids.size, table.dim)
                rows = table.pushed_rows(ids, out) if pushpull else table.read(ids, out)
                if out is not None:
                    body.setdefault("shm", []).append([i, ids.size])
                    rows = rows[:0]
                arrays.append(rows)
        else:  # sparse_rows: the rows changed after a step (-1: every row), and the step now
            table = self.rows.tables[keys[0]]
            since = None if msg.body["since"] == -1 else msg.body["since"]
            arrays = list(table.changed_since(since))  # the worker checks since <= step
            body["step"] = table.step
        kind = "ack" if msg.kind == "sparse_rows" else "data"  # ack: ids and rows, one key
        # the rows are gathered copies, never written again: no trackers
        self._send(req.identity, Message(kind, msg.id, self.name, body, arrays), track=False)


def _keys_of(request: Request) -> list:
    """The keys a request names (what its answer shows or confirms)."""
    return [tuple(k) for k in request.msg.body.get("keys") or ()]


def _members_of(raw, rank: int, num_workers: int) -> tuple | None:
    """An init's group of ranks, checked: sorted, distinct, in range, the sender's among them."""
    if raw is None:
        return None
    if (
        not isinstance(raw, list)
        or not raw
        or any(type(r) is not int or not 0 <= r < num_workers for r in raw)
        or sorted(set(raw)) != raw
    ):
        raise ValueError(
            f"members: expected sorted distinct ranks in [0, {num_workers}), got {raw!r:.80}"
        )
    if rank not in raw:
        raise ValueError(
            f"members: worker {rank} initialises a key of the group {raw}, not its own"
        )
    return tuple(raw)


def _staleness(msg: Message) -> int | None:
    """``dist_ssp``'s bound a request carries (None: not ``dist_ssp``; -1: unbounded)."""
    s = msg.body.get("ssp")
    if s is None:
        return None
    if type(s) is not int or not -1 <= s < 2**31:
        raise ValueError(f"ssp: expected a staleness bound in [-1, 2**31), got {s!r:.40}")
    return s


def _peer_of(frame) -> bytes:
    """The address of the peer a message came from (``host:port``), for the refusal log."""
    try:
        return frame.get("Peer-Address").encode()
    except (zmq.ZMQError, AttributeError):
        return b"?"


def _in_segment(array: np.ndarray) -> bool:
    """Whether ``array`` is a view of a shared segment (an mmap) rather than our own memory."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, mmap.mmap)


def _show(key) -> str:
    key, part = key
    return f"{key!r}" if part == 0 else f"{key!r} (part {part})"


def main() -> int:
    try:
        cfg = Config.from_env()
    except ValueError as exc:
        print(f"kvstore.server: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(cfg.verbose, "server")
    warn_if_insecure(cfg, log)
    tune_allocator()
    batch(cfg.sched_batch)
    try:
        server = Server(cfg)
    except OSError as exc:  # the port is taken: permanent
        print(f"kvstore.server: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KVStoreError as exc:  # the scheduler's name never resolved: transient
        print(f"kvstore.server: {exc}", file=sys.stderr)
        return exit_code_of(exc)
    try:
        return server.run()
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
