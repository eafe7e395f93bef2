"""Rank 0 asks for compressed pulls, rank 1 compresses its pushes only (a job whose workers
set different gradient compressions). Each writes what it read to out<rank>.npy; a store
that failed with a message about the compressions writes nothing and exits 0.

argv: the compression rank 1 sets ('push-only' or 'none').
"""

import sys

import numpy as np

import kvstore
from kvstore.errors import KVStoreError

other = sys.argv[1]
kv = kvstore.create("dist_sync")
rank = kv.rank
kv.init("w", np.zeros(1000, np.float32))
if rank == 0:
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5, "pull": True})
elif other == "push-only":
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
out = np.empty(1000, np.float32)
try:
    for rnd in range(3):
        g = np.random.default_rng([rnd, rank]).standard_normal(1000).astype(np.float32)
        kv.pushpull("w", g, out=out)
except KVStoreError as exc:
    print(f"refused: {exc}", flush=True)
    sys.exit(0)
np.save(f"out{rank}.npy", out)
kv.close()
print("OK", flush=True)
