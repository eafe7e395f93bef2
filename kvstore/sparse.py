"""Row-sparse values and the servers' row store, without I/O.

An embedding table of 10^9 rows never exists in full: a row-sparse key stores only the rows
that were pushed, and a push or a pull carries only the rows it names.

- :class:`RowSparse` is the value a worker pushes and pulls: ``indices`` (int64 row ids),
  ``data`` (one row per id) and the table's logical ``shape``.
- An initializer spec (:func:`zeros`, :func:`constant`, :func:`uniform`, :func:`normal`) gives
  every row its first value; the random ones hash ``(seed, row id, column)`` (a counter-based
  generator), so a row gets the same first value on any server, whenever it is created.
- :class:`RowTable` is one server's share of a key: a sorted id index (searched by
  :mod:`kvstore.rowsearch`) into a growable 2-D block, the optimizer's state in blocks of the
  same rows, and the step at which each row last changed (:meth:`RowTable.changed_since`).
  Every operation is vectorised.
- :func:`kvstore.sharding.row_server` spreads the rows of a key over the servers by id (a
  hash, the default); a key made with ``sharding="range"`` gives each server a range of ids
  (:func:`kvstore.sharding.row_bounds`), so a worker's sorted ids travel as runs.

>>> import numpy as np
>>> g = RowSparse([3, 1, 3], np.ones((3, 2), np.float32), shape=(10, 2))
>>> c = g.canonical(); c.indices.tolist(), c.data[:, 0].tolist()
([1, 3], [1.0, 2.0])
>>> t = RowTable(2, np.float32, uniform(-1, 1, seed=7))
>>> t.apply(c.indices, c.data)  # no optimizer: the touched rows become the round's sum
>>> t.read(np.array([3]))[0].tolist(), len(t)
([2.0, 2.0], 2)
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from . import rowsearch
from .arrays import to_host
from .plan import SHM_FROM, Outgoing, ReplyError
from .sharding import row_bounds

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CHUNK = 1 << 20  # elements per initializer chunk: bounded temporaries for big creations


# ---------------------------------------------------------------- the value


class RowSparse:
    """Rows ``indices`` of a ``shape = (rows, dim)`` table; ``data[i]`` is row ``indices[i]``.

    Ids need not be sorted or unique (duplicates are summed when pushed); every id must be in
    ``[0, rows)``. ``init`` (for :meth:`KVStore.init`) says how rows never pushed start;
    ``sharding`` (for :meth:`KVStore.init` too) how the rows spread over the servers: "hash"
    (the default: balanced for any ids) or "range" (server s holds a range of ids, as
    MXNet's layout: fewer copies per request, balanced when the ids touched are spread over
    the table, as hashed ids are).

    >>> v = RowSparse([0, 5], np.ones((2, 4), np.float32), shape=(10**9, 4))
    >>> v.dtype, v.nnz
    (dtype('float32'), 2)
    """

    __slots__ = ("indices", "data", "shape", "init")

    def __init__(self, indices, data, shape, init=None, sharding=None):
        if not isinstance(shape, (tuple, list)) or len(shape) != 2:
            raise ValueError(f"RowSparse: shape must be (rows, dim), got {shape!r}")
        rows, dim = (int(s) for s in shape)
        if rows < 0 or dim < 0:
            raise ValueError(f"RowSparse: shape must be non-negative, got {shape!r}")
        ids = np.asarray(to_host(indices))
        if ids.size == 0:
            ids = ids.astype(np.int64).reshape(0)
        if ids.ndim != 1:
            raise ValueError(f"RowSparse: indices must be 1-D, got shape {ids.shape}")
        if ids.dtype.kind not in "iu":
            if ids.dtype.kind == "f" and np.all(ids == np.floor(ids)):  # MXNet passes floats
                ids = _float_ids(ids, rows, "RowSparse: row id")
            else:
                raise TypeError(f"RowSparse: indices must be integers, got {ids.dtype}")
        block = np.asarray(to_host(data))
        if block.ndim == 1 and block.size == 0:
            block = block.reshape(0, dim)
        if block.ndim != 2 or block.shape != (ids.size, dim):
            raise ValueError(
                f"RowSparse: data must be {ids.size} rows x {dim} (one row per index), "
                f"got shape {block.shape}"
            )
        if block.dtype.kind not in "biufc":
            raise TypeError(f"RowSparse: data dtype {block.dtype} is not a number type")
        if ids.size:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= rows:
                bad = low if low < 0 else high
                raise ValueError(f"RowSparse: row id {bad} is outside [0, {rows})")
        self.indices = ids.astype(np.int64, copy=False)
        self.data = block
        self.shape = (rows, dim)
        if sharding is not None:
            init = {**check_init(init), "sharding": sharding}
        self.init = check_init(init) if init is not None else None

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def nnz(self) -> int:
        """The number of rows held (with duplicates)."""
        return int(self.indices.size)

    @property
    def nbytes(self) -> int:
        return int(self.indices.nbytes + self.data.nbytes)

    def __repr__(self) -> str:
        return f"RowSparse({self.nnz} rows of {self.shape}, {self.dtype})"

    # ---- constructors
    @classmethod
    def _trusted(cls, indices: np.ndarray, data: np.ndarray, shape: tuple) -> RowSparse:
        """Checked parts (int64 ids in range, a 2-D block of one row each) as a value,
        without checking them again: the library's own results of checked values."""
        value = cls.__new__(cls)
        value.indices, value.data, value.shape, value.init = indices, data, shape, None
        return value

    @classmethod
    def empty(
        cls,
        shape,
        dtype=np.float32,
        init=None,
        admit_after: int = 1,
        evict_after: int = 0,
        sharding=None,
    ) -> RowSparse:
        """No rows: ``kv.init(key, RowSparse.empty((10**9, 64), init=uniform(-0.1, 0.1)))``
        declares a table whose rows are created when first pushed.

        ``admit_after=k``: a row is stored only from the k-th round that pushes it (the
        pushes before are dropped; reads give its initial value): a rare id costs no row,
        only a candidate entry (16 bytes: id, count, last step) until admitted.
        ``evict_after=T``: a row no round has changed for T rounds is dropped (its next read
        gives its initial value again; checked every T/2 rounds), and so is a candidate no
        round pushed for T rounds (its count starts again). Without ``evict_after`` the
        candidates are kept until admitted.

        ``sharding="range"``: each server holds a range of ids (see the class)."""
        dim = int(shape[1]) if isinstance(shape, (tuple, list)) and len(shape) == 2 else 0
        spec = check_init(init)
        if admit_after != 1 or evict_after:
            spec = check_init({**spec, "admit_after": admit_after, "evict_after": evict_after})
        return cls(np.empty(0, np.int64), np.empty((0, dim), dtype), shape, spec, sharding)

    @classmethod
    def from_dense(cls, array, init=None) -> RowSparse:
        """The rows of a 2-D array that hold a non-zero (MXNet's ``tostype('row_sparse')``)."""
        array = np.asarray(to_host(array))
        if array.ndim != 2:
            raise ValueError(f"RowSparse.from_dense: expected a 2-D array, got {array.shape}")
        ids = np.flatnonzero(array.any(axis=1))
        return cls(ids, array[ids], array.shape, init)

    @classmethod
    def from_scipy(cls, matrix) -> RowSparse:
        """A SciPy sparse matrix (any format; duplicate entries are summed)."""
        coo = matrix.tocoo()
        return _from_coo(coo.row, coo.col, coo.data, coo.shape)

    @classmethod
    def from_torch(cls, tensor) -> RowSparse:
        """A ``torch.sparse_coo_tensor``, as ``nn.Embedding(sparse=True)`` makes its weight's
        gradient (one sparse dimension: row ids, and dense rows); duplicates are summed."""
        t = tensor.detach().coalesce()
        if t.sparse_dim() == 1 and t.dense_dim() == 1:
            ids = t.indices()[0].cpu().numpy()
            return cls(ids, t.values().cpu().numpy(), tuple(t.shape))
        if t.sparse_dim() == 2 and t.dense_dim() == 0:
            rows, cols = t.indices().cpu().numpy()
            return _from_coo(rows, cols, t.values().cpu().numpy(), tuple(t.shape))
        raise ValueError(
            f"RowSparse.from_torch: expected a 2-D sparse COO tensor, got {t.sparse_dim()} "
            f"sparse and {t.dense_dim()} dense dimensions"
        )

    # ---- forms
    def canonical(self) -> RowSparse:
        """The same rows with ids sorted and unique (duplicates summed, in order)."""
        ids = self.indices
        if ids.size < 2 or bool(np.all(ids[1:] > ids[:-1])):
            return self
        order = np.argsort(ids, kind="stable")
        ids, data = ids[order], self.data[order]
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        return RowSparse(ids[starts], np.add.reduceat(data, starts, axis=0), self.shape)

    def to_dense(self) -> np.ndarray:
        """The full table (small tables only), absent rows 0."""
        out = np.zeros(self.shape, self.dtype)
        c = self.canonical()
        out[c.indices] = c.data
        return out


def _from_coo(rows, cols, values, shape) -> RowSparse:
    rows = np.asarray(rows, np.int64)
    ids, inverse = np.unique(rows, return_inverse=True)
    data = np.zeros((ids.size, int(shape[1])), np.asarray(values).dtype)
    np.add.at(data, (inverse, np.asarray(cols, np.int64)), values)
    return RowSparse(ids, data, shape)


def _float_ids(ids: np.ndarray, rows: int, what: str) -> np.ndarray:
    """Whole-number float ids as int64, once they are in ``[0, rows)`` (an inf or 1e30 would
    cast to some other id): a ``ValueError`` naming the first one outside, or the first one
    past the float type's exact whole numbers (from 2**24 in float32, 2**53 in float64, a
    float id may be another id rounded: 16777217 is 16777216 in float32)."""
    wide = ids.astype(np.float64, copy=False)  # (rows as a float16 would be inf)
    bad = ~((wide >= 0) & (wide < rows))  # (NaN is not whole: refused before)
    if bad.any():
        raise ValueError(f"{what} {float(ids[bad][0]):g} is outside [0, {rows})")
    exact = 2 ** (np.finfo(ids.dtype).nmant + 1)
    if ids.size and ids.max() >= exact:
        raise ValueError(
            f"{what} {int(ids.max())} is a {ids.dtype} id from 2**{exact.bit_length() - 1} "
            f"= {exact} up, where {ids.dtype} skips whole numbers (an id may have been "
            f"rounded to it): give row ids as integers (int64)"
        )
    return ids.astype(np.int64)


def _increasing(ids: np.ndarray) -> bool:
    return ids.size < 2 or bool((ids[1:] > ids[:-1]).all())


def _unique(ids: np.ndarray) -> np.ndarray:
    """``np.unique``, at once for ids already sorted and unique (the common case)."""
    return ids if _increasing(ids) else np.unique(ids)


def sum_rows(values: list, shape, dtype, zero: bool = True) -> RowSparse:
    """The sum of several pushes of a key (devices, or workers in rank order), canonical:
    the bits of ``0 + a + b`` (of one push too: -0.0 becomes 0.0 on every path). With
    ``zero=False`` one push's rows come back as they are (a worker's push: the servers add
    it to 0, and the push is not copied for nothing)."""
    values = [v for v in values if v.nnz]
    if not values:
        return RowSparse(np.empty(0, np.int64), np.empty((0, shape[1]), dtype), shape)
    if len(values) == 1:
        v = values[0]
        v = RowSparse._trusted(v.indices, v.data.astype(dtype, copy=False), shape).canonical()
        if zero:  # (not in place: the data may be the caller's)
            v = RowSparse._trusted(v.indices, np.add(np.dtype(dtype).type(0), v.data), shape)
        return v
    if all(_increasing(v.indices) for v in values):
        # each push canonical (the servers' case): add each into the union's rows, in order;
        # no sort of the rows themselves (0 + a + b is a + b: the same sum as below)
        # sorted runs: a stable sort merges them in linear time; then drop the repeats
        union = np.sort(np.concatenate([v.indices for v in values]), kind="stable")
        union = union[np.r_[True, union[1:] != union[:-1]]]
        total = np.zeros((union.size, shape[1]), dtype)
        for v in values:
            total[np.searchsorted(union, v.indices)] += v.data
        return RowSparse(union, total, shape)
    ids = np.concatenate([v.indices for v in values])
    data = np.concatenate([v.data.astype(dtype, copy=False) for v in values])
    total = RowSparse(ids, data, shape).canonical()  # new arrays: written in place
    np.add(np.dtype(dtype).type(0), total.data, out=total.data)
    return total


# ---------------------------------------------------------------- initializers


def zeros() -> dict:
    """Rows start at 0 (the default)."""
    return {"kind": "zeros"}


def constant(value: float) -> dict:
    return {"kind": "constant", "value": float(value)}


def uniform(low: float = -0.07, high: float = 0.07, seed: int | None = None) -> dict:
    """Uniform in ``[low, high)``; the same row gets the same values for the same seed.
    ``seed=None``: the key's own (:func:`keyed`): two tables start apart."""
    return {"kind": "uniform", "low": float(low), "high": float(high), "seed": _seed(seed)}


def normal(mean: float = 0.0, std: float = 0.01, seed: int | None = None) -> dict:
    """Normal(mean, std); the same row gets the same values for the same seed.
    ``seed=None``: the key's own (:func:`keyed`): two tables start apart."""
    return {"kind": "normal", "mean": float(mean), "std": float(std), "seed": _seed(seed)}


def _seed(seed):
    return None if seed is None else int(seed)


def keyed(spec: dict | None, key) -> dict | None:
    """``spec`` with a seed left to the key (``None``) made the key's own: 64 bits of a
    BLAKE2 hash of the key, the same in every process (Python's ``hash`` is not), so the
    rows of two tables differ, as two tables' random initialisers draw apart in MXNet."""
    if not spec or "seed" not in spec or spec["seed"] is not None:
        return spec
    name = f"{type(key).__name__}:{key}".encode()
    return {**spec, "seed": int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")}


_INIT_FIELDS = {
    "zeros": {},
    "constant": {"value": (int, float)},
    "uniform": {"low": (int, float), "high": (int, float), "seed": (int, type(None))},
    "normal": {"mean": (int, float), "std": (int, float), "seed": (int, type(None))},
}


def check_init(spec) -> dict:
    """A valid initializer spec (a dict from :func:`uniform` and the like, or its kind's
    name for the defaults), or a ``ValueError`` saying what is expected."""
    if spec is None:
        return zeros()
    if isinstance(spec, str):
        spec = {"kind": spec}
        defaults = {"constant": constant(0), "uniform": uniform(), "normal": normal()}
        spec = defaults.get(spec["kind"], spec)
    if not isinstance(spec, dict) or spec.get("kind") not in _INIT_FIELDS:
        raise ValueError(
            f"row initializer {spec!r}: expected kvstore.sparse.zeros(), constant(v), "
            "uniform(low, high, seed) or normal(mean, std, seed)"
        )
    for name, types in _INIT_FIELDS[spec["kind"]].items():
        value = spec.get(name)
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(f"row initializer {spec!r}: {name!r} must be a number")
    if spec["kind"] == "uniform" and not spec["low"] <= spec["high"]:
        raise ValueError(f"row initializer {spec!r}: low must be <= high")
    if spec["kind"] == "normal" and spec["std"] < 0:
        raise ValueError(f"row initializer {spec!r}: std must be >= 0")
    if spec["kind"] in ("uniform", "normal") and not 0 <= (spec.get("seed") or 0) < 2**64:
        raise ValueError(f"row initializer {spec!r}: seed must be in [0, 2**64)")
    checked = {"kind": spec["kind"], **{k: spec.get(k) for k in _INIT_FIELDS[spec["kind"]]}}
    for rule, low in (("admit_after", 1), ("evict_after", 0)):  # row admission and eviction
        if rule in spec:
            value = spec[rule]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**31:
                raise ValueError(f"{rule} must be an int in [{low}, 2**31), got {value!r}")
            checked[rule] = value
    sharding = spec.get("sharding", "hash")
    if sharding not in ("hash", "range"):
        raise ValueError(f'sharding must be "hash" or "range", got {sharding!r:.40}')
    if sharding == "range":  # (hash, the default, is not written)
        checked["sharding"] = "range"
    return checked


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _unit(seed: int, ids: np.ndarray, dim: int, stream: int) -> np.ndarray:
    """Uniform [0, 1) float64 of shape (len(ids), dim): a hash of (seed, id, column, stream)."""
    with np.errstate(over="ignore"):
        row = _mix(ids.astype(np.uint64) ^ _mix(np.array([seed], np.uint64)))
        cols = np.arange(dim, dtype=np.uint64) * np.uint64(2) + np.uint64(stream)
        bits = _mix(row[:, None] + (cols[None, :] + np.uint64(1)) * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def init_rows(spec: dict, ids: np.ndarray, dim: int, dtype, out: np.ndarray | None = None):
    """The first values of rows ``ids`` (into ``out`` when given), in chunks of bounded size."""
    out = np.empty((ids.size, dim), dtype) if out is None else out
    kind = spec["kind"]
    if kind == "zeros" or ids.size == 0:
        out[...] = 0
        return out
    if kind == "constant":
        out[...] = spec["value"]
        return out
    step = max(1, _CHUNK // max(dim, 1))
    for lo in range(0, ids.size, step):
        part = ids[lo : lo + step]
        u = _unit(spec["seed"] or 0, part, dim, 0)  # (None: a table made with no key)
        if kind == "uniform":
            out[lo : lo + step] = spec["low"] + (spec["high"] - spec["low"]) * u
        else:  # Box-Muller with a second stream
            v = _unit(spec["seed"] or 0, part, dim, 1)
            z = np.sqrt(-2.0 * np.log1p(-u)) * np.cos(2 * math.pi * v)
            out[lo : lo + step] = spec["mean"] + spec["std"] * z
    return out


# ---------------------------------------------------------------- the row store


def _scatter(block: np.ndarray, where: np.ndarray, rows: np.ndarray) -> None:
    """``block[where] = rows``, each row moved whole (a void view: one copy a row, not element
    by element; about 15% less time for rows of dim 64) where both arrays allow it, by
    ``put`` (15% less again; ``put`` repeats ``rows`` when they are fewer: never here)."""
    if (
        rows.dtype == block.dtype
        and rows.ndim == block.ndim == 2
        and rows.shape[1] == block.shape[1] > 0
        and rows.shape[0] == len(where)
        and rows.flags.c_contiguous
        and block.flags.c_contiguous
    ):
        whole = np.dtype((np.void, block.shape[1] * block.itemsize))
        # put (the positions are valid, one per row): 15% less time than [where] =
        np.put(block.view(whole)[:, 0], where, rows.view(whole)[:, 0], mode="clip")
    else:
        block[where] = rows


DIRECT_ROWS = 1 << 22  # a table of at most this many rows looks its ids up in a direct map


class RowTable:
    """One server's rows of one key: ``ids`` (sorted) -> ``slots`` into ``block``.

    A row is created when first pushed (:meth:`apply`, :meth:`assign`), from the initializer;
    a read of an absent row returns its initial value without storing it. ``states`` hold the
    optimizer's state, row for row with ``block``; ``changed[slot]`` is the step (rounds
    applied) at which a row last changed. A table of at most :data:`DIRECT_ROWS` logical rows
    also keeps ``direct[id] = slot + 1`` (0: absent) once that map, 4 bytes per logical row,
    is at most an eighth of its rows' block (``direct_map``: True from the start, False
    never): a lookup is then one gather instead of a binary search of ``ids``.
    """

    def __init__(
        self,
        dim: int,
        dtype,
        init: dict | None = None,
        rows: int = 2**63 - 1,
        direct_map: bool | None = None,
    ):
        self.dim, self.dtype, self.rows = int(dim), np.dtype(dtype), int(rows)
        self.init = check_init(init)
        # int32 slots and steps: a server holds fewer than 2**31 rows of a key (that would
        # be 512 GiB at dim 64), and 10^6 rows of dim 64 with a state fit in 512 MiB
        self.ids = np.empty(0, np.int64)  # sorted
        self.slots = np.empty(0, np.int32)  # slot of ids[i]
        self.block = np.empty((0, self.dim), self.dtype)
        self.changed = np.empty(0, np.int32)
        self.states: tuple = ()  # optimizer state blocks, shaped like block
        self.state_of = None  # the optimizer the states belong to
        self.count = 0  # rows stored
        self.step = 0  # rounds applied
        self.admit_after = self.init.get("admit_after", 1)
        self.evict_after = self.init.get("evict_after", 0)
        self.cand_ids = np.empty(0, np.int64)  # rows pushed, not yet admitted (sorted)
        self.cand_counts = np.empty(0, np.int32)  # rounds that pushed each
        self.cand_last = np.empty(0, np.int32)  # the step each was last pushed at
        self.trimmed_bytes = 0  # nbytes when the server last trimmed its heap
        # the last round's pushes: id(ids) -> (ids, their slots), so the replies of a
        # pushpull gather their rows without a second lookup (the ids object is kept, so its
        # id cannot be another array's)
        self.recent: dict = {}
        self.scratch = np.empty(0, self.dtype)  # see _scratch
        self.direct = None
        self._direct_map = direct_map
        self._make_direct()

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        """Memory held: the block, the states, the index (capacity, not only rows used)."""
        arrays = (self.ids, self.slots, self.block, self.changed, *self.states)
        arrays += (self.cand_ids, self.cand_counts, self.cand_last, self.scratch)
        arrays += (self.direct,) if self.direct is not None else ()
        return sum(a.nbytes for a in arrays)

    # ---- lookup
    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found mask, slot per id; -1 where absent) for any ids."""
        if self.direct is not None:
            slots = self.direct[ids] - 1
            return slots >= 0, slots
        return rowsearch.find(self.ids, self.slots, ids)

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """Slots of sorted unique ``ids``, creating the absent rows."""
        found, slots = self.find(ids)
        if found.all():
            return slots
        return self._create(ids, found, slots)

    def _create(self, ids: np.ndarray, found: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """``slots`` (of sorted unique ``ids``, from :meth:`find`) with the rows not
        ``found`` created."""
        new = ids[~found]
        first = self.count
        self._grow(first + new.size)
        made = np.arange(first, first + new.size, dtype=np.int32)
        init_rows(self.init, new, self.dim, self.dtype, out=self.block[first : first + new.size])
        self.changed[made] = self.step
        if self.state_of is not None:
            fresh = self.state_of.create_state(self.block[made])
            for state, value in zip(self.states, fresh, strict=True):
                state[made] = value
        self.count += new.size
        at = np.searchsorted(self.ids, new)
        self.ids = np.insert(self.ids, at, new)
        self.slots = np.insert(self.slots, at, made)
        if self.direct is not None:
            self.direct[new] = made + 1
        else:
            self._make_direct()
        slots[~found] = made
        return slots

    def _make_direct(self) -> None:
        """Make ``direct`` when it is wanted and worth it (see the class)."""
        if self._direct_map is False or self.rows > DIRECT_ROWS:
            return
        block = self.count * self.dim * self.dtype.itemsize
        if self._direct_map is None and 32 * self.rows > block:
            return  # 4 bytes a logical row would be more than an eighth of the rows' block
        self.direct = np.zeros(self.rows, np.int32)  # calloc'd: pages made where ids fall
        self.direct[self.ids] = self.slots + 1

    def _grow(self, need: int) -> None:
        """Room for ``need`` rows. The arrays grow in place (``realloc``: for a big block,
        glibc's ``mremap`` moves pages rather than copying them), so the slack can be small:
        memory follows the rows stored within 1/64."""
        capacity = self.block.shape[0]
        if need <= capacity:
            return
        if need >= 2**31:
            raise ValueError(f"a server holds at most 2**31 - 1 rows of a key; {need} asked")
        capacity = min(max(need, capacity + capacity // 64, 256), 2**31 - 1)

        def grown(a):
            try:  # no view of these arrays outlives a call of this class: resize is safe
                a.resize((capacity, *a.shape[1:]), refcheck=False)
                return a
            except ValueError:  # not its own memory: copy
                b = np.empty((capacity, *a.shape[1:]), a.dtype)
                b[: self.count] = a[: self.count]
                return b

        self.block = grown(self.block)
        self.changed = grown(self.changed)
        self.states = tuple(grown(s) for s in self.states)

    # ---- reads
    def read(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The rows ``ids`` (any order, repeats allowed) as a new ``(len(ids), dim)`` array,
        or written into ``out`` (returned)."""
        for pushed, slots, *_ in self.recent.values():  # a worker's step: push, pull the same ids
            if pushed.size != ids.size or (ids.size and pushed[-1] != ids[-1]):
                continue  # (one compare rules out most of many workers' pushes)
            if np.array_equal(pushed, ids):
                return self._gather(slots, out)
        found, slots = self.find(ids)
        if found.all() and self.count:
            return self._gather(slots, out)
        if out is None:
            out = np.empty((ids.size, self.dim), self.dtype)
        if self.count:
            np.take(self.block, np.where(found, slots, 0), axis=0, out=out, mode="clip")
        missing = ~found
        out[missing] = init_rows(self.init, ids[missing], self.dim, self.dtype)
        return out

    def _gather(self, slots: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        # take, unbuffered (the slots are valid): twice as fast as block[slots]
        return np.take(self.block, slots, axis=0, out=out, mode="clip")

    def pushed_rows(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """:meth:`read` of the ids of a push of the round just applied, without a lookup."""
        hit = self.recent.get(id(ids))
        if hit is not None and hit[0] is ids:
            return self._gather(hit[1], out)
        return self.read(ids, out)

    def pushed_delta(self, ids: np.ndarray):
        """A push of the round just applied by :meth:`assign_sums`, as its reply's delta:
        ``(at, rows)``. Its rows after the round are ``0 +`` the rows it pushed, but at
        positions ``at`` (increasing, into its ids): the rows another push of the round
        touched too, given as ``rows``. None for any other ids (:meth:`pushed_rows`)."""
        hit = self.recent.get(id(ids))
        if hit is None or hit[0] is not ids or hit[2] is None:
            return None
        return hit[2], self._gather(hit[1][hit[2]], None)

    def changed_since(self, step: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of the rows changed after ``step`` (created rows count), ids sorted;
        ``None``: every stored row."""
        if step is None:
            return self.ids.copy(), self.block[self.slots]
        keep = self.changed[self.slots] > step
        return self.ids[keep], self.block[self.slots[keep]]

    def bookkeeping(self) -> tuple:
        """What admission and eviction go on from: (stored ids, the step each last changed
        at, candidate ids, their counts, the step each was last pushed at)."""
        return (self.ids, self.changed[self.slots], self.cand_ids, self.cand_counts, self.cand_last)

    def check_bookkeeping(self, step, ids, changed, cand_ids, counts, last) -> None:
        """Refuse :meth:`bookkeeping`'s arrays (at ``step``) unless they fit this table."""
        if (
            type(step) is not int
            or not 0 <= step < 2**31
            or not _ids(ids)
            or not _ids(cand_ids)
            or (ids.size and not (0 <= ids[0] and ids[-1] < self.rows))
            or (cand_ids.size and not (0 <= cand_ids[0] and cand_ids[-1] < self.rows))
            or not _steps(changed, ids.size, step)
            or not _steps(last, cand_ids.size, step)
            or not _steps(counts, cand_ids.size, 2**31 - 1, 1)
        ):
            raise ValueError("the admission state does not fit this table: saved for another")

    def restore_bookkeeping(self, step: int, ids, changed, cand_ids, counts, last) -> None:
        """:meth:`bookkeeping`'s arrays at ``step`` (checked: :meth:`check_bookkeeping`). A
        table at or behind ``step`` (a restart: load the rows first) goes on from ``step``,
        each stored row of ``ids`` with its step from ``changed`` (rows not stored are not
        made; a later ``load_rows`` stamps the rows it loads with the step then). A table
        ahead (an older checkpoint loaded mid-training) keeps its step: the ages move to now,
        and no row counts as changed earlier than its load. Candidates come back where rows
        are admitted by count."""
        found, slots = self.find(ids.astype(np.int64))
        slots, changed = slots[found], changed[found].astype(np.int64)
        shift = max(self.step - step, 0)
        if shift:
            self.changed[slots] = np.maximum(self.changed[slots], changed + shift)
        else:
            self.restore_step(step)
            self.changed[slots] = changed
        if self.admit_after <= 1:
            return
        stored = self.find(cand_ids.astype(np.int64))[0]  # (admitted since: not candidates)
        self.cand_ids = cand_ids.astype(np.int64)[~stored]
        self.cand_counts = counts.astype(np.int32)[~stored]
        self.cand_last = (last.astype(np.int64) + shift).astype(np.int32)[~stored]

    def restore_step(self, step: int) -> None:
        """Continue counting steps from ``step`` (a checkpoint's), when that is ahead."""
        if step > self.step:
            self.step = step

    # ---- writes
    def assign(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Set rows (an init or a load), sorted unique ids; their step becomes the current."""
        self.recent = {}  # the rows a round's replies would send are not these rows' now
        slots = self.slots_of(ids)
        self.block[slots] = rows
        self.changed[slots] = self.step

    def assign_sums(self, pushes: list) -> None:
        """A round without an optimizer from its pushes ``[(ids, rows, normal)]`` (each
        sorted and unique, in rank order): the touched rows become their sum, the bits of
        ``0 + a + b`` in rank order (of one push too: -0.0 becomes 0.0 whoever pushed with
        it). ``normal``: the rows are ``0 +`` themselves already (a same-host worker writes
        them so into its shared segment), scattered as they are, not through a scratch copy.
        :meth:`pushed_delta` then says, for each push, which of its rows are not ``0 +`` its
        own: those another push touched too."""
        self._next_step()
        zero, kept, dups = self.dtype.type(0), [], []
        for ids, rows, normal in pushes:
            # a row's first push this round writes 0 + its rows, in the pass that finds it; a
            # later push adds to them (a row changed at this step was written by an earlier
            # push of the round: rowsearch.assign leaves it, flag 2; before the round's first
            # push no row is at this step)
            given = rows if normal else np.add(zero, rows, out=self._scratch(rows))
            direct = self.direct is not None
            where, flags, found, again = rowsearch.assign(
                None if direct else self.ids,
                self.direct if direct else self.slots,
                ids,
                given,
                self.block,
                self.changed,
                self.step,
                again=bool(kept),
            )
            if found < ids.size:  # new rows (at this step now): their pushed rows
                absent = flags == 1
                where = self._create(ids, ~absent, where)
                _scatter(self.block, where[absent], given[absent])
            if again:
                hit = flags == 2
                at = where[hit]
                self.block[at] = self.block[at] + rows[hit]
                dups.append(ids[hit])
            kept.append((ids, where))
        twice = np.unique(np.concatenate(dups)) if len(dups) > 1 else (dups or [None])[0]
        recent = {}
        for ids, where in kept:  # the positions of each push's rows another push touched
            if twice is None or not ids.size:
                at = np.empty(0, np.intp)
            else:
                at = np.minimum(np.searchsorted(ids, twice), ids.size - 1)
                at = at[ids[at] == twice]
            recent[id(ids)] = (ids, where, at)
        self.recent = recent

    def _scratch(self, rows: np.ndarray) -> np.ndarray:
        """A reused array of ``rows``' shape and dtype (a round's ``0 + rows``, scattered at
        once): its pages stay mapped and warm, no new 1 MiB each push."""
        if self.scratch.size < rows.size or self.scratch.dtype != rows.dtype:
            self.scratch = np.empty(rows.size, rows.dtype)
        return self.scratch[: rows.size].reshape(rows.shape)

    def _next_step(self) -> None:
        self.recent = {}
        self.step += 1
        if self.evict_after and self.step % max(1, self.evict_after // 2) == 0:
            self._evict(self.step - 1 - self.evict_after)  # first: a row evicted now re-enters

    def apply(self, ids, rows, optimizer=None, t: int = 1, lr: float = 0.0, accumulate=False):
        """One round's sum (sorted unique ``ids``, ``rows``): without ``optimizer`` the rows
        become the sum (``accumulate``: are added to, an async push); with one, its update at
        count ``t`` and rate ``lr``: lazily on the touched rows, or on every stored row when
        the optimizer's ``lazy_update`` is False (as MXNet's ``lazy_update=False``). Returns
        the slots of ``ids`` (None when admission dropped some)."""
        self._next_step()
        if self.admit_after > 1:
            ids, rows = self._admit(ids, rows)
        slots = self.slots_of(ids)
        done = slots if self.admit_after == 1 else None
        if optimizer is None:
            if accumulate:
                self.block[slots] += rows
            else:
                self.block[slots] = rows
            self.changed[slots] = self.step
            return done
        self._states_for(optimizer)
        if getattr(optimizer, "lazy_update", True):
            weight = self.block[slots]
            states = tuple(s[slots] for s in self.states)
            optimizer.update(weight, rows.astype(self.dtype, copy=False), states, lr, t)
            self.block[slots] = weight
            for stored, state in zip(self.states, states, strict=True):
                stored[slots] = state
            self.changed[slots] = self.step
            return done
        n = self.count
        grad = np.zeros((n, self.dim), self.dtype)
        grad[slots] = rows
        optimizer.update(self.block[:n], grad, tuple(s[:n] for s in self.states), lr, t)
        self.changed[:n] = self.step
        return done

    def _admit(self, ids: np.ndarray, rows: np.ndarray):
        """The ids (and rows) of this round that are stored or admitted now; the others
        count one more round as candidates."""
        found, _ = self.find(ids)
        if found.all():
            return ids, rows
        new = ids[~found]
        pos = np.searchsorted(self.cand_ids, new)
        if self.cand_ids.size:
            known = self.cand_ids.take(pos, mode="clip") == new
        else:
            known = np.zeros(new.size, bool)
        counts = np.ones(new.size, np.int32)
        counts[known] += self.cand_counts[pos[known]]
        admitted = counts >= self.admit_after
        self.cand_counts[pos[known & ~admitted]] = counts[known & ~admitted]
        self.cand_last[pos[known & ~admitted]] = self.step
        fresh = ~known & ~admitted
        gone = pos[known & admitted]  # admitted candidates leave the list
        cand_ids = np.insert(self.cand_ids, pos[fresh], new[fresh])
        cand_counts = np.insert(self.cand_counts, pos[fresh], counts[fresh])
        cand_last = np.insert(self.cand_last, pos[fresh], self.step)
        gone = gone + np.searchsorted(pos[fresh], gone, side="right")
        self.cand_ids, self.cand_counts = np.delete(cand_ids, gone), np.delete(cand_counts, gone)
        self.cand_last = np.delete(cand_last, gone)
        keep = found.copy()
        keep[~found] = admitted
        return ids[keep], rows[keep]

    def _evict(self, limit: int) -> None:
        """Drop the rows last changed at step ``limit`` or before (the others are compacted
        to the front of the blocks, in id order), and the admission candidates last pushed
        then (their count starts again)."""
        if self.cand_ids.size:
            recent = self.cand_last > limit
            if not recent.all():
                self.cand_ids, self.cand_counts = self.cand_ids[recent], self.cand_counts[recent]
                self.cand_last = self.cand_last[recent]
        live = self.changed[self.slots] > limit
        if live.all():
            return
        kept = self.slots[live]
        m = kept.size
        self.block[:m] = self.block[kept]
        self.changed[:m] = self.changed[kept]
        for state in self.states:
            state[:m] = state[kept]
        if self.direct is not None:
            self.direct[self.ids[~live]] = 0
            self.direct[self.ids[live]] = np.arange(1, m + 1, dtype=np.int32)
        self.ids = self.ids[live]
        self.slots = np.arange(m, dtype=np.int32)
        self.count = m

    def _states_for(self, optimizer) -> None:
        if self.state_of is optimizer:
            return
        check_optimizer(optimizer, self.dtype)
        capacity = self.block.shape[0]
        fresh = optimizer.create_state(self.block[: self.count])
        self.states = tuple(
            np.empty((capacity, *np.shape(s)[1:]), np.asarray(s).dtype) for s in fresh
        )
        for stored, value in zip(self.states, fresh, strict=True):
            stored[: self.count] = value
        self.state_of = optimizer


def check_optimizer(optimizer, dtype) -> None:
    """A ``ValueError`` saying what to do when ``optimizer`` cannot update row-sparse rows of
    ``dtype``: LAMB (norms over the whole key), fp16 with ``multi_precision``."""
    if getattr(optimizer, "multi_precision", False) and np.dtype(dtype) == np.float16:
        raise ValueError(
            "multi_precision is not supported on row-sparse keys: store the table in "
            "float32, or set multi_precision=False"
        )
    if optimizer.name == "lamb":
        raise ValueError(
            "LAMB's update takes norms over the whole key; it has no lazy row-sparse "
            "form: use SGD, Adam, AdaGrad (or another row-wise optimizer) for this key"
        )


# ---------------------------------------------------------------- rounds of a server's keys


class SparseKeys:
    """A server's row-sparse keys: their tables and the pushes each round still sums.

    :class:`kvstore.rounds.Rounds` decides when a round completes (it is fed an empty array
    per push, so its join/finish/deadline rules hold unchanged); this holds the rows: a push
    is kept under its round number (``add``), and the round's :class:`~kvstore.rounds.Apply`
    sums them in rank order and updates the table (``apply``).
    """

    def __init__(self):
        self.tables: dict = {}  # (key, part) -> RowTable
        self.pending: dict = defaultdict(dict)  # (key, part) -> {round: [(rank, ids, rows)]}
        self.arrivals: dict = defaultdict(list)  # (key, part) -> async pushes, in order
        # (key, part) -> sync rounds applied: the round the next sync Apply is (a table's
        # step also counts async pushes and can be restored by load_rows)
        self.rounds_done: dict = defaultdict(int)
        self.placeholders: dict = {}  # dtype -> the empty array Rounds sums

    def add_key(self, where, rows: int, dim: int, dtype, init) -> RowTable:
        table = self.tables[where] = RowTable(dim, dtype, init, rows)
        return table

    def grown(self, table: RowTable) -> bool:
        """Whether ``table`` grew by an eighth (and 8 MiB) since this last said so: time to
        give the heap's free pages back (``kvstore.memory.trim``)."""
        total = table.nbytes
        if total < table.trimmed_bytes * 9 // 8 + (8 << 20):
            return False
        table.trimmed_bytes = total
        return True

    def placeholder(self, dtype) -> np.ndarray:
        found = self.placeholders.get(dtype)
        if found is None:
            found = self.placeholders[dtype] = np.empty(0, dtype)
        return found

    def add(self, where, round_: int, rank: int, ids, rows, sync: bool, normal=False) -> None:
        """File a push for its round (``normal``: its rows are ``0 +`` themselves already,
        :meth:`RowTable.assign_sums`)."""
        if sync:
            self.pending[where].setdefault(round_, []).append((rank, ids, rows, normal))
        else:
            self.arrivals[where].append((rank, ids, rows, normal))

    def next_pushes(self, where, accumulate: bool) -> list:
        """The pushes the next :meth:`apply` of ``where`` sums, ``[(rank, ids, rows,
        normal)]`` in the order it sums them (a primary forwards them to its backups)."""
        if accumulate:
            return self.arrivals[where][:1]
        return sorted(self.pending[where].get(self.rounds_done[where], []), key=lambda p: p[0])

    def apply(self, where, accumulate: bool, optimizer=None, t: int = 1, lr: float = 0.0):
        """Apply the round now complete (with ``accumulate``: the next async push): the
        pushes summed in rank order, then :meth:`RowTable.apply`. Without an optimizer (and
        admission) each push is added straight into the table's rows, no sum array between:
        ``0 + a + b``, the same bits as the sum."""
        table = self.tables[where]
        if accumulate:
            _, ids, rows, normal = self.arrivals[where].pop(0)
            if not normal:  # 0 + rows, as a shared segment's: the same bits on either path
                rows = np.add(rows.dtype.type(0), rows)
            table.apply(ids, rows, optimizer, t, lr, accumulate=True)
            return
        pushes = self.pending[where].pop(self.rounds_done[where], [])
        self.rounds_done[where] += 1
        pushes.sort(key=lambda p: p[0])
        if optimizer is None and table.admit_after == 1:
            table.assign_sums([p[1:] for p in pushes])
            return
        shape = (table.rows, table.dim)
        total = sum_rows([RowSparse(i, r, shape) for _, i, r, _ in pushes], shape, table.dtype)
        slots = table.apply(total.indices, total.data, optimizer, t, lr)
        if slots is not None:
            table.recent = {
                id(i): (i, slots[np.searchsorted(total.indices, i)], None) for _, i, _, _ in pushes
            }


def check_since(key, since: int | None, step: int) -> None:
    """A ``ValueError`` saying what to do when ``save_rows(key, since)`` asks for the rows
    changed after a step this table has not reached (a store restarted counts from 0)."""
    if since is not None and since > step:
        raise ValueError(
            f"save_rows(key={key!r}): since={since} is past the current step {step} (a new "
            "or restarted store counts steps from 0): pass since=None for every stored row, "
            "or restore the checkpoint's step with load_rows(key, rows, step=...)"
        )


def split_by_server(ids: np.ndarray, num_server: int, bounds=None) -> list:
    """Where each server's rows are in ``ids``: an index array per server, in the order of
    ``ids``; with ``bounds`` (range sharding, :func:`kvstore.sharding.row_bounds`) and
    increasing ids, a ``slice`` per server (its ids are a run). :func:`size` counts either."""
    if num_server == 1:
        return [slice(0, ids.size)]
    if bounds is not None:
        if _increasing(ids):  # the runs: one binary search per server
            edges = [0, *np.searchsorted(ids, bounds[1:-1]).tolist(), ids.size]
            return [slice(lo, hi) for lo, hi in zip(edges, edges[1:], strict=False)]
        where = np.searchsorted(np.asarray(bounds, np.int64), ids, side="right") - 1
        return rowsearch.group(where, num_server)
    return rowsearch.split(ids, num_server)


def size(pos) -> int:
    """The number of ids at ``pos`` (an index array or a slice from :func:`split_by_server`)."""
    return pos.stop - pos.start if isinstance(pos, slice) else int(pos.size)


def bounds_of(sharding: str, rows: int, num_server: int):
    """The range bounds of a key of ``rows`` rows sharded by ``sharding``; None when hashed."""
    return row_bounds(rows, num_server) if sharding == "range" and num_server > 1 else None


def check_ids(what: str, key, ids, rows: int) -> np.ndarray:
    """Row ids given by a user (any int array-like, CuPy too), as int64; a ``ValueError`` or
    ``TypeError`` naming the key when they are not ints in ``[0, rows)``."""
    ids = np.asarray(to_host(ids))
    if ids.size == 0:
        return np.empty(0, np.int64)
    if ids.ndim != 1:  # else the same object: a pushpull's pull finds its pushed ids by it
        ids = ids.reshape(-1)
    if ids.dtype.kind not in "iu":
        if ids.dtype.kind != "f" or not np.all(ids == np.floor(ids)):
            raise TypeError(f"{what}(key={key!r}): row ids must be integers, got {ids.dtype}")
        ids = _float_ids(ids, rows, f"{what}(key={key!r}): row id")
    low, high = ids.min(), ids.max()
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        raise ValueError(f"{what}(key={key!r}): row id {int(bad)} is outside [0, {rows})")
    return ids.astype(np.int64, copy=False)


def holds_ids(unique: np.ndarray, ids: np.ndarray) -> bool:
    """Whether every id of ``ids`` (any order, repeats allowed) is in ``unique`` (sorted,
    unique): a pull of ``ids`` can then be read from the rows of ``unique``.

    >>> holds_ids(np.array([1, 4, 9]), np.array([9, 1, 9]))
    True
    """
    if ids is unique or ids.size == 0:
        return True
    if unique.size == 0:
        return False
    pos = np.searchsorted(unique, ids)
    return bool(pos.max() < unique.size and (unique[pos] == ids).all())


def write_rows(out, ids: np.ndarray, rows_of) -> None:
    """Fill ``out`` with the rows ``ids``: a :class:`RowSparse` gets the unique sorted ids and
    their rows, a dense array of the table's shape those rows and 0 elsewhere. ``rows_of(u)``
    gives the rows of sorted unique ids ``u``."""
    unique = _unique(ids)
    rows = rows_of(unique)
    if isinstance(out, RowSparse):
        out.indices, out.data = unique, rows.astype(out.data.dtype, copy=False)
        return
    from .arrays import namespace

    xp = namespace(out)
    out[...] = 0
    if unique.size:
        out[xp.asarray(unique)] = xp.asarray(rows.astype(out.dtype, copy=False))


# ---------------------------------------------------------------- the worker's messages


def plan_init(items, num_server: int, members=None, arrivals=None) -> list:
    """``sparse_init`` per server: every server holds a part (its rows) of every key; a
    group's keys (``members``, as :meth:`kvstore.plan.Planner.init`) name the group."""
    group = {} if members is None else {"members": list(members)}
    if arrivals is not None:
        group["arrivals"] = list(arrivals)
    legs: list = [([], [], []) for _ in range(num_server)]
    for item in items:
        v = item.value
        meta = [v.shape[0], v.shape[1], v.dtype.str, v.init or zeros()]
        bounds = bounds_of(meta[3].get("sharding", "hash"), v.shape[0], num_server)
        for server, pos in enumerate(split_by_server(v.indices, num_server, bounds)):
            keys, metas, arrays = legs[server]
            keys.append((item.key, server))
            metas.append(meta)
            arrays += [v.indices[pos], np.ascontiguousarray(v.data[pos])]
    return [
        Outgoing(s, "sparse_init", tuple(k), [list(x) for x in k], {"meta": m, **group}, tuple(a))
        for s, (k, m, a) in enumerate(legs)
    ]


def plan_push(items, num_server: int, sync: bool, metas: dict, pulls=None, shm_servers=()):
    """``sparse_push`` per server, with every key: a server with none of a key's rows gets an
    empty set, so that its round of the key completes (it counts this worker's push). With
    ``pulls`` (a pushpull), each server answers with its rows once the round is applied, and
    a :class:`RowCollector` for them comes back too. The rows for a server in
    ``shm_servers`` (on this host) may go through a shared segment (``Outgoing.shared``).
    ``metas``: each key's Meta (its shape and sharding). The rows of a range-sharded key
    are views of the pushed value's (:func:`shares_rows`); a hashed key's are copies, or
    :class:`Picked` rows where they may go through a segment (gathered straight into it)."""
    splits = [
        split_by_server(item.value.indices, num_server, _bounds(metas[item.key], num_server))
        for item in items
    ]
    collector = None
    if pulls is not None:
        wanted = [
            (pull, item.value.indices, split)
            for item, pull, split in zip(items, pulls, splits, strict=True)
        ]
        collector = RowCollector(wanted, metas)
        for item in items:  # first: a hashed push's rows are gathered from these, 0 + already
            collector.fill(item.key, item.value.data)
    legs: list = [([], []) for _ in range(num_server)]
    for item, split in zip(items, splits, strict=True):
        v = item.value
        for server, pos in enumerate(split):
            keys, arrays = legs[server]
            keys.append((item.key, server))
            if isinstance(pos, slice):  # a run: views
                arrays += [v.indices[pos], np.ascontiguousarray(v.data[pos])]
                continue
            arrays.append(v.indices.take(pos))
            if collector is None:
                rows = Picked(v.data, pos, False)
            else:
                rows = Picked(collector.block_of(item.key), pos, True)
            if server not in shm_servers or rows.nbytes < SHM_FROM:  # by socket: gathered
                rows = rows.gather()
            arrays.append(rows)
    body = {"sync": sync} if pulls is None else {"sync": sync, "pull": True}
    out = []
    for s, (keys, arrays) in enumerate(legs):
        shared = ()
        if s in shm_servers:  # the rows of each key (array 2i + 1), when big enough
            shared = tuple(i for i in range(1, len(arrays), 2) if arrays[i].nbytes >= SHM_FROM)
        wire = [list(x) for x in keys]
        out.append(Outgoing(s, "sparse_push", tuple(keys), wire, body, tuple(arrays), shared))
    return out if collector is None else (out, collector)


class Picked(NamedTuple):
    """A hashed push's rows for one server, not gathered yet: ``source[pos]``. The worker
    gathers them straight into the server's shared segment (no copy in between), or into a
    new array to send by socket (:meth:`gather`; :func:`gathered`). ``normal``: ``source``
    holds ``0 +`` the pushed rows already (a pushpull's output block, filled first)."""

    source: np.ndarray
    pos: np.ndarray
    normal: bool

    @property
    def dtype(self) -> np.dtype:
        return self.source.dtype

    @property
    def shape(self) -> tuple:
        return (self.pos.size, self.source.shape[1])

    @property
    def nbytes(self) -> int:
        return self.pos.size * self.source.shape[1] * self.source.itemsize

    def gather(self, out: np.ndarray | None = None) -> np.ndarray:
        # take, unbuffered (the positions are valid): twice as fast as source[pos]
        return np.take(self.source, self.pos, axis=0, out=out, mode="clip")


def gathered(arrays: list) -> list:
    """``arrays`` with each :class:`Picked` entry gathered (what goes by socket)."""
    return [a.gather() if type(a) is Picked else a for a in arrays]


def _bounds(meta, num_server: int):
    return bounds_of(getattr(meta, "sharding", "hash"), meta.shape[0], num_server)


def shares_rows(items, metas: dict, num_server: int) -> bool:
    """Whether :func:`plan_push` sends views of the pushed rows (one server, or a range-
    sharded key), which ZeroMQ may still read after the call returns."""
    return num_server == 1 or any(_bounds(metas[i.key], num_server) for i in items)


def plan_pull(items, num_server: int, metas: dict) -> tuple[list, RowCollector]:
    """``sparse_pull`` to the servers holding rows wanted (the ids of every output of a key
    asked once), and the :class:`RowCollector` that writes the replies."""
    legs: list = [([], []) for _ in range(num_server)]
    wanted = []
    for item in items:
        if len(item.ids) == 1:
            unique = _unique(item.ids[0])
        else:
            unique = np.unique(np.concatenate(item.ids)) if item.ids else np.empty(0, np.int64)
        splits = split_by_server(unique, num_server, _bounds(metas[item.key], num_server))
        wanted.append((item, unique, splits))
        for server, pos in enumerate(splits):
            if size(pos):
                keys, arrays = legs[server]
                keys.append((item.key, server))
                arrays.append(unique[pos])
    collector = RowCollector(wanted, metas)
    out = [
        Outgoing(s, "sparse_pull", tuple(k), [list(x) for x in k], {}, tuple(a))
        for s, (k, a) in enumerate(legs)
        if k
    ]
    return out, collector


class RowCollector:
    """The outputs of one ``row_sparse_pull`` and the reply parts it still waits for; the same
    contract as :class:`kvstore.plan.Collector` (``expect``, ``receive``, ``cancel``,
    ``finish``): nothing is written into the caller's outputs before ``finish``."""

    def __init__(self, wanted: list, metas: dict):
        self.cancelled = False
        self.reason = ""
        self._wanted = wanted
        self._blocks: dict = {}
        self._positions: dict = {}
        for item, unique, splits in wanted:
            meta = metas[item.key]
            self._blocks[item.key] = np.empty((unique.size, meta.shape[1]), meta.dtype)
            for server, pos in enumerate(splits):
                self._positions[(item.key, server)] = pos
        self._expected: dict = {}
        self._own: set = set()  # requests whose pushed rows are in place (pushed)

    def expect(self, request: int, keys: tuple) -> None:
        self._expected[request] = keys

    def block_of(self, key) -> np.ndarray:
        """The rows of ``key`` to be written into its outputs (after :meth:`fill`, ``0 +``
        the rows pushed)."""
        return self._blocks[key]

    def fill(self, key, rows: np.ndarray) -> None:
        """The rows this call pushes of ``key`` (its ids are the wanted ids, in order), ``0 +``
        themselves: how the round leaves each row no other push touches. One pass in order,
        while they are in cache; a reply then brings only the rows another push touched
        too (a delta, :meth:`RowTable.pushed_delta`), or every row (with an optimizer)
        written over these."""
        block = self._blocks[key]
        np.add(block.dtype.type(0), rows, out=block)

    def pushed(self, request: int) -> None:
        """``request`` pushes rows :meth:`fill` put in place: its reply may be a delta."""
        self._own.add(request)

    def receive(self, request: int, keys, arrays, codes=None, delta=None) -> None:
        """Write a reply's rows (``codes``: rows never come as codes; refused), or with
        ``delta`` (``[[key index, positions]]``, after :meth:`pushed`) the reply's rows at
        those positions (int32 bytes, increasing) among the rows this worker pushed."""
        asked = self._expected.pop(request, None)
        own = request in self._own
        self._own.discard(request)
        if asked is None or self.cancelled:
            return
        if codes is not None:
            self.cancel()
            raise ReplyError("the reply holds codes, and rows are never compressed")
        if len(keys) != len(asked) or len(arrays) != len(asked):
            self.cancel()
            raise ReplyError(f"the reply holds {len(keys)} keys, expected {len(asked)}")
        try:
            deltas = _deltas(delta, own, len(asked))
        except ReplyError:
            self.cancel()
            raise
        for i, (where, got, rows) in enumerate(zip(asked, keys, arrays, strict=True)):
            block = self._blocks[where[0]]
            n, dim = size(self._positions[where]), block.shape[1]
            d = deltas.get(i)
            if d is not None:  # the rows pushed, the reply's at positions d
                at = d
                if rows.shape[0] != at.size or (at.size and (at[0] < 0 or at[-1] >= n)):
                    self.cancel()
                    raise ReplyError(
                        f"key {where[0]!r} server {where[1]}: a delta of {at.size} positions "
                        f"and {rows.shape[0]} rows for {n} rows pushed"
                    )
                n = at.size
            if list(got) != list(where) or rows.shape != (n, dim):
                self.cancel()
                raise ReplyError(
                    f"key {where[0]!r} server {where[1]}: got {got!r:.60} with rows "
                    f"{rows.shape}, expected {n} x {dim}"
                )
            if rows.dtype != block.dtype:
                self.cancel()
                raise ReplyError(f"key {where[0]!r}: rows of {rows.dtype}, expected {block.dtype}")
        for i, (where, rows) in enumerate(zip(asked, arrays, strict=True)):
            block, pos, d = self._blocks[where[0]], self._positions[where], deltas.get(i)
            if d is not None:  # (pushed: 0 + the rows pushed are in place)
                if not d.size:
                    continue
                if isinstance(pos, slice):
                    block[pos][d] = rows
                else:
                    block[pos[d]] = rows
            elif isinstance(pos, slice):  # a run: one copy
                block[pos] = rows
            else:
                block[pos] = rows

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.cancelled:
            self.cancelled, self.reason = True, reason
        self._expected.clear()
        self._own.clear()

    def finish(self) -> None:
        if self.cancelled:
            return
        for item, unique, _ in self._wanted:
            block = self._blocks[item.key]
            given = False  # the block itself goes to one output: the others get copies

            def rows_of(u, b=block, w=unique):
                nonlocal given
                if u is not w:
                    return b[np.searchsorted(w, u)]
                if given:
                    return b.copy()
                given = True
                return b

            for out, ids in zip(item.outs, item.ids, strict=True):
                write_rows(out, ids, rows_of)


def _deltas(delta, own: bool, count: int) -> dict:
    """``{key index: positions}`` of a reply's ``delta`` field (None: no delta); a
    :class:`ReplyError` when it is malformed or answers a request whose rows are not in
    place (``own``)."""
    if delta is None:
        return {}
    if not isinstance(delta, list) or not own:
        raise ReplyError("a delta reply to a request whose pushed rows were not kept")
    found = {}
    for entry in delta:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or type(entry[0]) is not int
            or not 0 <= entry[0] < count
            or not isinstance(entry[1], bytes)
            or len(entry[1]) % 4
        ):
            raise ReplyError(f"bad delta entry {entry!r:.60}")
        at = np.frombuffer(entry[1], "<i4")
        if at.size > 1 and not (at[1:] > at[:-1]).all():
            raise ReplyError("a delta's positions are not increasing")
        found[entry[0]] = at
    return found


# ---------------------------------------------------------------- optimizer states


def dump_states(updater, tables: dict) -> bytes:
    """``updater.dumps()`` (the dense keys' states) with the row-sparse tables' optimizer
    state added: per key its update count, its row ids and each state's rows."""
    import msgpack

    from .optimizer import _wire_key, pack_array

    data = msgpack.unpackb(updater.dumps(), strict_map_key=False)
    rows = []
    for key, table in tables.items():
        if table.state_of is None or not table.states:
            continue
        slots = table.slots
        states = [pack_array(s[slots]) for s in table.states]
        rows.append([_wire_key(key), updater.counts.get(key, 0), pack_array(table.ids), states])
    data["rows"] = rows
    data["admission"] = [  # its step, when rows changed, and the candidates: what exports,
        # admission and eviction go on from (a table never pushed nor loaded: none)
        [_wire_key(key), table.step, *(pack_array(a) for a in table.bookkeeping())]
        for key, table in tables.items()
        if table.count or table.cand_ids.size or table.step
    ]
    return msgpack.packb(data)


def load_states(updater, tables: dict, blob: bytes, dense: bool = True, like=None) -> None:
    """Load :func:`dump_states`' output: the dense states into ``updater`` (unless ``dense``
    is False: the caller did; ``like``: see :meth:`kvstore.optimizer.Updater.loads`), each
    row-sparse key's state into its table (rows not stored yet are created from the
    initializer; load their values with ``load_rows``), and its bookkeeping. The file is
    checked whole first (:func:`check_states`): a ``ValueError`` changes nothing."""
    apply = check_states(updater, tables, blob)
    if dense:
        updater.loads(blob, like=like)
    apply()


def check_states(updater, tables: dict, blob: bytes):
    """Parse and check :func:`dump_states`' output against ``tables`` and the optimizer,
    changing nothing (a ``ValueError`` saying what does not fit); returns the call that
    loads its row-sparse part (past the checks, only memory can fail it)."""
    import msgpack

    from .optimizer import _from_wire_key, _unpack_states, unpack_array

    _unpack_states(blob)  # the dense part
    try:
        data = msgpack.unpackb(blob, strict_map_key=False)
        entries = [
            (_from_wire_key(k), c, unpack_array(i), [unpack_array(s) for s in states])
            for k, c, i, states in data.get("rows") or []
        ]
        books = [
            (_from_wire_key(k), step, [unpack_array(a) for a in arrays])
            for k, step, *arrays in data.get("admission") or []
        ]
        for what, keys in (("rows", [e[0] for e in entries]), ("admission", [b[0] for b in books])):
            if len(set(keys)) != len(keys):
                raise ValueError(f"a key appears twice in its {what}")
        for _, count, ids, _ in entries:
            if type(count) is not int or not _ids(ids):
                raise ValueError("row states need an update count and increasing int ids")
    except Exception as exc:
        raise ValueError(f"not an optimizer state file written by kvstore: {exc}") from None

    def table_of(key):
        table = tables.get(key)
        if table is None:
            raise ValueError(
                f"the optimizer states hold row-sparse key {key!r}, which is not initialised "
                "here: init it (with a RowSparse) before load_optimizer_states"
            )
        return table

    optimizer = updater.optimizer
    for key, _, ids, states in entries:
        table = table_of(key)
        check_optimizer(optimizer, table.dtype)
        fresh = optimizer.create_state(np.zeros((0, table.dim), table.dtype))
        if len(states) != len(fresh) or any(s.shape != (ids.size, table.dim) for s in states):
            raise ValueError(
                f"the optimizer states of row-sparse key {key!r} do not fit this optimizer "
                f"({len(states)} states of {ids.size} rows; {optimizer.name} keeps "
                f"{len(fresh)} of dim {table.dim}): set the optimizer they were saved with"
            )
        if ids.size and not (0 <= ids[0] and ids[-1] < table.rows):
            raise ValueError(
                f"the optimizer states of row-sparse key {key!r} hold row ids outside "
                f"[0, {table.rows}): they were saved for another table"
            )
    for key, step, arrays in books:
        table_of(key).check_bookkeeping(step, *arrays)

    def apply() -> None:
        for key, count, ids, states in entries:
            table = tables[key]
            table._states_for(optimizer)
            slots = table.slots_of(ids.astype(np.int64))
            for stored, value in zip(table.states, states, strict=True):
                stored[slots] = value
            updater.counts[key] = count
        for key, step, arrays in books:
            tables[key].restore_bookkeeping(step, *arrays)

    return apply


def _ids(a) -> bool:
    """Whether ``a`` is a 1-D array of increasing (so unique) ints."""
    return a.ndim == 1 and a.dtype.kind in "iu" and (a.size < 2 or bool((a[1:] > a[:-1]).all()))


def _steps(a, n: int, high: int, low: int = 0) -> bool:
    """Whether ``a`` is ``n`` ints in ``[low, high]``."""
    return (
        a.ndim == 1
        and a.size == n
        and a.dtype.kind in "iu"
        and (n == 0 or bool(low <= a.min() and a.max() <= high))
    )
