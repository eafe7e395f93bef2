"""Print the CPU policy of this worker's threads after the store is created (kvstore.cpu):
the caller's, one the caller starts later, and a thread the caller started before. Then a
round, checked, so that the policy changes nothing else; then stay argv[1] seconds (the test
reads the servers' policies meanwhile)."""

import os
import sys
import threading
import time

import numpy as np

import kvstore

NAMES = {os.SCHED_OTHER: "other", os.SCHED_BATCH: "batch"}
before = {}
started = threading.Event()
stop = threading.Event()


def early():
    before["tid"] = threading.get_native_id()
    started.set()
    stop.wait(60)


threading.Thread(target=early, daemon=True).start()
started.wait(10)
kv = kvstore.create("dist_sync")
after = {}
t = threading.Thread(target=lambda: after.setdefault("policy", os.sched_getscheduler(0)))
t.start()
t.join(10)
kv.init("w", np.zeros(8, np.float32))
kv.push("w", np.ones(8, np.float32) * (kv.rank + 1))
out = np.empty(8, np.float32)
kv.pull("w", out=out)
assert np.array_equal(out, np.full(8, sum(range(1, kv.num_workers + 1)), np.float32)), out
print(
    f"policy caller={NAMES[os.sched_getscheduler(0)]} later={NAMES[after['policy']]} "
    f"earlier={NAMES[os.sched_getscheduler(before['tid'])]}",
    flush=True,
)
stop.set()
time.sleep(float(sys.argv[1]))  # the idle time itself, not a wait for something
kv.close()
