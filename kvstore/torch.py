"""Horovod's PyTorch API on a KVStore: a Horovod script runs after changing one import.

    import kvstore.torch as hvd          # was: import horovod.torch as hvd

    hvd.init()                           # dist_sync under launch.py, local when run alone
    torch.set_num_threads(1)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    for x, y in loader:
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()   # gradients leave while backward runs
        opt.step()                           # waits only for what is still in flight

How it works. After :func:`init`, one background thread owns the store and makes every call
on it (a KVStore is not thread-safe); the API functions hand it jobs and wait for them.
:class:`DistributedOptimizer` puts a hook on every parameter; when backward has produced a
parameter's gradient (``backward_passes_per_step`` times) the hook copies it into its
bucket, a flat buffer of about ``bucket_cap_mb`` (5 MB; DDP's are 25) holding parameters in
reverse order (the order backward produces them). A full bucket leaves at once: the
background thread starts its ``pushpull_async`` (one message out, the sum back into the
same buffer) and goes on with the next, several in flight while backward goes on;
``step()`` (or ``synchronize()``) waits for the buckets still in flight, averages each in
place and makes each ``p.grad`` a view into its bucket (no copy back; the next
``zero_grad()`` drops it, and a gradient kept past the next step sees the bucket reused, as
with DDP's ``gradient_as_bucket_view``). Buckets leave in the same order on every worker
(a full bucket waits for the ones before it), so workers can never wait on each other's
different keys. Buckets are smaller than DDP's because a server's round is
store-and-forward (the whole bucket in, the sum, the whole bucket out), where a ring
pipelines inside a bucket; since a bucket became one message, 1, 5 and 25 MB buckets give
ResNet-18 steps within 10% of each other on this project's 2-core machine (README).

Collectives are sums on the store's keys, because the servers only sum: a broadcast is the
root's tensor plus zeros from everyone else (exact), a gather puts each rank's rows at its
offset in zeros; Min, Max and Product gather every worker's tensor and reduce it on each
worker; reducescatter sums the whole tensor and keeps this worker's rows; alltoall gathers
every worker's rows and keeps the ones sent here. Each distinct (name, dtype, shape) is a
key, initialised (collectively) on first use and reused after. Before its data, every call
the user makes sends one small round that compares the workers' names, dtypes and shapes,
so a mismatch raises on every worker instead of leaving some waiting on a key the others
never push (the optimizer's buckets and SyncBatchNorm's statistics skip it: their shapes
come from the model). The ``*_async`` forms hand the same work to the store's thread and
return a handle for :func:`poll` and :func:`synchronize`. ``broadcast_object``,
``allgather_object`` and ``broadcast_optimizer_state`` serialise with pickle, between the
workers of one job (as Horovod's cloudpickle); the servers only ever see bytes.

Process sets (Horovod's, :func:`add_process_set`): a set's collectives use the store's keys
of a group, made by the set's members alone (``kv.init(..., members=ranks)``), whose rounds
complete when every member pushed; keys are named by the set's ranks (``kvt.ps0-2.``), ranks
and sizes are the set's, ``root_rank`` a global rank, as Horovod's.
Adasum: ``allreduce`` gathers and combines on each worker; DistributedOptimizer's combines
each worker's parameter change after its own optimizer step, as Horovod's.

Requires the ``torch`` extra (``pip install 'kvstore-ps[torch]'``). Tensors travel through host
memory as NumPy arrays; the store must sum (``dist_sync``, ``dist_device_sync``, ``local``,
``device``).
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # the message a user sees instead of a bare ModuleNotFoundError
    raise ImportError(
        "kvstore.torch needs PyTorch, which is not installed: pip install 'kvstore-ps[torch]' "
        "(or torch's own CPU/CUDA wheel from https://pytorch.org)"
    ) from exc

import atexit
import collections
import contextlib
import io
import itertools
import logging
import os
import pickle
import queue
import socket
import threading
import warnings
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np

from . import arrays, timeline
from .elastic import Generation, HostsUpdatedInterrupt, rendezvous, workers_changed
from .errors import KVStoreError
from .server import root_only
from .store import KVStore

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
    "elastic",
]

log = logging.getLogger("kvstore.torch")

# Horovod's reduction ops. The store sums; Average divides the sum by the number of workers.
Average, Sum, Adasum, Min, Max, Product = "Average", "Sum", "Adasum", "Min", "Max", "Product"
_SUMMING_TYPES = ("local", "device", "dist_sync", "dist_device_sync")


# ---------------------------------------------------------------- exceptions (Horovod's)

# Horovod raises HorovodInternalError (a RuntimeError) when a collective fails. Here every
# failure outside the caller's arguments is a KVStoreError (a peer lost, a deadline passed, a
# refused request; kvstore.errors), which is the same thing: so the one is the other, and an
# ``except hvd.HorovodInternalError`` written for Horovod catches PeerLostError too, with no
# layer translating errors (an uncaught one keeps its exit code: 129 for a lost peer).
HorovodInternalError = KVStoreError


class MismatchError(KVStoreError, ValueError):
    """Workers passed different tensors (names, dtypes or shapes) to the same collective. A
    ValueError, as the caller's arguments were wrong, and a HorovodInternalError (so a
    RuntimeError), as Horovod raises for a mismatch between ranks: either ``except`` catches
    it. Every worker of the call raises it, and the job goes on."""


# ---------------------------------------------------------------- compression (Horovod's)


class Compressor:
    """Casts a tensor for the wire and back. ``compress`` returns (tensor, context)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """Tensors travel in their own dtype."""


class FP16Compressor(Compressor):
    """Floating-point tensors travel (and are summed on the servers) as float16: half the
    bytes of float32, about 3 significant digits."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """``Compression.none`` or ``Compression.fp16``, as ``horovod.torch.Compression``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def _wire_dtype(compression, dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype a tensor of ``dtype`` travels in. NumPy has no bfloat16: bf16 goes as
    float32 unless the compressor makes it float16."""
    wire = compression.compress(torch.empty(0, dtype=dtype))[0].dtype
    if wire == torch.bfloat16:
        wire = torch.float32
    if wire == torch.bool:
        wire = torch.uint8
    return torch.empty(0, dtype=wire).numpy().dtype


# ---------------------------------------------------------------- the store's own thread


class _Comm:
    """One thread that makes every call on the store. ``submit(fn)`` runs ``fn(kv)`` there
    and returns a Future. A job submitted with ``first=True`` (a bucket's pushpull) runs
    before earlier such jobs are finished: it starts its call and returns a ``finish()``
    (a :class:`~kvstore.store.Pending`'s ``wait``), run when no job waits, in order, which
    completes the job's Future; so several buckets are in flight at once. Any other job
    runs after every pending finish."""

    def __init__(self, kv: KVStore):
        self.kv = kv
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="kvstore.torch", daemon=True)
        self.thread.start()

    def submit(self, fn, first: bool = False) -> Future:
        future: Future = Future()
        self.jobs.put((fn, future, first))
        return future

    def run(self, fn):
        return self.submit(fn).result()

    def stop(self, timeout: float) -> bool:
        self.jobs.put(None)
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _loop(self) -> None:
        pending: collections.deque = collections.deque()  # (finish, future), oldest first
        while True:
            if pending:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    self._finish(*pending.popleft())
                    continue
            else:
                job = self.jobs.get()
            if job is None:
                while pending:
                    self._finish(*pending.popleft())
                return
            fn, future, first = job
            if not first:
                while pending:
                    self._finish(*pending.popleft())
            try:
                result = fn(self.kv)
            except BaseException as exc:  # handed to the waiting thread, which raises it
                future.set_exception(exc)
                continue
            if first:
                pending.append((result, future))
            else:
                future.set_result(result)

    @staticmethod
    def _finish(finish, future: Future) -> None:
        try:
            future.set_result(finish())
        except BaseException as exc:
            future.set_exception(exc)


class _State:
    def __init__(self):
        self.kv: KVStore | None = None
        self.comm: _Comm | None = None
        self.owned = False
        self.local_rank = 0
        self.local_size = 1
        self.keys: set = set()  # keys initialised in the store (read in the comm thread)
        self.optimizers: collections.Counter = collections.Counter()  # per key prefix
        self.process_sets: dict = {}  # process_set_id -> its ranks (a sorted tuple)
        self.process_set_ids = itertools.count(1)
        self.handles: dict = {}  # handle -> (Future, finish) of the *_async calls in flight
        self.handle_ids = itertools.count(1)
        self.tracer: timeline.Tracer | None = None  # start_timeline's (set in the comm thread)
        self.generation: Generation | None = None  # an elastic job's workers (else None)


_state = _State()
_init_lock = threading.Lock()


def _require() -> _State:
    if _state.comm is None:
        raise ValueError("kvstore.torch has not been initialized; use hvd.init().")
    return _state


# ---------------------------------------------------------------- process sets


class ProcessSet:
    """Horovod's process set: a list of global ranks that run collectives together. Make it
    with :func:`add_process_set` (or ``hvd.init(process_sets=[...])``) on every worker, in
    the same order, then pass ``process_set=`` to a collective: only the set's members call
    it (a non-member raises ValueError before sending anything). Its keys are the store's
    keys of a group (``kv.init(..., members=ranks)``): a round completes when every member
    has pushed. ``root_rank`` stays a global rank, as Horovod's.

    >>> evens = hvd.add_process_set([0, 2])  # doctest: +SKIP
    >>> if evens.included(): hvd.allreduce(t, process_set=evens)  # doctest: +SKIP
    """

    process_set_id = None
    ranks = None

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, (str, bytes)) or not hasattr(ranks_or_comm, "__iter__"):
            raise ValueError(
                "ProcessSet: expected a list of ranks (kvstore.torch has no MPI communicators), "
                f"got {type(ranks_or_comm).__name__}"
            )
        ranks = sorted(ranks_or_comm)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet: ranks must be ints, got {ranks!r}")
        self.ranks = ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        """The number of workers in the set; None if it was never added (or was removed)."""
        if self.process_set_id is None:
            return None
        return size() if self.process_set_id == 0 else len(_registered(self))

    def rank(self) -> int | None:
        """This worker's rank within the set (its index among the set's sorted ranks); None
        if the set was never added. ValueError on a worker outside the set (as Horovod)."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return rank()
        ranks = _registered(self)
        if rank() not in ranks:
            raise ValueError("Process is not part of provided process set.")
        return ranks.index(rank())

    def included(self) -> bool | None:
        """Whether this worker is in the set."""
        return None if self.ranks is None else rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])  # its ranks are every worker's, set by init()
global_process_set.process_set_id = 0


def _registered(process_set: ProcessSet) -> tuple:
    ranks = _require().process_sets.get(process_set.process_set_id)
    if ranks is None or list(ranks) != process_set.ranks:
        raise ValueError(
            f"{process_set} does not exist or has not been registered: pass the object "
            "hvd.add_process_set returned (or one given to hvd.init(process_sets=...))"
        )
    return ranks


def add_process_set(process_set) -> ProcessSet:
    """Add a process set (a :class:`ProcessSet` or a list of ranks) and return it, its
    ``process_set_id`` set. Every worker calls it, in the same order (as Horovod's, which
    needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1``; not here). No communication: the set's keys
    are made by its members on first use. ValueError for a set of the same ranks as one
    already added (the global set's included).

    >>> evens = hvd.add_process_set([0, 2])  # doctest: +SKIP
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if not _add_set(process_set, "add_process_set"):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    return process_set


def _add_set(process_set: ProcessSet, what: str) -> bool:
    """Register the set (False: one of the same ranks is there)."""
    st = _require()
    if st.generation is not None:
        raise NotImplementedError(
            f"{what}: process sets in an elastic job are not supported (its ranks change at "
            "every reset)"
        )
    ranks, n = tuple(process_set.ranks), st.kv.num_workers
    if not ranks or len(set(ranks)) != len(ranks) or not 0 <= ranks[0] <= ranks[-1] < n:
        raise ValueError(f"{what}: expected distinct ranks in 0..{n - 1}, got {list(ranks)}")
    if ranks == tuple(range(n)) or ranks in st.process_sets.values():
        return False
    process_set.process_set_id = next(st.process_set_ids)
    st.process_sets[process_set.process_set_id] = ranks
    return True


def remove_process_set(process_set) -> bool:
    """Remove a set :func:`add_process_set` added (every worker calls it, as Horovod's) and
    invalidate the object (``process_set_id`` None); False for the global set and for a
    set not added. Its keys stay in the store (adding the same ranks again reuses them)."""
    st = _require()
    set_id = getattr(process_set, "process_set_id", None)
    if not set_id or st.process_sets.get(set_id) != tuple(process_set.ranks):
        return False
    del st.process_sets[set_id]
    process_set._invalidate()
    return True


class _Group(NamedTuple):
    """Who runs a collective: ``ranks`` (global, sorted), this worker's ``index`` among them,
    the ``prefix`` of the group's keys, and ``members`` for ``kv.init`` (None: every worker,
    the global set)."""

    ranks: tuple
    index: int
    prefix: str
    members: list | None

    @property
    def size(self) -> int:
        return len(self.ranks)


def _group(process_set, what: str, members_only: bool = True) -> _Group | None:
    """The group of ``process_set``; a ValueError for a set not added or (``members_only``)
    on a worker outside it (else None there)."""
    st = _require()
    kv, gen = st.kv, st.generation
    if gen is not None and (process_set is None or process_set is global_process_set):
        return _Group(tuple(range(len(gen.slots))), gen.rank, f"kvt.{gen.tag}.", list(gen.slots))
    if process_set is None or process_set is global_process_set:
        return _Group(tuple(range(size())), rank(), "kvt.", None)
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            f"{what}: process_set must be a hvd.ProcessSet, got {type(process_set).__name__}"
        )
    ranks = _registered(process_set)
    if kv.rank not in ranks:
        if not members_only:
            return None
        raise ValueError(
            f"{what}: rank {kv.rank} is not a member of the provided process set "
            f"{process_set}; only its members call a collective on it"
        )
    # The keys are named by the ranks, not the id: the same on every member, whatever sets
    # each worker added, and a set removed and added again finds its keys (same members).
    tag = "-".join(map(str, ranks))
    if len(ranks) > 16:
        tag = f"{zlib.crc32(tag.encode()):08x}"
    return _Group(ranks, ranks.index(kv.rank), f"kvt.ps{tag}.", list(ranks))


# ---------------------------------------------------------------- init and identity


def init(kv_store: str | KVStore | None = None, process_sets=None) -> None:
    """Start (or join) the job: create the store, and the thread that talks to it.

    ``kv_store``: a store type or a :class:`KVStore` to use (its keys must be strings); by
    default ``dist_sync`` when started by ``launch.py`` (``DMLC_ROLE`` is set), else
    ``local`` (one process). Every worker calls it; a second call does nothing.
    ``process_sets``: :class:`ProcessSet` objects to add (as :func:`add_process_set`, in
    order; one of the same ranks as the global set or as an earlier one is left invalid, as
    Horovod's); Horovod's ``"dynamic"`` is accepted (sets can always be added later).

    >>> import kvstore.torch as hvd; hvd.init(); hvd.size()  # doctest: +SKIP
    1
    """
    if process_sets == "dynamic":
        process_sets = None
    for ps in process_sets or ():
        if not isinstance(ps, ProcessSet):
            raise TypeError(
                f"init: process_sets must be hvd.ProcessSet objects, got {type(ps).__name__}"
            )
    with _init_lock:
        if _state.comm is not None:
            return
        import kvstore

        if isinstance(kv_store, KVStore):
            kv, owned = kv_store, False
        else:
            if kv_store is None:
                kv_store = "dist_sync" if os.environ.get("DMLC_ROLE") else "local"
            kv, owned = kvstore.create(kv_store), True
        # kv.type is the name given ("dist", "nccl", ...): judge the store it names
        if kvstore.ALIASES.get(kv.type, kv.type) not in _SUMMING_TYPES:
            if owned:
                kv.close()
            raise ValueError(
                f"kvstore.torch needs a store that sums ({', '.join(_SUMMING_TYPES)}, or "
                f"MXNet's names for them), not {kv.type!r}"
            )
        _state.kv, _state.owned, _state.keys = kv, owned, set()
        _state.handles, _state.tracer, _state.generation = {}, None, None
        _state.optimizers.clear()
        _state.process_sets, _state.process_set_ids = {}, itertools.count(1)
        _state.comm = _Comm(kv)
        # Registered after the store's own (atexit runs last first): the thread finishes
        # what is in flight and closes the store before anything else touches it.
        atexit.register(shutdown)
        global_process_set.ranks = list(range(kv.num_workers))
        if getattr(kv, "_present", None) is not None:  # elastic: agree on who is here
            _elastic_reset()
        _state.local_rank, _state.local_size = _local_ranks(kv)
    for ps in process_sets or ():
        if not _add_set(ps, "init"):
            ps._invalidate()


def _local_ranks(kv: KVStore) -> tuple[int, int]:
    """(local rank, local size): the launcher's ``LOCAL_RANK`` and ``LOCAL_SIZE``, else
    found by gathering every worker's host name (collective, at init only; not in an elastic
    job, whose newcomers' init meets nobody's)."""
    env = os.environ
    if kv.num_workers == 1:
        return 0, 1
    if env.get("LOCAL_RANK", "").isdigit() and env.get("LOCAL_SIZE", "").isdigit():
        return int(env["LOCAL_RANK"]), int(env["LOCAL_SIZE"])
    if _state.generation is not None:
        return 0, 1
    host = zlib.crc32(socket.gethostname().encode())
    hosts = allgather(torch.tensor([host], dtype=torch.int64), name="kvt.hosts").tolist()
    same = [r for r, h in enumerate(hosts) if h == host]
    return same.index(kv.rank), len(same)


def is_initialized() -> bool:
    return _state.comm is not None


def shutdown() -> None:
    """Finish what is in flight and close the store (at exit, by itself)."""
    with _init_lock:
        comm, kv, owned = _state.comm, _state.kv, _state.owned
        if comm is None:
            return
        _state.comm = _state.kv = None
        try:
            comm.run(_end_timeline)
            if owned:
                comm.run(_close_store)
        finally:
            comm.stop(timeout=30)
        atexit.unregister(shutdown)
        del kv


def _close_store(kv: KVStore) -> None:
    """Close the store; at exit after an uncaught exception, as a worker that failed (the
    store's own exit hook would say so, but this one runs first): else the scheduler hears
    that it finished, and an elastic job whose workers all raised ends with status 0."""
    from .worker import _ending

    if _ending and hasattr(kv, "_close_quietly"):
        kv._close_quietly()
    else:
        kv.close()


def rank() -> int:
    """This worker's rank, 0 .. size() - 1 (in an elastic job: among the workers of the last
    reset, renumbered at each)."""
    st = _require()
    return st.kv.rank if st.generation is None else st.generation.rank


def size() -> int:
    """The number of workers (in an elastic job: since the last reset)."""
    st = _require()
    return st.kv.num_workers if st.generation is None else len(st.generation.slots)


# ---------------------------------------------------------------- elastic jobs: resets
#
# Horovod's elastic reset (shutdown, init) forms a new ring of the workers present. Here the
# store and its rounds go on (no rollback); a reset is kvstore.elastic's rendezvous, whose
# pushers are the next generation; hvd.elastic (kvstore/torch_elastic.py) drives the resets.


def _elastic_reset() -> None:
    """A reset: the rendezvous, then ``rank()``, ``size()`` and the global process set are
    the new generation's. Every worker present calls it (a newcomer in ``init``)."""
    st = _require()
    st.generation = st.comm.run(rendezvous)
    global_process_set.ranks = list(range(st.generation.size))


def _workers_changed() -> bool:
    """Whether any worker of this generation has seen a membership change (the same answer
    on every one of them). False outside elastic jobs."""
    st = _require()
    gen = st.generation
    return gen is not None and st.comm.run(lambda kv: workers_changed(kv, gen))


def local_rank() -> int:
    """This worker's rank among the workers of its host (for ``torch.cuda.set_device``)."""
    return _require().local_rank


def local_size() -> int:
    """The number of workers on this worker's host."""
    return _require().local_size


def cross_rank() -> int:
    """The index of this worker's host, when every host runs ``local_size()`` workers."""
    return rank() // local_size()


def cross_size() -> int:
    return size() // local_size()


def join(device: int = -1) -> int:
    """Out of data: count as pushing zeros into every round (every other worker's gradient
    averages and allreduces go on) until all workers have joined; return the last rank to
    join. Keys first used after a worker has joined cannot be initialised: let every worker
    make each collective call once before anyone joins."""
    return _require().comm.run(lambda kv: kv.join())


def barrier(process_set=global_process_set) -> None:
    """Wait until every worker (of ``process_set``: every member) has called ``barrier``."""
    g = _group(process_set, "barrier")
    if g.members is None:
        _require().comm.run(lambda kv: kv.barrier())
    else:  # a round of a one-byte key of the set
        one = np.zeros(1, np.uint8)
        _sum(g, [_key(g, "barrier", None, one.dtype, one.shape)], [one])


# What Horovod's build and runtime flags answer here: no MPI, Gloo, NCCL, DDL or oneCCL (the
# workers talk to the servers over ZeroMQ). CUDA and ROCm: whether the CuPy that the
# ``device`` stores sum with is a CUDA or a ROCm build (kvstore.torch itself moves tensors
# through host memory).


def _false() -> bool:
    return False


mpi_threads_supported = mpi_built = mpi_enabled = gloo_built = gloo_enabled = _false
nccl_built = ddl_built = ccl_built = _false


def cuda_built() -> bool:
    """Whether CuPy, built for CUDA, is importable (``pip install 'kvstore-ps[cuda]'``)."""
    return arrays.cupy is not None and not arrays.cupy.cuda.runtime.is_hip


def rocm_built() -> bool:
    """Whether CuPy, built for ROCm, is importable."""
    return arrays.cupy is not None and bool(arrays.cupy.cuda.runtime.is_hip)


# ---------------------------------------------------------------- collectives: the work
#
# A collective is a _Work: ``job(kv)`` makes every store call in the store's thread (the
# tensors were copied to host arrays before, in the caller's thread); ``finish`` turns its
# result into tensors in the caller's thread. The blocking forms run both at once; the
# ``*_async`` forms return a handle and ``synchronize`` finishes it.


class _Work(NamedTuple):
    kind: str
    name: str | None
    job: Callable
    finish: Callable


def _then(work: _Work, fn) -> _Work:
    return work._replace(finish=lambda result: fn(work.finish(result)))


def _traced(work: _Work):
    """The job, as a span on the timeline while :func:`start_timeline` records."""

    def job(kv):
        tracer = _state.tracer
        if tracer is None:
            return work.job(kv)
        start = timeline.now()
        try:
            return work.job(kv)
        finally:
            tracer.span(work.kind, start, timeline.now(), {"name": work.name})

    return job


def _run(work: _Work):
    return work.finish(_require().comm.run(_traced(work)))


def _start(work: _Work) -> int:
    st = _require()
    handle = next(st.handle_ids)
    st.handles[handle] = (st.comm.submit(_traced(work)), work.finish)
    return handle


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` is done (then :func:`synchronize` does not block).

    >>> h = hvd.allreduce_async(t); hvd.poll(h)  # doctest: +SKIP
    False
    """
    return _handle(handle, "poll")[0].done()


def synchronize(handle: int):
    """Wait for the operation of ``handle`` and return its result (raising its error).

    >>> h = hvd.allreduce_async(t, name="loss"); ...; avg = hvd.synchronize(h)  # doctest: +SKIP
    """
    future, finish = _handle(handle, "synchronize")
    del _state.handles[handle]
    return finish(future.result())


def _handle(handle, what: str):
    found = _require().handles.get(handle)
    if found is None:
        hint = (
            "; sparse_allreduce_async's handle is a function: call it" if callable(handle) else ""
        )
        raise ValueError(
            f"{what}: {handle!r} is not the handle of an operation in flight (each handle "
            f"is synchronized once){hint}"
        )
    return found


def _key(g: _Group, kind: str, name, dtype: np.dtype, shape) -> str:
    dims = "x".join(map(str, shape))
    return f"{g.prefix}{kind}.{'' if name is None else name}.{dtype.str}.{dims}"


def _ensure(kv: KVStore, g: _Group, keys: list, arrays: list) -> None:
    """Initialise the keys not yet in the store (collective over the group's workers; in the
    comm thread)."""
    new = [(k, a) for k, a in zip(keys, arrays, strict=True) if k not in _state.keys]
    if new:
        zeros = [np.zeros_like(a) for _, a in new]
        if g.members is None:
            kv.init([k for k, _ in new], zeros)
        else:
            kv.init([k for k, _ in new], zeros, members=g.members)
        _state.keys.update(k for k, _ in new)


def _sum_in(kv: KVStore, g: _Group, keys: list, arrays: list) -> None:
    """Replace each array by its sum over the group's workers, in one call (in the comm
    thread)."""
    live = [(k, a) for k, a in zip(keys, arrays, strict=True) if a.size]
    if live:
        keys, arrays = [k for k, _ in live], [a for _, a in live]
        _ensure(kv, g, keys, arrays)
        kv.pushpull(keys, arrays)


def _sum(g: _Group, keys: list, arrays: list) -> None:
    _require().comm.run(lambda kv: _sum_in(kv, g, keys, arrays))


def _gather_in(kv: KVStore, g: _Group, kind: str, name, host: np.ndarray) -> np.ndarray:
    """Every group worker's ``host`` (one shape on all), stacked in rank order: each
    worker's in its own row of zeros, summed (exact: one worker writes each element)."""
    rows = np.zeros((g.size, *host.shape), host.dtype)
    rows[g.index] = host
    _sum_in(kv, g, [_key(g, kind, name, rows.dtype, rows.shape)], [rows])
    return rows


_AGREE_BYTES = 256


def _agree_in(kv: KVStore, g: _Group, what: str, entries: list) -> np.ndarray:
    """Raise the same MismatchError (a ValueError) on every worker unless all passed the same
    (name, array) ``entries`` (names, dtypes, shapes): one small round before the data, so
    that no worker pushes into a key the others never push (which would wait for the round
    timeout).
    Returns which workers take part (a worker that joined pushes zeros: it is left out)."""
    if g.size == 1:
        return np.ones(1, bool)
    text = ", ".join(f"{n or '-'}: {a.dtype} {tuple(a.shape)}" for n, a in entries).encode()
    row = np.zeros(_AGREE_BYTES, np.uint8)
    row[:4] = np.frombuffer(zlib.crc32(text).to_bytes(4, "little"), np.uint8)
    shown = text[: _AGREE_BYTES - 4]
    row[4 : 4 + len(shown)] = np.frombuffer(shown, np.uint8)
    rows = _gather_in(kv, g, "agree", None, row)
    live = rows.any(axis=1)
    if (rows[live] == row).all():
        return live
    got = "; ".join(f"rank {g.ranks[i]}: [{_shown(row)}]" for i, row in enumerate(rows) if live[i])
    raise MismatchError(
        f"{what}: every worker must pass tensors of the same names, dtypes and shapes (in "
        f"the same order of calls); got {got}"
    )


def _shown(row: np.ndarray) -> str:
    return bytes(row[4:]).rstrip(b"\0").decode(errors="replace")


def _host(tensor: torch.Tensor, dtype: np.dtype | None = None) -> np.ndarray:
    t = tensor.detach()
    if t.dtype in (torch.bfloat16, torch.bool):
        t = t.to(torch.float32 if t.dtype == torch.bfloat16 else torch.uint8)
    # A copy: the sum comes back into it, never into the caller's tensor.
    return np.array(t.cpu().numpy(), dtype=dtype, order="C", copy=True)


def _tensor(host: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(host).to(device=like.device, dtype=like.dtype)


def _check_tensor(what: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported; pass tensor.to_dense()")


def _check_tensors(what: str, tensors) -> list:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what}: expected a list of tensors, got {type(tensors).__name__}")
    for t in tensors:
        _check_tensor(what, t)
    return list(tensors)


def _check_root(root_rank, g: _Group | None = None) -> None:
    n = size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < n:
        raise ValueError(f"root_rank must be a rank in 0..{n - 1}, got {root_rank!r}")
    if g is not None and root_rank not in g.ranks:
        raise ValueError(
            f"root_rank={root_rank} is not in the process set (ranks {list(g.ranks)}); "
            "root_rank is a global rank (hvd.rank()), as in Horovod"
        )


# ---------------------------------------------------------------- allreduce

_SQRT_DOUBLE_MIN = float(np.sqrt(np.finfo(np.float64).tiny))


def _adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Adasum of two gradients (Horovod's): each scaled by 1 - (a.b) / (2 |itself|^2)
    (1 when its norm is about 0), then added; dot products in float64."""
    dot = float(np.vdot(a.astype(np.float64), b))
    a_sq, b_sq = float(np.vdot(a, a.astype(np.float64))), float(np.vdot(b, b.astype(np.float64)))
    a_coeff = 1.0 - dot / a_sq * 0.5 if a_sq >= _SQRT_DOUBLE_MIN else 1.0
    b_coeff = 1.0 - dot / b_sq * 0.5 if b_sq >= _SQRT_DOUBLE_MIN else 1.0
    return (a_coeff * a + b_coeff * b).astype(a.dtype)


def _adasum(rows: np.ndarray) -> np.ndarray:
    """Horovod's Adasum of every worker's tensor: pairs of neighbours (0 with 1, 2 with 3,
    ...), then pairs of those pairs, as its distance-doubling levels combine them."""
    level = list(rows)
    while len(level) > 1:
        level = [_adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


# Min, Max, Product and Adasum: the servers only sum, so each worker gathers every worker's
# tensor (one round, W times the bytes) and reduces them itself, in rank order.
_REDUCE = {
    Min: lambda rows: rows.min(axis=0),
    Max: lambda rows: rows.max(axis=0),
    Product: lambda rows: rows.prod(axis=0),
    Adasum: _adasum,
}


def _resolve_op(average, op):
    if average is not None and op is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        op = Sum if average is False else Average
    if op not in (Average, Sum, *_REDUCE):
        raise ValueError(f"op={op!r}: expected hvd.Average, Sum, Min, Max, Product or Adasum")
    return op


def _check_adasum(what: str, tensors: list, g: _Group) -> None:
    if g.members is not None:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    n = g.size
    if n & (n - 1):
        raise NotImplementedError(
            f"{what}: op=Adasum needs a power-of-2 number of workers (as Horovod's), not {n}"
        )
    for t in tensors:
        if not t.dtype.is_floating_point:
            raise TypeError(f"{what}: op=Adasum needs floating-point tensors, got {t.dtype}")


def _allreduce_work(what, tensors, names, op, prescale_factor, postscale_factor, ps) -> _Work:
    """The reduction of each tensor (already compressed) over the workers of process set
    ``ps``; finish: a list."""
    g = _group(ps, what)
    for t in tensors:
        if t.dtype == torch.bool:
            raise TypeError(f"{what}: bool tensors cannot be reduced; cast to an integer type")
    if op == Adasum:
        _check_adasum(what, tensors, g)
    hosts = [_host(t * prescale_factor if prescale_factor != 1.0 else t) for t in tensors]
    entries = list(zip(names, hosts, strict=True))
    reduce = _REDUCE.get(op)

    def job(kv):
        live = _agree_in(kv, g, what, entries)
        if reduce is None:
            keys = [_key(g, "allreduce", n, h.dtype, h.shape) for n, h in entries]
            _sum_in(kv, g, keys, hosts)
            return hosts
        return [
            reduce(_gather_in(kv, g, "reduce", n, h)[live]).astype(h.dtype, copy=False)
            for n, h in entries
        ]

    def finish(results):
        divisor = g.size if op == Average else 1
        scale = postscale_factor / divisor
        outs = []
        for t, r in zip(tensors, results, strict=True):
            out = torch.from_numpy(np.asarray(r)).reshape(t.shape)
            if scale != 1.0:
                if out.dtype.is_floating_point or out.dtype.is_complex:
                    out = out * scale
                else:  # an integer average is rounded down
                    out = torch.div(out * postscale_factor, divisor, rounding_mode="floor")
            outs.append(out.to(device=t.device, dtype=t.dtype))
        return outs

    return _Work(what, names[0] if len(names) == 1 else str(names), job, finish)


def _grouped_names(name, count: int) -> list:
    return [f"{'' if name is None else name}#{i}" for i in range(count)]


class _Allreduce(torch.autograd.Function):
    """Its gradient is the same reduction of the gradient (Horovod's definition)."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, ps):
        ctx.args = (op, prescale_factor, postscale_factor, ps)
        work = _allreduce_work(
            "allreduce", [tensor], [name], op, prescale_factor, postscale_factor, ps
        )
        return _run(work)[0]

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        out = allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)
        return out, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, ps, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, ps)
        names = _grouped_names(name, len(tensors))
        work = _allreduce_work(
            "grouped_allreduce", list(tensors), names, op, prescale_factor, postscale_factor, ps
        )
        return tuple(_run(work))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        grads = [g.contiguous() for g in grads]
        out = grouped_allreduce(
            grads, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
        )
        return (None, None, None, None, None, *out)


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression=Compression.none,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> torch.Tensor:
    """The average (``op=Average``, the default), sum, minimum, maximum or product of
    ``tensor`` over all workers, as a new tensor on the tensor's device. Every worker calls
    it, in the same order, with the same dtype and shape (else every worker raises
    ValueError). An integer tensor's average is rounded down. Min, Max and Product gather
    every worker's tensor and reduce on each worker (the servers only sum). Differentiable:
    the gradient is the same reduction of the gradient.

    >>> hvd.allreduce(torch.tensor(float(hvd.rank())))  # doctest: +SKIP
    tensor(0.5000)
    """
    op = _resolve_op(average, op)
    _check_tensor("allreduce", tensor)
    _group(process_set, "allreduce")
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> int:
    """:func:`allreduce`, started: returns a handle for :func:`poll` and :func:`synchronize`
    (which returns the result). Leave ``tensor`` alone until then.

    >>> h = hvd.allreduce_async(loss, name="loss"); ...; hvd.synchronize(h)  # doctest: +SKIP
    """
    op = _resolve_op(average, op)
    _check_tensor("allreduce_async", tensor)
    work = _allreduce_work(
        "allreduce", [tensor.detach()], [name], op, prescale_factor, postscale_factor, process_set
    )
    return _start(_then(work, lambda outs: outs[0]))


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> int:
    """:func:`allreduce_async` in place: :func:`synchronize` writes the result into
    ``tensor`` and returns it."""
    op = _resolve_op(average, op)
    _check_tensor("allreduce_async_", tensor)
    work = _allreduce_work(
        "allreduce", [tensor.detach()], [name], op, prescale_factor, postscale_factor, process_set
    )
    return _start(_then(work, lambda outs: _copy_into([tensor], outs)[0]))


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> torch.Tensor:
    """:func:`allreduce` in place; returns ``tensor``."""
    handle = allreduce_async_(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return synchronize(handle)


def _apply_compressed(what: str, function, tensors, compression, args: tuple) -> list:
    """``function.apply(*args, *tensors)`` for the blocking collective ``what``, with its
    checks: ``tensors`` a list of tensors, ``args[-1]`` a process set this worker is in. Each
    tensor travels compressed and each output comes back decompressed."""
    tensors = _check_tensors(what, tensors)
    _group(args[-1], what)
    if not tensors:
        return []
    compressed = [compression.compress(t) for t in tensors]
    outs = function.apply(*args, *[c for c, _ in compressed])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed, strict=True)]


def _copy_into(tensors: list, values: list) -> list:
    with torch.no_grad():
        for t, v in zip(tensors, values, strict=True):
            t.copy_(v)
    return tensors


def grouped_allreduce(
    tensors: list,
    average: bool | None = None,
    name: str | None = None,
    compression=Compression.none,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> list:
    """:func:`allreduce` of every tensor of the list, in one call (one message per server);
    returns a list. Differentiable.

    >>> a, b = hvd.grouped_allreduce([a, b], op=hvd.Sum)  # doctest: +SKIP
    """
    op = _resolve_op(average, op)
    args = (name, op, prescale_factor, postscale_factor, process_set)
    return _apply_compressed("grouped_allreduce", _GroupedAllreduce, tensors, compression, args)


def grouped_allreduce_async(
    tensors: list,
    average: bool | None = None,
    name: str | None = None,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> int:
    """:func:`grouped_allreduce`, started: :func:`synchronize` returns the list."""
    return _start(
        _grouped_allreduce_work(
            "grouped_allreduce_async",
            tensors,
            average,
            name,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )
    )


def grouped_allreduce_async_(
    tensors: list,
    average: bool | None = None,
    name: str | None = None,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> int:
    """:func:`grouped_allreduce_async` in place: :func:`synchronize` writes the results into
    ``tensors`` and returns them."""
    work = _grouped_allreduce_work(
        "grouped_allreduce_async_",
        tensors,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
    )
    return _start(_then(work, lambda outs: _copy_into(list(tensors), outs)))


def grouped_allreduce_(
    tensors: list,
    average: bool | None = None,
    name: str | None = None,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> list:
    """:func:`grouped_allreduce` in place; returns ``tensors``."""
    handle = grouped_allreduce_async_(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set
    )
    return synchronize(handle)


def _grouped_allreduce_work(what, tensors, average, name, op, pre, post, process_set) -> _Work:
    op = _resolve_op(average, op)
    tensors = _check_tensors(what, tensors)
    detached = [t.detach() for t in tensors]
    names = _grouped_names(name, len(tensors))
    return _allreduce_work("grouped_allreduce", detached, names, op, pre, post, process_set)


# ---------------------------------------------------------------- allgather and alltoall

_GATHER_DIMS = 8


def _allgather_in(kv: KVStore, g: _Group, what: str, hosts: list, names: list) -> list:
    """Every group worker's arrays concatenated along dimension 0, for each position of
    ``hosts`` (in the comm thread): one round for the shapes, one for the data."""
    me, n = g.index, g.size
    shapes = np.zeros((n, len(hosts), _GATHER_DIMS), np.int64)
    for i, h in enumerate(hosts):
        shapes[me, i, :2] = [zlib.crc32(h.dtype.str.encode()), h.ndim]
        shapes[me, i, 2 : 2 + h.ndim] = h.shape
    _sum_in(kv, g, [_key(g, "allgather.shapes", None, shapes.dtype, shapes.shape)], [shapes])
    totals = []
    for i, h in enumerate(hosts):
        mine = shapes[:, i]
        live = mine.any(axis=1)  # a worker that joined sent zeros: no rows
        if len({tuple(row[:2]) + tuple(row[3:]) for row in mine[live]}) > 1:
            described = ", ".join(
                f"rank {g.ranks[i]}: {tuple(int(d) for d in row[2 : 2 + row[1]])}"
                for i, row in enumerate(mine)
                if live[i]
            )
            dtypes = "differ" if len({row[0] for row in mine[live]}) > 1 else "match"
            raise MismatchError(
                f"{what}: tensors must match in dtype and in every dimension but the first; "
                f"got {described} (dtypes {dtypes})"
            )
        rows = mine[:, 2]
        start = int(rows[:me].sum())
        total = np.zeros((int(rows.sum()), *h.shape[1:]), h.dtype)
        total[start : start + h.shape[0]] = h
        totals.append(total)
    keys = [_key(g, "allgather", nm, t.dtype, t.shape) for nm, t in zip(names, totals, strict=True)]
    if len(set(keys)) != len(keys):
        raise ValueError(
            f"{what}: duplicate names {sorted({k for k in keys if keys.count(k) > 1})}"
        )
    _sum_in(kv, g, keys, totals)
    return totals


def _gather_host(what: str, tensor: torch.Tensor) -> np.ndarray:
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    if t.dim() > _GATHER_DIMS - 2:
        raise ValueError(f"{what}: at most {_GATHER_DIMS - 2} dimensions, got {t.dim()}")
    return _host(t)


def _allgather_work(what: str, tensors: list, names: list, ps) -> _Work:
    g = _group(ps, what)
    hosts = [_gather_host(what, t) for t in tensors]

    def finish(totals):
        return [
            torch.from_numpy(total).to(device=t.device, dtype=t.dtype)
            for total, t in zip(totals, tensors, strict=True)
        ]

    work_name = names[0] if len(names) == 1 else str(names)
    return _Work(what, work_name, lambda kv: _allgather_in(kv, g, what, hosts, names), finish)


class _Allgather(torch.autograd.Function):
    """Gradient (Horovod's): the gradient averaged over the workers, this worker's rows."""

    @staticmethod
    def forward(ctx, tensor, name, ps):
        ctx.rows, ctx.shape, ctx.ps = (
            (1 if tensor.dim() == 0 else tensor.shape[0]),
            tensor.shape,
            ps,
        )
        return _run(_allgather_work("allgather", [tensor], [name], ps))[0]

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.ps
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ps)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int64), process_set=ps)
        offset = int(rows[: _group(ps, "allgather").index].sum())
        return reduced.narrow(0, offset, ctx.rows).reshape(ctx.shape), None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set=global_process_set
) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along dimension 0, in rank order. The first
    dimension may differ between workers; the others and the dtype must not (else every
    worker raises ValueError). Differentiable (Horovod's gradient: the average over the
    workers of the output's gradient, this worker's rows of it).

    >>> hvd.allgather(torch.tensor([hvd.rank()]))  # doctest: +SKIP
    tensor([0, 1])
    """
    _check_tensor("allgather", tensor)
    _group(process_set, "allgather")
    return _Allgather.apply(tensor, name, process_set)


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set=global_process_set
) -> int:
    """:func:`allgather`, started: :func:`synchronize` returns the result."""
    _check_tensor("allgather_async", tensor)
    work = _allgather_work("allgather", [tensor], [name], process_set)
    return _start(_then(work, lambda outs: outs[0]))


def grouped_allgather(
    tensors: list, name: str | None = None, process_set=global_process_set
) -> list:
    """:func:`allgather` of every tensor of the list, one round for all their shapes and one
    for all their data; returns a list.

    >>> xs, ys = hvd.grouped_allgather([x, y])  # doctest: +SKIP
    """
    tensors = _check_tensors("grouped_allgather", tensors)
    _group(process_set, "grouped_allgather")
    if not tensors:
        return []
    names = _grouped_names(name, len(tensors))
    return _run(_allgather_work("grouped_allgather", tensors, names, process_set))


def grouped_allgather_async(
    tensors: list, name: str | None = None, process_set=global_process_set
) -> int:
    """:func:`grouped_allgather`, started: :func:`synchronize` returns the list."""
    tensors = _check_tensors("grouped_allgather_async", tensors)
    names = _grouped_names(name, len(tensors))
    return _start(_allgather_work("grouped_allgather", tensors, names, process_set))


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op, process_set=global_process_set
) -> Callable[[], torch.Tensor]:
    """Horovod's allreduce of a sparse COO tensor (an ``nn.Embedding(sparse=True)``'s
    gradient), started. Returns a function, as Horovod's, that waits and returns the result:
    every worker's entries, indices and values gathered in rank order and not coalesced (an
    index two workers sent appears twice; torch adds them in ``coalesce()`` or any dense
    use), the values divided by the number of workers for ``op=hvd.Average`` (integers
    rounded down, entry by entry). One call gathers both, as :func:`grouped_allgather`.

    >>> handle = hvd.sparse_allreduce_async(emb.weight.grad, "emb", hvd.Average)  # doctest: +SKIP
    >>> grad = handle()  # doctest: +SKIP
    """
    what = "sparse_allreduce_async"
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        got = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{what}: expected a sparse COO tensor (tensor.to_sparse()), got {got}")
    if op not in (Average, Sum):
        raise ValueError(f"{what}: op={op!r}; expected hvd.Average or hvd.Sum")
    n = _group(process_set, what).size
    # allgather concatenates along dimension 0: indices as (nnz, sparse_dim) rows
    parts = [tensor._indices().t().contiguous(), tensor._values()]
    work = _allgather_work(what, parts, [f"{name}.indices", f"{name}.values"], process_set)
    handle = _start(work)

    def result() -> torch.Tensor:
        indices, values = synchronize(handle)
        if op == Average:
            values = (
                values / n if values.is_floating_point() else values.div(n, rounding_mode="floor")
            )
        # checked: a worker whose tensor has fewer rows than another's index gets an error,
        # not a tensor that crashes later
        return torch.sparse_coo_tensor(indices.t(), values, tensor.shape, check_invariants=True)

    return result


def allgather_object(obj, name: str | None = None, process_set=global_process_set) -> list:
    """Every worker's ``obj``, in rank order (pickled between the workers of this job); with
    ``process_set`` (not in Horovod's), every member's.

    >>> hvd.allgather_object({"rank": hvd.rank()})  # doctest: +SKIP
    [{'rank': 0}, {'rank': 1}]
    """
    g = _group(process_set, "allgather_object")
    name = type(obj).__name__ if name is None else name
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    lengths = np.array([len(data)], np.int64)
    work = _Work(
        "allgather_object",
        name,
        lambda kv: _allgather_in(kv, g, "allgather_object", [lengths, data], [name + ".sz", name]),
        lambda totals: totals,
    )
    lengths, gathered = _run(work)
    ends = np.cumsum(lengths)
    return [
        pickle.loads(gathered[end - n : end].tobytes())
        for n, end in zip(lengths, ends, strict=True)
    ]


def _alltoall_splits(tensor: torch.Tensor, splits, n: int) -> np.ndarray:
    rows = tensor.shape[0] if tensor.dim() else 0
    if tensor.dim() == 0:
        raise ValueError("alltoall: expected a tensor of at least one dimension, got a 0-d one")
    if splits is None:
        if rows % n:
            raise ValueError(
                f"alltoall: splits not given, and the first dimension ({rows}) is not a "
                f"multiple of the number of workers ({n}); pass splits="
            )
        return np.full(n, rows // n, np.int64)
    counts = np.asarray(splits.tolist() if isinstance(splits, torch.Tensor) else splits)
    if counts.shape != (n,) or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise ValueError(
            f"alltoall: splits must be {n} non-negative ints (one per worker), got {splits!r}"
        )
    if counts.sum() > rows:
        raise ValueError(
            f"alltoall: splits add up to {int(counts.sum())}, more than the tensor's first "
            f"dimension ({rows})"
        )
    return counts.astype(np.int64)


def _alltoall_work(tensor: torch.Tensor, splits, name, ps) -> _Work:
    g = _group(ps, "alltoall")
    counts = _alltoall_splits(tensor, splits, g.size)
    sent = _host(tensor.detach()[: int(counts.sum())])
    names = [name, None if name is None else f"{name}.splits"]

    def job(kv):
        data, table = _allgather_in(kv, g, "alltoall", [sent, counts.reshape(1, -1)], names)
        me = g.index
        starts = np.concatenate([[0], np.cumsum(table.sum(axis=1))])
        pieces = [
            data[starts[s] + table[s, :me].sum() :][: table[s, me]] for s in range(len(table))
        ]
        return np.concatenate(pieces), table[:, me]

    def finish(result):
        data, received = result
        return _tensor(data, tensor), torch.from_numpy(received.astype(np.int32))

    return _Work("alltoall", name, job, finish)


class _Alltoall(torch.autograd.Function):
    """Gradient (Horovod's): the output's gradient sent back, alltoall with the received
    splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, ps):
        out, received = _run(_alltoall_work(tensor, splits, name, ps))
        ctx.received, ctx.ps = received, ps
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back = alltoall(grad.contiguous(), splits=ctx.received, process_set=ctx.ps)[0]
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor, splits=None, name: str | None = None, process_set=global_process_set
):
    """Send ``splits[i]`` rows of ``tensor`` (in order, along dimension 0) to worker i (with
    ``process_set``: to the set's i-th member) and return the rows every worker sent here,
    in rank order. Without ``splits`` the first dimension is split equally (it must be a
    multiple of ``size()``, or of the set's size). With ``splits``,
    returns ``(rows, received_splits)``, the rows and an int32 tensor of how many came from
    each worker (as Horovod). Built on allgather (every worker's rows reach every worker).
    Differentiable.

    >>> rows, received = hvd.alltoall(t, splits=[1, 2])  # doctest: +SKIP
    """
    _check_tensor("alltoall", tensor)
    _group(process_set, "alltoall")
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def alltoall_async(
    tensor: torch.Tensor, splits=None, name: str | None = None, process_set=global_process_set
) -> int:
    """:func:`alltoall`, started: :func:`synchronize` returns ``(rows, received_splits)``
    (as Horovod's, with or without ``splits``)."""
    _check_tensor("alltoall_async", tensor)
    return _start(_alltoall_work(tensor, splits, name, process_set))


# ---------------------------------------------------------------- reducescatter


def _scatter_rows(rows: int, n: int, r: int) -> tuple[int, int]:
    """(start, stop) of worker r's rows: the first ``rows % n`` workers get one more (as
    Horovod)."""
    base, extra = divmod(rows, n)
    start = r * base + min(r, extra)
    return start, start + base + (r < extra)


def _reducescatter_work(what, tensors, names, op, pre, post, ps) -> _Work:
    for t in tensors:
        if t.dim() == 0:
            raise ValueError(f"{what}: expected tensors of at least one dimension, got a 0-d one")
    if op not in (Average, Sum):
        raise ValueError(f"{what}: op={op!r}; expected hvd.Average or hvd.Sum")
    work = _allreduce_work(what, tensors, names, op, pre, post, ps)
    g = _group(ps, what)
    n, me = g.size, g.index
    return _then(work, lambda outs: [o[slice(*_scatter_rows(o.shape[0], n, me))] for o in outs])


class _Reducescatter(torch.autograd.Function):
    """Gradient (Horovod's): the gradient (times ``size()`` for Sum, times the scale
    factors) gathered from every worker."""

    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, ps, *tensors):
        n = _group(ps, "reducescatter").size
        ctx.scale, ctx.ps = (n if op == Sum else 1) * prescale_factor * postscale_factor, ps
        names = [name] if len(tensors) == 1 else _grouped_names(name, len(tensors))
        work = _reducescatter_work(
            "reducescatter", list(tensors), names, op, prescale_factor, postscale_factor, ps
        )
        return tuple(_run(work))

    @staticmethod
    def backward(ctx, *grads):
        grads = [(g * ctx.scale if ctx.scale != 1 else g).contiguous() for g in grads]
        return (None, None, None, None, None, *grouped_allgather(grads, process_set=ctx.ps))


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """The average (or ``op=Sum``: sum) over the workers of ``tensor``, of which each worker
    gets its share of rows: worker r the r-th of ``size()`` near-equal parts of dimension 0
    (the first ``rows % size()`` workers one row more, as Horovod). The whole tensor is
    summed on the servers and sliced here. Differentiable.

    >>> mine = hvd.reducescatter(torch.ones(4, 3), op=hvd.Sum)  # doctest: +SKIP
    """
    _check_tensor("reducescatter", tensor)
    args = (name, op, prescale_factor, postscale_factor, process_set)
    return _apply_compressed("reducescatter", _Reducescatter, [tensor], compression, args)[0]


def grouped_reducescatter(
    tensors: list,
    name: str | None = None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list:
    """:func:`reducescatter` of every tensor of the list, in one call; returns a list."""
    args = (name, op, prescale_factor, postscale_factor, process_set)
    return _apply_compressed("grouped_reducescatter", _Reducescatter, tensors, compression, args)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op=Average,
    process_set=global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """:func:`reducescatter`, started: :func:`synchronize` returns this worker's rows."""
    _check_tensor("reducescatter_async", tensor)
    work = _reducescatter_work(
        "reducescatter",
        [tensor.detach()],
        [name],
        op,
        prescale_factor,
        postscale_factor,
        process_set,
    )
    return _start(_then(work, lambda outs: outs[0]))


def grouped_reducescatter_async(
    tensors: list,
    name: str | None = None,
    op=Average,
    process_set=global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """:func:`grouped_reducescatter`, started: :func:`synchronize` returns the list."""
    tensors = _check_tensors("grouped_reducescatter_async", tensors)
    names = _grouped_names(name, len(tensors))
    detached = [t.detach() for t in tensors]
    return _start(
        _reducescatter_work(
            "grouped_reducescatter",
            detached,
            names,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )
    )


# ---------------------------------------------------------------- broadcast


def _broadcast_work(what: str, named: list, root_rank: int, kind: str, ps) -> _Work:
    """Root's value of every tensor of ``named`` [(name, tensor)], in one call: the root's
    tensor plus zeros from every other worker (exact). ``root_rank``: a global rank."""
    g = _group(ps, what)
    _check_root(root_rank, g)
    mine = rank() == root_rank
    hosts, keys = [], []
    for i, (name, tensor) in enumerate(named):
        host = _host(tensor)
        if not mine:
            host = np.zeros_like(host)
        hosts.append(host)
        keys.append(_key(g, kind, f"#{i}" if name is None else name, host.dtype, host.shape))
    if len(set(keys)) != len(keys):
        raise ValueError(f"{kind}: duplicate names {sorted(k for k in keys if keys.count(k) > 1)}")
    entries = [(name, h) for (name, _), h in zip(named, hosts, strict=True)]

    def job(kv):
        _agree_in(kv, g, what, entries)
        _sum_in(kv, g, keys, hosts)
        return hosts

    def finish(results):
        return [_tensor(h, t) for h, (_, t) in zip(results, named, strict=True)]

    return _Work(what, named[0][0] if len(named) == 1 else None, job, finish)


class _Broadcast(torch.autograd.Function):
    """Gradient (Horovod's): the output's gradient averaged over the workers, on the root;
    zeros elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, ps):
        ctx.root_rank, ctx.ps = root_rank, ps
        work = _broadcast_work("broadcast", [(name, tensor)], root_rank, "broadcast", ps)
        return _run(work)[0]

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ctx.ps)
        mine = rank() == ctx.root_rank
        return (reduced if mine else torch.zeros_like(reduced)), None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set=global_process_set
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every worker, as a new tensor (bit for bit). Every
    worker passes the same dtype and shape. Differentiable (Horovod's gradient: the average
    of the output's gradient on the root, zeros elsewhere).

    >>> w = hvd.broadcast(w, root_rank=0)  # doctest: +SKIP
    """
    _check_tensor("broadcast", tensor)
    _check_root(root_rank, _group(process_set, "broadcast"))
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set=global_process_set
) -> int:
    """:func:`broadcast`, started: :func:`synchronize` returns the result."""
    _check_tensor("broadcast_async", tensor)
    work = _broadcast_work("broadcast", [(name, tensor)], root_rank, "broadcast", process_set)
    return _start(_then(work, lambda outs: outs[0]))


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set=global_process_set
) -> int:
    """:func:`broadcast_async` in place: :func:`synchronize` writes the root's value into
    ``tensor`` and returns it."""
    _check_tensor("broadcast_async_", tensor)
    work = _broadcast_work("broadcast", [(name, tensor)], root_rank, "broadcast", process_set)
    return _start(_then(work, lambda outs: _copy_into([tensor], outs)[0]))


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set=global_process_set
) -> torch.Tensor:
    """:func:`broadcast` in place; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Copy ``root_rank``'s tensors into every worker's, in place: ``model.state_dict()``,
    ``model.named_parameters()``, or a list of tensors (one call for all of them; callable
    any number of times).

    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # doctest: +SKIP
    """
    _require()
    _check_root(root_rank)
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, (str, bytes, torch.Tensor)) or not hasattr(params, "__iter__"):
        raise ValueError(
            f"broadcast_parameters: invalid params of type {type(params).__name__}: expected "
            "model.state_dict(), model.named_parameters() or a list of tensors"
        )
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"broadcast_parameters: {name or 'an entry'} is a {type(p).__name__}, not a tensor"
            )
    if not items:
        return
    values = _run(_broadcast_work("broadcast_parameters", items, root_rank, "param", None))
    with torch.no_grad():
        for (_, p), value in zip(items, values, strict=True):
            p.copy_(value)


def broadcast_object(
    obj, root_rank: int = 0, name: str | None = None, process_set=global_process_set
):
    """``root_rank``'s ``obj`` on every worker (of ``process_set``; ``root_rank`` is a global
    rank), pickled between the workers of this job.

    >>> epoch = hvd.broadcast_object(epoch, root_rank=0)  # doctest: +SKIP
    """
    g = _group(process_set, "broadcast_object")
    _check_root(root_rank, g)
    mine = rank() == root_rank
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if mine else b""
    # The bytes every worker unpickles are the root's alone: on keys under root_only(root) the
    # servers count any other rank's push as zeros, so no other worker can change them.
    gen = _state.generation  # the servers know workers by their slots
    root = root_only(root_rank if gen is None else gen.slots[root_rank])
    length = np.array([len(data)], np.int64)
    _sum(g, [root + _key(g, "object.length", name, length.dtype, length.shape)], [length])
    n = int(length[0])
    # Sizes rounded up to a power of two: few keys however many sizes are sent.
    capacity = 1 << max(6, (n - 1).bit_length())
    payload = np.zeros(capacity, np.uint8)
    if mine:
        payload[:n] = np.frombuffer(data, np.uint8)
    _sum(g, [root + _key(g, "object", name, payload.dtype, payload.shape)], [payload])
    return obj if mine else pickle.loads(payload[:n].tobytes())


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every worker's optimizer state (and hyperparameters: ``lr``, momentum, ...)
    ``root_rank``'s, through its ``state_dict``. A fresh optimizer's empty state is
    broadcast as it is (the parameters are left alone)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"broadcast_optimizer_state: expected a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    _require()
    _check_root(root_rank)
    state = None
    if rank() == root_rank:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        state = buf.getvalue()
    state = broadcast_object(state, root_rank, name="kvt.optimizer_state")
    if rank() != root_rank:
        loaded = torch.load(io.BytesIO(state), map_location="cpu", weights_only=True)
        optimizer.load_state_dict(loaded)


# ---------------------------------------------------------------- SyncBatchNorm


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalisation over every worker's batch, as ``torch.nn.SyncBatchNorm`` and
    Horovod's: in training (and in eval without running statistics) each forward reduces
    the count, mean and sum of squared deviations of every worker's batch (one round), so
    W workers with B samples each normalise as one process with W x B samples; backward
    reduces the two sums the input's gradient needs (one more round). The weight's and
    bias's gradients stay this worker's (DistributedOptimizer averages them). Works on CPU
    and CUDA tensors (Horovod's needs CUDA). Every worker must call it, in the same order;
    with ``process_set`` (as ``torch.nn.SyncBatchNorm``'s ``process_group``; not in
    Horovod's), every member of the set, over the set's batches.

    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8))
    ... # doctest: +SKIP
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set=global_process_set,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input (got {input.dim()}D)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return torch.nn.functional.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        update = self.training and self.track_running_stats
        return _SyncBatchNorm.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if update else None,
            self.running_var if update else None,
            self.eps,
            factor,
            self.process_set,
        )


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, ps):
        g = _group(ps, "SyncBatchNorm")
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        xs = x.to(_stat_dtype(x.dtype))
        count = x.numel() // channels
        mean = xs.mean(dims) if count else xs.new_zeros(channels)
        m2 = ((xs - mean.view(shape)) ** 2).sum(dims)
        # Each worker's (count, mean, squared deviations), combined exactly (Chan et al.)
        row = np.concatenate([[count], mean.double().cpu().numpy(), m2.double().cpu().numpy()])
        rows = _run(
            _Work("sync_batch_norm", None, lambda kv: _gather_in(kv, g, "bn", None, row), _same)
        )
        counts, means, m2s = rows[:, 0], rows[:, 1 : 1 + channels], rows[:, 1 + channels :]
        total = counts.sum()
        if total <= 1:
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel when training, got "
                f"{int(total)} over all workers (input shape {tuple(x.shape)} here)"
            )
        g_mean = (counts[:, None] * means).sum(0) / total
        g_m2 = (m2s + counts[:, None] * (means - g_mean) ** 2).sum(0)
        var = torch.from_numpy(g_m2 / total).to(xs)
        g_mean_t = torch.from_numpy(g_mean).to(xs)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            unbiased = torch.from_numpy(g_m2 / (total - 1))
            running_mean.mul_(1 - factor).add_(g_mean_t.to(running_mean) * factor)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var) * factor)
        xhat = (xs - g_mean_t.view(shape)) * invstd.view(shape)
        out = xhat if weight is None else xhat * weight.view(shape).to(xs)
        if bias is not None:
            out = out + bias.view(shape).to(xs)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total, ctx.group = float(total), g
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        xhat, weight, invstd = ctx.saved_tensors
        channels = xhat.shape[1]
        dims = [0, *range(2, xhat.dim())]
        shape = [1, channels] + [1] * (xhat.dim() - 2)
        dy = grad.to(xhat.dtype)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = _host(torch.cat([sum_dy, sum_dy_xhat]))
            g = ctx.group
            _sum(g, [_key(g, "bn.sums", None, sums.dtype, sums.shape)], [sums])
            # the sums come back in host memory: onto the input's device (a GPU's) and dtype
            g_dy = torch.from_numpy(sums[:channels]).view(shape).to(dy)
            g_dy_xhat = torch.from_numpy(sums[channels:]).view(shape).to(dy)
            scale = invstd if weight is None else invstd * weight.to(invstd)
            grad_input = (dy - (g_dy + xhat * g_dy_xhat) / ctx.total) * scale.view(shape)
            grad_input = grad_input.to(grad.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _same(result):
    return result


# ---------------------------------------------------------------- timeline


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record this worker's collectives (one span each, with its name) and the store calls
    they make, into ``<file_path>.worker<rank>``: the trace-event format of
    ``KVSTORE_TIMELINE`` (:mod:`kvstore.timeline`), valid JSON once :func:`stop_timeline`
    closed it; ``kvstore.timeline.merge(file_path)`` merges the workers' files into
    ``file_path``. Each worker records its own (Horovod's coordinator records the job's);
    ``mark_cycles`` is accepted and ignored (there are no negotiation cycles here).

    >>> hvd.start_timeline("/tmp/trace.json"); ...; hvd.stop_timeline()  # doctest: +SKIP
    """
    st = _require()
    if not isinstance(file_path, str) or not file_path:
        raise ValueError(f"start_timeline: expected a file path, got {file_path!r}")
    control = getattr(st.kv, "_control", None)
    if control is not None and control.tracer is not None and control.tracer is not st.tracer:
        raise ValueError(
            "start_timeline: this worker already writes the timeline KVSTORE_TIMELINE names; "
            "unset KVSTORE_TIMELINE to start and stop one from the script"
        )
    stop_timeline()
    tracer = timeline.Tracer(file_path, "worker")
    tracer.rank = st.kv.rank

    def begin(kv):
        _state.tracer = tracer
        if control is not None:
            control.tracer = tracer  # the store's own calls too (read by metrics.observed)

    st.comm.run(begin)


def stop_timeline() -> None:
    """Stop recording (see :func:`start_timeline`) and close the file; nothing if none is
    being recorded."""
    _require().comm.run(_end_timeline)


def _end_timeline(kv: KVStore) -> None:
    tracer, _state.tracer = _state.tracer, None
    if tracer is None:
        return
    control = getattr(kv, "_control", None)
    if control is not None and control.tracer is tracer:
        control.tracer = None
    tracer.close()


# ---------------------------------------------------------------- DistributedOptimizer


class _Bucket:
    """A flat wire buffer for some parameters' gradients (all of one dtype), pushed and
    pulled as one key. After :meth:`synchronize <_DistributedMixin.synchronize>` each
    ``p.grad`` is a view into ``grads`` (DDP's ``gradient_as_bucket_view``): the averages
    are made in place, one pass per bucket. ``grads`` is the wire buffer itself where the
    gradient travels in its own dtype from host memory, else a buffer of the parameters'
    dtype on their device."""

    def __init__(self, key: str, dtype: np.dtype, params: list):
        self.key = key
        self.slots = []  # (param, lo, hi)
        offset = 0
        for p in params:
            self.slots.append((p, offset, offset + p.numel()))
            offset += p.numel()
        self.host = np.zeros(offset, dtype)
        self.flat = torch.from_numpy(self.host)
        grad_dtype, device = params[0].dtype, params[0].device
        same = self.flat.dtype == grad_dtype and device.type == "cpu"
        # the averages go where the parameters are: a GPU's memory for a model on a GPU
        self.grads = self.flat if same else torch.zeros(offset, dtype=grad_dtype, device=device)
        self.wire_views = [self.flat[lo:hi].view(p.shape) for p, lo, hi in self.slots]
        self.grad_views = [self.grads[lo:hi].view(p.shape) for p, lo, hi in self.slots]
        self.filled = 0
        self.future: Future | None = None


class _DistributedMixin:
    """Mixed into the wrapped optimizer's own class (see :func:`DistributedOptimizer`)."""

    def _kvt_setup(self, named, compression, passes, op, predivide, bucket_bytes, group):
        """``group``: the process set's (None on a worker outside it: no hooks, and
        ``synchronize`` leaves the gradients alone, as Horovod's)."""
        st = _require()
        self._kvt_group = group
        self._kvt_compression = compression
        # Horovod's own compressors are casts: copy_ into the wire buffer casts in the same
        # pass, and back; another compressor's compress and decompress run as given.
        self._kvt_casts = compression in (NoneCompressor, FP16Compressor)
        self._kvt_passes = passes
        self._kvt_prescale = 1.0 / predivide
        self._kvt_postscale = predivide / group.size if op == Average and group else 1.0
        self._kvt_average = (op == Average, predivide)
        self._kvt_generation = st.generation
        self._kvt_should_sync = True
        self._kvt_synchronized = False
        self._kvt_lock = threading.Lock()
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        params = list({id(p): p for p in params}.values())
        rows = [p for p in params if getattr(p, "_kvt_row_sparse", False)]  # row_sparse()
        params = [p for p in params if not getattr(p, "_kvt_row_sparse", False)]
        if group is None:
            params = rows = []
        self._kvt_names = {id(p): named[id(p)] for p in params}
        # Reverse order: backward produces the last layers' gradients first.
        groups: dict = {}
        for p in reversed(params):
            groups.setdefault((_wire_dtype(compression, p.dtype), p.dtype, p.device), []).append(p)
        # Numbered per group: the same on every member, whatever other sets' optimizers are
        index = 0
        if group is not None:
            # an elastic job's optimizers keep their number across resets: count them all
            counted = "kvt.elastic" if st.generation is not None else group.prefix
            st.optimizers[counted] += 1
            index = st.optimizers[counted]
        self._kvt_index = index
        self._kvt_rows = _RowGrads(rows, index, group) if rows else None
        self._kvt_buckets: list[_Bucket] = []
        for (dtype, _, _), members in groups.items():
            current, nbytes = [], 0
            for p in members:
                if current and nbytes + p.numel() * dtype.itemsize > bucket_bytes:
                    self._kvt_add_bucket(index, dtype, current)
                    current, nbytes = [], 0
                current.append(p)
                nbytes += p.numel() * dtype.itemsize
            if current:
                self._kvt_add_bucket(index, dtype, current)
        self._kvt_where = {
            id(p): (b, i) for b in self._kvt_buckets for i, (p, _, _) in enumerate(b.slots)
        }
        self._kvt_reset()
        keys = [b.key for b in self._kvt_buckets]
        hosts = [b.host for b in self._kvt_buckets]
        if keys:
            st.comm.run(lambda kv: _ensure(kv, group, keys, hosts))
        me = weakref.ref(self)
        self._kvt_hooks = [
            p.register_post_accumulate_grad_hook(lambda p, me=me: me() and me()._kvt_hook(p))
            for p in params
        ]
        weakref.finalize(self, _remove_hooks, self._kvt_hooks)

    def _kvt_follow(self) -> None:
        """After an elastic reset: the buckets' keys and the average are the new workers'
        (between steps: no bucket in flight)."""
        gen = _state.generation
        if self._kvt_group is None or gen is self._kvt_generation or self._kvt_next:
            return
        group = _group(None, "DistributedOptimizer")
        average, predivide = self._kvt_average
        self._kvt_group, self._kvt_generation = group, gen
        self._kvt_postscale = predivide / group.size if average else 1.0
        for i, b in enumerate(self._kvt_buckets):
            b.key = f"{group.prefix}grad.{self._kvt_index}.{i}"
        keys = [b.key for b in self._kvt_buckets]
        hosts = [b.host for b in self._kvt_buckets]
        if keys:
            _state.comm.run(lambda kv: _ensure(kv, group, keys, hosts))
        if self._kvt_rows is not None:
            self._kvt_rows.follow(group)

    def _kvt_add_bucket(self, index: int, dtype: np.dtype, params: list) -> None:
        key = f"{self._kvt_group.prefix}grad.{index}.{len(self._kvt_buckets)}"
        self._kvt_buckets.append(_Bucket(key, dtype, params))

    def _kvt_reset(self) -> None:
        self._kvt_countdown = {pid: self._kvt_passes for pid in self._kvt_where}
        for b in self._kvt_buckets:
            b.filled, b.future = 0, None
        self._kvt_next = 0  # the first bucket not yet sent

    # -- backward's side
    def _kvt_hook(self, p: torch.Tensor) -> None:
        with self._kvt_lock:
            left = self._kvt_countdown[id(p)] - 1
            if left < 0:
                raise AssertionError(
                    f"Gradients were computed more than backward_passes_per_step "
                    f"({self._kvt_passes}) times before call to step() (parameter "
                    f"{self._kvt_names[id(p)]!r}). Increase backward_passes_per_step to "
                    "accumulate gradients locally."
                )
            self._kvt_countdown[id(p)] = left
            if left == 0:
                self._kvt_fill(p)
                self._kvt_send_ready()

    def _kvt_fill(self, p: torch.Tensor) -> None:
        bucket, i = self._kvt_where[id(p)]
        wire = bucket.wire_views[i]
        grad = p.grad
        if grad is None:
            wire.zero_()
        elif grad.is_sparse:
            if not self._kvt_sparse_as_dense:
                name = self._kvt_names[id(p)]
                if getattr(p, "_kvt_row_sparse", False):  # marked after this optimizer
                    raise ValueError(
                        f"parameter {name!r} has a sparse gradient and hvd.row_sparse was "
                        "called on it after DistributedOptimizer: call hvd.row_sparse(module) "
                        "before wrapping the optimizer"
                    )
                raise ValueError(
                    f"parameter {name!r} has a sparse gradient: call hvd.row_sparse(module) "
                    "before DistributedOptimizer to send only the rows a step touched, or "
                    "pass sparse_as_dense=True to DistributedOptimizer (the whole table "
                    "every step)"
                )
            self._kvt_to_wire(wire, grad.to_dense())
        elif not (grad.data_ptr() == wire.data_ptr() and grad.dtype == wire.dtype):
            # else backward accumulated into the bucket itself (zero_grad(set_to_none=False)
            # keeps p.grad a view of it): nothing to copy
            self._kvt_to_wire(wire, grad.detach())
        bucket.filled += 1

    def _kvt_to_wire(self, wire: torch.Tensor, grad: torch.Tensor) -> None:
        if self._kvt_casts:
            wire.copy_(grad)  # cast (fp16) and copy in one pass
        else:
            wire.view(-1).copy_(self._kvt_compression.compress(grad.reshape(-1))[0])

    def _kvt_send_ready(self) -> None:
        """Send the full buckets, in bucket order (the same order on every worker)."""
        self._kvt_follow()
        buckets = self._kvt_buckets
        while self._kvt_next < len(buckets):
            b = buckets[self._kvt_next]
            if b.filled < len(b.slots):
                return
            if self._kvt_prescale != 1.0:
                b.flat.mul_(self._kvt_prescale)
            b.future = _state.comm.submit(_pushpull_start(b.key, b.host), first=True)
            self._kvt_next += 1

    # -- Horovod's API
    def synchronize(self) -> None:
        """Wait for every gradient's average (sending the ones backward did not produce:
        unused parameters count as zero) and write them into ``p.grad``. Nothing on a worker
        outside the optimizer's process set."""
        if self._kvt_group is None:
            self._kvt_synchronized = True
            return
        with self._kvt_lock:
            for b in self._kvt_buckets[self._kvt_next :]:
                for p, _, _ in b.slots:
                    if self._kvt_countdown[id(p)] > 0:
                        self._kvt_countdown[id(p)] = 0
                        self._kvt_fill(p)
            self._kvt_send_ready()
        errors = []
        for b in self._kvt_buckets:
            try:
                b.future.result()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            self._kvt_reset()
            raise errors[0]
        with torch.no_grad():
            for b in self._kvt_buckets:
                if not self._kvt_casts:
                    for p, lo, hi in b.slots:
                        value = self._kvt_compression.decompress(b.flat[lo:hi], p.dtype)
                        b.grads[lo:hi].copy_(value.reshape(-1))
                elif b.grads is not b.flat:
                    b.grads.copy_(b.flat)  # from float16 (or float32 for bfloat16): one pass
                if self._kvt_postscale != 1.0:
                    b.grads.mul_(self._kvt_postscale)
                for (p, _, _), view in zip(b.slots, b.grad_views, strict=True):
                    p.grad = view
        if getattr(self, "_kvt_rows", None) is not None:
            self._kvt_rows.sync(self._kvt_prescale, self._kvt_postscale)
        self._kvt_reset()
        self._kvt_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, ``step()`` does not synchronize (call ``synchronize()`` before it, e.g. to
        clip or unscale the averaged gradients)."""
        self._kvt_should_sync = False
        try:
            yield
        finally:
            self._kvt_should_sync = True

    def step(self, closure=None):
        if self._kvt_should_sync:
            if self._kvt_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context "
                    "after optimizer.synchronize(). This can cause training slowdown. You may "
                    "want to consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._kvt_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(left == 0 for left in self._kvt_countdown.values()):
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition."
            )
        return super().zero_grad(set_to_none=set_to_none)


# The wrapped class's step already runs the optimizer's step hooks: torch must not wrap this
# one again (it does so for a class whose step is not marked, e.g. in load_state_dict).
_DistributedMixin.step.hooked = True


def _pushpull_start(key: str, host: np.ndarray):
    """A bucket's job for the comm thread: one message per server carries the bucket out and
    its sum back into the same buffer; the job returns the call's ``wait``."""

    def start(kv):
        return kv.pushpull_async(key, host).wait

    return start


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()


def DistributedOptimizer(  # noqa: N802  (Horovod's name: a factory returning an optimizer)
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression=Compression.none,
    backward_passes_per_step: int = 1,
    op=Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=global_process_set,
    bucket_cap_mb: float = 5,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses the average of every worker's gradients.

    The result is an instance of the optimizer's own class (``isinstance(opt, torch.optim.SGD)``
    holds; LR schedulers, ``state``, ``param_groups``, ``state_dict`` are the wrapped
    optimizer's), with ``synchronize()`` and ``skip_synchronize()``. Gradients are averaged
    over the workers (``op=Sum``: summed) in buckets of about ``bucket_cap_mb`` that leave
    while backward runs. ``backward_passes_per_step=N`` accumulates N backward passes
    locally (summed, as Horovod) before communicating. ``Compression.fp16`` halves the bytes.
    ``num_groups`` and ``groups`` (Horovod's fusion groups) are accepted and ignored: buckets
    play their part. ``process_set``: average over its members only; on a worker outside it
    the optimizer steps on its own gradients (as Horovod's).

    >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    ... # doctest: +SKIP
    """
    group = _group(process_set, "DistributedOptimizer", members_only=False)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"DistributedOptimizer: expected a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if isinstance(optimizer, (_DistributedMixin, _AdasumMixin)):
        raise ValueError("DistributedOptimizer: this optimizer is already distributed")
    if op == Adasum:
        return _adasum_optimizer(optimizer, named_parameters, compression, process_set)
    if op not in (Average, Sum):
        raise NotImplementedError(f"op={op!r} is not supported by kvstore.torch: Average or Sum")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if (
        isinstance(backward_passes_per_step, bool)
        or not isinstance(backward_passes_per_step, int)
        or backward_passes_per_step < 1
    ):
        raise ValueError(
            f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
        )
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    if not (isinstance(compression, type) and issubclass(compression, Compressor)) and not (
        hasattr(compression, "compress") and hasattr(compression, "decompress")
    ):
        raise TypeError(
            "compression: expected hvd.Compression.none, hvd.Compression.fp16 or a "
            f"Compressor, got {compression!r}"
        )
    named = _names(optimizer, named_parameters)
    dist = _wrapped(optimizer, _DistributedMixin)
    dist._kvt_sparse_as_dense = sparse_as_dense
    dist._kvt_setup(
        named,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        int(bucket_cap_mb * 2**20),
        group,
    )
    return dist


def _wrapped(optimizer: torch.optim.Optimizer, mixin: type) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class with ``mixin`` before it, on the same state."""
    cls = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    dist = cls.__new__(cls)
    # Share the wrapped optimizer's state: param_groups, state, defaults, hooks. A step
    # stored on the instance (an LR scheduler's counter) would call the unwrapped step.
    dist.__dict__.update(
        {
            k: v
            for k, v in optimizer.__dict__.items()
            if k != "step" and getattr(v, "__self__", None) is not optimizer
        }
    )
    return dist


class _AdasumMixin:
    """Horovod's Adasum optimizer: each worker steps the wrapped optimizer on its own
    gradients, and the parameters' changes are combined with Adasum over the workers
    (:func:`grouped_allreduce` with ``op=Adasum``), so every worker ends the step with the
    same parameters: start + Adasum(every worker's change)."""

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        params = self._kvt_adasum_params
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
            super().step()
            deltas = [p.detach() - s for p, s in zip(params, starts, strict=True)]
        combined = grouped_allreduce(
            deltas, name="adasum", compression=self._kvt_compression, op=Adasum
        )
        with torch.no_grad():
            for p, s, d in zip(params, starts, combined, strict=True):
                p.copy_(s + d)
        return loss

    def synchronize(self) -> None:
        """Nothing to wait for: :meth:`step` combines the changes."""

    def skip_synchronize(self):
        raise AssertionError(
            "Skipping synchronization is not supported when using Adasum optimizer."
        )


def _adasum_optimizer(optimizer, named_parameters, compression, process_set):
    group = _group(process_set, "DistributedOptimizer", members_only=False)
    if group is None or group.members is not None:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    params = list({id(p): p for p in params}.values())
    _names(optimizer, named_parameters)  # Horovod's checks of the names
    _check_adasum("DistributedOptimizer", params, group)
    dist = _wrapped(optimizer, _AdasumMixin)
    dist._kvt_adasum_params = params
    dist._kvt_compression = compression
    return dist


def _names(optimizer, named_parameters) -> dict:
    """id(param) -> name for every parameter of ``optimizer`` (Horovod's checks)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return {id(p): f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(n, tuple) or len(n) != 2 for n in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually "
            "produced by model.named_parameters()."
        )
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: "
            f"{', '.join(dups)}"
        )
    by_id = {id(p): n for n, p in named}
    unnamed = [p for p in params if id(p) not in by_id]
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not "
            f"named (shapes {[tuple(p.shape) for p in unnamed]})."
        )
    return by_id


# ---------------------------------------------------------------- row-sparse gradients


def row_sparse(module) -> None:
    """Send the gradient of ``module``'s weight (an ``nn.Embedding`` or ``nn.EmbeddingBag``
    made with ``sparse=True``) as rows through a row-sparse key (:mod:`kvstore.sparse`)
    instead of a dense bucket: only the rows a step touched travel, and every worker's
    ``step()`` gets the same sparse gradient, the rows any worker touched, averaged (as
    Horovod's sparse allreduce). Call it before :func:`DistributedOptimizer`.

    >>> emb = torch.nn.Embedding(10**6, 64, sparse=True)  # doctest: +SKIP
    >>> hvd.row_sparse(emb)  # doctest: +SKIP
    """
    weight = getattr(module, "weight", module)
    embedding = isinstance(module, torch.nn.Module) and hasattr(module, "sparse")
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 2
        or (isinstance(module, torch.nn.Module) and not embedding)
    ):
        raise TypeError(
            f"row_sparse: expected an nn.Embedding or nn.EmbeddingBag made with sparse=True "
            f"(or its 2-D weight), got {type(module).__name__}: only those make row-sparse "
            "gradients"
        )
    if embedding and not module.sparse:
        raise ValueError(
            "row_sparse: the module makes dense gradients; create it with sparse=True "
            "(nn.Embedding(num, dim, sparse=True))"
        )
    weight._kvt_row_sparse = True


class _RowGrads:
    """The parameters marked by :func:`row_sparse`, one row-sparse key each, of the
    optimizer's group (a process set's keys have its members; an elastic job's, the workers
    of the last reset: new keys when they change). A step: every member pushes its
    gradient's rows (an empty set when it has none); the round leaves each touched row's
    sum; ``save_rows`` since the last step gives every member that round's rows, the same
    bits everywhere. A row no round touched for two rounds is dropped from the servers
    (``evict_after=2``: these keys have no optimizer on the servers, so a round's sum does
    not depend on what a row held): they hold the rows of the last few steps, not every row
    ever touched."""

    def __init__(self, params: list, index: int, group: _Group):
        self.params, self.index = params, index
        self.shapes = [tuple(p.shape) for p in params]
        self.dtypes = [
            np.dtype(np.float32)
            if p.dtype == torch.bfloat16
            else _wire_dtype(NoneCompressor, p.dtype)
            for p in params
        ]
        self.keys: list = []
        self.follow(group)

    def follow(self, group: _Group) -> None:
        """The keys of ``group`` (at first, and after an elastic reset), made by its members."""
        from .sparse import RowSparse

        keys = [f"{group.prefix}rows.{self.index}.{i}" for i in range(len(self.params))]
        if keys == self.keys:  # a reset with the same workers (a HorovodInternalError
            return  # raised by hand): the same generation's keys, made already
        empty = [
            RowSparse.empty(s, d, evict_after=2)
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        ]
        if group.members is None:
            _require().comm.run(lambda kv: kv.init(keys, empty))
        else:
            _require().comm.run(lambda kv: kv.init(keys, empty, members=group.members))
        # kept once made: an init that raised (an elastic reset follows) is tried again
        self.keys, self.steps = keys, [0] * len(self.params)

    def sync(self, prescale: float, postscale: float) -> None:
        from .sparse import RowSparse

        values = []
        for p, shape, dtype in zip(self.params, self.shapes, self.dtypes, strict=True):
            grad = p.grad
            if grad is None:
                values.append(RowSparse.empty(shape, dtype))
                continue
            if not grad.is_sparse:
                raise ValueError(
                    f"row_sparse: the {shape[0]} x {shape[1]} weight passed to hvd.row_sparse "
                    "has a dense gradient: make its nn.Embedding or nn.EmbeddingBag with "
                    "sparse=True"
                )
            value = RowSparse.from_torch(grad.float() if grad.dtype == torch.bfloat16 else grad)
            if prescale != 1.0:
                value.data = value.data * value.data.dtype.type(prescale)
            values.append(value)

        def job(kv):
            kv.push(self.keys, values)
            found = []
            for key, last in zip(self.keys, self.steps, strict=True):
                rows, step = kv.save_rows(key, since=last)
                if step > last + 1:  # rounds this worker sat out (after hvd.join): since
                    # them the table went on; its step now is this push's round (the next
                    # round needs this worker's next push), whose rows are what changed since
                    # the step before
                    rows, step = kv.save_rows(key, since=step - 1)
                elif step <= last:
                    raise KVStoreError(
                        f"row_sparse: key {key!r} is at step {step} after this worker's push "
                        f"of step {last + 1}: its rounds were lost (a server restarted?)"
                    )
                found.append((rows, step))
            return found

        results = _require().comm.run(job)
        for i, (p, (rows, step)) in enumerate(zip(self.params, results, strict=True)):
            self.steps[i] = step
            data = rows.data if postscale == 1.0 else rows.data * rows.data.dtype.type(postscale)
            index = torch.from_numpy(rows.indices).unsqueeze(0)
            # sorted unique ids in range (save_rows' canonical form): nothing to check, and
            # said so (else torch 2.14 warns of the checks it skips on every step)
            grad = torch.sparse_coo_tensor(
                index,
                torch.from_numpy(data),
                self.shapes[i],
                check_invariants=False,
                is_coalesced=True,
            )
            p.grad = grad.to(device=p.device, dtype=p.dtype).coalesce()


# ---------------------------------------------------------------- hvd.elastic

# Horovod's horovod.torch.elastic: ``hvd.elastic.run``, and ``import kvstore.torch.elastic``.
import sys as _sys  # noqa: E402

from . import torch_elastic as elastic  # noqa: E402

_sys.modules[__name__ + ".elastic"] = elastic
