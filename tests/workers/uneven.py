"""Uneven inputs: rank r has 4 + 3r batches, then calls join(); the others train on, and
every value is checked against the sum of the pushes that were really made. After join()
returns, every worker does one more (even) round.

argv: seed.
"""

import random
import sys
import time

import numpy as np

import kvstore

seed = int(sys.argv[1])
kv = kvstore.create("dist_sync")
rank, W = kv.rank, kv.num_workers
shapes = {"w": (6,), "big": (3000,)}  # 3000 elements: split over the servers
names = sorted(shapes)
kv.init(names, [np.ones(shapes[k], np.float32) for k in names])
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
batches = [4 + 3 * r for r in range(W)]
rng = random.Random(seed * 31 + rank)


def grad(r, i, key):
    return np.random.default_rng([seed, r, i, names.index(key)]).integers(-5, 6, shapes[key])


def expected(key, rounds):
    value = np.ones(shapes[key], np.float32)
    for i in range(rounds):
        value -= sum(grad(r, i, key) for r in range(W) if batches[r] > i).astype(np.float32)
    return value


for i in range(batches[rank]):
    time.sleep(rng.choice([0, 0.001, 0.02]))
    outs = [np.empty(shapes[k], np.float32) for k in names]
    kv.pushpull(names, [grad(rank, i, k).astype(np.float32) for k in names], out=outs)
    for k, out in zip(names, outs, strict=True):
        assert np.array_equal(out, expected(k, i + 1)), (rank, i, k)
last = kv.join()
print(f"rank {rank} joined; last to join: {last}", flush=True)
done = max(batches)
outs = [np.empty(shapes[k], np.float32) for k in names]
kv.pull(names, out=outs)
for k, out in zip(names, outs, strict=True):
    assert np.array_equal(out, expected(k, done)), (rank, "after join", k)
kv.barrier()
kv.pushpull(names, [np.full(shapes[k], -1, np.float32) for k in names], out=outs)
for k, out in zip(names, outs, strict=True):
    assert np.array_equal(out, expected(k, done) + W), (rank, "next epoch", k)
kv.close()
print(f"rank {rank} OK", flush=True)
