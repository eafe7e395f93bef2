"""A worker of an elastic soak: every step it pushes [1, 2**slot] into the key "tally", so a
round's tally is [the number of pushes it holds, the set of their slots] (exact in float32
for up to 24 slots): the two agree exactly when every push of the round counted once.
Prints one line a step; stops when the file ``stop`` exists in the working directory (all
workers) or ``leave-<slot>`` does (this one: it closes its store and exits 0, a graceful
leave).

With a second argument K > 1 it pushes K keys each step ("tally", "tally-1", ...), one blocking
``pushpull`` after another (Gluon's per-parameter loop), or with a third argument ``async``
a ``pushpull_async`` of each, then waits for them all (Horovod's), and prints each further
key's tally after ``more``.

argv: seconds per step [, keys [, blocking|async]].
"""

import os
import sys
import time

import numpy as np

import kvstore

pause = float(sys.argv[1])
keys = ["tally"] + [f"tally-{i}" for i in range(1, int(sys.argv[2]) if len(sys.argv) > 2 else 1)]
pattern = sys.argv[3] if len(sys.argv) > 3 else "blocking"
kv = kvstore.create("dist_sync")
slot = kv._rank
for key in keys:
    kv.init(key, np.zeros(2, np.float32))
print(f"start slot {slot} pid {os.getpid()} late {int(kv._late)}", flush=True)
tallies = [np.zeros(2, np.float32) for _ in keys]
mine = np.array([1.0, 2.0**slot], np.float32)
step = 0
while not os.path.exists("stop") and not os.path.exists(f"leave-{slot}"):
    if pattern == "async":
        for pending in [
            kv.pushpull_async(k, mine, out=t) for k, t in zip(keys, tallies, strict=True)
        ]:
            pending.wait()
    else:
        for key, tally in zip(keys, tallies, strict=True):
            kv.pushpull(key, mine, out=tally)
    more = " ".join(f"{t[0]:g}/{int(t[1])}" for t in tallies[1:])
    print(
        f"step {step} count {tallies[0][0]:g} who {int(tallies[0][1])} workers {kv.num_workers} "
        f"epoch {kv.epoch} t {time.time():.3f}" + (f" more {more}" if more else ""),
        flush=True,
    )
    step += 1
    time.sleep(pause)
kv.close()
print(f"left slot {slot} after {step} steps", flush=True)
