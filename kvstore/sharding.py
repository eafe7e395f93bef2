"""Where a key lives: which servers hold which slice of it. Pure functions, no state.

A key smaller than the big-array bound lives whole on one server, picked by a hash that every
process computes alike. A bigger one is cut into one contiguous slice per server, so every
server sums an equal share. Both sides recompute the slices from the part number; only
``[key, part]`` travels.

>>> place("w", 10, num_server=2, bigarray_bound=4)
[(0, 0, 0, 5), (1, 1, 5, 10)]
>>> place(7, 3, num_server=2, bigarray_bound=4)
[(1, 0, 0, 3)]
"""

from __future__ import annotations

import zlib


def server_of(key, num_server: int) -> int:
    """The server holding a small key: stable across processes and spread evenly."""
    if isinstance(key, str):
        return zlib.crc32(key.encode()) % num_server
    return key % num_server


def place(key, size: int, num_server: int, bigarray_bound: int) -> list[tuple[int, int, int, int]]:
    """``[(server, part, lo, hi)]``: the flat slices ``[lo, hi)`` of a key of ``size``
    elements, and the server and part number of each; together they cover ``[0, size)``."""
    if size >= bigarray_bound and num_server > 1:
        bounds = [size * i // num_server for i in range(num_server + 1)]
        return [(i, i, bounds[i], bounds[i + 1]) for i in range(num_server)]
    return [(server_of(key, num_server), 0, 0, size)]
