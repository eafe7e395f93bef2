"""Resume from a checkpoint under replicas: ``save`` trains a few steps with SGD momentum and
writes the weights (rank 0) and the servers' optimizer state; ``resume`` starts from them
(init with the weights, load_optimizer_states), trains on and prints the hash of its final
weights, which must not depend on a server killed on the way (every replica loaded the
state, not only the primaries).

argv: save|resume, directory, steps. Prints "step N at T" as it goes.
"""

import hashlib
import os
import sys
import time

import numpy as np

import kvstore

phase, where, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
kv = kvstore.create("dist_sync")
rank = kv.rank
shapes = {"w": (7,), "b": (3000,), "big": (100_000,)}
names = sorted(shapes)
if phase == "save":
    start = [np.full(shapes[k], 0.5, np.float32) for k in names]
else:
    start = [np.load(os.path.join(where, f"{k}.npy")) for k in names]
kv.init(names, start)
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
if phase == "resume":
    kv.load_optimizer_states(os.path.join(where, "states.bin"))
outs = [np.empty(shapes[k], np.float32) for k in names]
first = 0 if phase == "save" else 1000
for step in range(first, first + steps):
    grads = [
        np.random.default_rng([rank, step, i]).standard_normal(shapes[k]).astype(np.float32)
        for i, k in enumerate(names)
    ]
    kv.pushpull(names, grads, out=outs)
    print(f"step {step - first} at {time.time():.3f}", flush=True)
    time.sleep(0.02)
kv.pull(names, out=outs)
if phase == "save":
    kv.barrier()
    if rank == 0:
        for k, o in zip(names, outs, strict=True):
            np.save(os.path.join(where, f"{k}.npy"), o)
        kv.save_optimizer_states(os.path.join(where, "states.bin"))
    kv.barrier()
digest = hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest()
kv.close()
print(f"rank {rank} weights {digest}", flush=True)
