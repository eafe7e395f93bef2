"""The worker-side KVStore API and the single-process stores ``local`` and ``device``.

:class:`KVStore` turns the many call shapes MXNet accepts (one key or a list; one array or
one per device; ``out`` one array or one per device) into a list of :class:`Item` and checks
them against the initialised shapes and dtypes before anything changes. Subclasses implement
``_init``, ``_push``, ``_pull`` on validated items: :class:`LocalStore` here, the distributed
store in :mod:`kvstore.worker`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from . import optimizer as opt
from .arrays import copy_into, device_id, is_array, namespace, reduce_sum
from .compression import Compression, PullCodes
from .protocol import internal
from .sparse import (
    RowSparse,
    check_ids,
    check_optimizer,
    check_since,
    keyed,
    sum_rows,
    write_rows,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Item:
    """One key of one call: its values (one per device) and, for pulls, its outputs."""

    key: int | str
    values: list
    outs: list


class Pending:
    """A call in flight (:meth:`KVStore.pushpull_async`): :meth:`wait` finishes it."""

    __slots__ = ("_finish",)

    def __init__(self, finish):
        self._finish = finish  # a callable, or None once finished

    def wait(self) -> None:
        """Finish the call: its outputs are written, or its error is raised (once)."""
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has finished it."""
        return self._finish is None


@dataclass(frozen=True)
class Meta:
    shape: tuple
    dtype: np.dtype
    sharding: str = "hash"  # a row-sparse key's: "hash" or "range" (kvstore.sparse)


@dataclass
class RowsItem:
    """One row-sparse key of a call: the pushed sum (canonical), or the outputs and the row
    ids wanted for each."""

    key: int | str
    value: RowSparse | None = None
    outs: list | None = None
    ids: list | None = None

    @property
    def values(self) -> list:  # the metrics read an item's first value and output
        return [self.value]


_NUMBER_KINDS = "biufc"  # not object, str, bytes, void (structured) or datetime arrays

# Calls on at least this many keys remember their checked key list (see KVStore._seen).
_SEEN_FROM = 8

# An argument left out, told apart from a None the caller passed (an error, named as such).
_ABSENT = object()


def _norm_key(key):
    if isinstance(key, (bool, np.bool_)) or not isinstance(key, (int, np.integer, str)):
        raise TypeError(f"key {key!r}: keys must be int or str, got {type(key).__name__}")
    return int(key) if isinstance(key, np.integer) else key


def _no_repeats(what: str, keys: list) -> None:
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1}, key=str)
        raise ValueError(f"{what}: duplicate keys in one call: {_few(twice)}")


def _few(keys: list, shown: int = 8) -> str:
    """``keys`` for an error message: the first few, and how many more."""
    text = ", ".join(repr(k) for k in keys[:shown])
    return f"[{text}, ... {len(keys) - shown} more]" if len(keys) > shown else f"[{text}]"


def _as_list(value, what: str, key, role: str = "value") -> list:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError(f"{what}(key={key!r}): empty list of arrays")
    for a in items:
        if isinstance(a, RowSparse):
            give = "value.to_dense()" if role == "value" else "an array of the key's shape"
            raise TypeError(
                f"{what}(key={key!r}): {'' if role == 'value' else f'{role}: '}a "
                "kvstore.RowSparse goes only with a row-sparse key (one initialised with a "
                f"RowSparse); this key is dense: give {give}"
            )
        if not is_array(a):
            got = "None" if a is None else type(a).__name__
            name = "" if role == "value" else f"{role}: "
            raise TypeError(
                f"{what}(key={key!r}): {name}expected a NumPy or CuPy array (or a list of "
                f"them, one per device), got {got}"
            )
        if a.dtype.kind not in _NUMBER_KINDS or a.dtype.fields is not None:
            raise TypeError(
                f"{what}(key={key!r}): dtype {a.dtype} cannot be stored: a KVStore holds "
                "numbers (bool, int, uint, float or complex arrays); convert it first, "
                "e.g. array.astype(np.float32)"
            )
    return items


def _holds_rows(value) -> bool:
    """Whether an init value (one, or one per key) holds a RowSparse."""
    if isinstance(value, RowSparse):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, RowSparse) for v in value)


def _is_id_list(value) -> bool:
    """A plain list of numbers is one set of row ids, not one per output (whole floats are
    ids too, as MXNet's float id arrays are; check_ids refuses the others)."""
    kinds = (int, float, np.integer, np.floating)
    return all(isinstance(v, kinds) and not isinstance(v, bool) for v in value)


class KVStore:
    """The API shared by every store type. Create one with :func:`kvstore.create`.

    >>> import numpy as np, kvstore
    >>> kv = kvstore.create('local')
    >>> kv.init('w', np.zeros(3, np.float32))
    >>> kv.push('w', [np.ones(3), np.ones(3)])
    >>> out = np.empty(3, np.float32); kv.pull('w', out=out); out
    array([2., 2., 2.], dtype=float32)
    """

    OPTIMIZER = "optimizer"  # MXNet's capability name, for is_capable

    def __init__(self, kind: str):
        self._type = kind
        self._meta: dict = {}
        self._key_kind: type | None = None
        self._seen_lists: set = set()  # key lists already checked (see _seen)
        self._compression: Compression | None = None
        self._skipped: set = set()  # row-sparse keys a pull skipped, said once (ignore_sparse)
        self._pushed = False
        self._sparse: dict = {}  # row-sparse keys -> Meta (kvstore.sparse)

    # ---- identity
    @property
    def type(self) -> str:
        return self._type

    @property
    def rank(self) -> int:
        return 0

    @property
    def num_workers(self) -> int:
        return 1

    def barrier(self) -> None:
        """Wait until every worker reaches this point (a no-op in one process)."""

    def join(self) -> int:
        """Call when this worker is out of data (Horovod's ``hvd.join``): until every worker
        has joined, it counts as pushing zeros into every ``dist_sync`` round, so the others
        train on. Returns the rank of the last worker to join (0 in one process).

        >>> kvstore.create('local').join()  # doctest: +SKIP
        0
        """
        return 0

    def close(self) -> None:
        """Release resources; a distributed store also tells the scheduler it is done."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- argument checking
    def _items(self, what: str, keys, values=_ABSENT, outs=_ABSENT, need_init=True) -> list[Item]:
        single = not isinstance(keys, (list, tuple))
        key_list = [keys] if single else list(keys)
        if not key_list:
            raise ValueError(f"{what}: empty list of keys")
        norm = self._seen(key_list)
        if norm is None:
            norm = [_norm_key(k) for k in key_list]
            kinds = {type(k) for k in norm if not internal(k)}
            kinds |= {self._key_kind} if self._key_kind else set()
            if len(kinds) > 1:
                raise TypeError(
                    f"{what}: int and str keys cannot be mixed in one store "
                    f"(store uses {(self._key_kind or type(norm[0])).__name__} keys, "
                    f"got {_few(norm)})"
                )
            _no_repeats(what, norm)
            if len(norm) >= _SEEN_FROM and self._key_kind is not None:
                if len(self._seen_lists) >= 1024:  # key lists that never repeat
                    self._seen_lists.clear()
                self._seen_lists.add(tuple(norm))
        per_key = {}
        for name, given in (("values", values), ("out", outs)):
            if given is _ABSENT:
                per_key[name] = [None] * len(norm)
            elif single:
                per_key[name] = [given]
            else:
                if given is None:
                    raise TypeError(
                        f"{what}(key={norm!r}): expected one array (or a list of arrays, one "
                        f"per device) per key, got None"
                    )
                if not isinstance(given, (list, tuple)) or len(given) != len(norm):
                    n = len(given) if isinstance(given, (list, tuple)) else 1
                    raise ValueError(
                        f"{what}: {len(norm)} keys but {n} {name}; give one "
                        "array (or list of arrays) per key"
                    )
                per_key[name] = list(given)
        items = []
        meta_of, arrays, ndarray = self._meta, self._arrays, np.ndarray
        no_values, no_outs = values is _ABSENT, outs is _ABSENT
        for key, v, o in zip(norm, per_key["values"], per_key["out"], strict=True):
            meta = meta_of.get(key) if need_init else None
            if need_init and meta is None:  # (before the values: a RowSparse's message)
                raise KeyError(f"{what}(key={key!r}): key was never initialised; call init first")
            # the common case at once (what _arrays takes first): one host array of the key's
            # own shape and dtype
            if meta is not None and type(v) is ndarray and v.dtype == meta.dtype:
                given = [v] if v.shape == meta.shape else arrays(v, meta, what, key, "value")
            else:
                given = [] if no_values else arrays(v, meta, what, key, "value")
            if meta is not None and type(o) is ndarray and o.dtype == meta.dtype:
                wanted = [o] if o.shape == meta.shape else arrays(o, meta, what, key, "out")
            else:
                wanted = [] if no_outs else arrays(o, meta, what, key, "out")
            items.append(Item(key, given, wanted))
        return items

    def _seen(self, key_list: list) -> list | None:
        """``key_list`` when a call already checked these keys (every one of the store's key
        type, none twice): a training loop's list of many keys is checked once, not every
        step. Exact types only, so a bool or NumPy integer (equal to an int in a set) is
        checked, and refused or converted, every time."""
        if len(key_list) < _SEEN_FROM or self._key_kind is None:
            return None
        if set(map(type, key_list)) != {self._key_kind}:
            return None
        return key_list if tuple(key_list) in self._seen_lists else None

    def _arrays(self, given, meta, what: str, key, role: str) -> list:
        """The arrays of one key of a call, checked against the key's ``meta`` (when known).
        The common case is taken at once: one host array of the key's own shape and dtype
        (a number dtype: ``init`` checked it)."""
        if (
            type(given) is np.ndarray
            and meta is not None
            and given.dtype == meta.dtype
            and given.shape == meta.shape
        ):
            return [given]
        arrays = _as_list(given, what, key, role)
        if meta is not None:
            for a in arrays:
                if a.shape != meta.shape or a.dtype != meta.dtype:
                    self._check(what, key, a, meta, role)
        return arrays

    @staticmethod
    def _check(what, key, array, meta: Meta, role: str) -> None:
        if array.shape != meta.shape:
            raise ValueError(
                f"{what}(key={key!r}): {role} shape {tuple(array.shape)} does not "
                f"match the initialised shape {meta.shape}"
            )
        src, dst = (array.dtype, meta.dtype) if role == "value" else (meta.dtype, array.dtype)
        if src != dst and not np.can_cast(src, dst, "same_kind"):
            raise TypeError(
                f"{what}(key={key!r}): {role} dtype {array.dtype} does not match "
                f"the initialised dtype {meta.dtype} (no same-kind cast)"
            )

    # ---- public API
    def init(self, key, value, members=None) -> None:
        """Initialise each key once with a value; every worker calls it (rank 0's value wins).
        A :class:`~kvstore.sparse.RowSparse` value makes a row-sparse key (see
        :meth:`init_rows`).

        ``members`` (a list of ranks, this worker's among them) makes a group's keys, as
        Horovod's process sets need: only the members call ``init`` (no barrier with the
        others), the first to reach a server creates a key (give every member the same
        value: a row-sparse key's shape, dtype and init spec too), and only they push and
        pull it; a round is complete once every member pushed.
        In an elastic job the members are slots (``kv.rank`` is renumbered at every change),
        and a newcomer taking a slot is not a member of the groups made before it came.

        >>> kv.init("grad.ps1", np.zeros(4), members=[0, 2])  # on ranks 0 and 2  # doctest: +SKIP
        """
        for k in key if isinstance(key, (list, tuple)) else [key]:
            if internal(k):
                raise ValueError(
                    f"init(key={k!r}): keys that start with 'kvstore.' are the library's own "
                    "(no optimizer updates them); choose another name"
                )
        self._init_any(key, value, members)

    def _init_any(self, key, value, members=None) -> None:
        """``init`` of any key, the library's own (``kvstore.*``) too."""
        group = self._group(members)
        if _holds_rows(value):
            self._split_rows("init", key, value, None, group)
            return
        items = self._items("init", key, value, need_init=False)
        for item in items:
            if item.key in self._meta:
                # MXNet's stores refuse it too ("duplicate init of key"); a new value goes in
                # with push (no optimizer: the pushed sum is stored) or broadcast to new keys
                raise ValueError(
                    f"init(key={item.key!r}): duplicate init of key: it is already "
                    "initialised (init once per key, as in MXNet)"
                )
            shapes = {tuple(a.shape) for a in item.values}
            if len(shapes) > 1:
                raise ValueError(f"init(key={item.key!r}): arrays of different shapes {shapes}")
        if group is None:
            self._init(items)
        else:
            self._init(items, group)
        for item in items:
            first = item.values[0]
            self._meta[item.key] = Meta(tuple(first.shape), np.dtype(first.dtype))
            if not internal(item.key):
                self._key_kind = type(item.key)

    def _group(self, members) -> tuple | None:
        if members is None:
            return None
        ranks = list(members) if isinstance(members, (list, tuple)) else None
        count, mine = self._member_space()
        if (
            not ranks
            or any(type(r) is not int or not 0 <= r < count for r in ranks)
            or len(set(ranks)) != len(ranks)
        ):
            raise ValueError(
                f"init: members= must be distinct ranks in [0, {count}), got {members!r:.80}"
            )
        if mine not in ranks:
            raise ValueError(
                f"init: worker {mine} is not in members={sorted(ranks)}: only the members "
                "of a group initialise its keys"
            )
        return tuple(sorted(ranks))

    def _member_space(self) -> tuple[int, int]:
        """(how many, mine): what a group's ``members`` name (ranks; slots in an elastic job)."""
        return self.num_workers, self.rank

    def push(self, key, value, priority: int = 0) -> None:
        """Push one array or one per device per key; the arrays of a key are summed first."""
        if self._sparse and self._names_rows(key):
            self._split_rows("push", key, value, None)
            return
        items = self._items("push", key, value)
        self._pushed = True
        self._push(items)

    def pull(self, key, out=None, priority: int = 0, ignore_sparse: bool = True) -> None:
        """Copy each key's current value into ``out`` (one array or one per device).
        A row-sparse key pulled into dense arrays gets every row (a small table); into
        :class:`~kvstore.sparse.RowSparse` outputs, as MXNet, it is skipped with a warning
        (``ignore_sparse=True``, the default: use :meth:`row_sparse_pull`), or gets every
        row (``ignore_sparse=False``)."""
        if out is None:
            raise ValueError("pull: out= is required (one array, or one per device, per key)")
        if self._sparse and self._names_rows(key):
            kept = self._without_sparse_outs(key, out) if ignore_sparse else None
            if kept is not None:
                if not kept:
                    return
                key, out = [k for k, _ in kept], [o for _, o in kept]
            self._split_rows("pull", key, None, out)
            return
        self._pull(self._items("pull", key, outs=out))

    def _without_sparse_outs(self, key, out) -> list | None:
        """``pull``'s ``(key, out)`` pairs less the row-sparse keys pulled into RowSparse
        outputs, which MXNet's ``ignore_sparse=True`` skips, saying so; None when there is
        no pair per key (the pull refuses it, in its own words)."""
        single = not isinstance(key, (list, tuple))
        keys, outs = ([key], [out]) if single else (list(key), out)
        if not isinstance(outs, (list, tuple)) or len(outs) != len(keys):
            return None
        _no_repeats("pull", [_norm_key(k) for k in keys])
        kept = []
        for k, o in zip(keys, outs, strict=True):
            given = list(o) if isinstance(o, (list, tuple)) else [o]
            name = _norm_key(k)
            if name in self._sparse and given and all(isinstance(g, RowSparse) for g in given):
                if name not in self._skipped:  # (said once a key)
                    self._skipped.add(name)
                    log.warning(
                        "pull(key=%r) into a RowSparse skipped (ignore_sparse=True, as MXNet): "
                        "use row_sparse_pull(key, out, row_ids), or pull(..., "
                        "ignore_sparse=False) for every row",
                        name,
                    )
                continue
            kept.append((k, o))
        return kept

    def pushpull(self, key, value, out=None, priority: int = 0) -> None:
        """``push`` then ``pull``; with ``out=None`` the result is written back into ``value``.
        For a row-sparse key, the rows pushed are pulled back (into ``value`` itself when
        ``out`` is None)."""
        if self._sparse and self._names_rows(key):
            self._split_rows("pushpull", key, value, value if out is None else out)
            return
        items = self._items("pushpull", key, value, value if out is None else out)
        self._pushed = True
        self._pushpull(items)

    def pushpull_async(self, key, value, out=None) -> Pending:
        """Start a ``pushpull`` and return at once; ``wait()`` on the result finishes it
        (writes ``out``) and raises its error, if any. Until then, leave ``value`` unchanged
        and do not read ``out``. Calls in flight complete in any order; every other call
        on the store (a barrier, a pull) also waits for them.

        >>> pending = kv.pushpull_async('w', grad, out=w)  # doctest: +SKIP
        >>> ...  # compute the next bucket
        >>> pending.wait()  # doctest: +SKIP
        """
        if self._sparse and self._names_rows(key):
            raise TypeError(
                f"pushpull_async(key={key!r}): names a row-sparse key, which it does not "
                "take; use pushpull (one message per server as well)"
            )
        items = self._items("pushpull", key, value, value if out is None else out)
        self._pushed = True
        return self._pushpull_start(items)

    def _pushpull_start(self, items) -> Pending:
        self._pushpull(items)  # one process: done at once
        return Pending(None)

    def broadcast(self, key, value, out, priority: int = 0) -> None:
        """Initialise each key with ``value`` (rank 0's) and pull it into ``out`` everywhere
        (a row-sparse key: every row, into a RowSparse too)."""
        self.init(key, value)
        self.pull(key, out=out, ignore_sparse=False)

    def set_gradient_compression(self, params: dict) -> None:
        """``{'type': '2bit', 'threshold': 0.5}`` or ``{'type': '1bit'}``: every push from now
        on is compressed (with error feedback from zero), whatever keys exist already; as in
        MXNet, whose nightly test sets it after other keys were initialised and pushed.
        Every worker of a job must set the same.

        ``'pull': True`` compresses the pulls too (as BytePS does; MXNet compresses pushes
        only): the servers quantise each round's sum once, with their own error feedback,
        and every worker reads the same dequantised floats. For sums of gradients (no
        optimizer on the servers) in ``dist_sync``: a value that init or an optimizer left
        is never quantised, and ``set_optimizer`` is refused while it is on."""
        compression = Compression.from_params(params)
        if compression.pull:
            self._check_pull_compression()
        self._compression = compression
        self._residuals = {}
        self._uncompressed: set = set()  # row-sparse keys told to travel as they are

    def _check_pull_compression(self) -> None:
        """Raise where compressed pulls do not apply: a store whose updates run in it."""
        if getattr(self, "_optimizer", None) is not None or getattr(self, "_updater", None):
            raise ValueError(
                "compressed pulls ({'pull': True}) send the sum of a round's gradients "
                "quantised; with an optimizer in the store a pull reads weights, which "
                "quantising would destroy: drop 'pull', or update the weights on the workers"
            )

    def _refuse_pull_compression(self, what: str) -> None:
        if self._compression is not None and self._compression.pull:
            raise ValueError(
                f"{what}: gradient compression with 'pull': True is on, and compressed pulls "
                "carry sums of gradients, not weights; set the optimizer first, without "
                "'pull' in set_gradient_compression"
            )

    def row_sparse_pull(self, key, out=None, priority: int = 0, row_ids=None) -> None:
        """Pull only the rows ``row_ids`` of each key into ``out``; the other rows of ``out``
        become 0 (the dense form of MXNet's RowSparseNDArray result). ``row_ids`` is one
        1-D integer array for every ``out`` of a key, or a list of them, one per ``out``;
        ids need not be unique nor sorted. With a list of keys, one such entry per key.

        >>> kv.row_sparse_pull('emb', out=rows, row_ids=np.array([0, 2]))  # doctest: +SKIP
        """
        if out is None:
            raise ValueError("row_sparse_pull: out= is required (one array, or one per device)")
        if row_ids is None:
            raise ValueError("row_sparse_pull: row_ids= is required (a 1-D array of row ids)")
        if self._sparse and self._names_rows(key):
            self._row_sparse_pull_rows(key, out, row_ids)
            return
        items = self._items("row_sparse_pull", key, outs=out)
        single = not isinstance(key, (list, tuple))
        per_key = [row_ids] if single else row_ids
        if not single and (not isinstance(row_ids, (list, tuple)) or len(row_ids) != len(items)):
            raise ValueError("row_sparse_pull: with a list of keys, give one row_ids per key")
        full = []
        for item in items:
            meta = self._meta[item.key]
            if len(meta.shape) < 1:
                raise ValueError(f"row_sparse_pull(key={item.key!r}): a 0-d value has no rows")
            full.append(namespace(item.outs[0]).empty(meta.shape, meta.dtype))
        self.pull([item.key for item in items], out=full, priority=priority)
        for item, value, ids in zip(items, full, per_key, strict=True):
            plain = isinstance(ids, (list, tuple)) and not _is_id_list(ids)
            id_list = list(ids) if plain else [ids]
            if len(id_list) == 1:
                id_list = id_list * len(item.outs)
            if len(id_list) != len(item.outs):
                raise ValueError(
                    f"row_sparse_pull(key={item.key!r}): {len(id_list)} row_ids for "
                    f"{len(item.outs)} outputs; give one, or one per output"
                )
            for target, rows in zip(item.outs, id_list, strict=True):
                rows = check_ids("row_sparse_pull", item.key, rows, value.shape[0])
                xp = namespace(target)
                index = xp.asarray(np.unique(rows))
                target[...] = 0
                target[index] = value[index]

    # ---- row-sparse keys (kvstore.sparse)
    def _names_rows(self, key) -> bool:
        keys = key if isinstance(key, (list, tuple)) else [key]
        return any(_norm_key(k) in self._sparse for k in keys)

    def _split_rows(self, what: str, key, value, out, members=None) -> None:
        """A call naming row-sparse keys: the dense keys go through the dense path, the
        row-sparse ones through ``_init_rows`` / ``_push_rows`` / ``_pull_rows``
        (``members``: an init's group, checked)."""
        single = not isinstance(key, (list, tuple))
        keys = [key] if single else list(key)
        values = [value] if single else value
        outs = [out] if single else out
        for given, name in ((values, "values"), (outs, "out")):
            if given is not None and (
                not isinstance(given, (list, tuple)) or len(given) != len(keys)
            ):
                raise ValueError(f"{what}: {len(keys)} keys but not one {name} entry per key")
        _no_repeats(what, [_norm_key(k) for k in keys])
        rows, dense = [], []
        for i, k in enumerate(keys):
            k = _norm_key(k)
            v = None if values is None else values[i]
            sparse = _holds_rows(v) if what == "init" else k in self._sparse
            (rows if sparse else dense).append((k, v, None if outs is None else outs[i]))
        if dense:
            ks, vs, os_ = ([d[j] for d in dense] for j in range(3))
            if what == "init":
                self._init_any(ks, vs, members)
            elif what == "push":
                self.push(ks, vs)
            elif what == "pull":
                self.pull(ks, out=os_)
            else:
                self.pushpull(ks, vs, out=os_)
        if what == "init":
            self._init_row_keys([k for k, _, _ in rows], [v for _, v, _ in rows], members)
            return
        if what == "pull":  # a whole small table, as MXNet's pull of a row_sparse key
            if not rows:  # (skipped: ignore_sparse)
                return
            ids = []
            for k, _, _ in rows:
                n = self._sparse[k].shape[0]
                if n * self._sparse[k].shape[1] > 1 << 28:
                    raise ValueError(
                        f"pull(key={k!r}): a row-sparse key of {n} rows is not pulled whole; "
                        "use row_sparse_pull(key, out, row_ids) for the rows you need"
                    )
                ids.append(np.arange(n))
            outs_ = [o for _, _, o in rows]
            self._row_sparse_pull_rows([k for k, _, _ in rows], outs_, ids, "pull")
            return
        pushed = [self._rows_value(what, k, v) for k, v, _ in rows]
        items = [RowsItem(k, p) for (k, _, _), p in zip(rows, pushed, strict=True)]
        self._pushed = True
        if what == "push":
            self._push_rows(items)
            return
        pulls = self._rows_pull_items(
            [k for k, _, _ in rows], [o for _, _, o in rows], [p.indices for p in pushed], what
        )
        for item, pull in zip(items, pulls, strict=True):
            item.outs = pull.outs  # what the metrics count as pulled
        self._pushpull_rows(items, pulls)

    def _pushpull_rows(self, items, pulls) -> None:
        """Push ``items``, then pull the rows each pushed into ``pulls``' outputs."""
        self._push_rows(items)
        self._pull_rows(pulls)

    def _rows_value(self, what: str, key, value) -> RowSparse:
        """The canonical sum of a key's pushed values (one per device)."""
        meta = self._sparse[key]
        if self._compression is not None and key not in self._uncompressed:
            self._uncompressed.add(key)  # (said once a key)
            log.warning(
                "gradient compression applies to dense keys: row-sparse key %r travels "
                "uncompressed (its pushes carry only the rows touched)",
                key,
            )
        optimizer = getattr(self, "_optimizer", None)
        if optimizer is not None:  # refused here, before anything is sent
            try:
                check_optimizer(optimizer, meta.dtype)
            except ValueError as exc:
                raise ValueError(f"{what}(key={key!r}): {exc}") from None
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values:
            raise ValueError(f"{what}(key={key!r}): empty list of values")
        checked = []
        for v in values:
            if is_array(v) and tuple(v.shape) == meta.shape:
                v = RowSparse.from_dense(v)  # a dense gradient: its non-zero rows
            if not isinstance(v, RowSparse):
                raise TypeError(
                    f"{what}(key={key!r}): a row-sparse key takes a kvstore.sparse.RowSparse "
                    f"(or a dense array of its shape {meta.shape}), got {type(v).__name__}"
                )
            if v.shape != meta.shape:
                raise ValueError(
                    f"{what}(key={key!r}): value shape {v.shape} does not match the "
                    f"initialised shape {meta.shape}"
                )
            if v.dtype != meta.dtype and not np.can_cast(v.dtype, meta.dtype, "same_kind"):
                raise TypeError(
                    f"{what}(key={key!r}): value dtype {v.dtype} does not match the "
                    f"initialised dtype {meta.dtype} (no same-kind cast)"
                )
            checked.append(v)
        return sum_rows(checked, meta.shape, meta.dtype, zero=False)

    def init_rows(self, key, value) -> None:
        """Initialise row-sparse keys: ``value`` a :class:`~kvstore.sparse.RowSparse` holding
        the rows to start with (often none: ``RowSparse.empty(shape, init=...)``); every
        other row is created when first pushed, from ``value.init`` (default zeros).

        >>> from kvstore.sparse import RowSparse, uniform
        >>> init = uniform(-0.1, 0.1, seed=1)
        >>> kv.init('emb', RowSparse.empty((10**9, 64), init=init))  # doctest: +SKIP
        """
        self._init_row_keys(key, value, None)

    def _init_row_keys(self, key, value, members) -> None:
        single = not isinstance(key, (list, tuple))
        keys = [_norm_key(k) for k in ([key] if single else key)]
        values = [value] if single else list(value)
        if len(values) != len(keys):
            raise ValueError(f"init: {len(keys)} keys but {len(values)} values")
        kinds = {type(k) for k in keys} | ({self._key_kind} if self._key_kind else set())
        if len(kinds) > 1:
            raise TypeError(f"init: int and str keys cannot be mixed in one store, got {keys}")
        items = []
        for k, v in zip(keys, values, strict=True):
            if k in self._meta:
                raise ValueError(
                    f"init(key={k!r}): duplicate init of key: it is already initialised "
                    "(init once per key, as in MXNet)"
                )
            if not isinstance(v, RowSparse):
                raise TypeError(f"init(key={k!r}): expected a kvstore.sparse.RowSparse")
            if v.dtype.kind not in "fc":
                raise TypeError(f"init(key={k!r}): a row-sparse key holds floats, got {v.dtype}")
            canonical = v.canonical()
            init = keyed(v.init, k)  # (a seed left to the key: the key's own)
            items.append(RowsItem(k, RowSparse(canonical.indices, canonical.data, v.shape, init)))
        self._init_rows(items, members)
        for item in items:
            v = item.value
            # a row-sparse key's Meta: shape (rows, dim); the servers keep its init spec
            sharding = (v.init or {}).get("sharding", "hash")
            meta = Meta(v.shape, np.dtype(v.dtype), sharding)
            self._meta[item.key] = self._sparse[item.key] = meta
            self._key_kind = type(item.key)

    def _row_sparse_pull_rows(self, key, out, row_ids, what: str = "row_sparse_pull") -> None:
        single = not isinstance(key, (list, tuple))
        keys = [_norm_key(k) for k in ([key] if single else key)]
        outs = [out] if single else list(out)
        ids = [row_ids] if single else row_ids
        if not single and (not isinstance(ids, (list, tuple)) or len(ids) != len(keys)):
            raise ValueError("row_sparse_pull: with a list of keys, give one row_ids per key")
        if len(outs) != len(keys):
            raise ValueError("row_sparse_pull: with a list of keys, give one out per key")
        _no_repeats("row_sparse_pull", keys)
        self._pull_rows(self._rows_pull_items(keys, outs, ids, what))

    def _rows_pull_items(self, keys, outs, ids, what: str = "row_sparse_pull") -> list:
        """Checked :class:`RowsItem` s of a row-sparse pull: one list of outputs and one id
        array per output, per key."""
        items = []
        for k, o, r in zip(keys, outs, ids, strict=True):
            meta = self._sparse.get(k)
            if meta is None:
                if k in self._meta:
                    raise TypeError(
                        f"{what}(key={k!r}): a list of keys mixes row-sparse and "
                        "dense keys; pull them in separate calls"
                    )
                raise KeyError(f"{what}(key={k!r}): key was never initialised")
            key_outs = list(o) if isinstance(o, (list, tuple)) else [o]
            for target in key_outs:
                if isinstance(target, RowSparse):
                    if target.shape != meta.shape:
                        raise ValueError(
                            f"{what}(key={k!r}): out shape {target.shape} does not "
                            f"match the initialised shape {meta.shape}"
                        )
                elif not is_array(target) or tuple(target.shape) != meta.shape:
                    raise TypeError(
                        f"{what}(key={k!r}): out must be a kvstore.sparse.RowSparse "
                        f"or an array of the key's shape {meta.shape}"
                    )
            id_list = list(r) if isinstance(r, (list, tuple)) and not _is_id_list(r) else [r]
            if len(id_list) == 1:
                id_list = id_list * len(key_outs)
            if len(id_list) != len(key_outs):
                raise ValueError(
                    f"{what}(key={k!r}): {len(id_list)} row_ids for "
                    f"{len(key_outs)} outputs; give one, or one per output"
                )
            checked = [check_ids(what, k, x, meta.shape[0]) for x in id_list]
            items.append(RowsItem(k, outs=key_outs, ids=checked))
        return items

    def save_rows(self, key, since: int | None = None) -> tuple[RowSparse, int]:
        """The rows of a row-sparse key, and the step now (a step is a round applied on the
        servers). ``since=None`` (the default): every stored row, a checkpoint; ``since=s``:
        only the rows changed after step ``s`` (rows created count), to export what changed
        in between (online training). Includes every push this worker made before the call.
        A ``since`` past the current step is refused (a restarted store counts from 0 unless
        ``load_rows`` or ``load_optimizer_states`` restored the step). Under ``dist_async``
        the servers' steps can differ for a moment; the step returned is the smallest, so an
        export from it may repeat a few rows but never misses one.

        >>> rows, step = kv.save_rows('emb')  # doctest: +SKIP
        >>> later, step = kv.save_rows('emb', since=step)  # doctest: +SKIP
        >>> kv2.load_rows('emb', rows, step=step)  # doctest: +SKIP
        """
        k = _norm_key(key)
        if k not in self._sparse:
            raise KeyError(f"save_rows(key={k!r}): not a row-sparse key (init it with a RowSparse)")
        if since is not None and (
            isinstance(since, bool) or not isinstance(since, (int, np.integer)) or since < 0
        ):
            raise ValueError(
                f"save_rows(key={k!r}): since must be None or a step >= 0, got {since!r}"
            )
        return self._save_rows(k, None if since is None else int(since))

    def load_rows(self, key, value: RowSparse, step: int | None = None) -> None:
        """Set rows of a row-sparse key (from :meth:`save_rows`), bypassing the optimizer
        (each row once; the optimizer state of a row already stored stays as it is: load it
        with :meth:`load_optimizer_states`).
        ``step`` (the one ``save_rows`` returned): the key's steps continue from there, so
        ``save_rows(key, since=step)`` keeps working after a restart."""
        k = _norm_key(key)
        if k not in self._sparse:
            raise KeyError(f"load_rows(key={k!r}): not a row-sparse key (init it with a RowSparse)")
        meta = self._sparse[k]
        if not isinstance(value, RowSparse) or value.shape != meta.shape:
            got = f"shape {value.shape}" if isinstance(value, RowSparse) else type(value).__name__
            raise ValueError(
                f"load_rows(key={k!r}): expected a RowSparse of shape {meta.shape}, got {got}"
            )
        if step is not None and (
            isinstance(step, bool)
            or not isinstance(step, (int, np.integer))
            or not 0 <= step < 2**31
        ):
            raise ValueError(
                f"load_rows(key={k!r}): step must be None or in [0, 2**31), got {step!r}"
            )
        ids = np.sort(value.indices)
        again = ids[1:][ids[1:] == ids[:-1]]
        if again.size:  # a push sums repeats; a load sets rows: which value would be meant?
            raise ValueError(
                f"load_rows(key={k!r}): row id {int(again[0])} is given more than once; "
                "give each row once (save_rows does)"
            )
        c = value.canonical()
        rows = RowSparse(c.indices, c.data.astype(meta.dtype, copy=False), meta.shape)
        self._load_rows(k, rows, None if step is None else int(step))

    def server_stats(self) -> list[dict]:
        """Each server's memory and its share of every row-sparse key, to watch a table
        grow: ``[{"server": s, "process": the server answering for s, "rss": its bytes
        resident, "rows": {key: {"rows": rows stored, "bytes": bytes held (the rows,
        optimizer state, index)}}}]``. With replicas, after a failover, the server acting for
        a dead one answers for it too (``process``; count its ``rss`` once), and a server's
        ``rss`` includes the copies it keeps. A local store is its own server: one entry,
        this process.

        >>> sum(s["rows"]["emb"]["rows"] for s in kv.server_stats())  # doctest: +SKIP
        """
        from .metrics import resident_bytes

        tables = getattr(self, "_tables", {})
        rows = {k: {"rows": len(t), "bytes": t.nbytes} for k, t in tables.items()}
        return [{"server": 0, "process": 0, "rss": resident_bytes(), "rows": rows}]

    def is_capable(self, capability: str) -> bool:
        """MXNet's capability query: ``'optimizer'`` (updates on the store) is True."""
        if isinstance(capability, str) and capability.lower() == KVStore.OPTIMIZER:
            return True
        raise ValueError(f"Unknown capability: {capability}")

    # ---- MXNet's underscore methods, used by Module, Gluon's Trainer and MXNet's own tests
    def _barrier(self) -> None:
        """MXNet's name for :meth:`barrier`."""
        self.barrier()

    def _set_updater(self, updater) -> None:
        """MXNet's name for ``set_updater(updater)``: ``updater(key, grad, stored)`` updates
        ``stored`` in place on every push (local stores; a distributed store refuses it)."""
        self.set_updater(updater)

    # MXNet's command heads (kvstore.py: _get_kvstore_server_command_type)
    _COMMANDS = {0: "kController", 1: "kSetMultiPrecision", 2: "kStopServer", 3: "kSyncMode"}
    _COMMANDS.update({4: "kSetGradientCompression", 5: "kSetProfilerParams"})

    def _send_command_to_servers(self, head: int, body) -> None:
        """MXNet's server commands, where they mean something here; returns when done.

        - 0 (kController): ``body`` is an optimizer (a :class:`~kvstore.optimizer.Optimizer`,
          its spec dict, or that spec as JSON): the same as ``set_optimizer``. MXNet sends a
          pickle here; kvstore never unpickles, so a pickled body is refused.
        - 1 (kSetMultiPrecision): the optimizer set last gets ``multi_precision=True``.
        - 3 (kSyncMode): nothing to do; the store type decides (``dist_sync``/``dist_async``).
        - 4 (kSetGradientCompression): ``body`` a dict (or JSON) as ``set_gradient_compression``.
        - 2 (kStopServer), 5 (kSetProfilerParams): not supported (servers stop when every
          worker has closed its store).
        """
        import json

        name = self._COMMANDS.get(head)
        if name is None:
            raise ValueError(f"_send_command_to_servers: unknown command head {head!r}")
        if isinstance(body, bytes):
            body = body.decode("utf-8", "replace")
        if isinstance(body, str) and body.strip().startswith(("{", "[")):
            body = json.loads(body)
        if name == "kSyncMode":
            return
        if name == "kController":
            if isinstance(body, dict):
                body = opt.from_spec(body)
            if not isinstance(body, opt.Optimizer):
                raise TypeError(
                    "_send_command_to_servers(0, body): body must be a kvstore optimizer or "
                    "its spec ({'name': ..., 'params': {...}}); a pickled optimizer is never "
                    "accepted (no pickle crosses the network)"
                )
            self.set_optimizer(body)
        elif name == "kSetMultiPrecision":
            current = getattr(self, "_optimizer", None)
            if current is None:
                raise ValueError("kSetMultiPrecision: set an optimizer first")
            current.multi_precision = True
            self.set_optimizer(current)
        elif name == "kSetGradientCompression":
            if not isinstance(body, dict):
                raise TypeError("kSetGradientCompression: body must be a dict (or its JSON)")
            self.set_gradient_compression(body)
        else:
            raise ValueError(f"_send_command_to_servers: {name} ({head}) is not supported")

    # ---- to implement
    def _init(self, items, members=None):
        raise NotImplementedError

    def _push(self, items):
        raise NotImplementedError

    def _pull(self, items):
        raise NotImplementedError

    def _init_rows(self, items, members=None):
        raise NotImplementedError

    def _push_rows(self, items):
        raise NotImplementedError

    def _pull_rows(self, items):
        raise NotImplementedError

    def _save_rows(self, key, since: int | None):
        raise NotImplementedError

    def _load_rows(self, key, value, step: int | None):
        raise NotImplementedError

    def _pushpull(self, items):
        self._push(items)
        self._pull(items)


class LocalStore(KVStore):
    """``local`` (reduce in host memory) and ``device`` (reduce on the arrays' own device)."""

    def __init__(self, kind: str = "local"):
        super().__init__(kind)
        self._on_device = kind == "device"
        self._store: dict = {}
        self._updater = None
        self._residuals: dict = {}
        self._pull_codes = PullCodes()  # compressed pulls, quantised lazily as on the servers
        self._pushes: dict = {}  # key -> the values its last push summed (compressed pulls)

    def set_gradient_compression(self, params: dict) -> None:
        super().set_gradient_compression(params)
        self._pull_codes = PullCodes()

    def _init(self, items, members=None):  # one worker: a group of it is every worker
        for item in items:
            first = item.values[0]
            target = device_id(first) if self._on_device else -1
            stored = reduce_sum([first], first.dtype, on_device=target >= 0)
            self._store[item.key] = stored

    def _reduce(self, item):
        stored = self._store[item.key]
        values = item.values
        if self._compression is not None:
            values = [
                self._compression.roundtrip(self._residuals, (item.key, i), v)
                for i, v in enumerate(values)
            ]
        return reduce_sum(values, stored.dtype, on_device=self._on_device)

    def _push(self, items):
        merged = [self._reduce(item) for item in items]
        for item, grad in zip(items, merged, strict=True):
            stored = self._store[item.key]
            if device_id(grad) != device_id(stored):
                moved = namespace(stored).empty_like(stored)
                copy_into(moved, grad)
                grad = moved
            if self._updater is None:
                copy_into(stored, grad)
                self._pull_codes.summed(item.key)
                self._pushes[item.key] = len(item.values)
            else:
                self._updater(item.key, grad, stored)

    def _pull(self, items):
        codec = self._compression if self._compression and self._compression.pull else None
        for item in items:
            value = self._store[item.key]
            if codec is not None:  # what a pull through the servers reads (server.py _coded)
                codes = self._pull_codes.codes(
                    item.key, value.reshape(-1), codec, self._pushes.get(item.key, 1)
                )
                if codes is not None:
                    decoded = codec.decode(*codes, value.size, value.dtype.type)
                    value = decoded.reshape(value.shape)
            for out in item.outs:
                copy_into(out, value)

    # ---- optimizer
    def set_optimizer(self, optimizer: opt.Optimizer) -> None:
        """Apply ``optimizer`` in the store on every push: ``w = opt(w, sum_of_grads)``."""
        if not isinstance(optimizer, opt.Optimizer):
            raise TypeError(
                f"set_optimizer: expected a kvstore.optimizer.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        self._refuse_pull_compression("set_optimizer")
        self._updater = opt.Updater(optimizer)
        self._optimizer = optimizer

    def set_updater(self, updater) -> None:
        """Use ``updater(key, grad, weight)`` (updating ``weight`` in place) on every push."""
        if not callable(updater):
            raise TypeError("set_updater: expected a callable updater(key, grad, weight)")
        self._refuse_pull_compression("set_updater")
        self._updater = updater

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        from .sparse import dump_states

        updater = self._require_updater("save_optimizer_states")
        with open(fname, "wb") as f:
            f.write(dump_states(updater, getattr(self, "_tables", {})))

    def load_optimizer_states(self, fname: str) -> None:
        updater = self._require_updater("load_optimizer_states")
        with open(fname, "rb") as f:
            blob = f.read()
        from .sparse import load_states  # (with the row-sparse keys' states, all checked first)

        load_states(updater, getattr(self, "_tables", {}), blob, like=self._store)

    def _require_updater(self, what: str) -> opt.Updater:
        if not isinstance(self._updater, opt.Updater):
            raise ValueError(f"{what}: no optimizer state; call set_optimizer first")
        return self._updater

    # ---- row-sparse keys: a RowTable per key (kvstore.sparse), updated lazily
    def _init_rows(self, items, members=None):  # (one worker: every group is all of it)
        from .sparse import RowTable

        tables = self.__dict__.setdefault("_tables", {})
        for item in items:
            v = item.value
            table = RowTable(v.shape[1], v.dtype, v.init, v.shape[0])
            table.assign(v.indices, v.data)
            tables[item.key] = table

    def _push_rows(self, items):
        for item in items:
            table = self._tables[item.key]
            value = item.value  # as a server's round: 0 + the push (-0.0 is 0.0)
            value = RowSparse(value.indices, np.add(table.dtype.type(0), value.data), value.shape)
            if self._updater is None:
                table.apply(value.indices, value.data)
                continue
            if not isinstance(self._updater, opt.Updater):
                raise ValueError(
                    f"push(key={item.key!r}): a set_updater callable cannot update a "
                    "row-sparse key; use set_optimizer"
                )
            up = self._updater
            t = up.counts[item.key] = up.counts.get(item.key, 0) + 1
            up.num_update = max(up.num_update, t)
            lr = up.optimizer.learning_rate(up.num_update)
            table.apply(value.indices, value.data, up.optimizer, t, lr)

    def _pull_rows(self, items):
        for item in items:
            table = self._tables[item.key]
            for out, ids in zip(item.outs, item.ids, strict=True):
                write_rows(out, ids, table.read)

    def _save_rows(self, key, since: int | None):
        table = self._tables[key]
        check_since(key, since, table.step)
        ids, rows = table.changed_since(since)
        return RowSparse(ids, rows, self._sparse[key].shape), table.step

    def _load_rows(self, key, value, step: int | None):
        table = self._tables[key]
        if step is not None:
            table.restore_step(step)
        table.assign(value.indices, value.data)
