"""Push a 4 MiB key in a loop, never pulling (bounded: at most 60 s); prints progress.

A lost peer ends it with the store's uncaught error, as in a user's script.
"""

import os
import time

import numpy as np

import kvstore

print(f"pid {os.getpid()}", flush=True)
kv = kvstore.create("dist_sync")
n = 1 << 20
kv.init("w", np.zeros(n, np.float32))
grad = np.ones(n, np.float32)
started = time.monotonic()
i = 0
while time.monotonic() - started < 60:
    kv.push("w", grad)
    i += 1
    if i % 10 == 0:
        print(f"push {i}", flush=True)
kv.close()
print("done", flush=True)
