"""A pull or pushpull interrupted (a signal handler raises, as Ctrl-C does) while its round
waits for the other worker; the caller reuses its output array, and a late reply of the
interrupted call must not write into it.

Rank 0 starts the call with a 0.5 s alarm; once interrupted it fills ``out`` with -7 and
leaves a file that tells rank 1 to push; then a barrier and a pull of the same key (which
read the late reply). Rank 1 pushes only once it sees the file.

argv: "pull" or "pushpull".
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import kvstore

FLAG = "rank0-interrupted"
how = sys.argv[1]


class Interrupted(Exception):
    pass


def on_alarm(signum, frame):
    raise Interrupted


kv = kvstore.create("dist_sync")
rank = kv.rank
kv.init("w", np.zeros(1000, np.float32))
ones = np.ones(1000, np.float32)
if rank == 0:
    out = np.zeros(1000, np.float32)
    if how == "pull":
        kv.push("w", ones)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        if how == "pull":
            kv.pull("w", out=out)
        else:
            kv.pushpull("w", ones, out=out)
        print("rank 0 was not interrupted", flush=True)
    except Interrupted:
        print(f"rank 0 {how} interrupted", flush=True)
    signal.setitimer(signal.ITIMER_REAL, 0)
    out[:] = -7  # the caller's array is its own again
    open(FLAG, "w").close()
    kv.barrier()
    value = np.empty(1000, np.float32)
    kv.pull("w", out=value)
    print(f"rank 0 pulled {np.unique(value).tolist()}", flush=True)
    print(f"rank 0 out holds {np.unique(out).tolist()}", flush=True)
else:
    deadline = time.monotonic() + 30
    while not os.path.exists(FLAG) and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    out = np.empty(1000, np.float32)
    kv.pushpull("w", ones, out=out)
    print(f"rank 1 pushpull got {np.unique(out).tolist()}", flush=True)
    kv.barrier()
kv.close()
print(f"rank {rank} done", flush=True)
