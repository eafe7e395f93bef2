"""Training with replicated servers: fixed per-rank float32 gradients, random delays; prints
the hash of the final weights, which must not depend on the timing nor on a server killed or
frozen on the way (KVSTORE_REPLICAS=2, reproducible sums).

argv: steps, optimizer (sgd | adam | bmuf | none), call (pushpull | push | 2bit: pushpull
with 2-bit compression). The hash covers the weights and, with an optimizer, the optimizer
state the servers give back (save_optimizer_states). Every worker prints "step N at T" as it
goes, so a test can kill a server mid-run.
"""

import hashlib
import os
import random
import sys
import time

import numpy as np

import kvstore
from kvstore.block import block_momentum

steps, which, call = int(sys.argv[1]), sys.argv[2], sys.argv[3]
kv = kvstore.create("dist_sync")
rank, W = kv.rank, kv.num_workers
# small keys (one server each), a key split over the servers, one through shared memory
shapes = {"w": (7,), "b": (3000,), "c": (5,), "big": (100_000,)}
names = sorted(shapes)
kv.init(names, [np.full(shapes[k], 0.5, np.float32) for k in names])
if which == "sgd":
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
elif which == "adam":
    kv.set_optimizer(kvstore.optimizer.Adam(learning_rate=0.01))
elif which == "bmuf":  # block momentum's outer step on the servers
    kv.set_optimizer(block_momentum(W, block_size=64))
if call == "2bit":
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
delays = random.Random(os.urandom(8))  # a different timing in every run
outs = [np.empty(shapes[k], np.float32) for k in names]
for step in range(steps):
    grads = [
        (np.random.default_rng([rank, step, i]).standard_normal(shapes[k])).astype(np.float32)
        for i, k in enumerate(names)
    ]
    time.sleep(delays.choice([0, 0, 0.002, 0.01, 0.03]))
    if call == "push":
        kv.push(names, grads)
        kv.pull(names, out=outs)
    else:
        kv.pushpull(names, grads, out=outs)
    print(f"step {step} at {time.time():.3f}", flush=True)
kv.pull(names, out=outs)
digest = hashlib.sha256(b"".join(o.tobytes() for o in outs))
if which != "none":
    kv.save_optimizer_states(f"states{rank}.bin")
    with open(f"states{rank}.bin", "rb") as f:
        digest.update(f.read())
digest = digest.hexdigest()
kv.close()
print(f"rank {rank} weights {digest}", flush=True)
