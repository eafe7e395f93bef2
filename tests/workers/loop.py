"""Train in a loop (bounded) and report a KVStoreError instead of a traceback.

argv: rounds of pushpull; then optionally a rank that stops early after that many rounds,
and what it does then: "close" (default) or "barrier" (waits for the others, who never come).
"""

import os
import sys
import time

import numpy as np

import kvstore

rounds = int(sys.argv[1])
short_rank, short_rounds = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (-1, 0)
then = sys.argv[4] if len(sys.argv) > 4 else "close"
started = time.monotonic()
print(f"pid {os.getpid()}", flush=True)
try:
    kv = kvstore.create("dist_sync")
    kv.init(["w", "b"], [np.zeros(100, np.float32), np.zeros(2000, np.float32)])
    mine = rounds if kv.rank != short_rank else short_rounds
    w, b = np.empty(100, np.float32), np.empty(2000, np.float32)
    for rnd in range(mine):
        kv.pushpull(["w", "b"], [np.ones(100, np.float32), np.ones(2000, np.float32)], out=[w, b])
        assert w[0] == kv.num_workers, w[0]
        print(f"round {rnd}", flush=True)
        if time.monotonic() - started > 60:
            break
    if kv.rank == short_rank and then == "barrier":
        kv.barrier()
    kv.close()
    print("done", flush=True)
except kvstore.KVStoreError as exc:
    print(f"KVStoreError after {time.monotonic() - started:.1f}s: {exc}", flush=True)
    sys.exit(3)
