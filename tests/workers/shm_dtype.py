"""The same key initialised float32 on rank 0 (the servers store that) and int32 on rank 1,
pushed through shared memory (one host, parts of 256 KiB): prints what each rank got, or
the error it raised.
"""

import numpy as np

import kvstore

n = 65536
kv = kvstore.create("dist_sync")
rank = kv.rank
dtype = np.float32 if rank == 0 else np.int32
kv.init("w", np.zeros(n, dtype))
out = np.empty(n, dtype)
try:
    kv.pushpull("w", np.full(n, 3, dtype), out=out)
    print(f"rank {rank} got {np.unique(out).tolist()[:4]} (3 + 3 = 6 expected)", flush=True)
except kvstore.KVStoreError as exc:
    print(f"rank {rank} raised {type(exc).__name__}: {exc}", flush=True)
