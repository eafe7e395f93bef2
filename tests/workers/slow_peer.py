"""A slow but healthy rank: ``slow_peer.py CALL BUSY``.

Rank 0 is busy for BUSY seconds (a long checkpoint: its heartbeats go on) before it calls
CALL (``barrier`` or ``join``); the other ranks call it at once and wait. Each rank prints
``OK <rank> after <seconds>s`` when its call returns, or the error that ended it.
"""

import sys
import threading
import time

import numpy as np

import kvstore

call, busy = sys.argv[1], float(sys.argv[2])
kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(4, np.float32))
if kv.rank == 0:
    threading.Event().wait(busy)  # the user's work: the process is alive, its store idle
started = time.monotonic()
try:
    getattr(kv, call)()
except kvstore.KVStoreError as exc:
    print(f"FAILED {kv.rank} after {time.monotonic() - started:.1f}s: {exc}", flush=True)
    sys.exit(3)
print(f"OK {kv.rank} after {time.monotonic() - started:.1f}s", flush=True)
kv.close()
