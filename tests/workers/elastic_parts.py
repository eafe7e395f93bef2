"""An elastic job's counter in a key cut into parts on every server (run it with a small
KVSTORE_BIGARRAY_BOUND): every worker pushes ones once per step, so each element of a
round's value is the number of workers whose push it holds. Prints "step S min A max B
workers N" per step; a newcomer prints "late" first.

argv: steps, seconds per step.
"""

import sys
import time

import numpy as np

import kvstore

steps, pause = int(sys.argv[1]), float(sys.argv[2])
kv = kvstore.create("dist_sync")
kv.init("count", np.zeros(4096, np.float32))
if getattr(kv, "_late", False):
    print(f"late: slot {kv._rank}", flush=True)
out = np.zeros(4096, np.float32)
for step in range(steps):
    kv.pushpull("count", np.ones(4096, np.float32), out=out)
    print(f"step {step} min {out.min():g} max {out.max():g} workers {kv.num_workers}", flush=True)
    time.sleep(pause)
print("done", flush=True)
