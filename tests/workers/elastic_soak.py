"""A worker of an elastic soak: every step it pushes 1 into "count" and 2**slot into "who",
so a round's "who" is the set of slots whose push it holds and "count" their number (exact
in float32 for up to 24 slots). Prints one line a step; stops when the file ``stop`` exists
in the working directory (all workers) or ``leave-<slot>`` does (this one: it closes its
store and exits 0, a graceful leave).

argv: seconds per step.
"""

import os
import sys
import time

import numpy as np

import kvstore

pause = float(sys.argv[1])
kv = kvstore.create("dist_sync")
slot = kv._rank
kv.init(["count", "who"], [np.zeros(1, np.float32), np.zeros(1, np.float32)])
print(f"start slot {slot} pid {os.getpid()} late {int(kv._late)}", flush=True)
count, who = np.zeros(1, np.float32), np.zeros(1, np.float32)
mine = [np.ones(1, np.float32), np.full(1, 2.0**slot, np.float32)]
step = 0
while not os.path.exists("stop") and not os.path.exists(f"leave-{slot}"):
    kv.pushpull(["count", "who"], mine, out=[count, who])
    print(
        f"step {step} count {count[0]:g} who {int(who[0])} workers {kv.num_workers} "
        f"epoch {kv.epoch} t {time.time():.3f}",
        flush=True,
    )
    step += 1
    time.sleep(pause)
kv.close()
print(f"left slot {slot} after {step} steps", flush=True)
