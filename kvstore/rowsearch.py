"""The loops over every pushed row id: a worker's split of them by server, a server's check
of them, its search for their rows and its write of a round's push into them.

At dim 16 a server spent about a quarter of its time on the check and search (a push of
2,048 rows: five NumPy passes to check the ids, a binary search of the table for each), and
a third once the scatter of the rows and the marking of their step are counted; a worker a
tenth of its own on the split. The C module ``kvstore._rowsearch``, built by ``pip install``
when a C compiler is there, does each in one pass (``assign``: the search, the rows and their
steps together); this module's NumPy code is the reference it is tested against and what
runs without it (``FAST`` says which; a function's ``fast`` picks one, by default ``FAST``).
The answers are the same.

>>> import numpy as np
>>> stored, slots = np.array([3, 8, 20]), np.array([2, 0, 1], np.int32)
>>> found, where = find(stored, slots, np.array([8, 9, 20]))
>>> found.tolist(), where.tolist()
([True, False, True], [0, -1, 1])
>>> check(np.array([1, 5]), 10, 1, 0), check(np.array([5, 1]), 10, 1, 0)
(0, 1)
>>> [p.tolist() for p in split(np.arange(8), 2)]
[[0, 2, 3, 6, 7], [1, 4, 5]]
"""

from __future__ import annotations

import numpy as np

from .sharding import row_server

API = 2  # the C module's (its API constant): another is a stale build, not called

try:
    from . import _rowsearch
except ImportError:  # installed without a C compiler: NumPy's passes, slower
    _rowsearch = None
STALE = _rowsearch is not None and getattr(_rowsearch, "API", 0) != API
if STALE:  # an editable install's old build after a pull: `pip install -e .` builds it again
    _rowsearch = None

FAST = _rowsearch is not None
GOOD, ORDER, SERVER = 0, 1, 2  # check's answers


def check(
    ids: np.ndarray, rows: int, num_server: int, server: int, fast: bool | None = None
) -> int:
    """Of 1-D int64 ``ids``: :data:`ORDER` unless sorted, unique and in ``[0, rows)``; else
    :data:`SERVER` if ``num_server > 1`` and one of them is another server's
    (:func:`~kvstore.sharding.row_server`); else :data:`GOOD`."""
    if FAST if fast is None else fast:
        return _rowsearch.check(np.ascontiguousarray(ids, np.int64), rows, num_server, server)
    if ids.size and (ids[0] < 0 or ids[-1] >= rows or not (ids[1:] > ids[:-1]).all()):
        return ORDER
    if num_server > 1 and (row_server(ids, num_server) != server).any():
        return SERVER
    return GOOD


def find(
    stored: np.ndarray, slots: np.ndarray, ids: np.ndarray, fast: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(found mask, int32 slot per id (-1 where absent)) of int64 ``ids`` in the sorted
    ``stored`` ids, whose rows are at int32 ``slots``. Any ``ids``; sorted ones are the fast
    case (each search starts where the last one ended)."""
    if FAST if fast is None else fast:
        where = np.empty(ids.shape, np.int32)
        count = _rowsearch.find(stored, slots, np.ascontiguousarray(ids, np.int64), where)
        found = np.ones(ids.size, bool) if count == ids.size else where >= 0
        return found, where
    if stored.size == 0:
        return np.zeros(ids.size, bool), np.full(ids.size, -1, np.int32)
    pos = np.searchsorted(stored, ids)
    found = stored.take(pos, mode="clip") == ids  # past the end: clipped, not equal
    if found.all():  # every row present: the common case, one pass less
        return found, slots[pos]
    return found, np.where(found, slots.take(pos, mode="clip"), -1)


def assign(
    stored: np.ndarray | None,
    slots: np.ndarray,
    ids: np.ndarray,
    rows: np.ndarray,
    block: np.ndarray,
    changed: np.ndarray,
    step: int,
    again: bool = True,
    fast: bool | None = None,
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """A push's rows written into a table in the pass that finds them: ``(where, flags,
    found, again)``. For unique int64 ``ids`` (sorted: the fast case) with ``rows`` (one per
    id, ``block``'s dtype and width): ``where`` the int32 slot of each id (found by
    :func:`find` in the sorted ``stored`` ids at ``slots``, or with ``stored`` None through
    the direct map ``slots``: slot + 1 per id, 0 absent), -1 where absent (``flags`` 1);
    with ``again`` a found row whose ``changed[slot] == step`` (an earlier push of the
    round wrote it) is left as it is (``flags`` 2); every other found row gets its row in
    ``block[slot]`` and ``changed[slot] = step`` (``flags`` 0). The counts: rows found,
    rows left as they were."""
    if ids.ndim != 1 or rows.shape != (ids.size, *block.shape[1:]) or block.ndim != 2:
        raise ValueError(
            f"assign: {ids.shape} ids need rows of {(ids.size, *block.shape[1:])}, got "
            f"{rows.shape} (a 2-D block of rows, 1-D ids)"
        )
    where = np.empty(ids.shape, np.int32)
    flags = np.empty(ids.shape, np.uint8)
    if (FAST if fast is None else fast) and (rows.size or not ids.size):  # (not dim 0)
        ids = np.ascontiguousarray(ids, np.int64)
        rows = np.ascontiguousarray(rows, block.dtype)
        found, hits = _rowsearch.assign(
            stored, slots, ids, rows, block, changed, step, again, where, flags
        )
        return where, flags, found, hits
    if stored is None:
        where[...] = slots[ids] - 1
        present = where >= 0
    else:
        present, slot = find(stored, slots, ids, fast=False)
        where[...] = slot
    hit = np.zeros(ids.shape, bool)
    if again and present.any():
        hit = present & (changed.take(where, mode="clip") == step)
    write = present & ~hit
    flags[...] = np.where(present, np.where(hit, 2, 0), 1)
    to = where[write]
    block[to] = rows[write]
    changed[to] = step
    return where, flags, int(present.sum()), int(hit.sum())


def split(ids: np.ndarray, num_server: int, fast: bool | None = None) -> list[np.ndarray]:
    """Where each server's rows are in int64 ``ids`` (:func:`~kvstore.sharding.row_server`):
    an index array per server, in the order of ``ids``."""
    if FAST if fast is None else fast:
        order = np.empty(ids.size, np.int64)
        starts = np.empty(num_server + 1, np.int64)
        _rowsearch.split(np.ascontiguousarray(ids, np.int64), num_server, order, starts)
        bounds = starts.tolist()
        return [order[bounds[s] : bounds[s + 1]] for s in range(num_server)]
    return group(row_server(ids, num_server), num_server)


def group(where: np.ndarray, num_server: int) -> list[np.ndarray]:
    """The positions of each server's entries in ``where`` (a server per id), in order."""
    if num_server == 2:  # two masks beat a sort
        first = where == 0
        return [np.flatnonzero(first), np.flatnonzero(~first)]
    if num_server <= 1 << 16:  # small ints: a radix sort
        where = where.astype(np.uint16)
    order = np.argsort(where, kind="stable")
    bounds = np.searchsorted(where[order], np.arange(num_server + 1))
    return [order[bounds[s] : bounds[s + 1]] for s in range(num_server)]
