"""The distributed store a worker uses: ``dist_sync``, ``dist_device_sync``, ``dist_async``.

The path of one ``kv.push``: :meth:`KVStore.push` checks the arguments against the initialised
keys; :meth:`DistStore._push` sums the value's device arrays (on the device for
``dist_device_sync``), cuts the flat result into one slice per part (a big array has one part
on every server, a small key one part on one server: :mod:`kvstore.sharding`), and sends one
message per server holding all of that server's slices, without copying them. The servers'
replies are collected later: a pull of the same key waits for its round on the server.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import sys
import threading
import time
import weakref

import msgpack
import numpy as np
import zmq

from . import auth, metrics, shm, transport
from .arrays import copy_into, namespace, reduce_sum, to_host
from .config import Config, setup_logging, warn_if_insecure
from .control import Control, raise_for
from .errors import ConfigError, KVStoreError, PeerLostError, exit_code_of
from .memory import tune_allocator
from .optimizer import Optimizer
from .protocol import Message, ProtocolError, decode
from .sharding import place
from .store import KVStore

log = logging.getLogger("kvstore.worker")

SHM_FROM = 65536  # bytes: a part at least this big goes through shared memory on one host

# The uncaught exception ending this process, if one is: a store closed at exit then reports
# the worker as failed (naming the exception) instead of finished.
_ending: list[str] = []


def _note_uncaught(kind, value, tb) -> None:
    """sys.excepthook while a distributed store may be open: note the exception (so the store,
    closed at exit, reports this worker as failed), print it as before, and for a KVStoreError
    or a bad setting exit with its code (``kvstore.errors``: 129 for a lost peer tells the
    platform to retry) instead of Python's 1."""
    if not issubclass(kind, KeyboardInterrupt):
        _ending.append(f"raised {kind.__name__}: {value}"[:400])
    _previous_hook(kind, value, tb)
    code = exit_code_of(value) if isinstance(value, (KVStoreError, ConfigError)) else 1
    if code != 1:
        _exit_as_python_would(code)


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


def create_dist(kind: str) -> KVStore:
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
    return DistStore(kind, cfg)


class DistStore(KVStore):
    def __init__(self, kind: str, cfg: Config):
        super().__init__(kind)
        self.cfg = cfg
        self._sync = kind != "dist_async"
        self._on_device = kind == "dist_device_sync"
        self._ctx = zmq.Context()
        self._cred = auth.Credential.make(cfg)
        try:
            self._control = Control(self._ctx, cfg, "worker", 0, self._cred.public)
        except KVStoreError:
            self._ctx.term()
            raise
        self._closed = False
        self._failure: str | None = None
        self._failure_type: type[KVStoreError] = KVStoreError  # raised again on every call
        self._sockets: list = []
        try:
            book = self._control.wait(f"kvstore.create({kind!r})", ("book",), cfg.start_timeout + 5)
        except KVStoreError:
            self._shutdown(finalize=False)
            raise
        self._rank = book.body["rank"]
        self._num_workers = book.body["num_worker"]
        self._servers = [tuple(s) for s in book.body["servers"]]
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
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple] = {}  # request id -> (server index, reply handler)
        self._layout: dict = {}  # key -> [(server, part, lo, hi)]
        self._residuals: dict = {}
        self._optimizer: Optimizer | None = None
        self._segments = shm.WorkerSegments(self._rank)
        self._shm_servers = self._hello()
        log.info(
            "worker %d of %d connected to %d servers",
            self._rank,
            self._num_workers,
            len(self._servers),
        )
        # Horovod and MXNet scripts never close their store: close it when it is collected or
        # at exit, whichever comes first.
        atexit.register(_close_at_exit, weakref.ref(self))

    def _hello(self) -> set:
        """The servers on this host, which take big parts through shared memory. By default
        each server's reply carries a challenge, and this worker proves its token on that
        connection (``auth``) before any other request (see :mod:`kvstore.auth`)."""
        local: set = set()
        proofs: dict = {}
        use_shm = self.cfg.shm and shm.available()

        def answer(server):
            def on_reply(msg):
                if use_shm and msg.body.get("shm") is True:
                    local.add(server)
                body = auth.answer(msg.body, self._cred, self._rank)
                if body is not None:
                    proofs[server] = body

            return on_reply

        host = shm.host_id()
        ids = [
            self._send(s, "hello", {"host": host}, on_reply=answer(s))
            for s in range(len(self._servers))
        ]
        self._wait("kvstore.create (hello)", ids)
        ids = [self._send(s, "auth", body) for s, body in proofs.items()]
        self._wait("kvstore.create (auth)", ids)
        return local

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_workers(self) -> int:
        return self._num_workers

    # ---- transport
    def _send(
        self, server: int, kind: str, body: dict, arrays=(), on_reply=None, trackers=None
    ) -> int:
        self._check_alive()
        msg_id = next(self._ids)
        msg = Message(kind, msg_id, f"worker-{self._rank}", body, list(arrays))
        try:
            sent = transport.send(self._sockets[server], msg)
            if trackers is not None:
                trackers.extend(s.tracker for s in sent)
        except zmq.Again:
            raise PeerLostError(
                f"{kind}: cannot send to {self._server_name(server)}: its queue "
                "is full (is it alive?)"
            ) from None
        self._pending[msg_id] = (server, on_reply)
        return msg_id

    def _server_name(self, server: int) -> str:
        host, port = self._servers[server]
        return f"server {server} ({host}:{port})"

    def _check_alive(self) -> None:
        if self._closed:
            raise KVStoreError("the store is closed")
        if self._failure:
            raise self._failure_type(self._failure)

    @metrics.traced("wait")
    def _wait(self, what: str, ids=None, trackers=()) -> None:
        """Collect replies until ``ids`` (default: every request in flight) are answered and
        ``trackers`` report their buffers sent. Errors, failures and the deadline raise."""
        self._check_alive()
        waiting = set(self._pending) if ids is None else set(ids)
        deadline = time.monotonic() + self.cfg.request_timeout
        trackers = list(trackers)
        while True:
            waiting &= self._pending.keys()
            trackers = [t for t in trackers if not t.done]
            if not waiting and not trackers:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                servers = sorted({self._pending[i][0] for i in waiting})
                names = ", ".join(self._server_name(s) for s in servers) or "the network"
                raise PeerLostError(
                    f"{what}: no reply from {names} within "
                    f"{self.cfg.request_timeout:g}s (KVSTORE_TIMEOUT)"
                )
            timeout = left
            if trackers:  # wake the moment ZeroMQ lets go of a buffer, not a tick later
                try:
                    trackers[0].wait(min(left, 0.05))
                except zmq.NotDone:
                    pass
                timeout = 0
            for sock, _ in self._poller.poll(timeout * 1000):
                if sock is self._control.pipe:
                    msg = self._control.recv()
                    if msg.kind == "stall":  # a slow peer, alive: say so, and keep waiting
                        log.warning("%s: %s", what, msg.body["message"])
                        deadline = time.monotonic() + self.cfg.request_timeout
                        continue
                    self._on_control(msg, what)
                else:
                    self._on_reply(sock.recv_multipart(copy=False), what)

    def _on_control(self, msg: Message, what: str) -> None:
        try:
            raise_for(msg, what)
        except KVStoreError as exc:
            self._failure, self._failure_type = str(exc), type(exc)
            raise

    def _on_reply(self, frames, what: str) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            raise KVStoreError(f"{what}: bad reply from a server: {exc}") from None
        entry = self._pending.pop(msg.id, None)
        if entry is None:
            return
        if msg.kind == "error":  # "lost": the server failed it because a node was lost
            kind = PeerLostError if msg.body.get("lost") is True else KVStoreError
            raise kind(f"{what}: {msg.body['message']}")
        handler = entry[1]
        if handler is not None:
            handler(msg)

    # ---- the store operations
    def _init(self, items):
        for item in items:
            self._layout[item.key] = place(
                item.key, item.values[0].size, len(self._servers), self.cfg.bigarray_bound
            )
        if self._rank == 0:
            batches = self._batches(items, lambda item: self._flat(item.values[:1]))
            ids = [
                self._send(s, "init", {"keys": keys}, arrays)
                for s, (keys, arrays, *_) in batches.items()
            ]
            self._wait("init", ids)
        self.barrier()

    @metrics.observed("push")
    def _push(self, items):
        self._send_push("push", items, None)

    @metrics.observed("pull")
    def _pull(self, items):
        on_reply, finish = self._receiver(items)
        ids = [
            self._send(s, "pull", {"keys": keys}, on_reply=on_reply)
            for s, (keys, *_) in self._batches(items, None).items()
        ]
        self._wait("pull", ids)
        finish()

    @metrics.observed("pushpull")
    def _pushpull(self, items):
        on_reply, finish = self._receiver(items)
        trackers: list = []
        ids = self._send_push("pushpull", items, on_reply, trackers)
        self._wait("pushpull", ids, trackers)
        finish()

    def _send_push(self, kind: str, items, on_reply, trackers=None) -> list:
        """Send the pushes of ``items``, one message per server. Without ``trackers`` to fill,
        return only when ZeroMQ has let go of the caller's buffers (they may be reused)."""
        batches = self._batches(items, lambda item: self._flat(item.values), push=True)
        body = {"sync": self._sync}
        if self._compression is not None:
            body["compression"] = self._compression.params()
        own_trackers = trackers is None
        trackers = [] if own_trackers else trackers
        ids = []
        for server, (keys, arrays, headers, shared) in batches.items():
            extra = {"headers": headers} if self._compression is not None else {}
            if shared:
                extra["shm"] = shared
            ids.append(
                self._send(
                    server, kind, {"keys": keys, **body, **extra}, arrays, on_reply, trackers
                )
            )
        if own_trackers:
            self._wait(kind, ids=(), trackers=trackers)
        return ids

    def _flat(self, values) -> np.ndarray:
        """The sum of a key's device arrays as one flat, contiguous host array."""
        first = values[0]
        if len(values) == 1 and namespace(first) is np and first.flags.c_contiguous:
            return first.reshape(-1)
        total = reduce_sum(values, first.dtype, on_device=self._on_device)
        return np.ascontiguousarray(to_host(total)).reshape(-1)

    def _batches(self, items, flatten, push=False) -> dict:
        """server -> ([wire key], [array slice], [compression header], [shm entry]) for
        ``items``. A big slice for a server on this host goes into its shared segment and
        travels as an empty array (see :mod:`kvstore.shm`)."""
        batches: dict = {}
        compressing = push and self._compression is not None
        for item in items:
            flat = None
            if flatten is not None:
                flat = flatten(item)
                meta = self._meta[item.key] if item.key in self._meta else None
                if meta is not None and flat.dtype != meta.dtype:
                    flat = flat.astype(meta.dtype)
            for server, part, lo, hi in self._layout[item.key]:
                keys, arrays, headers, shared = batches.setdefault(server, ([], [], [], []))
                keys.append([item.key, part])
                if flat is None:
                    continue
                piece = flat[lo:hi]
                if compressing:
                    packed, header = self._compression.encode(
                        self._residuals, (item.key, part), piece
                    )
                    piece = packed
                    headers.append(header)
                elif push and server in self._shm_servers and piece.nbytes >= SHM_FROM:
                    shared.append([len(arrays), *self._to_segment((item.key, part), piece)])
                    piece = piece[:0]
                arrays.append(piece)
        return batches

    def _to_segment(self, where: tuple, piece: np.ndarray) -> tuple[str, int]:
        """Copy a push into its shared segment once the server has taken the previous one."""
        segment = self._segments.get(where, piece.nbytes)
        written = int(segment.counters[0])
        deadline = time.monotonic() + self.cfg.request_timeout
        while int(segment.counters[1]) != written:  # the server copies a push out on receipt
            if time.monotonic() > deadline:
                raise KVStoreError(
                    f"push: the server did not take the previous push of {where[0]!r} from "
                    f"shared memory within {self.cfg.request_timeout:g}s (KVSTORE_TIMEOUT)"
                )
            time.sleep(0.0001)
        np.copyto(segment.push.view(piece.dtype), piece)
        segment.counters[0] = written + 1
        return segment.name, written + 1

    def _receiver(self, items):
        """A reply handler writing pulled slices into each item's outputs, and a finisher
        that copies to every further output (other devices, other dtypes)."""
        targets = {}
        staged = []
        for item in items:
            first = item.outs[0]
            meta = self._meta[item.key]
            direct = (
                namespace(first) is np and first.flags.c_contiguous and first.dtype == meta.dtype
            )
            flat = first.reshape(-1) if direct else np.empty(int(np.prod(meta.shape)), meta.dtype)
            targets[item.key] = (flat, {p: (lo, hi) for _, p, lo, hi in self._layout[item.key]})
            staged.append((item, flat, direct))

        def on_reply(msg: Message) -> None:
            shared = msg.body.get("shm") or ()
            for i, ((key, part), array) in enumerate(
                zip(msg.body["keys"], msg.arrays, strict=True)
            ):
                flat, parts = targets[key]
                lo, hi = parts[part]
                if i in shared:  # the server left the value in this part's shared segment
                    segment = self._segments.segments[(key, part)]
                    array = segment.pull.view(flat.dtype)
                    segment.unlink()  # both sides have it mapped: no name left behind
                flat[lo:hi] = array

        def finish() -> None:
            for item, flat, direct in staged:
                source = flat.reshape(self._meta[item.key].shape)
                for out in item.outs[1:] if direct else item.outs:
                    copy_into(out, source)

        return on_reply, finish

    # ---- collective and control
    @metrics.observed("barrier")
    def barrier(self) -> None:
        """Wait until every worker has called ``barrier`` (and this worker's pushes are done)."""
        self._wait("barrier")
        self._control.send("barrier", {"group": "worker"})
        try:
            self._control.wait("barrier", ("barrier_done",), self.cfg.request_timeout)
        except KVStoreError as exc:
            self._failure, self._failure_type = str(exc), type(exc)
            raise

    @metrics.observed("join")
    def join(self) -> int:
        """Out of data: wait until this worker's pushes are done, then count as pushing zeros
        into every round until all workers have joined; return the last rank to join."""
        self._wait("join")
        self._control.send("join")
        try:
            done = self._control.wait("join", ("join_done",), self.cfg.request_timeout)
        except KVStoreError as exc:
            self._failure, self._failure_type = str(exc), type(exc)
            raise
        return done.body["last"]

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Send the optimizer (as a spec) to every server; return once they all hold it, so
        that every push this worker makes afterwards is updated by it. Every worker sends
        it (as in MXNet): a server keeps the state of an optimizer it already has."""
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"set_optimizer: expected a kvstore.optimizer.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        spec = optimizer.spec()
        self._optimizer = optimizer
        ids = [self._send(s, "optimizer", {"spec": spec}) for s in range(len(self._servers))]
        self._wait("set_optimizer", ids)

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
            self._send(s, "command", {"name": "get_states"}, on_reply=keep(s))
            for s in range(len(self._servers))
        ]
        self._wait("save_optimizer_states", ids)
        with open(fname, "wb") as f:
            f.write(msgpack.packb({"num_server": len(self._servers), "servers": blobs}))

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
        ids = [
            self._send(s, "command", {"name": "set_states"}, [np.frombuffer(b, np.uint8)])
            for s, b in enumerate(blobs)
        ]
        self._wait("load_optimizer_states", ids)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._close_quietly()

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None and not issubclass(kind, KeyboardInterrupt):
            self._fail_out(f"raised {kind.__name__}: {value}"[:400])
        else:
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
        self._control.close(finalize=False, failed=reason if self._failure is None else "")
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
        except KVStoreError:
            finalize = self._failure is None  # a refused request: still a normal end
            raise
        finally:
            self._shutdown(finalize and self._failure is None)

    def _shutdown(self, finalize: bool) -> None:
        self._closed = True
        if hasattr(self, "_segments"):
            self._segments.close()
        self._control.close(finalize=finalize)
        for sock in self._sockets:
            sock.close(linger=0)  # every request was answered, or the job has failed
        self._ctx.term()
