"""The loops over every pushed row id: a worker's split of them by server, a server's check
of them and its search for their rows.

At dim 16 a server spent about a quarter of its time on the last two (a push of 2,048 rows:
five NumPy passes to check the ids, a binary search of the table for each), and a worker a
tenth of its own on the first. The C module ``kvstore._rowsearch``, built by ``pip install``
when a C compiler is there, does each in one or two passes; this module's NumPy code is the
reference it is tested against and what runs without it (``FAST`` says which; a function's
``fast`` picks one, by default ``FAST``). The answers are the same.

>>> import numpy as np
>>> stored, slots = np.array([3, 8, 20]), np.array([2, 0, 1], np.int32)
>>> found, where, again = find(stored, slots, np.array([8, 9, 20]))
>>> found.tolist(), where.tolist(), again
([True, False, True], [0, -1, 1], 0)
>>> check(np.array([1, 5]), 10, 1, 0), check(np.array([5, 1]), 10, 1, 0)
(0, 1)
>>> [p.tolist() for p in split(np.arange(8), 2)]
[[0, 2, 3, 6, 7], [1, 4, 5]]
"""

from __future__ import annotations

import numpy as np

from .sharding import row_server

API = 1  # the C module's (its API constant): another is a stale build, not called

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
    stored: np.ndarray,
    slots: np.ndarray,
    ids: np.ndarray,
    changed: np.ndarray | None = None,
    step: int = 0,
    fast: bool | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """(found mask, int32 slot per id (-1 where absent), again) of int64 ``ids`` in the sorted
    ``stored`` ids, whose rows are at int32 ``slots``. ``again``: how many of the rows found
    have ``changed[slot] == step`` (0 without ``changed``). Any ``ids``; sorted ones are the
    fast case (each search starts where the last one ended)."""
    if FAST if fast is None else fast:
        where = np.empty(ids.shape, np.int32)
        count, again = _rowsearch.find(
            stored, slots, np.ascontiguousarray(ids, np.int64), where, changed, step
        )
        found = np.ones(ids.size, bool) if count == ids.size else where >= 0
        return found, where, again
    if stored.size == 0:
        return np.zeros(ids.size, bool), np.full(ids.size, -1, np.int32), 0
    pos = np.searchsorted(stored, ids)
    found = stored.take(pos, mode="clip") == ids  # past the end: clipped, not equal
    if found.all():  # every row present: the common case, one pass less
        where = slots[pos]
    else:
        where = np.where(found, slots.take(pos, mode="clip"), -1)
    again = 0
    if changed is not None:
        again = int((found & (changed.take(where, mode="clip") == step)).sum())
    return found, where, again


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
