"""MXNet's nightly dist_sync_kvstore.py / dist_async_kvstore.py checks, in our API.

Every worker pushes ``-(rank + 1)`` three times to small keys (one by one and as a list) and
to a big key split over the servers, with random delays so that workers run ahead of each
other, then pulls: with ``SGD(learning_rate=1, rescale_grad=rate)`` every value must be
``1 + rate * W (W + 1) / 2 * 3`` exactly. In ``dist_sync`` the pull comes straight after the
worker's own pushes (it must include them, and everyone's rounds up to them); in
``dist_async`` after a barrier.

argv: kv type, seed, slow rank (-1: none; it sleeps before set_optimizer and each push).
"""

import random
import sys
import time

import numpy as np

import kvstore

kind, seed, slow = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kv = kvstore.create(kind)
rank, W = kv.rank, kv.num_workers
rng = random.Random(seed * 1000 + rank)
keys, rate, shape, big_shape, nrepeat = ["3", "5", "7"], 2.0, (2, 2), (1200, 1200), 3
kv.init(keys, [np.ones(shape, np.float32)] * len(keys))
kv.init("99", np.ones(big_shape, np.float32))
if rank == slow:
    time.sleep(0.3)  # the others push before this worker's set_optimizer reaches the servers
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0, rescale_grad=rate))
for _ in range(nrepeat):
    time.sleep(0.3 if rank == slow else rng.uniform(0, 0.02))
    kv.push("3", np.full(shape, -(rank + 1), np.float32))
    kv.push("99", np.full(big_shape, -(rank + 1), np.float32))
    kv.push(["5", "7"], [np.full(shape, -(rank + 1), np.float32)] * 2)
if kind == "dist_async":
    kv.barrier()
want = 1 + rate * W * (W + 1) / 2 * nrepeat
for key, s in (("3", shape), ("99", big_shape), ("5", shape), ("7", shape)):
    out = np.zeros(s, np.float32)
    kv.pull(key, out=out)
    if not (out == want).all():
        print(f"rank {rank}: pulled {key} = {np.unique(out)}, expected {want}", flush=True)
        sys.exit(5)
kv.close()
print(f"rank {rank} OK {want:g}", flush=True)
