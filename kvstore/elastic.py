"""Elastic jobs for KVStore scripts: Horovod's elastic loop (``run``, a state, ``commit``) on a
plain store, with NumPy and no framework.

    import kvstore, kvstore.elastic

    kv = kvstore.create("dist_sync")
    state = kvstore.elastic.State(kv, epoch=0, batch=0)

    @kvstore.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, steps):
                mine = data[state.rank :: state.size]   # this worker's share
                ...                                     # kv.pushpull(...), as in any job
                state.commit()                          # may raise HostsUpdatedInterrupt
            state.batch = 0

    train(state)

Run it with ``launch.py -n MIN:MAX``. The values live on the servers, so a change of workers
rolls nothing back: at the first ``commit()`` (or ``check_host_updates()``) after a worker
left or came, every worker of the job raises :class:`HostsUpdatedInterrupt` at the same step;
``run`` agrees with the newcomers on who is here (``state.rank``, ``state.size``), calls the
reset callbacks, gives every worker rank 0's attributes (``sync``) and calls the function
again. Between two resets ``state.rank`` and ``state.size`` stay put, while ``kv.rank`` and
``kv.num_workers`` follow each change as it comes. In a job of a fixed size the same script
runs unchanged: nothing ever changes, ``commit`` sends nothing.

``kvstore.torch.elastic`` (Horovod's ``hvd.elastic``) is this loop with PyTorch's state.
"""

from __future__ import annotations

import copy
import functools
import logging
import pickle
import zlib
from typing import NamedTuple

import numpy as np

from .protocol import INTERNAL_PREFIX

log = logging.getLogger(__name__)

__all__ = ["BaseState", "Generation", "HostsUpdatedInterrupt", "State", "run"]

MEMBERS_KEY = INTERNAL_PREFIX + "elastic.members"

# The store types whose rounds wait for every worker: a reset is a round of them all.
SYNC_TYPES = ("local", "device", "dist_sync", "dist_device_sync")


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's (``horovod.common.exceptions``): the job's workers changed, in an elastic job
    (``launch.py -n MIN:MAX``); ``commit()`` raises it on every worker at the same step, and
    :func:`run` catches it.

    >>> HostsUpdatedInterrupt(skip_sync=True).skip_sync
    True
    """

    def __init__(self, skip_sync: bool):
        super().__init__(skip_sync)
        self.skip_sync = skip_sync


class Generation(NamedTuple):
    """An elastic job's workers between two resets, as every one of them agreed in
    :func:`rendezvous`: ``slots`` (the store's slots, sorted), the membership ``epoch`` they
    had seen, this worker's ``slot``, and per slot the epoch its worker came in
    (``arrivals``: 0 for the first workers)."""

    epoch: int
    slots: tuple
    slot: int
    arrivals: tuple = ()

    @property
    def rank(self) -> int:
        return self.slots.index(self.slot)

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def tag(self) -> str:
        """A name for this generation's keys: made as a group of its slots, so a worker that
        comes later is in none of them and never holds up their rounds."""
        crc = zlib.crc32(",".join(map(str, self.slots)).encode())
        return f"e{self.epoch}-{crc:08x}"


def is_elastic(kv) -> bool:
    return getattr(kv, "_present", None) is not None


def fixed(kv) -> Generation:
    """The one generation of a job of a fixed size."""
    return Generation(0, tuple(range(kv.num_workers)), kv.rank, (0,) * kv.num_workers)


def rendezvous(kv) -> Generation:
    """Agree with every worker present on the next generation: one round of a key of every
    slot (made by the first workers; a newcomer's init sends nothing), into which each worker
    present puts (1, the membership epoch it has seen, the epoch it came in) at its slot's
    row. The survivors do not wait for a newcomer in any key before it pushes or enters, so
    the newcomer's push waits there for the survivors' next reset."""
    kv._wait("elastic reset")  # this worker's rounds before the reset are done without it
    slots = kv._num_workers
    if MEMBERS_KEY not in kv._meta:
        kv._init_any(MEMBERS_KEY, np.zeros((slots, 3), np.int64))
    rows = np.zeros((slots, 3), np.int64)
    rows[kv._rank] = (1, kv.epoch, kv._arrival)
    kv.pushpull(MEMBERS_KEY, rows)
    here = tuple(int(s) for s in np.flatnonzero(rows[:, 0]))
    arrivals = tuple(int(rows[s, 2]) for s in here)
    gen = Generation(int(rows[:, 1].max()), here, kv._rank, arrivals)
    # the groups made by this generation's workers name them by slot and arrival: a slot
    # taken by a newcomer after this is out of them (it would wait in the next reset)
    kv._arrivals = dict(zip(here, arrivals, strict=True))
    # A newcomer is in a key's rounds from its first push of it: here it enters them all,
    # and nobody goes on before it did (a round of the generation), so that every key's next
    # round is every member's, whoever pushes it first.
    kv._enter()
    _group_sum(kv, gen, "entered", np.zeros(1, np.int64))
    log.info("elastic reset: epoch %d, workers in slots %s; rank %d", gen.epoch, here, gen.rank)
    return gen


def _group_sum(kv, gen: Generation, name: str, rows: np.ndarray) -> None:
    """``rows`` summed over the generation's workers, in place."""
    key = f"{INTERNAL_PREFIX}elastic.{gen.tag}.{name}"
    if key not in kv._meta:
        kv._init_any(key, np.zeros_like(rows), members=list(gen.slots))
    kv.pushpull(key, rows)


def workers_changed(kv, gen: Generation) -> bool:
    """Whether any worker of ``gen`` has seen a membership change since it was agreed: the
    same answer on every one of them (a round of the generation's key). False, sending
    nothing, in a job of a fixed size."""
    if not is_elastic(kv):
        return False
    rows = np.zeros((gen.size, 2), np.int64)
    rows[gen.rank] = (kv.epoch, int(tuple(kv._present) != gen.slots))
    _group_sum(kv, gen, "check", rows)
    return bool(rows[:, 0].max() > gen.epoch or rows[:, 1].any())


def broadcast(kv, gen: Generation, obj, root: int = 0):
    """``root``'s ``obj`` (pickled) on every worker of ``gen``: the others push zeros.
    A root that left mid-way (its bytes missing, in part or whole: the length and a CRC of
    them go first) is :class:`HostsUpdatedInterrupt` on every worker, to reset again."""
    if gen.size == 1:
        return obj
    mine = gen.rank == root
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if mine else b""
    head = np.array([len(data), zlib.crc32(data)], np.int64)
    _group_sum(kv, gen, "object.head", head)
    n, crc = int(head[0]), int(head[1])
    if n == 0:
        raise HostsUpdatedInterrupt(skip_sync=False)
    capacity = 1 << max(6, (n - 1).bit_length())  # few keys however many sizes are sent
    payload = np.zeros(capacity, np.uint8)
    if mine:
        payload[:n] = np.frombuffer(data, np.uint8)
    _group_sum(kv, gen, f"object{capacity}", payload)
    got = payload[:n].tobytes()
    if zlib.crc32(got) != crc:
        raise HostsUpdatedInterrupt(skip_sync=False)
    return obj if mine else pickle.loads(got)


class BaseState:
    """Horovod's ``horovod.common.elastic.State``: what :func:`run` saves, restores and
    syncs. A subclass says how (``save``, ``restore``, ``sync``) and how its workers agree
    (``_workers_changed``, ``_reset_workers``)."""

    # errors after which run() restores the last commit before the reset (Horovod's
    # HorovodInternalError, for kvstore.torch)
    _restore_on: tuple = ()

    def __init__(self):
        self._reset_callbacks: list = []

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called after each reset (workers came or left), before ``sync``: e.g. to
        scale the learning rate by the new number of workers."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state (``restore()`` comes back to it), then ``check_host_updates()``."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` if workers came or left since the last reset:
        on every worker at once."""
        if self._workers_changed():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError()

    def restore(self) -> None:
        raise NotImplementedError()

    def sync(self) -> None:
        raise NotImplementedError()

    def reset(self) -> None:
        """Called at a reset, before the callbacks and ``sync``."""

    def _workers_changed(self) -> bool:
        raise NotImplementedError()

    def _reset_workers(self) -> None:
        raise NotImplementedError()


def run(func):
    """Horovod's ``elastic.run``: call ``func(state, ...)`` after ``state.sync()``; when workers
    came or left (:class:`HostsUpdatedInterrupt`), agree on the new workers, call the reset
    callbacks and sync, keeping this worker's state (nothing rolls back); then call it again.

    >>> @run
    ... def train(state): ...
    """

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except state._restore_on:
                state.restore()
                skip_sync = False
            state._reset_workers()
            state.on_reset()

    return wrapper


_OWN = ("rank", "size", "kv")


class State(BaseState):
    """The state of a KVStore script: plain attributes (``epoch=0, batch=0``, NumPy arrays,
    anything picklable) beside the store ``kv``. ``commit()`` saves a copy of them and checks
    for workers that came or left; ``restore()`` goes back to the last commit; ``sync()``
    gives every worker rank 0's. ``rank`` and ``size`` are this worker's place and the number
    of workers since the last reset (the same on every worker between two resets: shard data
    by them).

    >>> import kvstore
    >>> state = State(kvstore.create("local"), epoch=0, w=np.zeros(2))
    >>> state.epoch, state.rank, state.size
    (0, 0, 1)
    """

    def __init__(self, kv, **attrs):
        from . import ALIASES

        kind = ALIASES.get(getattr(kv, "type", None), getattr(kv, "type", None))
        if kind is None or not hasattr(kv, "_meta"):
            raise TypeError(f"State: expected a kvstore store, got {type(kv).__name__}")
        if kind not in SYNC_TYPES:
            raise ValueError(
                f"State: a store of type {kind!r} has no rounds that every worker meets; use "
                f"one of {', '.join(SYNC_TYPES)} (an async job's workers never wait for "
                "each other: read kv.rank and kv.num_workers at each step instead)"
            )
        taken = sorted(set(attrs) & set(_OWN) | {a for a in attrs if a.startswith("_")})
        if taken:
            raise ValueError(
                f"State: attribute names {taken} are the state's own (rank, size, kv) or "
                "private; choose others"
            )
        super().__init__()
        self._kv = kv
        self._gen = rendezvous(kv) if is_elastic(kv) else fixed(kv)
        self._saved = copy.deepcopy(attrs)
        for name, value in attrs.items():
            setattr(self, name, value)

    @property
    def kv(self):
        return self._kv

    @property
    def rank(self) -> int:
        """This worker's rank among the workers of the last reset."""
        return self._gen.rank

    @property
    def size(self) -> int:
        """The number of workers at the last reset."""
        return self._gen.size

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._saved}

    def restore(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        """Every worker takes rank 0's last commit (Horovod's: a reset follows a commit)."""
        if self._saved:
            self._saved = broadcast(self._kv, self._gen, self._saved)
            self.restore()

    def _workers_changed(self) -> bool:
        return workers_changed(self._kv, self._gen)

    def _reset_workers(self) -> None:
        self._gen = rendezvous(self._kv) if is_elastic(self._kv) else fixed(self._kv)
