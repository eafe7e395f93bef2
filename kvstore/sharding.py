"""Where a key lives: which servers hold which slice of it. Pure functions, no state.

A key smaller than the big-array bound lives whole on one server, picked by a hash that every
process computes alike. A bigger one is cut into one contiguous slice per server, so every
server sums an equal share. Both sides recompute the slices from the part number; only
``[key, part]`` travels.

A key of more than ``piece_bytes`` is cut further, into pieces of at most about that many
bytes (the parts of a big key go round-robin over the servers): each piece is its own round
on its server, so the server sums piece k while piece k+1 is still on the wire, and answers
it at once (BytePS cuts at 4 MB for the same reason).

>>> place("w", 10, num_server=2, bigarray_bound=4)
[(0, 0, 0, 5), (1, 1, 5, 10)]
>>> place(7, 3, num_server=2, bigarray_bound=4)
[(1, 0, 0, 3)]
>>> place(7, 6, num_server=2, bigarray_bound=100, itemsize=4, piece_bytes=8)
[(1, 0, 0, 2), (1, 1, 2, 4), (1, 2, 4, 6)]
"""

from __future__ import annotations

import zlib


def server_of(key, num_server: int) -> int:
    """The server holding a small key: stable across processes and spread evenly."""
    if isinstance(key, str):
        return zlib.crc32(key.encode()) % num_server
    return key % num_server


def place(
    key, size: int, num_server: int, bigarray_bound: int, itemsize: int = 4, piece_bytes: int = 0
) -> list[tuple[int, int, int, int]]:
    """``[(server, part, lo, hi)]``: the flat slices ``[lo, hi)`` of a key of ``size``
    elements of ``itemsize`` bytes, and the server and part number of each; together they
    cover ``[0, size)``. ``piece_bytes`` (0: no limit) bounds a part's bytes, roughly."""
    split = size >= bigarray_bound and num_server > 1
    parts = num_server if split else 1
    if piece_bytes > 0 and size * itemsize > piece_bytes * parts:
        pieces = -(-size * itemsize // piece_bytes)  # ceil
        # a multiple of the servers it spans; never more parts than elements
        parts = max(parts, min(-(-pieces // parts) * parts, size))
    bounds = [size * i // parts for i in range(parts + 1)]
    home = server_of(key, num_server)
    return [(i % num_server if split else home, i, bounds[i], bounds[i + 1]) for i in range(parts)]


def row_server(ids, num_server: int):
    """The server holding each row of a row-sparse key: a multiplicative (Fibonacci) hash of
    the int64 row id, so strided ids (every other row, every 64th) still spread evenly.
    Vectorised over a NumPy array of ids; the same on every process.

    >>> import numpy as np
    >>> row_server(np.arange(8), 2).tolist()
    [0, 1, 0, 0, 1, 1, 0, 0]
    """
    import numpy as np

    ids = np.asarray(ids, np.int64)
    # wraps mod 2**64 (array arithmetic never warns); one new array, then in place: this
    # runs on every row message, at both ends
    mixed = ids.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    mixed >>= np.uint64(32)
    if num_server & (num_server - 1) == 0:
        mixed &= np.uint64(num_server - 1)
    else:
        mixed %= np.uint64(num_server)
    return mixed.view(np.int64)


def row_bounds(rows: int, num_server: int) -> list[int]:
    """Range sharding of a row-sparse key of ``rows`` logical rows (MXNet's and TorchRec's
    row-wise layout): server s holds the ids ``[bounds[s], bounds[s + 1])``. A worker's sorted
    ids then go to the servers as runs, not gathered per server, and their rows come back as
    runs: no hash, no gather, no scatter. Balanced only when the ids touched are spread over
    ``[0, rows)`` (hashed ids are); :func:`row_server` (the default) is balanced for any ids.

    >>> row_bounds(10, 3)
    [0, 3, 6, 10]
    """
    return [rows * s // num_server for s in range(num_server + 1)]


def replicas(server: int, num_server: int, count: int, hosts=None) -> list[int]:
    """The servers holding the key parts whose primary is ``server``: ``server`` first, then
    its ``count - 1`` backups, the next servers in rank order, those on another host than
    ``server`` first (``hosts[s]``: server s's host; None: all on one). Every part of one
    server has the same backups, so a failover moves a dead server's parts as one block.

    >>> replicas(2, 4, 2), replicas(0, 4, 3, ["a", "a", "b", "b"])
    ([2, 3], [0, 2, 3])
    """
    others = [(server + i) % num_server for i in range(1, num_server)]
    if hosts is not None:
        others.sort(key=lambda s: hosts[s] == hosts[server])  # stable: rank order within
    return [server, *others[: count - 1]]


def acting(server: int, chains: list, dead) -> int | None:
    """The live server that answers for ``server``'s key parts: the first of its chain
    (``chains[server]``, from :func:`replicas`) that is not ``dead``; None when all are.

    >>> acting(1, [[0, 1], [1, 2], [2, 0]], {1}), acting(1, [[0, 1], [1, 2], [2, 0]], {1, 2})
    (2, None)
    """
    return next((s for s in chains[server] if s not in dead), None)
