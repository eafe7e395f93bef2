"""A worker of known traffic: ``traffic.py N BYTES [RELEASE [STOP]]``.

N pushpulls of one float32 key of BYTES bytes, then prints ``done`` and, given RELEASE (a
path), waits for that file before closing, so the scheduler's counters can be read while the
job runs. Given STOP, it goes on with pushpulls (20 a second) until that file exists.
The store type is ``TRAFFIC_STORE`` (default ``dist_sync``).
"""

import os
import sys
import threading

import numpy as np

import kvstore

steps, nbytes = int(sys.argv[1]), int(sys.argv[2])
release = sys.argv[3] if len(sys.argv) > 3 else ""
stop = sys.argv[4] if len(sys.argv) > 4 else ""
pause = threading.Event()

kv = kvstore.create(os.environ.get("TRAFFIC_STORE", "dist_sync"))
kv.init("w", np.zeros(nbytes // 4, np.float32))
grad = np.ones(nbytes // 4, np.float32)
out = np.empty_like(grad)
for _ in range(steps):
    kv.pushpull("w", grad, out=out)
assert out[0] == kv.num_workers, out[0]
print("done", flush=True)
for _ in range(1200):  # 60 s at most
    if stop and not os.path.exists(stop):
        kv.pushpull("w", grad, out=out)
    elif not release or os.path.exists(release):
        break
    pause.wait(0.05)
kv.close()
