"""Uneven inputs on a row-sparse key: rank r has 2 + 2r batches, then calls join(); until
every worker has joined, a joined worker counts as pushing no rows, so the others train on.
Every pull is checked against the pushes really made (SGD, learning rate 1: each row falls
by the sum of its pushed values)."""

import numpy as np

import kvstore
from kvstore.sparse import RowSparse, constant

kv = kvstore.create("dist_sync")
rank, W = kv.rank, kv.num_workers
shape = (30, 2)
kv.init("t", RowSparse.empty(shape, np.float32, init=constant(1.0)))
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
batches = [2 + 2 * r for r in range(W)]


def grad(r, i):
    ids = np.random.default_rng([r, i]).integers(0, shape[0], 5)
    return RowSparse(ids, np.full((5, 2), r + 1.0, np.float32), shape)


for i in range(batches[rank]):
    g = grad(rank, i)
    out = RowSparse.empty(shape, np.float32)
    kv.pushpull("t", g, out=out)
    want = np.ones(shape)
    for n in range(i + 1):
        for r in range(W):
            if batches[r] > n:
                np.add.at(want, grad(r, n).indices, -(r + 1.0))
    assert np.array_equal(out.data, want[out.indices].astype(np.float32)), (rank, i)
kv.join()
kv.close()
print(f"rank {rank} OK join rows", flush=True)
