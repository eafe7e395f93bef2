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

Collectives (``allreduce``, ``allgather``, ``broadcast*``) are sums on the store's keys:
a broadcast is the root's tensor plus zeros from everyone else (exact), a gather puts each
rank's rows at its offset in zeros. Each distinct (name, dtype, shape) is a key, initialised
(collectively) on first use and reused after. ``broadcast_object`` and
``broadcast_optimizer_state`` serialise with pickle, between the workers of one job (as
Horovod's cloudpickle); the servers only ever see bytes.

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
import logging
import os
import pickle
import queue
import socket
import threading
import warnings
import weakref
import zlib
from concurrent.futures import Future

import numpy as np

from .server import root_only
from .store import KVStore

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Sum",
    "allgather",
    "allreduce",
    "allreduce_",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]

log = logging.getLogger("kvstore.torch")

# Horovod's reduction ops. The store sums; Average divides the sum by the number of workers.
Average, Sum, Adasum, Min, Max, Product = "Average", "Sum", "Adasum", "Min", "Max", "Product"
_SUMMING_TYPES = ("local", "device", "dist_sync", "dist_device_sync")


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
        self.optimizers = 0


_state = _State()
_init_lock = threading.Lock()


def _require() -> _State:
    if _state.comm is None:
        raise ValueError("kvstore.torch has not been initialized; use hvd.init().")
    return _state


# ---------------------------------------------------------------- init and identity


def init(kv_store: str | KVStore | None = None) -> None:
    """Start (or join) the job: create the store, and the thread that talks to it.

    ``kv_store``: a store type or a :class:`KVStore` to use (its keys must be strings); by
    default ``dist_sync`` when started by ``launch.py`` (``DMLC_ROLE`` is set), else
    ``local`` (one process). Every worker calls it; a second call does nothing.

    >>> import kvstore.torch as hvd; hvd.init(); hvd.size()  # doctest: +SKIP
    1
    """
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
        _state.comm = _Comm(kv)
        # Registered after the store's own (atexit runs last first): the thread finishes
        # what is in flight and closes the store before anything else touches it.
        atexit.register(shutdown)
        _state.local_rank, _state.local_size = _local_ranks(kv)


def _local_ranks(kv: KVStore) -> tuple[int, int]:
    """(local rank, local size): the launcher's ``LOCAL_RANK`` and ``LOCAL_SIZE``, else
    found by gathering every worker's host name (collective, at init only)."""
    env = os.environ
    if kv.num_workers == 1:
        return 0, 1
    if env.get("LOCAL_RANK", "").isdigit() and env.get("LOCAL_SIZE", "").isdigit():
        return int(env["LOCAL_RANK"]), int(env["LOCAL_SIZE"])
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
            if owned:
                comm.run(lambda kv: kv.close())
        finally:
            comm.stop(timeout=30)
        atexit.unregister(shutdown)
        del kv


def rank() -> int:
    """This worker's rank, 0 .. size() - 1."""
    return _require().kv.rank


def size() -> int:
    """The number of workers."""
    return _require().kv.num_workers


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


def barrier() -> None:
    _require().comm.run(lambda kv: kv.barrier())


def mpi_threads_supported() -> bool:
    return False


def _false() -> bool:
    return False


mpi_built = mpi_enabled = gloo_built = gloo_enabled = nccl_built = _false
ddl_built = ccl_built = cuda_built = rocm_built = _false


# ---------------------------------------------------------------- collectives


def _key(kind: str, name, dtype: np.dtype, shape) -> str:
    return f"kvt.{kind}.{'' if name is None else name}.{dtype.str}.{'x'.join(map(str, shape))}"


def _ensure(kv: KVStore, keys: list, arrays: list) -> None:
    """Initialise the keys not yet in the store (collective; in the comm thread)."""
    new = [(k, a) for k, a in zip(keys, arrays, strict=True) if k not in _state.keys]
    if new:
        kv.init([k for k, _ in new], [np.zeros_like(a) for _, a in new])
        _state.keys.update(k for k, _ in new)


def _sum(keys: list, arrays: list) -> None:
    """Replace each array by its sum over the workers (one call; arrays are host, contiguous)."""

    def job(kv):
        _ensure(kv, keys, arrays)
        kv.pushpull(keys, arrays)

    _require().comm.run(job)


def _host(tensor: torch.Tensor, dtype: np.dtype | None = None) -> np.ndarray:
    t = tensor.detach()
    if t.dtype in (torch.bfloat16, torch.bool):
        t = t.to(torch.float32 if t.dtype == torch.bfloat16 else torch.uint8)
    # A copy: the sum comes back into it, never into the caller's tensor.
    return np.array(t.cpu().numpy(), dtype=dtype, order="C", copy=True)


def _check_tensor(what: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported; pass tensor.to_dense()")


def _check_root(root_rank) -> None:
    n = size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < n:
        raise ValueError(f"root_rank must be a rank in 0..{n - 1}, got {root_rank!r}")


def _resolve_op(average, op):
    if average is not None and op is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise NotImplementedError(
            "op=Adasum is not supported by kvstore.torch (the servers sum); use Average or Sum"
        )
    if op not in (Average, Sum):
        raise NotImplementedError(f"op={op!r} is not supported by kvstore.torch: Average or Sum")
    return op


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression=Compression.none,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=None,
) -> torch.Tensor:
    """The average (``op=Average``, the default) or sum (``op=Sum``) of ``tensor`` over all
    workers, as a new tensor on the tensor's device. Every worker calls it, in the same order.
    An integer tensor's average is rounded down.

    >>> hvd.allreduce(torch.tensor(float(hvd.rank())))  # doctest: +SKIP
    tensor(0.5000)
    """
    op = _resolve_op(average, op)
    _check_tensor("allreduce", tensor)
    _no_process_set(process_set)
    if tensor.dtype == torch.bool:
        raise TypeError("allreduce: bool tensors cannot be summed; cast to an integer type")
    compressed, ctx = compression.compress(tensor.detach())
    if prescale_factor != 1.0:
        compressed = compressed * prescale_factor
    host = _host(compressed)
    if host.size:
        _sum([_key("allreduce", name, host.dtype, host.shape)], [host])
    out = compression.decompress(torch.from_numpy(host).to(compressed.dtype), ctx)
    scale = postscale_factor / (size() if op == Average else 1)
    if scale != 1.0:
        if out.dtype.is_floating_point or out.dtype.is_complex:
            out = out * scale
        else:
            out = torch.div(out * postscale_factor, size(), rounding_mode="floor").to(out.dtype)
    return out.to(device=tensor.device, dtype=tensor.dtype)


def allreduce_(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """:func:`allreduce` in place."""
    with torch.no_grad():
        tensor.copy_(allreduce(tensor, *args, **kwargs))
    return tensor


_GATHER_DIMS = 8


def allgather(tensor: torch.Tensor, name: str | None = None, process_set=None) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along dimension 0, in rank order. The first
    dimension may differ between workers; the others and the dtype must not.

    >>> hvd.allgather(torch.tensor([hvd.rank()]))  # doctest: +SKIP
    tensor([0, 1])
    """
    _check_tensor("allgather", tensor)
    _no_process_set(process_set)
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    if t.dim() > _GATHER_DIMS - 2:
        raise ValueError(f"allgather: at most {_GATHER_DIMS - 2} dimensions, got {t.dim()}")
    host = _host(t)
    me, n = rank(), size()
    shapes = np.zeros((n, _GATHER_DIMS), np.int64)
    shapes[me, :2] = [zlib.crc32(host.dtype.str.encode()), t.dim()]
    shapes[me, 2 : 2 + t.dim()] = t.shape
    _sum([_key("allgather.shapes", None, shapes.dtype, shapes.shape)], [shapes])
    rest = {tuple(row[:2]) + tuple(row[3:]) for row in shapes}
    if len(rest) > 1:
        described = ", ".join(
            f"rank {r}: {tuple(int(d) for d in row[2 : 2 + row[1]])}"
            for r, row in enumerate(shapes)
        )
        raise ValueError(
            f"allgather: tensors must match in dtype and in every dimension but the first; "
            f"got {described} (dtypes {'differ' if len({r[0] for r in rest}) > 1 else 'match'})"
        )
    rows = shapes[:, 2]
    start = int(rows[:me].sum())
    total = np.zeros((int(rows.sum()), *host.shape[1:]), host.dtype)
    total[start : start + host.shape[0]] = host
    if total.size:
        _sum([_key("allgather", name, total.dtype, total.shape)], [total])
    out = torch.from_numpy(total)
    if tensor.dtype in (torch.bfloat16, torch.bool):
        out = out.to(tensor.dtype)
    return out.to(tensor.device)


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set=None
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every worker, as a new tensor (bit for bit)."""
    _check_tensor("broadcast", tensor)
    _no_process_set(process_set)
    _check_root(root_rank)
    return _broadcast_many([(name, tensor)], root_rank, "broadcast")[0]


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set=None):
    """:func:`broadcast` in place."""
    with torch.no_grad():
        tensor.copy_(broadcast(tensor, root_rank, name, process_set))
    return tensor


def _broadcast_many(named: list, root_rank: int, kind: str) -> list:
    """Root's value of every tensor of ``named`` [(name, tensor)], in one call."""
    mine = rank() == root_rank
    hosts, keys = [], []
    for i, (name, tensor) in enumerate(named):
        host = _host(tensor)
        if not mine:
            host = np.zeros_like(host)
        hosts.append(host)
        keys.append(_key(kind, f"#{i}" if name is None else name, host.dtype, host.shape))
    if len(set(keys)) != len(keys):
        raise ValueError(f"{kind}: duplicate names {sorted(k for k in keys if keys.count(k) > 1)}")
    live = [(k, h) for k, h in zip(keys, hosts, strict=True) if h.size]
    if live:
        _sum([k for k, _ in live], [h for _, h in live])
    return [
        torch.from_numpy(h).to(device=t.device, dtype=t.dtype)
        for h, (_, t) in zip(hosts, named, strict=True)
    ]


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
    values = _broadcast_many(items, root_rank, "param")
    with torch.no_grad():
        for (_, p), value in zip(items, values, strict=True):
            p.copy_(value)


def broadcast_object(obj, root_rank: int = 0, name: str | None = None, process_set=None):
    """``root_rank``'s ``obj`` on every worker (pickled between the workers of this job).

    >>> epoch = hvd.broadcast_object(epoch, root_rank=0)  # doctest: +SKIP
    """
    _require()
    _no_process_set(process_set)
    _check_root(root_rank)
    mine = rank() == root_rank
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if mine else b""
    # The bytes every worker unpickles are the root's alone: on keys under root_only(root) the
    # servers count any other rank's push as zeros, so no other worker can change them.
    root = root_only(root_rank)
    length = np.array([len(data)], np.int64)
    _sum([root + _key("object.length", name, length.dtype, length.shape)], [length])
    n = int(length[0])
    # Sizes rounded up to a power of two: few keys however many sizes are sent.
    capacity = 1 << max(6, (n - 1).bit_length())
    payload = np.zeros(capacity, np.uint8)
    if mine:
        payload[:n] = np.frombuffer(data, np.uint8)
    _sum([root + _key("object", name, payload.dtype, payload.shape)], [payload])
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


def _no_process_set(process_set) -> None:
    if process_set is not None:
        raise NotImplementedError("process sets are not supported by kvstore.torch")


# ---------------------------------------------------------------- DistributedOptimizer


class _Bucket:
    """A flat wire buffer for some parameters' gradients (all of one dtype), pushed and
    pulled as one key. After :meth:`synchronize <_DistributedMixin.synchronize>` each
    ``p.grad`` is a view into ``grads`` (DDP's ``gradient_as_bucket_view``): the averages
    are made in place, one pass per bucket. ``grads`` is the wire buffer itself where the
    gradient travels in its own dtype, else a buffer of the parameters' dtype."""

    def __init__(self, key: str, dtype: np.dtype, params: list):
        self.key = key
        self.slots = []  # (param, lo, hi)
        offset = 0
        for p in params:
            self.slots.append((p, offset, offset + p.numel()))
            offset += p.numel()
        self.host = np.zeros(offset, dtype)
        self.flat = torch.from_numpy(self.host)
        grad_dtype = params[0].dtype
        same = self.flat.dtype == grad_dtype
        self.grads = self.flat if same else torch.zeros(offset, dtype=grad_dtype)
        self.wire_views = [self.flat[lo:hi].view(p.shape) for p, lo, hi in self.slots]
        self.grad_views = [self.grads[lo:hi].view(p.shape) for p, lo, hi in self.slots]
        self.filled = 0
        self.future: Future | None = None


class _DistributedMixin:
    """Mixed into the wrapped optimizer's own class (see :func:`DistributedOptimizer`)."""

    def _kvt_setup(self, named, compression, passes, op, predivide, bucket_bytes):
        st = _require()
        self._kvt_compression = compression
        # Horovod's own compressors are casts: copy_ into the wire buffer casts in the same
        # pass, and back; another compressor's compress and decompress run as given.
        self._kvt_casts = compression in (NoneCompressor, FP16Compressor)
        self._kvt_passes = passes
        self._kvt_prescale = 1.0 / predivide
        self._kvt_postscale = predivide / st.kv.num_workers if op == Average else 1.0
        self._kvt_should_sync = True
        self._kvt_synchronized = False
        self._kvt_lock = threading.Lock()
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        params = list({id(p): p for p in params}.values())
        rows = [p for p in params if getattr(p, "_kvt_row_sparse", False)]  # row_sparse()
        params = [p for p in params if not getattr(p, "_kvt_row_sparse", False)]
        self._kvt_names = {id(p): named[id(p)] for p in params}
        # Reverse order: backward produces the last layers' gradients first.
        groups: dict = {}
        for p in reversed(params):
            groups.setdefault((_wire_dtype(compression, p.dtype), p.dtype), []).append(p)
        st.optimizers += 1
        self._kvt_rows = _RowGrads(rows, st.optimizers) if rows else None
        self._kvt_buckets: list[_Bucket] = []
        for (dtype, _), members in groups.items():
            current, nbytes = [], 0
            for p in members:
                if current and nbytes + p.numel() * dtype.itemsize > bucket_bytes:
                    self._kvt_add_bucket(st.optimizers, dtype, current)
                    current, nbytes = [], 0
                current.append(p)
                nbytes += p.numel() * dtype.itemsize
            if current:
                self._kvt_add_bucket(st.optimizers, dtype, current)
        self._kvt_where = {
            id(p): (b, i) for b in self._kvt_buckets for i, (p, _, _) in enumerate(b.slots)
        }
        self._kvt_reset()
        keys = [b.key for b in self._kvt_buckets]
        hosts = [b.host for b in self._kvt_buckets]
        if keys:
            st.comm.run(lambda kv: _ensure(kv, keys, hosts))
        me = weakref.ref(self)
        self._kvt_hooks = [
            p.register_post_accumulate_grad_hook(lambda p, me=me: me() and me()._kvt_hook(p))
            for p in params
        ]
        weakref.finalize(self, _remove_hooks, self._kvt_hooks)

    def _kvt_add_bucket(self, index: int, dtype: np.dtype, params: list) -> None:
        key = f"kvt.grad.{index}.{len(self._kvt_buckets)}"
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
                raise ValueError(
                    f"parameter {self._kvt_names[id(p)]!r} has a sparse gradient: pass "
                    "sparse_as_dense=True to DistributedOptimizer"
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
        unused parameters count as zero) and write them into ``p.grad``."""
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
    process_set=None,
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
    play their part.

    >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    ... # doctest: +SKIP
    """
    _require()
    _no_process_set(process_set)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"DistributedOptimizer: expected a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("DistributedOptimizer: this optimizer is already distributed")
    if op == Adasum:
        raise NotImplementedError(
            "op=Adasum is not supported by kvstore.torch (the servers sum); use Average or Sum"
        )
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
    cls = type(optimizer.__class__.__name__, (_DistributedMixin, optimizer.__class__), {})
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
    dist._kvt_sparse_as_dense = sparse_as_dense
    dist._kvt_setup(
        named,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        int(bucket_cap_mb * 2**20),
    )
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
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(
            f"row_sparse: expected an nn.Embedding (or its 2-D weight), got {type(module).__name__}"
        )
    if isinstance(module, torch.nn.Module) and not getattr(module, "sparse", True):
        raise ValueError(
            "row_sparse: the module makes dense gradients; create it with sparse=True "
            "(nn.Embedding(num, dim, sparse=True))"
        )
    weight._kvt_row_sparse = True


class _RowGrads:
    """The parameters marked by :func:`row_sparse`, one row-sparse key each. A step: every
    worker pushes its gradient's rows (an empty set when it has none); the round leaves each
    touched row's sum; ``save_rows`` since the last step gives every worker that round's
    rows, the same bits everywhere."""

    def __init__(self, params: list, index: int):
        from .sparse import RowSparse

        self.params = params
        self.keys = [f"kvt.rows.{index}.{i}" for i in range(len(params))]
        self.shapes = [tuple(p.shape) for p in params]
        self.dtypes = [
            np.dtype(np.float32)
            if p.dtype == torch.bfloat16
            else _wire_dtype(NoneCompressor, p.dtype)
            for p in params
        ]
        self.steps = [0] * len(params)
        empty = [RowSparse.empty(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]
        _require().comm.run(lambda kv: kv.init(self.keys, empty))

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
                    f"row_sparse: parameter of shape {shape} has a dense gradient; make its "
                    "module with sparse=True"
                )
            value = RowSparse.from_torch(grad.float() if grad.dtype == torch.bfloat16 else grad)
            if prescale != 1.0:
                value.data = value.data * value.data.dtype.type(prescale)
            values.append(value)

        def job(kv):
            kv.push(self.keys, values)
            return [kv.save_rows(k, since=s) for k, s in zip(self.keys, self.steps, strict=True)]

        results = _require().comm.run(job)
        for i, (p, (rows, step)) in enumerate(zip(self.params, results, strict=True)):
            self.steps[i] = step
            data = rows.data if postscale == 1.0 else rows.data * rows.data.dtype.type(postscale)
            index = torch.from_numpy(rows.indices).unsqueeze(0)
            grad = torch.sparse_coo_tensor(index, torch.from_numpy(data), self.shapes[i])
            p.grad = grad.to(device=p.device, dtype=p.dtype).coalesce()
