"""A dist_sync job with fixed per-rank float32 gradients and random delays; prints the hash of
its final weights, which must be the same in every run (reproducible sums).

Rank W-1 runs out of data two steps early and joins. argv: steps.
"""

import hashlib
import os
import random
import sys
import time

import numpy as np

import kvstore

steps = int(sys.argv[1])
kv = kvstore.create("dist_sync")
rank, W = kv.rank, kv.num_workers
# 3000 elements: split over the servers; 100_000 (400 KB): through shared memory
shapes = {"w": (7,), "b": (3000,), "big": (100_000,)}
names = sorted(shapes)
kv.init(names, [np.zeros(shapes[k], np.float32) for k in names])
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
mine = steps - 2 if rank == W - 1 and W > 1 else steps
delays = random.Random(os.urandom(8))  # a different timing in every run
for step in range(mine):
    grads = [
        (
            np.random.default_rng([rank, step, i]).standard_normal(shapes[k]) * 10.0 ** (rank - 2)
        ).astype(np.float32)
        for i, k in enumerate(names)
    ]
    time.sleep(delays.choice([0, 0, 0.001, 0.01, 0.03]))
    kv.push(names, grads)
kv.join()
outs = [np.empty(shapes[k], np.float32) for k in names]
kv.pull(names, out=outs)
digest = hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest()
kv.close()
print(f"rank {rank} weights {digest}", flush=True)
