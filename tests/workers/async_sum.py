"""dist_async: concurrent pushes from every worker; the final value is init + every push."""

import sys

import numpy as np

import kvstore

pushes = int(sys.argv[1])
kv = kvstore.create("dist_async")
W = kv.num_workers
shapes = {"a": (10,), "b": (3000,), "c": (4, 4)}
kv.init(list(shapes), [np.ones(s, np.float32) for s in shapes.values()])


def grad(rank, i, shape):
    return np.random.default_rng(rank * 100000 + i).integers(-4, 5, size=shape).astype(np.float32)


for i in range(pushes):
    kv.push(list(shapes), [grad(kv.rank, i, s) for s in shapes.values()])
kv.barrier()
for name, shape in shapes.items():
    out = np.empty(shape, np.float32)
    kv.pull(name, out=out)
    expected = np.ones(shape, np.float32) + sum(
        grad(r, i, shape) for r in range(W) for i in range(pushes)
    )
    np.testing.assert_array_equal(out, expected)
kv.close()
print(f"rank {kv.rank} OK", flush=True)
