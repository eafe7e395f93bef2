"""A server refuses bad row-sparse requests, saying why, and serves on.

The worker sends raw ``sparse_pull`` requests (not mutating: a refusal does not fail the
store) with ids unsorted, out of range, of the other server and of the wrong dtype; each is
refused with its reason, then a normal pushpull still works.
"""

import numpy as np

import kvstore
from kvstore.errors import KVStoreError
from kvstore.sharding import row_server
from kvstore.sparse import RowSparse

kv = kvstore.create("dist_sync")
shape = (100, 2)
kv.init("e", RowSparse.empty(shape, np.float32))
ids = np.arange(100)
theirs = ids[row_server(ids, 2) == 1][:2].astype(np.int64)
mine = ids[row_server(ids, 2) == 0][:2].astype(np.int64)
cases = [
    (mine[::-1].copy(), "sorted, unique and in [0, 100)"),
    (np.array([mine[0], 100], np.int64), "sorted, unique and in [0, 100)"),
    (theirs, "row ids of another server"),
    (mine.astype(np.int32), "row ids must be 1-D int64"),
]
for bad, reason in cases:
    request = kv._send(0, "sparse_pull", {"keys": [["e", 0]]}, [bad])
    try:
        kv._wait("raw sparse_pull", [request])
    except KVStoreError as exc:
        assert reason in str(exc) and "sparse_pull refused" in str(exc), exc
    else:
        raise AssertionError(f"{bad} was not refused")
g = RowSparse([3, 50], np.ones((2, 2), np.float32), shape)
kv.pushpull("e", g)
assert g.data.tolist() == [[1, 1], [1, 1]], g.data
kv.close()
print("OK refusals", flush=True)
