"""dist_async on a row-sparse key: every push is applied on arrival, none is lost.

Every worker pushes ``-(rank + 1)`` to its own seeded random rows (duplicates in a push are
summed) 20 times; with ``SGD(learning_rate=1)`` the pulled table after a barrier is the
initial table plus every push of every worker. Then, under gradient compression (which
applies to dense keys), a push of rows travels as it is: exact.

argv: kv type.
"""

import sys

import numpy as np

import kvstore
from kvstore.sparse import RowSparse, constant

kind = sys.argv[1]
kv = kvstore.create(kind)
rank, W = kv.rank, kv.num_workers
shape, steps = (50, 4), 20
kv.init("t", RowSparse.empty(shape, np.float32, init=constant(1.0)))
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
want = np.ones(shape)
for r in range(W):
    rng = np.random.default_rng(r)
    for _ in range(steps):
        ids = rng.integers(0, shape[0], size=6)
        if r == rank:
            kv.push("t", RowSparse(ids, np.full((6, 4), -(r + 1.0), np.float32), shape))
        np.add.at(want, ids, r + 1.0)
kv.barrier()
out = np.zeros(shape, np.float32)
kv.row_sparse_pull("t", out=out, row_ids=np.arange(shape[0]))
if not np.array_equal(out, want):
    print(f"rank {rank}: async sum wrong at rows {np.argwhere(out != want)[:5, 0]}", flush=True)
    sys.exit(5)
# under gradient compression (for the dense keys) rows travel as they are, exact (after a
# barrier: under dist_async a push is applied on arrival, and another worker may not have
# pulled the sums above yet)
kv.barrier()
kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
kv.push("t", RowSparse([1], np.full((1, 4), 0.25, np.float32), shape))
kv.barrier()
want[1] -= 0.25 * W  # (SGD, learning rate 1)
kv.row_sparse_pull("t", out=out, row_ids=np.arange(shape[0]))
if not np.array_equal(out, want):
    print(f"rank {rank}: rows under compression wrong: {out[1]} != {want[1]}", flush=True)
    sys.exit(6)
kv.close()
print(f"rank {rank} OK async rows", flush=True)
