"""A row-sparse server's two loops over every pushed id: checking the ids, finding their rows.

At dim 16 a server spends about a quarter of its time on these two (a push of 2,048 rows:
five NumPy passes to check the ids, a binary search of the table for each). The C module
``kvstore._rowsearch``, built by ``pip install`` when a C compiler is there, does each in one
pass; this module's NumPy code is the reference it is tested against and what runs without
it (``FAST`` says which). The answers are the same.

>>> import numpy as np
>>> stored, slots = np.array([3, 8, 20]), np.array([2, 0, 1], np.int32)
>>> found, where = find(stored, slots, np.array([8, 9, 20]))
>>> found.tolist(), where.tolist()
([True, False, True], [0, -1, 1])
>>> check(np.array([1, 5]), 10, 1, 0), check(np.array([5, 1]), 10, 1, 0)
(0, 1)
"""

from __future__ import annotations

import numpy as np

from .sharding import row_server

try:
    from . import _rowsearch
except ImportError:  # installed without a C compiler: NumPy's passes, slower
    _rowsearch = None

FAST = _rowsearch is not None
GOOD, ORDER, SERVER = 0, 1, 2  # check's answers


def check(ids: np.ndarray, rows: int, num_server: int, server: int, fast: bool = FAST) -> int:
    """Of 1-D int64 ``ids``: :data:`ORDER` unless sorted, unique and in ``[0, rows)``; else
    :data:`SERVER` if ``num_server > 1`` and one of them is another server's
    (:func:`~kvstore.sharding.row_server`); else :data:`GOOD`."""
    if fast:
        return _rowsearch.check(np.ascontiguousarray(ids, np.int64), rows, num_server, server)
    if ids.size and (ids[0] < 0 or ids[-1] >= rows or not (ids[1:] > ids[:-1]).all()):
        return ORDER
    if num_server > 1 and (row_server(ids, num_server) != server).any():
        return SERVER
    return GOOD


def find(
    stored: np.ndarray, slots: np.ndarray, ids: np.ndarray, fast: bool = FAST
) -> tuple[np.ndarray, np.ndarray]:
    """(found mask, int32 slot per id, -1 where absent) of int64 ``ids`` in the sorted
    ``stored`` ids, whose rows are at int32 ``slots``. Any ``ids``; sorted ones are the
    fast case (each search starts where the last one ended)."""
    if fast:
        where = np.empty(ids.size, np.int32)
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
