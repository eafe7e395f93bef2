"""The distributed store a worker uses: ``dist_sync``, ``dist_device_sync``, ``dist_ssp``,
``dist_async``.

:class:`DistStore` is a driver: it owns the sockets (one DEALER per server, the pipe to the
control thread), the shared segments and one wait loop; what to send and what a reply means
are decided without I/O in :mod:`kvstore.plan`.

The path of one ``kv.push``: :meth:`KVStore.push` (``store.py``) checks the arguments against
the initialised keys; :meth:`DistStore._push` sums each key's device arrays (on the device for
``dist_device_sync``) and asks :meth:`Planner.push <kvstore.plan.Planner.push>` for one message
per server; :meth:`DistStore._commit` writes the shared segments, sends every message without
copying, and only then keeps the compression residuals. On the server (``server.py``) the push
becomes an event of its round machine.

A call that fails half-way (a server refused a push, a send failed) leaves this worker's
rounds different from server to server, so the store is marked failed and every later call
raises that cause; a failed or interrupted pull cancels its :class:`~kvstore.plan.Collector`,
so a late reply never writes into the caller's arrays.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator

import msgpack
import numpy as np
import zmq

from . import auth, channel, metrics, shm, sparse, transport
from .arrays import namespace, reduce_sum, to_host
from .config import Config, setup_logging, staleness_of, warn_if_insecure
from .control import Control, raise_for
from .cpu import batch
from .errors import ConfigError, KVStoreError, PeerLostError, exit_code_of
from .memory import tune_allocator
from .optimizer import Optimizer
from .plan import Collector, Outgoing, Planner, ReplyError
from .protocol import Message, ProtocolError, decode, encode_frames, internal, request_ids
from .sharding import acting
from .store import KVStore, Pending, RowsItem

log = logging.getLogger("kvstore.worker")

# Requests whose refusal by one server leaves the servers disagreeing (rounds, optimizer):
# the store fails with it.
_MUTATING = frozenset(
    {"init", "push", "pushpull", "optimizer", "set_states"}
    | {"sparse_init", "sparse_push", "sparse_load"}  # row-sparse keys
)
_PULLING = frozenset({"pull", "pushpull", "sparse_pull"})  # and a sparse_push with "pull"
_PUSHING = frozenset({"push", "pushpull", "sparse_push"})  # the requests a round counts
# Requests every live replica of a part gets its own copy of (or that prove one connection):
# after a failover, one to a dead server is not sent again.
_FANNED_OUT = frozenset({"init", "optimizer", "hello", "auth", "sparse_init"})


# The uncaught exception ending this process, if one is: a store closed at exit then reports
# the worker as failed (naming the exception) instead of finished.
_ending: list[str] = []


def _note_uncaught(kind, value, tb) -> None:
    """sys.excepthook while a distributed store may be open: note the exception (so the store,
    closed at exit, reports this worker as failed), print it as before, and for a KVStoreError
    or a bad setting exit with its code (``kvstore.errors``: 129 for a lost peer tells the
    platform to retry) instead of Python's 1."""
    _ending.append(_ended_by(kind, value))
    _previous_hook(kind, value, tb)
    code = exit_code_of(value) if isinstance(value, (KVStoreError, ConfigError)) else 1
    if code != 1:
        _exit_as_python_would(code)


def _ended_by(kind, value) -> str:
    """Why an exception ends this worker, as the others will read it ("worker 1 failed: it
    ..."): a KeyboardInterrupt (Ctrl-C, SIGINT) is an interruption, not an error of the
    script, and not a finish either (the others would be told to look for uneven data)."""
    if issubclass(kind, KeyboardInterrupt):
        return "was interrupted (KeyboardInterrupt: Ctrl-C or SIGINT)"
    return f"raised {kind.__name__}: {value}"[:400]


def _exit_as_python_would(code: int) -> None:
    """End the process with ``code`` after what the interpreter does at exit: wait for
    non-daemon threads, run the atexit handlers (the store's close among them), flush."""
    wait_for_threads = getattr(threading, "_shutdown", None)
    try:
        if wait_for_threads is not None:
            wait_for_threads()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken stream must not change the status
                pass
        os._exit(code)


_previous_hook = sys.excepthook


def _close_at_exit(ref) -> None:
    store = ref()
    if store is not None:
        store._close_quietly()


def create_dist(kind: str, staleness: int | float | str | None = None) -> KVStore:
    """Build the store for this process's ``DMLC_ROLE``; servers and schedulers never return."""
    if sys.excepthook is not _note_uncaught:  # first: a bad setting exits 2 too
        global _previous_hook
        _previous_hook, sys.excepthook = sys.excepthook, _note_uncaught
    cfg = Config.from_env()
    if cfg.role in ("server", "scheduler"):
        # MXNet compatibility: the same script is started for every role.
        from . import scheduler, server

        sys.exit((server if cfg.role == "server" else scheduler).main())
    setup_logging(cfg.verbose, "worker")
    warn_if_insecure(cfg, log)
    tune_allocator()
    batch(cfg.sched_batch)  # this thread, and the threads the store starts
    if staleness is not None:
        cfg = dataclasses.replace(cfg, staleness=staleness_of(staleness, "staleness"))
    return DistStore(kind, cfg)


class _Request:
    """A request in flight."""

    __slots__ = ("server", "kind", "collector", "on_reply", "segments", "msg", "sent_to")

    def __init__(
        self, server: int, kind: str, collector=None, on_reply=None, segments=(), msg=None, to=-1
    ):
        self.server, self.kind = server, kind
        self.collector: Collector | None = collector
        self.on_reply = on_reply  # a callable taking the reply Message
        self.segments = segments  # shared segments it names: mapped once answered
        self.msg = msg  # with replicas: the message, re-sent after a failover
        self.sent_to = server if to < 0 else to  # the server that has it


class _RowsBack:
    """A push of a row-sparse key that asked for its rows back: its requests, the collector
    of their replies and the pull item that collector writes."""

    __slots__ = ("requests", "collector", "pull", "read")

    def __init__(self, requests: list, collector, pull):
        self.requests, self.collector, self.pull = requests, collector, pull
        self.read = False  # a row_sparse_pull was served from it


class DistStore(KVStore):
    def __init__(self, kind: str, cfg: Config):
        super().__init__(kind)
        self.cfg = cfg
        ssp = kind == "dist_ssp"
        unbounded = ssp and cfg.staleness == float("inf")
        self._sync = kind != "dist_async" and not unbounded
        # dist_ssp's bound, the client's to keep (None: not dist_ssp, or unbounded and so
        # dist_async); the servers hear it with every request (-1: unbounded)
        self._staleness = int(cfg.staleness) if ssp and self._sync else None
        self._unacked: dict = {}  # dist_ssp: key -> ids of its last push's requests
        self._clocks: dict = {}  # dist_ssp: key -> this worker's pushes of it
        self._on_device = kind == "dist_device_sync"
        self._ctx = zmq.Context()
        self._cred = auth.Credential.make(cfg)
        try:
            # the store type and its bound: a worker of another kind is refused at once
            store = kind if self._staleness is None else f"{kind}:{self._staleness}"
            self._control = Control(self._ctx, cfg, "worker", 0, self._cred.public, store)
        except KVStoreError:
            self._ctx.term()
            raise
        self._closed = False
        self._failure: str | None = None
        self._failure_type: type[KVStoreError] = KVStoreError  # raised again on every call
        self._failure_known = False  # told by the scheduler: it needs no report of it
        self._sockets: list = []
        # same-host servers' channels (kvstore.channel): by server, and the server by fd
        self._channels: dict[int, channel.Channel] = {}
        self._channel_fds: dict[int, int] = {}
        # replies read from a channel and not yet handled: one per turn of the wait loop, as
        # ZeroMQ gives them (a reply that raises leaves the next ones for the next wait)
        self._inbox: collections.deque = collections.deque()
        # row-sparse keys (dist_sync): the last push's rows come back with its reply when the
        # key's last push was followed by a row_sparse_pull of its ids (see _pull_from_push)
        self._rows_back: dict = {}  # key -> _RowsBack of the last push, until the next send
        self._rows_ahead: set = set()  # keys whose pushes ask for their rows back
        self._rows_pushed: dict = {}  # key -> the ids of its last push (what it learns from)
        try:
            book = self._control.wait(f"kvstore.create({kind!r})", ("book",), cfg.start_timeout + 5)
        except KVStoreError:
            self._shutdown(finalize=False)
            raise
        self._rank = book.body["rank"]  # the slot: this worker's name to the servers
        self._num_workers = book.body["num_worker"]
        # elastic (KVSTORE_MIN_WORKERS): the slots held now; a worker that came after the
        # start (a book of a later epoch) finds its keys made and its peers training
        self._present = book.body.get("present")
        self._members_epoch = book.body.get("epoch", 0)
        self._late = self._present is not None and self._members_epoch > 0
        self._arrival = self._members_epoch if self._late else 0  # when it took its slot
        self._arrivals: dict = {}  # slot -> its holder's arrival, as the last reset agreed
        self._joined_epoch = self._members_epoch  # the epoch this worker came in
        # the membership epoch the servers must know before they act on this worker's
        # requests: its own arrival's, or a newcomer's it tells them of (_saw_entered)
        self._mepoch = self._joined_epoch if self._late else 0
        # elastic: the newcomers a server's reply said were in a completed round (slot ->
        # arrival epoch); every push tells the servers (Rounds.expect)
        self._entered: dict = {}
        self._entered_wire: list = []
        self._servers = [tuple(s) for s in book.body["servers"]]
        # KVSTORE_REPLICAS > 1: the servers holding each server's parts (kvstore.sharding);
        # a request goes to the live server acting for its server (_route), and is kept
        # until answered, to be re-sent after a failover
        self._chains = book.body.get("replicas")
        self._route = list(range(len(self._servers)))
        self._dead: set[int] = set()
        self._epoch = 0
        if self._chains and ssp:
            self._shutdown(finalize=False)
            raise ConfigError(
                "dist_ssp answers a push before its round is complete, so a server's replicas "
                "could lose it: with KVSTORE_REPLICAS > 1 use dist_sync or dist_async"
            )
        server_keys = book.body.get("server_keys") or [""] * len(self._servers)
        for (host, port), key in zip(self._servers, server_keys, strict=True):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"worker-{self._rank}".encode())
            sock.setsockopt(zmq.LINGER, 1000)
            auth.worker_socket(sock, cfg, self._rank, self._cred, key)
            sock.connect(f"tcp://{host}:{port}")
            self._sockets.append(sock)
        self._poller = zmq.Poller()
        for sock in self._sockets:
            self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._control.pipe, zmq.POLLIN)
        failover = book.body.get("failover")  # an elastic newcomer after servers failed over
        if self._chains and failover:
            self._fail_over(failover["epoch"], set(failover["dead"]))
        self._ids = request_ids(self._arrival)
        self._requests: dict[int, _Request] = {}
        self._answers: dict[str, Message] = {}  # control answers (barrier_done, ...) by kind
        self._control_handlers = {
            "stall": self._on_stall,
            "failover": self._on_failover,
            "members": self._on_members,
            "barrier_done": self._on_answer,
            "join_done": self._on_answer,
        }
        self._planner = Planner(
            len(self._servers),
            cfg.bigarray_bound,
            (),
            cfg.piece_bytes,
            -1 if unbounded else self._staleness,
        )
        self._residuals: dict = {}
        self._optimizer: Optimizer | None = None
        self._segments = shm.WorkerSegments(self._rank)
        self._shm_last: dict = {}  # (key, part) -> the last push that used its segment
        self._refused: dict = {}  # request id -> the error of a refusal every server gives
        self._optimizer_sent = False  # an elastic newcomer's first set_optimizer keeps the job's
        self._pull_last: dict = {}  # (key, part) -> the last request answered through it
        self._no_segment: set = set()  # parts whose segment /dev/shm had no room for
        local = self._hello()
        self._planner.set_shm_servers(local)
        log.info(
            "worker %d of %d connected to %d servers%s",
            self._rank,
            self._num_workers,
            len(self._servers),
            f" ({len(local)} on this host: shared memory, and {len(self._channels)} by a "
            "same-host channel)"
            if local
            else "",
        )
        # Horovod and MXNet scripts never close their store: close it when it is collected or
        # at exit, whichever comes first.
        atexit.register(_close_at_exit, weakref.ref(self))

    def _hello(self) -> set:
        """The servers that share this process's memory: each proves it by reading a probe
        segment this worker made (:func:`kvstore.shm.prove`). By default each server's reply
        also carries a challenge, and this worker proves its token on that connection
        (``auth``) before any other request (see :mod:`kvstore.auth`)."""
        local: set = set()
        proofs: dict = {}
        offers: dict = {}  # server -> [its channel's address, a secret]
        use_shm = self.cfg.shm and shm.available()

        def answer(server):
            def on_reply(msg):
                if use_shm and msg.body.get("shm") is True:
                    local.add(server)
                    offer = msg.body.get("channel")
                    if self.cfg.channel and isinstance(offer, list) and len(offer) == 2:
                        offers[server] = offer
                body = auth.answer(msg.body, self._cred, self._rank)
                if body is not None:
                    proofs[server] = body

            return on_reply

        probe, body = None, {"host": ""}
        if use_shm:
            try:
                probe, nonce = shm.make_probe(self._segments)
                body = {"host": shm.host_id(), "probe": probe.name, "nonce": nonce}
            except OSError as exc:  # no room, or no /dev/shm to write: TCP
                log.info("no shared memory (%s); every part goes through TCP", exc)
        live = [s for s in range(len(self._servers)) if s not in self._dead]
        ids = [self._send(s, "hello", body, on_reply=answer(s)) for s in live]
        try:
            self._wait("kvstore.create (hello)", ids)
        finally:
            if probe is not None:
                probe.unlink()
        ids = [self._send(s, "auth", body) for s, body in proofs.items()]
        self._wait("kvstore.create (auth)", ids)
        for server, (address, secret) in offers.items():
            self._open_channel(server, address, secret)
        return local

    def _open_channel(self, server: int, address, secret) -> None:
        """Talk to a same-host server by its channel from now on (kvstore.channel); where
        that fails (another network namespace, say), by ZeroMQ as before."""
        try:
            chan = channel.connect(address, self._rank, secret, min(self.cfg.request_timeout, 30))
        except OSError as exc:
            log.info("%s: no same-host channel (%s): TCP", self._server_name(server), exc)
            return
        self._channels[server] = chan
        self._channel_fds[chan.fd] = server
        self._poller.register(chan.fd, zmq.POLLIN)

    def _close_channel(self, server: int) -> None:
        chan = self._channels.pop(server, None)
        if chan is not None:
            del self._channel_fds[chan.fd]
            self._poller.unregister(chan.fd)
            chan.close()

    @property
    def rank(self) -> int:
        """This worker's place among the workers now (an elastic job renumbers them 0..N-1 in
        slot order at every change, as Horovod does)."""
        if self._present is None:
            return self._rank
        return self._present.index(self._rank) if self._rank in self._present else -1

    @property
    def num_workers(self) -> int:
        """The workers in the job now (an elastic job's changes as they come)."""
        return self._num_workers if self._present is None else len(self._present)

    def _member_space(self) -> tuple[int, int]:
        # the slots: the ranks of a fixed job; an elastic job's stay while its ranks move
        return self._num_workers, self._rank

    @property
    def epoch(self) -> int:
        """An elastic job's membership epoch: one more at every worker that joins or leaves."""
        return self._members_epoch

    # ---- sending
    def _send(
        self, server: int, kind: str, body: dict, arrays=(), on_reply=None, trackers=None
    ) -> int:
        """Send one message (not part of a multi-server call: see :meth:`_commit`)."""
        self._check_alive()
        msg_id = next(self._ids)
        if self._epoch:
            body = {**body, "epoch": self._epoch}
        if self._mepoch:  # the servers act on it once they know this worker (its epoch)
            body = {**body, "mepoch": self._mepoch}
        msg = Message(kind, msg_id, f"worker-{self._rank}", body, list(arrays))
        self._transmit(server, msg)
        kept = msg if self._chains else None
        self._requests[msg_id] = _Request(
            server, kind, None, on_reply, (), kept, self._route[server]
        )
        return msg_id

    def _transmit(self, server: int, msg: Message) -> list:
        # a message may change rows or order a change (its answer waited on): the rows a
        # push's reply brings are not read since; a row push is answered with no wait and
        # changes its own keys' rows only (_push_rows forgets those)
        if self._rows_back and msg.kind != "sparse_push":
            self._forget_rows_back()
        return self._send_to(self._route[server], msg)

    def _send_to(self, server: int, msg: Message) -> list:
        """Send ``msg`` to that very server: by its channel if it has one (what the socket does
        not take at once is copied and written by the channel's thread: a tracker of that),
        else by ZeroMQ (its trackers). A message to a server whose channel closed is lost, as with
        ZeroMQ (see below)."""
        chan = self._channels.get(server)
        try:
            if chan is None:
                return transport.send(self._sockets[server], msg)
            taken = chan.send(encode_frames(msg)[0])
            if not taken:
                raise zmq.Again
        except zmq.Again:
            raise PeerLostError(
                f"{msg.kind}: cannot send to {self._server_name(server)}: its queue "
                "is full (is it alive?)"
            ) from None
        except OSError as exc:
            # it closed (the server died): lost, as ZeroMQ loses what it queued to a dead
            # peer; the scheduler says what became of the server (a failover re-sends the
            # request, or the call fails naming the server), and the deadline still holds
            log.info("%s closed its same-host channel (%s)", self._server_name(server), exc)
            self._close_channel(server)
            return []
        return [] if taken is True else [transport.Sent(-1, taken)]

    def _commit(self, what: str, outgoing: Iterable[Outgoing], collector=None) -> tuple[list, list]:
        """Carry out a plan: write the shared segments, send every message as the plan gives
        it (a compressed push is quantised message by message, so one is on the wire while
        the next is quantised), then keep the compression residuals. A failure after the
        first send leaves the servers' rounds apart: the store is failed with its cause.
        Returns (request ids, trackers)."""
        self._check_alive()
        ids, trackers, kept = [], [], []
        sent_any = False
        retain, moved = self._chains is not None, self._dead  # with replicas: keep messages
        try:
            for out in outgoing:
                msg_id = next(self._ids)
                arrays = list(out.arrays)
                body = {"keys": out.wire, **out.body}
                here = out.server not in moved  # else its parts moved: TCP, no segment
                used = self._to_segments(out, arrays) if out.shared and here else []
                if out.shared:  # rows not written into a segment go by socket
                    arrays = sparse.gathered(arrays)
                if used:
                    body["shm"] = [entry for _, _, entry, _ in used]
                pulling = out.kind in _PULLING or out.body.get("pull") is True
                pulled = self._pull_regions(out) if pulling and here else ()
                if pulled:
                    body["shm_pull"] = pulled
                if self._mepoch:
                    body["mepoch"] = self._mepoch
                if self._entered_wire and out.kind in _PUSHING:
                    body["entered"] = self._entered_wire
                if retain:
                    if self._epoch:
                        body["epoch"] = self._epoch
                    if out.kind in ("push", "sparse_push"):  # these return before their
                        # answer (the caller may write its arrays again): keep a copy
                        arrays = [a.copy() if a.size else a for a in arrays]
                msg = Message(out.kind, msg_id, f"worker-{self._rank}", body, arrays)
                trackers.extend(s.tracker for s in self._transmit(out.server, msg))
                sent_any = True
                segments = tuple(seg for _, seg, _, _ in used)
                self._requests[msg_id] = _Request(
                    out.server,
                    out.kind,
                    collector,
                    None,
                    segments,
                    msg if retain else None,
                    self._route[out.server],
                )
                for where, _, _, _ in used:
                    self._shm_last[where] = msg_id
                for i in pulled:
                    self._pull_last[out.keys[i]] = msg_id
                if collector is not None:
                    collector.expect(msg_id, out.keys)
                    if out.kind == "sparse_push" and pulling:  # its reply may be a delta
                        collector.pushed(msg_id)
                ids.append(msg_id)
                kept.extend(out.residuals)
        except BaseException as exc:
            if collector is not None:
                collector.cancel()
            if sent_any and out.kind in _MUTATING:
                self._fail(
                    f"{what}: failed half-way ({exc}); the servers now hold different "
                    "rounds of this worker's keys: restart the job",
                    PeerLostError,
                )
            raise
        self._residuals.update(kept)
        return ids, trackers

    def _to_segments(self, out: Outgoing, arrays: list) -> list:
        """Move the big slices of ``out`` into their shared segments, where that is possible
        now: ``[((key, part), segment, body entry, region written)]``; the rest go through
        TCP. A dense part's entry is ``[array index, segment, sequence]``; a
        ``sparse_push``'s rows (array ``2i + 1``: key ``i``) add the segment's size, which
        grows with the rows pushed, and are written as ``0 +`` themselves."""
        used = []
        rows = out.kind == "sparse_push"
        for index in out.shared:
            where = out.keys[index // 2 if rows else index]
            last = self._shm_last.get(where)
            if where in self._no_segment or (last is not None and last in self._requests):
                continue  # no room, or the server has not answered the last push: TCP
            piece = arrays[index]
            try:
                if rows:
                    segment = self._row_segment(where, piece.nbytes)
                    if segment is None:
                        continue
                else:
                    segment = self._segments.get(where, piece.nbytes)
            except OSError as exc:
                self._no_segment.add(where)
                log.warning(
                    "no room in %s for key %r (%d bytes: %s); it goes through TCP",
                    shm.SHM_DIR,
                    where[0],
                    2 * piece.nbytes,
                    exc.strerror or exc,
                )
                continue
            if rows:  # 0 + the rows (the bits a round gives them): scattered as they are
                region = segment.push[: piece.nbytes].view(piece.dtype).reshape(piece.shape)
                if type(piece) is sparse.Picked:  # gathered here, 0 + in place (in cache)
                    piece.gather(out=region)
                    if not piece.normal:
                        np.add(piece.dtype.type(0), region, out=region)
                    piece = piece.source  # (its [:0] below: the rows' dtype and dim)
                else:
                    np.add(piece.dtype.type(0), piece, out=region)
            else:
                region = segment.push.view(piece.dtype)[: piece.size]
                np.copyto(region, piece)
            seq = int(segment.counters[0]) + 1
            segment.counters[0] = seq
            arrays[index] = piece[:0]  # the dtype travels, the bytes do not
            entry = [index, segment.name, seq] + ([segment.nbytes] if rows else [])
            used.append((where, segment, entry, region))
        return used

    def _row_segment(self, where: tuple, nbytes: int) -> shm.Segment | None:
        """The segment for a push of ``nbytes`` of rows of ``where``: its own, or a new one
        with a quarter to spare where that is too small (None, TCP, while a reply may still
        come through the old one's pull region)."""
        segment = self._segments.segments.get(where)
        if segment is not None and segment.nbytes >= nbytes:
            return segment
        if segment is not None:
            if self._pull_last.get(where) in self._requests:
                return None
            self._segments.segments.pop(where).close()
        spare = nbytes + nbytes // 4
        return self._segments.get(where, spare + -spare % 64)  # the pull region stays aligned

    def _pull_regions(self, out: Outgoing) -> list:
        """The indices of ``out``'s keys whose value may come back through the pull region of
        their segment: those with a segment and no other reply of theirs in flight (the
        server writes the region when it answers; a second reply in flight could overwrite
        it before the first is read)."""
        segments = self._segments.segments
        if not segments:
            return []
        return [
            i
            for i, where in enumerate(out.keys)
            if where in segments and self._pull_last.get(where) not in self._requests
        ]

    def _server_name(self, server: int) -> str:
        server = self._route[server]
        host, port = self._servers[server]
        return f"server {server} ({host}:{port})"

    def _check_alive(self) -> None:
        if self._closed:
            raise KVStoreError("the store is closed")
        if self._failure:
            raise self._failure_type(self._failure)

    def _fail(
        self, text: str, kind: type[KVStoreError] = KVStoreError, known: bool = False
    ) -> None:
        """Every later call raises ``text``; at the end the scheduler hears it (unless it was
        the scheduler's own news), so the other workers learn the cause at once."""
        if self._failure is None:
            self._failure, self._failure_type, self._failure_known = text, kind, known

    # ---- the one wait loop
    @metrics.traced("wait")
    def _wait(self, what: str, ids=None, trackers=(), answer: str | None = None) -> Message | None:
        """Collect replies until ``ids`` (default: every request in flight) are answered,
        ``trackers`` report their buffers sent and, with ``answer``, the scheduler has sent
        that control message (returned). Errors, failures and the deadline raise; the
        deadline (KVSTORE_TIMEOUT) starts again whenever the scheduler reports that the
        peers this call waits for are alive but slow."""
        self._check_alive()
        waiting = set(self._requests) if ids is None else set(ids)
        asked = tuple(waiting)
        try:
            return self._wait_for(what, waiting, trackers, answer, asked)
        finally:
            for i in asked:
                self._refused.pop(i, None)

    def _wait_for(self, what, waiting: set, trackers, answer, asked: tuple) -> Message | None:
        deadline = time.monotonic() + self.cfg.request_timeout
        trackers = list(trackers)
        while True:
            waiting &= self._requests.keys()
            trackers = [t for t in trackers if not t.done]
            if not waiting and not trackers and (answer is None or answer in self._answers):
                refused = [self._refused[i] for i in asked if i in self._refused]
                if refused and len(refused) < len(asked):  # taken by some servers: apart
                    text = f"{refused[0]} (other servers took it: the servers now differ)"
                    kind = type(refused[0])
                    self._fail(f"{text}; the store takes no more calls: restart the job", kind)
                    raise kind(text)
                if refused:  # every server refused it: nothing changed
                    raise refused[0]
                return self._answers.pop(answer) if answer is not None else None
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerLostError(self._deadline_text(what, waiting, answer))
            timeout = left
            if self._inbox:  # a reply read with others from a channel: one a turn
                self._on_reply(self._inbox.popleft(), what)
                continue
            if trackers:  # wake the moment ZeroMQ lets go of a buffer, not a tick later
                try:
                    trackers[0].wait(min(left, 0.05))
                except zmq.NotDone:
                    pass
                timeout = 0
            for sock, event in self._poller.poll(timeout * 1000):
                if type(sock) is int:
                    self._on_channel(sock, event, what)
                elif sock is self._control.pipe:
                    msg = self._control.recv()
                    handler = self._control_handlers.get(msg.kind, self._on_failure)
                    if handler(msg, what):
                        deadline = time.monotonic() + self.cfg.request_timeout
                else:
                    self._on_reply(transport.recv(sock), what)

    def _on_channel(self, fd: int, event: int, what: str) -> None:
        """A server's channel: its replies go to the inbox; at its end, close it (the
        scheduler says whether the server failed)."""
        server = self._channel_fds.get(fd)
        if server is None:  # closed by an earlier event of this poll
            return
        chan = self._channels[server]
        try:
            self._inbox.extend(chan.receive())
        except (OSError, ValueError) as exc:
            log.warning("%s: channel to %s: %s", what, self._server_name(server), exc)
            self._close_channel(server)
            return
        if chan.closed:
            log.info("%s: %s closed its same-host channel", what, self._server_name(server))
            self._close_channel(server)

    def _deadline_text(self, what: str, waiting: set, answer: str | None) -> str:
        servers = sorted({self._requests[i].server for i in waiting})
        names = [self._server_name(s) for s in servers]
        if answer is not None and not waiting:
            names.append(f"the scheduler at {self.cfg.scheduler_address}")
        if not names:  # only the trackers of arrays sent without a copy: still queued
            return (
                f"{what}: the arrays sent are still queued in ZeroMQ after "
                f"{self.cfg.request_timeout:g}s (KVSTORE_TIMEOUT): is the server reading "
                "from the network?"
            )
        return (
            f"{what}: no reply from {', '.join(names) or 'the network'} within "
            f"{self.cfg.request_timeout:g}s (KVSTORE_TIMEOUT), and no word that the peers it "
            "waits for are alive"
        )

    # ---- control messages: a handler returns True when the call's deadline starts again
    def _on_stall(self, msg: Message, what: str) -> bool:
        """A peer this call waits for is alive, only slow: keep waiting (and say so, at the
        scheduler's KVSTORE_STALL_REPORT cadence)."""
        level = logging.WARNING if msg.body.get("log", True) else logging.DEBUG
        log.log(level, "%s: %s", what, msg.body["message"])
        return True

    def _on_failover(self, msg: Message, what: str) -> bool:
        """Servers were failed over (a new epoch): their parts are answered by the next live
        replica; every request they had not answered is re-sent there, in order (the same
        ids: a push already applied there is answered, not applied again)."""
        epoch, dead = msg.body["epoch"], set(msg.body["dead"])
        if not self._chains or epoch <= self._epoch:
            return False
        newly = self._fail_over(epoch, dead)
        again = []
        for msg_id, request in sorted(self._requests.items()):
            if request.sent_to not in newly:
                continue
            if request.kind in _FANNED_OUT:  # every live replica has its own copy of it
                del self._requests[msg_id]
            else:
                again.append(request)
        log.warning(
            "%s: %s; failed over to its replicas (epoch %d): re-sending %d unanswered request(s)",
            what,
            msg.body["reason"],
            epoch,
            len(again),
        )
        for request in again:
            self._resend(request)
        return True

    def _fail_over(self, epoch: int, dead: set) -> set:
        """Route every server's requests to the live replica acting for it from ``epoch``
        on, and close the sockets of the newly dead; returns them."""
        newly = dead - self._dead
        self._epoch, self._dead = epoch, dead
        for server in range(len(self._servers)):
            self._route[server] = acting(server, self._chains, dead)
        for server in newly:
            self._close_channel(server)
            sock = self._sockets[server]
            self._poller.unregister(sock)
            sock.close(linger=0)
        return newly

    def _resend(self, request: _Request) -> None:
        """Send a request again, to the server now acting for its own, over TCP."""
        old = request.msg
        body = {**old.body, "resend": True, "epoch": self._epoch}
        body.pop("shm_pull", None)
        arrays = list(old.arrays)
        for (index, *_), segment in zip(body.pop("shm", ()), request.segments, strict=True):
            if old.kind == "sparse_push":  # ids before it; an empty (0, dim) block of rows
                shape = (arrays[index - 1].size, arrays[index].shape[1])
                count = shape[0] * shape[1]
                rows = segment.push.view(arrays[index].dtype)[:count].reshape(shape)
                arrays[index] = rows.copy()
                continue
            key, part = old.body["keys"][index]
            lo, hi = self._planner.parts[key][part]
            arrays[index] = segment.push.view(arrays[index].dtype)[: hi - lo].copy()
        request.msg = Message(old.kind, old.id, old.sender, body, arrays)
        request.sent_to = self._route[request.server]
        self._send_to(request.sent_to, request.msg)

    def _on_members(self, msg: Message, what: str) -> bool:
        """An elastic job's workers changed: the new ones are counted from now on."""
        body = msg.body
        if self._present is None or body["epoch"] <= self._members_epoch:
            return False
        self._present, self._members_epoch = sorted(body["present"]), body["epoch"]
        if "left" in body:
            change = f"worker in slot {body['left']} left ({body.get('why', '')})"
        else:
            change = f"a worker took slot {body.get('joined')}"
        log.info("epoch %d: %s; %d workers", body["epoch"], change, len(self._present))
        return True

    def _on_answer(self, msg: Message, what: str) -> bool:
        self._answers[msg.kind] = msg
        return False

    def _on_failure(self, msg: Message, what: str) -> bool:
        try:
            raise_for(msg, what)
        except KVStoreError as exc:
            self._fail(str(exc), type(exc), known=True)
            raise
        return False

    # ---- replies
    def _on_reply(self, frames, what: str) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            raise KVStoreError(f"{what}: bad reply from a server: {exc}") from None
        if "entered" in msg.body:
            self._saw_entered(msg.body["entered"])
        request = self._requests.pop(msg.id, None)
        if request is None:
            return  # a reply of a request given up on
        for segment in request.segments:
            segment.unlink()  # the server has it mapped: no name left behind
        if msg.kind == "error":  # "lost": the server failed it because a node was lost
            kind = PeerLostError if msg.body.get("lost") is True else KVStoreError
            text = f"{what}: {msg.body['message']}"
            self._drop(request.collector, f"{request.kind}: {msg.body['message']}")
            if msg.body.get("unchanged") is True:  # every server refuses it alike: raised
                self._refused[msg.id] = kind(text)  # once the call's other answers are in
                return
            if request.kind in _MUTATING:
                self._fail(
                    f"{text} (this worker's {request.kind} was refused by one server after "
                    "others may have taken theirs, so the servers' rounds differ: the store "
                    "takes no more calls; restart the job)",
                    kind,
                )
            raise kind(text)
        if request.collector is not None:
            try:
                args = (msg.id, msg.body["keys"], self._read(msg, request), msg.body.get("codes"))
                if "delta" in msg.body:  # (a row push's reply)
                    request.collector.receive(*args, delta=msg.body["delta"])
                else:
                    request.collector.receive(*args)
            except (ReplyError, KeyError, IndexError, TypeError) as exc:
                self._drop(request.collector, f"bad reply: {exc}")
                raise KVStoreError(
                    f"{what}: bad reply from {self._server_name(request.server)}: {exc}"
                ) from None
        elif request.on_reply is not None:
            request.on_reply(msg)

    def _saw_entered(self, entered) -> None:
        """A server's reply: these newcomers ([[slot, arrival epoch]]) were in one of its
        rounds that completed. This worker's pushes from now on say so, so that every server
        waits for them in the rounds they come after (Rounds.expect)."""
        if not isinstance(entered, list):
            raise KVStoreError(f"bad reply from a server: 'entered' is {entered!r:.60}")
        changed = False
        for item in entered:
            if not (
                isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item)
            ):
                raise KVStoreError(f"bad reply from a server: 'entered' holds {item!r:.60}")
            slot, epoch = item
            if slot != self._rank and self._entered.get(slot, -1) < epoch:
                self._entered[slot] = epoch
                changed = True
        if changed:
            self._entered_wire = [[slot, epoch] for slot, epoch in self._entered.items()]
            self._mepoch = max(self._mepoch, *self._entered.values())

    def _read(self, msg: Message, request: _Request) -> list:
        """The reply's arrays, those left in shared segments read from there."""
        arrays = msg.arrays
        shared = msg.body.get("shm") or ()
        if shared:
            arrays = list(arrays)
            for entry in shared:  # a dense part's index, or [index, rows] for rows
                i, rows = entry if isinstance(entry, list) else (entry, None)
                key, part = msg.body["keys"][i]
                segment = self._segments.segments[(key, part)]
                pulled = segment.pull.view(arrays[i].dtype)
                if rows is None:
                    arrays[i] = pulled[: segment.nbytes // arrays[i].dtype.itemsize]
                else:  # the reply's empty (0, dim) array gives the rows' shape
                    dim = arrays[i].shape[1]
                    if type(rows) is not int or not 0 <= rows * dim <= pulled.size:
                        raise ReplyError(f"{rows!r:.20} rows do not fit the shared segment")
                    arrays[i] = pulled[: rows * dim].reshape(rows, dim)
                segment.unlink()
        return arrays

    def _drop(self, collector: Collector | None, reason: str = "interrupted") -> None:
        """Cancel a call's collector: its late replies write nothing. Its requests stay in
        flight (a later wait collects them): a refusal among them still fails the store, and
        a shared segment they name is not written again before the server has answered."""
        if collector is not None:
            collector.cancel(reason)

    def _collect(self, what: str, ids: list, trackers: list, collector: Collector) -> None:
        try:
            self._wait(what, ids, trackers)
        except BaseException:  # an error, the deadline, Ctrl-C: nothing more is written
            self._drop(collector)
            raise
        if collector.cancelled:  # failed while another call waited (pushpull_async)
            raise KVStoreError(f"{what}: {collector.reason}")
        collector.finish()

    # ---- the store operations
    def _init(self, items, members=None):
        for item in items:
            first = item.values[0]
            self._planner.add_key(item.key, first.size, first.dtype)
        # rank 0 initialises the keys for everyone, then a barrier; every member initialises
        # a group's keys, with no barrier across all workers; an elastic job's newcomer finds
        # its keys made (it pulls their values) and its peers past their barrier
        if self._late and members is None:
            return
        if members is not None or self.rank == 0:
            keys = [item.key for item in items]
            flats = [self._flat(item.values[:1]) for item in items]
            outgoing = self._planner.init(keys, flats, members, self._arrivals_of(members))
            ids, _ = self._commit("init", self._fanned_out(outgoing))
            self._wait("init", ids)
        if members is None:
            self.barrier()

    def _arrivals_of(self, members) -> list | None:
        """An elastic job's group of the last reset's workers: when each member's holder
        came (a slot taken by a newcomer since then is out of the group: the servers know
        when each holder came); None outside elastic jobs."""
        if members is None or not all(m in self._arrivals for m in members):
            return None
        return [self._arrivals[m] for m in members]

    def _fanned_out(self, outgoing) -> list:
        """With replicas, every live replica of a part gets its own copy of each message,
        told whose part it is (``home``)."""
        if not self._chains:
            return outgoing
        return [
            out._replace(server=r, body={**out.body, "home": out.server})
            for out in outgoing
            for r in self._chains[out.server]
            if r not in self._dead
        ]

    def _push_plan(self, kind: str, items) -> Iterator[Outgoing]:
        keys = [item.key for item in items]
        compression = self._compression
        if compression is not None and any(internal(k) for k in keys):
            compression = None  # the library's own keys (kvstore.elastic's counts) go exact
        return self._planner.push(
            kind,
            keys,
            [self._flat(item.values) for item in items],
            self._sync,
            compression,
            self._residuals,
        )

    @metrics.observed("push")
    def _push(self, items):
        """Send, and return once ZeroMQ has let go of the caller's buffers (they may be
        reused); the acknowledgements are collected by later calls."""
        if self._staleness is not None:
            self._bound("push", items)
        ids, trackers = self._commit("push", self._push_plan("push", items))
        if self._staleness is not None:
            for item in items:
                self._unacked[item.key] = ids
        self._wait("push", ids=(), trackers=trackers)

    def _bound(self, what: str, items) -> None:
        """``dist_ssp``: a worker pushes a key again only once its last push of it was
        answered, which the servers do once it is at most ``staleness`` rounds ahead of the
        slowest worker; and its clock (for the status page) advances."""
        unacked, requests, clocks = self._unacked, self._requests, self._clocks
        ids = [i for item in items for i in unacked.get(item.key, ()) if i in requests]
        if ids:
            self._wait(f"{what} (dist_ssp, staleness {self._staleness})", ids)
        for item in items:
            unacked.pop(item.key, None)
        clock = 0
        for item in items:
            clocks[item.key] = mine = clocks.get(item.key, 0) + 1
            clock = max(clock, mine)
        m = self._control.metrics
        if m is not None and clock > m.clock:
            m.clock = clock

    @metrics.observed("pull")
    def _pull(self, items):
        collector = self._collector(items)
        keys = [item.key for item in items]
        compression = self._compression
        if compression is not None and (not compression.pull or any(internal(k) for k in keys)):
            compression = None  # only compressed pulls say it; the library's keys go exact
        ids, _ = self._commit("pull", self._planner.pull(keys, compression), collector)
        self._collect("pull", ids, [], collector)

    @metrics.observed("pushpull")
    def _pushpull(self, items):
        if self._staleness is not None:
            self._bound("pushpull", items)
        collector = self._collector(items)
        ids, trackers = self._commit("pushpull", self._push_plan("pushpull", items), collector)
        self._collect("pushpull", ids, trackers, collector)

    def _pushpull_start(self, items) -> Pending:
        """Send now; the returned handle's ``wait`` collects (see ``pushpull_async``)."""
        if self._staleness is not None:
            self._bound("pushpull", items)
        collector = self._collector(items)
        ids, trackers = self._commit("pushpull", self._push_plan("pushpull", items), collector)
        if self._staleness is not None:
            for item in items:
                self._unacked[item.key] = ids

        def finish():
            if self._rows_back:  # its answer can order another worker's write (load_rows)
                self._forget_rows_back()  # before a pull: a push's reply no longer serves it
            self._collect("pushpull", ids, trackers, collector)

        return Pending(finish)

    def _collector(self, items) -> Collector:
        keys = [item.key for item in items]
        shapes = [self._meta[key].shape for key in keys]
        codec = self._compression if self._compression and self._compression.pull else None
        return Collector(self._planner, keys, [item.outs for item in items], shapes, codec)

    def _flat(self, values) -> np.ndarray:
        """The sum of a key's device arrays as one flat, contiguous host array."""
        first = values[0]
        if len(values) == 1 and type(first) is np.ndarray and first.ndim == 1:
            if first.flags.c_contiguous:  # the common case: the caller's array itself
                return first
        if len(values) == 1 and namespace(first) is np and first.flags.c_contiguous:
            return first.reshape(-1)
        total = reduce_sum(values, first.dtype, on_device=self._on_device)
        return np.ascontiguousarray(to_host(total)).reshape(-1)

    # ---- row-sparse keys (kvstore.sparse): every server holds the rows row_server gives it
    def _init_rows(self, items, members=None):
        # as _init: rank 0 for everyone then a barrier, or every member of a group
        if self._late and members is None:
            return
        if members is not None or self.rank == 0:
            arrivals = self._arrivals_of(members)
            plan = sparse.plan_init(items, len(self._servers), members, arrivals)
            ids, _ = self._commit("init", self._fanned_out(plan))
            self._wait("init", ids)
        if members is None:
            self.barrier()

    @metrics.observed("push")
    def _push_rows(self, items):
        n, shm_servers = len(self._servers), self._planner.shm_servers
        if self._rows_back:  # a reply no pull read: its key stops asking now, not after
            self._forget_rows_back([item.key for item in items])
        back = None
        if (
            self._sync
            and self._staleness is None
            and self._rows_ahead.issuperset(item.key for item in items)
        ):  # answered with its rows, for the row_sparse_pull expected next
            back = [RowsItem(item.key, outs=[], ids=[]) for item in items]
            # the ids the reply's rows are of, copied: the caller may reuse its array
            items = [
                RowsItem(
                    i.key,
                    sparse.RowSparse._trusted(i.value.indices.copy(), i.value.data, i.value.shape),
                )
                for i in items
            ]
            outgoing, collector = sparse.plan_push(
                items, n, self._sync, self._sparse, back, shm_servers
            )
        else:
            outgoing = sparse.plan_push(items, n, self._sync, self._sparse, None, shm_servers)
            collector = None
        ids, trackers = self._commit("push", outgoing, collector)
        for i, item in enumerate(items):
            self._rows_pushed[item.key] = item.value.indices
            if back is not None:
                self._rows_back[item.key] = _RowsBack(ids, collector, back[i])
        if not sparse.shares_rows(items, self._sparse, n):  # copies were sent: no wait
            return
        self._wait("push", ids=(), trackers=trackers)

    def _forget_rows_back(self, keys=None) -> None:
        """A message is going out (or an answer was waited on): the rows a push's reply
        brings are no longer the rows a pull would read; of ``keys`` only, when given. A key
        whose rows came back unread stops asking for them."""
        for key in list(self._rows_back) if keys is None else keys:
            back = self._rows_back.pop(key, None)
            if back is not None and not back.read:
                self._rows_ahead.discard(key)

    def _pull_from_push(self, items) -> bool:
        """Serve a ``row_sparse_pull`` from the reply of this worker's last push when nothing
        was sent since and it pushed every id asked (the benchmark's and MXNet's anchor step:
        a push, then a pull of the same rows): one round trip instead of two. Under
        ``dist_sync`` a key's rows change only when a round is applied, and the next round
        of the key needs this worker's next push, so the rows after the pushed round are
        the rows a pull sent now would get. Returns whether it did. A key learns here
        whether its pushes should ask for their rows back: when a pull of it asks only for
        rows its last push had."""
        asked = []
        for item in items:
            pushed = self._rows_pushed.get(item.key)
            if pushed is None:
                return False
            # ids equal to the pushed ones become the pushed array: written with no lookup
            same = [
                x if x.size != pushed.size or not np.array_equal(x, pushed) else pushed
                for x in item.ids
            ]
            if not all(sparse.holds_ids(pushed, x) for x in same):
                self._rows_ahead.discard(item.key)
                return False
            self._rows_ahead.add(item.key)
            asked.append(same)
        backs = [self._rows_back.get(item.key) for item in items]
        if any(b is None or b.read or b.collector.cancelled for b in backs):
            return False  # (read once: the first pull's output may hold the reply's block)
        if len({id(b.collector) for b in backs}) != 1 or len({id(b) for b in backs}) < len(backs):
            return False  # (every back is of the last push, one call; a key named twice)
        for item, b, ids in zip(items, backs, asked, strict=True):
            b.pull.outs, b.pull.ids, b.read = item.outs, ids, True
        try:
            self._collect("row_sparse_pull", backs[0].requests, [], backs[0].collector)
        finally:
            for b in backs:
                b.pull.outs, b.pull.ids = [], []
        return True

    @metrics.observed("pushpull")
    def _pushpull_rows(self, items, pulls):
        """One message per server: the push, answered with the pushed rows once its round
        is applied."""
        n = len(self._servers)
        if self._rows_back:  # its keys' rows change: an earlier push's reply is not them now
            self._forget_rows_back([item.key for item in items])
        for item in items:  # (a pull after it learns nothing: no reply of it is kept)
            self._rows_pushed.pop(item.key, None)
        outgoing, collector = sparse.plan_push(
            items, n, self._sync, self._sparse, pulls, self._planner.shm_servers
        )
        ids, trackers = self._commit("pushpull", outgoing, collector)
        if not sparse.shares_rows(items, self._sparse, n):  # copies: the replies are enough
            trackers = []
        self._collect("pushpull", ids, trackers, collector)

    @metrics.observed("pull")
    def _pull_rows(self, items):
        if self._rows_pushed and self._pull_from_push(items):
            return
        outgoing, collector = sparse.plan_pull(items, len(self._servers), self._sparse)
        ids, _ = self._commit("row_sparse_pull", outgoing, collector)
        self._collect("row_sparse_pull", ids, [], collector)

    def _save_rows(self, key, since: int | None):
        parts: list = []

        def keep(msg):
            parts.append((msg.body.get("step", 0), *msg.arrays[:2]))

        wire = -1 if since is None else since  # -1: every stored row
        ids = [
            self._send(s, "sparse_rows", {"keys": [[key, s]], "since": wire}, on_reply=keep)
            for s in range(len(self._servers))
        ]
        self._wait("save_rows", ids)
        meta = self._sparse[key]
        found = [p for p in parts if len(p) == 3]
        if len(found) != len(self._servers):
            raise KVStoreError(f"save_rows(key={key!r}): a server's reply holds no rows")
        for step, _, _ in found:  # every reply read: none is left to come in later
            sparse.check_since(key, since, step)
        value = sparse.RowSparse(
            np.concatenate([p[1] for p in found]),
            np.concatenate([p[2].reshape(-1, meta.shape[1]) for p in found]),
            meta.shape,
        ).canonical()
        # the smallest step: under dist_async a server may not yet have applied a push
        # another has; an export since the largest would miss that push's rows for good
        return value, min(p[0] for p in found)

    def _load_rows(self, key, value, step: int | None):
        ids = []
        body: dict = {"keys": None}
        if step is not None:
            body["step"] = step
        n = len(self._servers)
        bounds = sparse.bounds_of(self._sparse[key].sharding, value.shape[0], n)
        for s, pos in enumerate(sparse.split_by_server(value.indices, n, bounds)):
            arrays = [value.indices[pos], np.ascontiguousarray(value.data[pos])]
            # with replicas, to the server acting for s: it forwards the load to the backups
            ids.append(self._send(s, "sparse_load", {**body, "keys": [[key, s]]}, arrays))
        self._wait("load_rows", ids)

    # ---- collective and control
    def _ask_scheduler(self, what: str, kind: str, answer: str, body=None) -> Message:
        """Send ``kind`` to the scheduler once this worker's requests are answered, and wait
        in the one wait loop for ``answer``."""
        self._wait(what)
        if self._rows_back:
            self._forget_rows_back()
        self._control.send(kind, body)
        return self._wait(what, ids=(), answer=answer)

    @metrics.observed("barrier")
    def barrier(self) -> None:
        """Wait until every worker has called ``barrier`` (and this worker's pushes are done)."""
        self._ask_scheduler("barrier", "barrier", "barrier_done", {"group": "worker"})

    @metrics.observed("join")
    def join(self) -> int:
        """Out of data: wait until this worker's pushes are done, then count as pushing zeros
        into every round until all workers have joined; return the last rank to join."""
        if self._present is not None:
            raise ValueError(
                "join() is for a fixed set of workers; in an elastic job a worker out of data "
                "closes its store (kv.close()) and the others go on without it"
            )
        return self._ask_scheduler("join", "join", "join_done").body["last"]

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Send the optimizer (as a spec) to every server; return once they all hold it, so
        that every push this worker makes afterwards is updated by it. Every worker sends
        it (as in MXNet): a server keeps the state of an optimizer it already has."""
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"set_optimizer: expected a kvstore.optimizer.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        self._refuse_pull_compression("set_optimizer")
        spec = optimizer.spec()
        self._optimizer = optimizer
        live = [s for s in range(len(self._servers)) if s not in self._dead]
        # a newcomer to an elastic job keeps the job's optimizer (and its state): another
        # spec is refused, not installed in its place
        first = self._late and not self._optimizer_sent  # (later ones: counted as anyone's)
        body = {"spec": spec, "keep": True} if first else {"spec": spec}
        self._optimizer_sent = True
        ids = [self._send(s, "optimizer", body) for s in live]
        self._wait("set_optimizer", ids)

    def _check_pull_compression(self) -> None:
        super()._check_pull_compression()
        if not self._sync or self._staleness is not None:
            raise ValueError(
                f"{self.type}: compressed pulls ({{'pull': True}}) need dist_sync, where every "
                "worker reads the same sum of a round; here a pull reads whatever the servers "
                "hold: drop 'pull', or use dist_sync"
            )
        if self._chains is not None:
            raise ValueError(
                "compressed pulls ({'pull': True}) are not available with KVSTORE_REPLICAS > 1 "
                "(a backup that takes over holds no codes of the rounds already answered); "
                "drop 'pull', or run without replicas"
            )

    def _enter(self) -> None:
        """kvstore.elastic's reset: this worker is in every key's rounds from now on (a
        newcomer is otherwise in a key's rounds from its first push of the key)."""
        live = [s for s in range(len(self._servers)) if s not in self._dead]
        ids = [self._send(s, "command", {"name": "enter"}) for s in live]
        self._wait("elastic reset", ids)

    def set_updater(self, updater) -> None:
        raise ValueError(
            f"{self.type}: updates run on the servers, and a Python callable "
            "cannot be sent there; use set_optimizer"
        )

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Gather every server's optimizer state into one file."""
        blobs = [b""] * len(self._servers)

        def keep(server):
            return lambda msg: blobs.__setitem__(server, msg.arrays[0].tobytes())

        ids = [
            self._send(s, "command", {"name": "get_states", "home": s}, on_reply=keep(s))
            for s in range(len(self._servers))
        ]
        self._wait("save_optimizer_states", ids)
        with open(fname, "wb") as f:
            f.write(msgpack.packb({"num_server": len(self._servers), "servers": blobs}))

    def server_stats(self) -> list[dict]:
        found: dict = {}

        def keep(server):
            return lambda msg: found.__setitem__(server, msg.body)

        ids = [
            self._send(s, "command", {"name": "stats", "home": s}, on_reply=keep(s))
            for s in range(len(self._servers))
        ]
        self._wait("server_stats", ids)
        stats = []
        for s in range(len(self._servers)):
            body = found.get(s, {})
            rows = {key: {"rows": n, "bytes": b} for key, n, b in body.get("rows", ())}
            process = body.get("rank", s)  # with replicas, after a failover: the acting one
            entry = {"server": s, "process": process, "rss": int(body.get("rss", 0))}
            stats.append({**entry, "rows": rows})
        return stats

    def load_optimizer_states(self, fname: str) -> None:
        """Give every server back its part of :meth:`save_optimizer_states`'s file."""
        with open(fname, "rb") as f:
            try:
                saved = msgpack.unpackb(f.read())
                blobs = saved["servers"]
            except Exception:
                raise ValueError(f"{fname}: not a distributed optimizer state file") from None
        if len(blobs) != len(self._servers):
            raise ValueError(
                f"{fname} holds the state of {len(blobs)} servers; this job has "
                f"{len(self._servers)}: restart with the same DMLC_NUM_SERVER"
            )
        ids = [  # with replicas, to the server acting for s: it forwards them to the backups
            self._send(
                s, "command", {"name": "set_states", "home": s}, [np.frombuffer(b, np.uint8)]
            )
            for s, b in enumerate(blobs)
        ]
        for msg_id in ids:
            self._requests[msg_id].kind = "set_states"  # a partial load fails the store
        self._wait("load_optimizer_states", ids)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._close_quietly()

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None and not (issubclass(kind, SystemExit) and value.code in (0, None)):
            self._fail_out(_ended_by(kind, value))
        else:  # (sys.exit() or sys.exit(0) in the block: a finish)
            self.close()

    def _close_quietly(self) -> None:
        """Close at exit or on collection: the user's own error (if any) was already shown;
        never a second traceback."""
        if self._closed:
            return
        if _ending:
            self._fail_out(_ending[-1])
            return
        try:
            self.close()
        except Exception as exc:
            log.error("%s", exc)

    def _fail_out(self, reason: str) -> None:
        """This worker ends with an error: tell the scheduler, which tells everyone else."""
        if self._closed:
            return
        self._closed = True
        self._segments.close()
        known = self._failure is not None and self._failure_known
        self._control.close(finalize=False, failed="" if known else reason)
        for server in list(self._channels):
            self._close_channel(server)
        for sock in self._sockets:
            sock.close(linger=0)
        self._ctx.term()

    def close(self) -> None:
        """Finish this worker's requests and tell the scheduler it is done."""
        if self._closed:
            return
        finalize = True
        try:
            if self._failure is None:
                self._wait("close")
                if self._staleness is not None and self._clocks:
                    self._flush()
        except KVStoreError:
            finalize = self._failure is None  # a refused request: still a normal end
            raise
        finally:
            self._shutdown(finalize and self._failure is None)

    def _flush(self) -> None:
        """``dist_ssp``: wait until every round this worker pushed is complete. Its pushes
        were answered up to ``staleness`` rounds early: a round that can never complete (a
        worker closed before pushing it) is an error here, not a push lost in silence."""
        ids = [
            self._send(
                leg.server, "pull", {"keys": leg.wire, "ssp": self._staleness, "flush": True}
            )
            for leg in self._planner.route(tuple(self._clocks), False)
        ]
        self._wait("close (dist_ssp: the rounds this worker pushed)", ids)

    def _shutdown(self, finalize: bool) -> None:
        self._closed = True
        if hasattr(self, "_segments"):
            self._segments.close()
        failed = self._failure if self._failure and not self._failure_known else ""
        reason = f"stopped after an error: {failed}"[:400] if failed else ""
        self._control.close(finalize=finalize and not failed, failed=reason)
        for server in list(getattr(self, "_channels", ())):
            self._close_channel(server)
        for sock in self._sockets:
            sock.close(linger=0)  # every request was answered, or the job has failed
        self._ctx.term()
