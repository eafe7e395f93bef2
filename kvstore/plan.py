"""The worker's side of a call, without I/O: what to send to which server, and what to do
with the replies.

:class:`Planner` turns one call (``push``, ``pull``, ``pushpull``, ``init``) into immutable
per-server :class:`Outgoing` messages: the slices of each key's flat value (placement from
:mod:`kvstore.sharding`), dtype casts, compression (the new residuals are returned, not kept:
the driver keeps them once the messages are sent) and which slices may go through a shared
segment. The routing of a key set is cached, so a training loop that pushes the same keys
every step pays for it once.

A :class:`Collector` owns one call's outputs and the reply parts still expected. It checks
each reply against what was asked (keys, sizes, dtypes) before writing, and once cancelled (the
call failed, was interrupted or timed out) it writes nothing more: a late reply of a call that
already raised never touches the caller's arrays.

Neither does I/O; :mod:`kvstore.worker` drives them (sockets, shared memory, the wait loop)
and tests drive them directly (``tests/test_plan.py``).

>>> p = Planner(num_server=2, bigarray_bound=4)
>>> p.add_key("w", 6, np.dtype("f4"))
>>> [(m.server, m.keys) for m in p.pull(["w"])]
[(0, (('w', 0),)), (1, (('w', 1),))]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, zip_longest
from typing import NamedTuple

import numpy as np

from .arrays import copy_into, namespace
from .compression import Compression, packed_size
from .sharding import place

SHM_FROM = 65536  # bytes: a slice at least this big may go through a shared segment


@dataclass(frozen=True)
class Slice:
    """The part of one key of a call that one server holds."""

    item: int  # the key's position in the call
    key: object
    part: int
    lo: int
    hi: int
    shared: bool  # big enough for the shared segment of a server on this host


class Leg(NamedTuple):
    """The part of a cached route that goes to one server."""

    server: int
    slices: tuple  # (Slice, ...)
    keys: tuple  # ((key, part), ...)
    wire: list  # [[key, part], ...]: the body's "keys" (shared by every message: never changed)
    shared: tuple  # indices of the slices that may travel through a shared segment
    cuts: tuple = ()  # per slice (item, lo, hi), hi None for a key's whole value (no slice)


class Outgoing(NamedTuple):
    """One message to one server, ready to send but for the shared-memory entries, which
    the driver fills in (it owns the segments)."""

    server: int
    kind: str
    keys: tuple  # ((key, part), ...): one per array
    wire: list  # the same as the body's "keys" field
    body: dict  # without "keys" and "shm"
    arrays: tuple  # one flat slice (or compressed codes) per key, or none (a pull)
    shared: tuple = ()  # indices of arrays that may travel through a shared segment
    residuals: tuple = ()  # ((key, part), new residual): kept once this message is sent


class Planner:
    """Key placement, and routes per key set (cached)."""

    def __init__(
        self,
        num_server: int,
        bigarray_bound: int,
        shm_servers=frozenset(),
        piece_bytes: int = 0,
        staleness: int | None = None,
    ):
        self.num_server = num_server
        # dist_ssp's bound: every push and pull says it, so the servers apply its rule
        self._mode = {} if staleness is None else {"ssp": staleness}
        self.bigarray_bound = bigarray_bound
        self.piece_bytes = piece_bytes  # a message carries about this much at most (0: any)
        self.shm_servers = frozenset(shm_servers)
        self.layout: dict = {}  # key -> [(server, part, lo, hi)]
        self.parts: dict = {}  # key -> {part: (lo, hi)}
        self.dtypes: dict = {}  # key -> the stored dtype
        self._routes: dict = {}  # (keys, push) -> ((server, (Slice, ...)), ...)

    def add_key(self, key, size: int, dtype) -> None:
        dtype = np.dtype(dtype)
        self.layout[key] = place(
            key, size, self.num_server, self.bigarray_bound, dtype.itemsize, self.piece_bytes
        )
        self.parts[key] = {part: (lo, hi) for _, part, lo, hi in self.layout[key]}
        self.dtypes[key] = dtype

    def set_shm_servers(self, servers) -> None:
        self.shm_servers = frozenset(servers)
        self._routes.clear()

    def route(self, keys: tuple, push: bool) -> tuple[Leg, ...]:
        """The :class:`Leg` s of a call on ``keys``: one message per server, or several when
        its slices hold more than ``piece_bytes`` (so the server sums a piece while the next
        is on the wire); in key order within a server, the servers taking turns (each one's
        first message, then each one's second, ...: a compressed push quantises a message
        just before it is sent, and every link gets its first piece early)."""
        cached = self._routes.get((keys, push))
        if cached is not None:
            return cached
        by_server: dict = {}
        for item, key in enumerate(keys):
            itemsize = self.dtypes[key].itemsize
            for server, part, lo, hi in self.layout[key]:
                shared = push and server in self.shm_servers and (hi - lo) * itemsize >= SHM_FROM
                by_server.setdefault(server, []).append(Slice(item, key, part, lo, hi, shared))
        per_server = [
            [
                Leg(
                    server,
                    tuple(group),
                    tuple((s.key, s.part) for s in group),
                    [[s.key, s.part] for s in group],
                    tuple(i for i, s in enumerate(group) if s.shared),
                    tuple(
                        (s.item, s.lo, None if len(self.layout[s.key]) == 1 else s.hi)
                        for s in group
                    ),
                )
                for group in self._messages(slices)
            ]
            for server, slices in sorted(by_server.items())
        ]
        turns = chain.from_iterable(zip_longest(*per_server))
        route = tuple(leg for leg in turns if leg is not None)
        if len(self._routes) >= 4096:  # key sets that never repeat: do not grow for ever
            self._routes.clear()
        self._routes[(keys, push)] = route
        return route

    def _messages(self, slices: list) -> list[list]:
        """``slices`` of one server cut into messages of at most about ``piece_bytes``."""
        if not self.piece_bytes:
            return [slices]
        groups: list = [[]]
        size = 0
        for s in slices:
            nbytes = (s.hi - s.lo) * self.dtypes[s.key].itemsize
            if groups[-1] and size + nbytes > self.piece_bytes:
                groups.append([])
                size = 0
            groups[-1].append(s)
            size += nbytes
        return groups

    # ---- calls
    def pull(self, keys, compression: Compression | None = None) -> list[Outgoing]:
        """With ``compression`` (compressed pulls), the servers may answer with codes."""
        body = (
            self._mode
            if compression is None
            else {**self._mode, "compression": compression.params()}
        )
        return [
            Outgoing(leg.server, "pull", leg.keys, leg.wire, body, ())
            for leg in self.route(tuple(keys), False)
        ]

    def init(self, keys, flats, members=None, arrivals=None) -> list[Outgoing]:
        body = {} if members is None else {"members": list(members)}
        if arrivals is not None:
            body["arrivals"] = list(arrivals)
        return list(self._with_values("init", keys, flats, body, None, None))

    def push(
        self, kind: str, keys, flats, sync: bool, compression=None, residuals=None
    ) -> Iterator[Outgoing]:
        """``kind`` is ``push`` or ``pushpull``; ``flats`` one flat host array per key (cast
        to the stored dtype here). With ``compression``, the codes travel instead of the
        values, and each message carries the residuals to keep once it is sent.

        The messages come one at a time and are quantised one ahead: taking message k
        quantises message k+1 (:func:`_one_ahead`), so a driver that sends each as it comes
        has message k on the wire while message k+2 is quantised (``list()`` them to have
        them all)."""
        body: dict = {"sync": sync, **self._mode}
        if compression is not None:
            body["compression"] = compression.params()
        return _one_ahead(self._with_values(kind, keys, flats, body, compression, residuals or {}))

    def _with_values(self, kind, keys, flats, body, compression, residuals) -> Iterator[Outgoing]:
        keys = tuple(keys)
        dtypes = self.dtypes
        cast = [
            flat if flat.dtype == dtypes[key] else flat.astype(dtypes[key])
            for key, flat in zip(keys, flats, strict=True)
        ]
        for leg in self.route(keys, kind != "init"):
            pieces = tuple(cast[i] if hi is None else cast[i][lo:hi] for i, lo, hi in leg.cuts)
            if compression is None:
                yield Outgoing(leg.server, kind, leg.keys, leg.wire, body, pieces, leg.shared)
                continue
            coded, headers, kept = [], [], []
            for where, piece in zip(leg.keys, pieces, strict=True):
                packed, header, residual = compression.quantize(residuals.get(where), piece)
                coded.append(packed)
                headers.append(header)
                kept.append((where, residual))
            yield Outgoing(
                leg.server,
                kind,
                leg.keys,
                leg.wire,
                {**body, "headers": headers},
                tuple(coded),
                (),
                tuple(kept),
            )


def _one_ahead(messages: Iterator[Outgoing]) -> Iterator[Outgoing]:
    """``messages``, each given once the next one is made (quantised): a call of one or two
    messages goes out at once, as it did when every message was quantised first, while a big
    key's pieces still overlap. Measured over a 1 Gbit/s link (``benchmarks/netsim.py``, two
    hosts sharing two cores): sending each message as soon as it was quantised made 1-bit
    4 MiB pushpulls 5-10% slower (probably a server's work on the first piece competing with
    the workers quantising the second); one ahead, they are as fast as before, and 64 MiB
    ones faster than either."""
    ahead = next(messages, None)
    for message in messages:
        yield ahead
        ahead = message
    if ahead is not None:
        yield ahead


class ReplyError(ValueError):
    """A reply that does not answer what was asked."""


class Collector:
    """The outputs of one pulling call, and the reply parts it still waits for.

    ``outs`` is one list of output arrays per key (the first is written directly when it is
    a contiguous host array of the stored dtype, else a staging array is; :meth:`finish`
    copies to the rest). :meth:`expect` registers a sent request, :meth:`receive` writes a
    reply's slices (decoding those that came as codes, with ``codec``: compressed pulls),
    :meth:`cancel` stops all writing."""

    def __init__(self, planner: Planner, keys, outs, shapes, codec: Compression | None = None):
        self.cancelled = False
        self._codec = codec  # compressed pulls: decodes the replies that come as codes
        self.reason = ""
        self._targets: dict = {}
        self._staged = []
        for key, key_outs, shape in zip(keys, outs, shapes, strict=True):
            dtype = planner.dtypes[key]
            first = key_outs[0]
            direct = (
                (type(first) is np.ndarray or namespace(first) is np)
                and first.flags.c_contiguous
                and first.dtype == dtype
            )
            if not direct:
                flat = np.empty(int(np.prod(shape)), dtype)
            else:
                flat = first if first.ndim == 1 else first.reshape(-1)
            self._targets[key] = (flat, planner.parts[key])
            if not direct or len(key_outs) > 1:
                self._staged.append((key_outs, flat, shape, direct))
        self._expected: dict = {}  # request id -> ((key, part), ...)

    def expect(self, request: int, keys: tuple) -> None:
        self._expected[request] = keys

    @property
    def waiting(self) -> set:
        return set(self._expected)

    def receive(self, request: int, keys, arrays, codes=None) -> None:
        """Write a reply's slices (``arrays`` in the order of ``keys``; ``codes``, the reply's
        ``[[index, header], ...]``, says which came as codes). A reply of a cancelled call, or
        one that was not expected, writes nothing; one that answers something else than was
        asked raises :class:`ReplyError` and writes nothing."""
        asked = self._expected.pop(request, None)
        if asked is None or self.cancelled:
            return
        if len(keys) != len(asked) or len(arrays) != len(asked):
            self.cancel()
            raise ReplyError(f"the reply holds {len(keys)} keys, expected {len(asked)}")
        coded = self._coded(codes, len(asked)) if codes else {}
        writes = []
        for i, ((key, part), got, array) in enumerate(zip(asked, keys, arrays, strict=True)):
            if got[0] != key or got[1] != part:
                self.cancel()
                raise ReplyError(f"the reply holds key {got!r:.60}, expected {[key, part]}")
            flat, parts = self._targets[key]
            lo, hi = parts[part]
            header = coded.get(i) if coded else None
            if header is not None:
                nbytes = packed_size(self._codec.kind, hi - lo)
                if array.dtype != np.uint8 or array.size != nbytes:
                    self.cancel()
                    raise ReplyError(
                        f"key {key!r} part {part}: got {array.size} x {array.dtype} of codes, "
                        f"expected {nbytes} x uint8"
                    )
                writes.append((flat, lo, hi, array, header))
                continue
            if array.dtype != flat.dtype or array.size != hi - lo:
                self.cancel()
                raise ReplyError(
                    f"key {key!r} part {part}: got {array.size} x {array.dtype}, "
                    f"expected {hi - lo} x {flat.dtype}"
                )
            writes.append((flat, lo, hi, array, None))
        for flat, lo, hi, array, header in writes:
            if header is not None:
                self._codec.decode(array, header, hi - lo, flat.dtype.type, out=flat[lo:hi])
                continue
            if array.ndim != 1:
                array = array.reshape(-1)
            if lo == 0 and hi == flat.shape[0]:  # a small key whole: 5x cheaper than a slice
                flat[...] = array
            else:
                flat[lo:hi] = array

    def _coded(self, codes, count: int) -> dict:
        """``{index: header}`` from a reply's ``codes``, checked."""
        codec = self._codec
        if codec is None or not isinstance(codes, list):
            self.cancel()
            raise ReplyError("the reply holds codes, and this call asked for none")
        coded = {}
        for entry in codes:
            if (
                type(entry) is not list
                or len(entry) != 2
                or type(entry[0]) is not int
                or not 0 <= entry[0] < count
                or not codec.check_header(entry[1])
            ):
                self.cancel()
                raise ReplyError(f"bad codes entry {entry!r:.60}")
            coded[entry[0]] = entry[1]
        return coded

    def cancel(self, reason: str = "cancelled") -> None:
        """Write nothing more; ``reason`` says why (a finisher raises it)."""
        if not self.cancelled:
            self.cancelled, self.reason = True, reason
        self._expected.clear()

    def finish(self) -> None:
        """Copy the pulled values to every further output (other devices, dtypes)."""
        if self.cancelled:
            return
        for key_outs, flat, shape, direct in self._staged:
            source = flat.reshape(shape)
            for out in key_outs[1:] if direct else key_outs:
                copy_into(out, source)
