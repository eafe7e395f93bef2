"""dist_ssp, s=1: rank 0 pushes a key 3 times, rank 1 twice and closes. Rank 0's third push is
answered (within the bound) but its round can never complete: rank 0's close must say so.
Prints ``CLOSE: ok`` or ``CLOSE: <error>``."""

import numpy as np

import kvstore

kv = kvstore.create("dist_ssp", staleness=1)
kv.init("w", np.zeros(3, np.float32))
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
for _ in range(3 if kv.rank == 0 else 2):
    kv.push("w", np.ones(3, np.float32))
if kv.rank == 0:
    out = np.empty(3, np.float32)
    kv.pull("w", out=out)  # clock 3: rounds 0 and 1 are enough
    print("pulled", out.tolist(), flush=True)
kv.barrier()  # rank 0's third push is answered before rank 1 closes
try:
    kv.close()
    print("CLOSE: ok", flush=True)
except kvstore.KVStoreError as exc:
    print(f"CLOSE: {exc}", flush=True)
