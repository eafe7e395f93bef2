"""A row-sparse key named twice in one call: refused on the worker, before anything is sent.

argv: 'pull' (row_sparse_pull([e, e]) with different ids), 'push_then_pull_twice' (push of e,
then row_sparse_pull([e, e]) of the pushed ids)."""

import sys

import numpy as np

import kvstore
from kvstore.sparse import RowSparse

what = sys.argv[1]
kv = kvstore.create("dist_sync")
shape = (10, 2)
start = np.arange(20, dtype=np.float32).reshape(shape)  # row i = [2i, 2i+1]
kv.init("e", RowSparse(np.arange(10), start, shape))
o1, o2 = RowSparse.empty(shape, np.float32), RowSparse.empty(shape, np.float32)
try:
    if what == "pull":
        kv.row_sparse_pull(["e", "e"], out=[o1, o2], row_ids=[np.array([1, 2]), np.array([3, 4])])
    else:
        kv.push("e", RowSparse(np.array([1, 2]), np.ones((2, 2), np.float32), shape))
        kv.row_sparse_pull(["e", "e"], out=[o1, o2], row_ids=[np.array([1, 2]), np.array([3, 4])])
        start[[1, 2]] = 1
except ValueError as exc:
    assert "duplicate keys in one call" in str(exc), exc
    print("refused:", exc)
else:
    raise AssertionError("a key named twice was taken")
try:
    kv.push(["e", "e"], [RowSparse(np.array([1]), np.ones((1, 2), np.float32), shape)] * 2)
except ValueError as exc:
    assert "duplicate keys in one call" in str(exc), exc
else:
    raise AssertionError("a push naming a key twice was taken")
kv.row_sparse_pull("e", out=o1, row_ids=np.array([3]))  # the store still works
assert np.array_equal(o1.data, start[[3]]), o1.data
print("OK dup keys")
