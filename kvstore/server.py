"""A server: one shard of the keys, aggregation, and the sync or async update.

One :class:`Server` owns one ROUTER socket (the workers' DEALERs connect to it) and runs one
poll loop; its link to the scheduler runs in :class:`~kvstore.control.Control`. Keys on a
server are ``(key, part)`` pairs holding flat arrays: a big array is split into one part per
server by the worker.

``dist_sync``: the pushes of all workers for a key are summed in place into a preallocated
buffer; when the last worker's push arrives the updater (or assignment) runs once and every
request waiting on that round is answered. A worker that pushes again before the round
completes waits in a queue for the next round, so a fast worker can never be counted twice.
A round that some worker never joins fails after ``KVSTORE_ROUND_TIMEOUT`` with an error
naming the key and the missing ranks.

``dist_async``: each push is applied at once (``w += g``, or the updater).

Run it alone with ``DMLC_ROLE=server ... python -m kvstore.server``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import zmq

from . import optimizer as opt
from .compression import Compression, packed_size
from .config import Config, setup_logging
from .control import Control
from .errors import KVStoreError
from .memory import tune_allocator
from .protocol import Message, ProtocolError, decode, encode, error_reply

log = logging.getLogger("kvstore.server")


@dataclass(eq=False)
class Request:
    """A worker's request that waits for one or more key rounds before its reply."""

    identity: bytes
    msg: Message
    waiting: int
    failed: bool = False


@dataclass(eq=False)
class KeyState:
    stored: np.ndarray
    merge: np.ndarray
    pushers: dict = field(default_factory=dict)  # rank -> Request (this round)
    pullers: list = field(default_factory=list)  # pulls waiting for this round
    queued: deque = field(default_factory=deque)  # (rank, Request, grad) for the next round
    started: float = 0.0
    first: np.ndarray | None = None  # the round's first push, summed when the second arrives
    trackers: list = field(default_factory=list)  # zero-copy sends still reading ``stored``


class Server:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if cfg.server_port:
                self.sock.bind(f"tcp://{cfg.node_host}:{cfg.server_port}")
                self.port = cfg.server_port
            else:
                self.port = self.sock.bind_to_random_port(f"tcp://{cfg.node_host}")
        except zmq.ZMQError as exc:
            self.sock.close()
            self.ctx.term()
            raise OSError(
                f"server cannot listen on {cfg.node_host}:{cfg.server_port or '*'}: "
                f"{exc.strerror}; free the port or change KVSTORE_SERVER_PORT"
            ) from None
        self.control = Control(self.ctx, cfg, "server", self.port)
        self.keys: dict[tuple, KeyState] = {}
        self.active: set[tuple] = set()  # keys with a sync round under way
        self.updater: opt.Updater | None = None
        self.rank = -1
        self.num_workers = cfg.num_worker
        self.finished: set[int] = set()  # workers that closed their store
        self.name = "server"

    # ---- life cycle
    def run(self) -> int:
        try:
            book = self.control.wait("server start-up", ("book",), self.cfg.start_timeout + 5)
        except KVStoreError as exc:
            log.error("%s", exc)
            return 1
        self.rank = book.body["rank"]
        self.name = f"server {self.rank} ({self.cfg.node_host}:{self.port})"
        log.info("%s ready for %d workers", self.name, self.num_workers)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.control.pipe, zmq.POLLIN)
        next_check = 0.0
        tick = min(100.0, self.cfg.round_timeout * 250)
        while True:
            events = dict(poller.poll(tick))
            if self.sock in events:
                for _ in range(64):  # drain a burst before looking at anything else
                    try:
                        identity, *frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(identity.bytes, frames)
            if self.control.pipe in events:
                msg = self.control.recv()
                if msg.kind == "shutdown":
                    log.info("%s: shutdown", self.name)
                    return 0
                if msg.kind == "worker_done":
                    self.finished.add(msg.body["rank"])
                    next_check = 0.0
                if msg.kind == "node_failed":
                    text = f"{msg.body['node']} failed: {msg.body['reason']}"
                    log.error("%s: %s; stopping", self.name, text)
                    self._fail_all(text)
                    return 1
            now = time.monotonic()
            if self.active and now >= next_check:
                self._expire_rounds(now)
                next_check = now + min(0.1, self.cfg.round_timeout / 4)

    def close(self) -> None:
        self.control.close(finalize=False)
        self.sock.close(linger=1000)
        self.ctx.term()

    # ---- replies
    def _send(self, identity: bytes, msg: Message, track_keys=()) -> None:
        frames = encode(msg)
        try:
            self.sock.send(identity, zmq.SNDMORE)
            for i, frame in enumerate(frames):
                last = i == len(frames) - 1
                big = i > 0 and memoryview(frame).nbytes >= zmq.COPY_THRESHOLD
                tracker = self.sock.send(frame, 0 if last else zmq.SNDMORE, copy=not big, track=big)
                if big and i - 1 < len(track_keys):
                    self.keys[track_keys[i - 1]].trackers.append(tracker)
        except zmq.ZMQError as exc:
            log.warning("%s: reply to %r lost: %s", self.name, identity, exc.strerror)

    def _error(self, identity: bytes, request: Message, text: str) -> None:
        log.warning("%s: %s", self.name, text)
        self._send(identity, error_reply(request, self.name, f"{self.name}: {text}"))

    def _reply(self, req: Request) -> None:
        if req.msg.kind == "push":
            self._send(req.identity, Message("ack", req.msg.id, self.name))
            return
        keys = [tuple(k) for k in req.msg.body["keys"]]
        data = Message(
            "data",
            req.msg.id,
            self.name,
            {"keys": req.msg.body["keys"]},
            [self.keys[k].stored for k in keys],
        )
        self._send(req.identity, data, track_keys=keys)

    def _key_done(self, req: Request) -> None:
        req.waiting -= 1
        if req.waiting == 0 and not req.failed:
            self._reply(req)

    def _fail(self, req: Request, text: str) -> None:
        if not req.failed:
            req.failed = True
            self._send(req.identity, error_reply(req.msg, self.name, f"{self.name}: {text}"))

    def _fail_all(self, text: str) -> None:
        for state in self.keys.values():
            for req in [*state.pushers.values(), *state.pullers, *(q[1] for q in state.queued)]:
                self._fail(req, text)

    # ---- requests
    def _handle(self, identity: bytes, frames) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            self._error(identity, Message("error"), f"bad message: {exc}")
            return
        if self.cfg.verbose >= 2:
            log.debug(
                "%s: %s %s from %s", self.name, msg.kind, msg.body.get("keys", ""), msg.sender
            )
        try:
            rank = _worker_rank(identity, self.num_workers)
            handler = getattr(self, f"_on_{msg.kind}", None)
            if handler is None:
                raise ValueError(f"unexpected message kind {msg.kind!r} from {msg.sender}")
            handler(identity, rank, msg)
        except (ValueError, TypeError, KeyError) as exc:
            self._error(identity, msg, f"{msg.kind} refused: {exc}")
        except Exception as exc:  # a server never dies of one bad request
            log.exception("%s: %s failed", self.name, msg.kind)
            self._error(identity, msg, f"{msg.kind} failed: {type(exc).__name__}: {exc}")

    def _state(self, key) -> KeyState:
        state = self.keys.get(tuple(key))
        if state is None:
            raise KeyError(f"key {_show(key)} was never initialised on this server")
        return state

    def _on_init(self, identity, rank, msg) -> None:
        keys = [tuple(k) for k in msg.body["keys"]]
        for key in keys:
            if key in self.keys:
                raise ValueError(f"key {_show(key)} is already initialised")
        for key, array in zip(keys, msg.arrays, strict=True):
            stored = np.array(array.reshape(-1))  # our own, writable copy
            self.keys[key] = KeyState(stored, np.empty_like(stored))
        self._send(identity, Message("ack", msg.id, self.name))

    def _grads(self, msg: Message) -> list:
        """The pushed gradients, checked against the stored keys and decompressed."""
        comp = msg.body.get("compression")
        codec = Compression.from_params(comp) if comp else None
        headers = msg.body.get("headers") or [None] * len(msg.arrays)
        grads = []
        for key, array, header in zip(msg.body["keys"], msg.arrays, headers, strict=True):
            stored = self._state(key).stored
            if codec is None:
                if array.dtype != stored.dtype or array.size != stored.size:
                    raise ValueError(
                        f"key {_show(key)}: got {array.size} x {array.dtype}, "
                        f"expected {stored.size} x {stored.dtype}"
                    )
                grads.append(array.reshape(-1))
                continue
            if array.dtype != np.uint8 or array.size != packed_size(codec.kind, stored.size):
                raise ValueError(
                    f"key {_show(key)}: compressed frame of {array.size} bytes, "
                    f"expected {packed_size(codec.kind, stored.size)}"
                )
            grads.append(codec.decode(array, header, stored.size, stored.dtype.type))
        return grads

    def _on_push(self, identity, rank, msg) -> None:
        grads = self._grads(msg)
        keys = [tuple(k) for k in msg.body["keys"]]
        req = Request(identity, msg, len(keys))
        sync = bool(msg.body.get("sync", True))
        for key, grad in zip(keys, grads, strict=True):
            if sync:
                self._push_sync(key, rank, req, grad)
            else:
                self._apply(key, self.keys[key], grad, accumulate=True)
                self._key_done(req)

    _on_pushpull = _on_push

    def _on_pull(self, identity, rank, msg) -> None:
        keys = [tuple(k) for k in msg.body["keys"]]
        states = [self._state(k) for k in keys]
        req = Request(identity, msg, len(keys))
        for state in states:
            if rank in state.pushers:  # this worker's push is in the round: wait for its result
                state.pullers.append(req)
            else:
                self._key_done(req)

    def _push_sync(self, key, rank: int, req: Request, grad) -> None:
        state = self.keys[key]
        if rank in state.pushers:
            state.queued.append((rank, req, grad))
            return
        if not state.pushers:  # keep the frame; summing two pushes is one pass, not two
            state.started = time.monotonic()
            state.first = grad
            self.active.add(key)
        elif state.first is not None:
            self._release(state)  # the buffer may be an older value a reply is still reading
            np.add(state.first, grad, out=_writable(state, "merge"))
            state.first = None
        else:
            np.add(state.merge, grad, out=state.merge)
        state.pushers[rank] = req
        if len(state.pushers) == self.num_workers:
            self._complete(key, state)

    def _complete(self, key, state: KeyState) -> None:
        total = state.merge if state.first is None else state.first
        state.first = None
        self._apply(key, state, total, accumulate=False)
        done = [*state.pushers.values(), *state.pullers]
        state.pushers, state.pullers = {}, []
        self.active.discard(key)
        for req in done:
            self._key_done(req)
        self._start_queued(key, state)

    def _start_queued(self, key, state: KeyState) -> None:
        if not state.queued:
            return
        queued, state.queued = state.queued, deque()
        for rank, req, grad in queued:
            if not req.failed:
                self._push_sync(key, rank, req, grad)

    def _apply(self, key, state: KeyState, grad, accumulate: bool) -> None:
        """``stored = updater(grad, stored)``; without an updater, assign (sync) or add (async)."""
        self._release(state)
        if self.updater is not None:
            self.updater(key, grad, _writable(state, "stored"))
        elif accumulate:
            np.add(state.stored, grad, out=_writable(state, "stored"))
        elif grad is state.merge:  # the round's sum becomes the value; the old one, the buffer
            state.stored, state.merge = state.merge, state.stored
        else:  # one worker: its push (a view of the received frame) is the value, uncopied
            state.stored = grad

    def _release(self, state: KeyState) -> None:
        """Wait until zero-copy sends of ``stored`` are on the wire before changing it."""
        for tracker in state.trackers:
            try:
                tracker.wait(self.cfg.request_timeout)
            except zmq.NotDone:
                log.warning(
                    "%s: a reply was not sent within %gs", self.name, self.cfg.request_timeout
                )
        state.trackers.clear()

    def _expire_rounds(self, now: float) -> None:
        """Fail the rounds that cannot complete: a worker that should push has finished, or
        the round deadline has passed."""
        for key in list(self.active):
            state = self.keys[key]
            missing = sorted(set(range(self.num_workers)) - set(state.pushers))
            gone = sorted(self.finished.intersection(missing))
            if gone:
                why = (
                    f"cannot complete: worker rank(s) {gone} finished (closed the store) "
                    "without pushing it"
                )
            elif now - state.started > self.cfg.round_timeout:
                why = (
                    f"timed out after {self.cfg.round_timeout:g}s (KVSTORE_ROUND_TIMEOUT): "
                    f"worker rank(s) {missing} did not push it"
                )
            else:
                continue
            text = (
                f"dist_sync round of key {_show(key)} {why}; rank(s) "
                f"{sorted(state.pushers)} did. Every worker must push each key the same "
                "number of times"
            )
            log.error("%s: %s", self.name, text)
            for req in [*state.pushers.values(), *state.pullers]:
                self._fail(req, text)
            state.pushers, state.pullers, state.first = {}, [], None
            self.active.discard(key)
            self._start_queued(key, state)

    def _on_optimizer(self, identity, rank, msg) -> None:
        self.updater = opt.Updater(opt.from_spec(msg.body["spec"]))
        log.info("%s: optimizer %s", self.name, self.updater.optimizer)
        self._send(identity, Message("ack", msg.id, self.name))

    def _on_command(self, identity, rank, msg) -> None:
        name = msg.body["name"]
        if name == "get_states":
            if self.updater is None:
                raise ValueError("no optimizer is set; call set_optimizer first")
            blob = np.frombuffer(self.updater.dumps(), np.uint8)
            self._send(identity, Message("ack", msg.id, self.name, {}, [blob]))
        elif name == "set_states":
            if self.updater is None or len(msg.arrays) != 1:
                raise ValueError("set_states needs an optimizer and one state blob")
            self.updater.loads(msg.arrays[0].tobytes())
            self._send(identity, Message("ack", msg.id, self.name))
        else:
            raise ValueError(f"unknown command {name!r}")


def _writable(state: KeyState, name: str) -> np.ndarray:
    """``state.<name>``, copied first if it is a read-only view of a received frame."""
    array = getattr(state, name)
    if not array.flags.writeable:
        array = array.copy()
        setattr(state, name, array)
    return array


def _worker_rank(identity: bytes, num_workers: int) -> int:
    name = identity.decode(errors="replace")
    prefix, _, rank = name.partition("-")
    if prefix != "worker" or not rank.isdigit() or int(rank) >= num_workers:
        raise ValueError(
            f"unknown peer {name!r}: only workers 0..{num_workers - 1} may talk to a server"
        )
    return int(rank)


def _show(key) -> str:
    key, part = key
    return f"{key!r}" if part == 0 else f"{key!r} (part {part})"


def main() -> int:
    try:
        cfg = Config.from_env()
    except ValueError as exc:
        print(f"kvstore.server: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg.verbose, "server")
    tune_allocator()
    try:
        server = Server(cfg)
    except OSError as exc:
        print(f"kvstore.server: {exc}", file=sys.stderr)
        return 1
    try:
        return server.run()
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
