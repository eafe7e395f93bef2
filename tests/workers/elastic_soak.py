"""A worker of an elastic soak: every step it pushes [1, 2**slot] into the key "tally", so a
round's tally is [the number of pushes it holds, the set of their slots] (exact in float32
for up to 24 slots): the two agree exactly when every push of the round counted once.
Prints one line a step; stops when the file ``stop`` exists in the working directory (all
workers) or ``leave-<slot>`` does (this one: it closes its store and exits 0, a graceful
leave).

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
kv.init("tally", np.zeros(2, np.float32))
print(f"start slot {slot} pid {os.getpid()} late {int(kv._late)}", flush=True)
tally = np.zeros(2, np.float32)
mine = np.array([1.0, 2.0**slot], np.float32)
step = 0
while not os.path.exists("stop") and not os.path.exists(f"leave-{slot}"):
    kv.pushpull("tally", mine, out=tally)
    print(
        f"step {step} count {tally[0]:g} who {int(tally[1])} workers {kv.num_workers} "
        f"epoch {kv.epoch} t {time.time():.3f}",
        flush=True,
    )
    step += 1
    time.sleep(pause)
kv.close()
print(f"left slot {slot} after {step} steps", flush=True)
