"""A worker frozen (SIGSTOP) while a big reply to it is still being sent.

Rank 1 pushes round 0, sends a pull (answered when round 0 completes) without reading it,
pushes round 1, prints READY and is frozen by the test. Rank 0 waits for the test's go-file,
then pushes rounds 0 and 1: both must complete at once although the server's reply to rank 1
is stuck (the server must not wait for it, and round 1's update must not write into the
array that reply still reads). Then, by ``then``:

- ``resume``: the test thaws rank 1; its reply must hold round 0's value exactly.
- ``dead``: rank 0 pushes round 2 and waits; the scheduler declares rank 1 dead, and rank 0
  must hear it within the heartbeat timeout, not after KVSTORE_TIMEOUT.

argv: go-file, then.
"""

import os
import sys
import time

import numpy as np

import kvstore
from kvstore.errors import KVStoreError

go, then = sys.argv[1], sys.argv[2]
N = 8 * 1024 * 1024  # 32 MiB: far more than the socket buffers hold
kv = kvstore.create("dist_sync")
rank = kv.rank
kv.init("big", np.ones(N, np.float32))
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
grad = np.full(N, -(rank + 1), np.float32)  # each round adds 3 to every element
out = np.empty(N, np.float32)

if rank == 1:
    kv.push("big", grad)
    got = []
    pull = kv._send(0, "pull", {"keys": [["big", 0]]}, on_reply=lambda m: got.append(m.arrays[0]))
    kv.push("big", grad)
    print("READY", flush=True)  # the test freezes this process now
    kv._wait("pull", [pull])
    value = np.unique(got[0])
    print(f"rank 1 round-0 reply holds {value}", flush=True)
    if value.tolist() != [4.0]:
        sys.exit(5)
    kv.pull("big", out=out)
    assert (out == 7).all(), np.unique(out)
    kv.close()
    print("rank 1 OK", flush=True)
    sys.exit(0)

deadline = time.monotonic() + 60
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("no go-file within 60s")
    time.sleep(0.01)
t0 = time.monotonic()
kv.push("big", grad)
kv.pushpull("big", grad, out=out)
print(f"ROUNDS DONE in {time.monotonic() - t0:.2f}s, value {np.unique(out)}", flush=True)
assert (out == 7).all()
if then == "dead":
    t0 = time.monotonic()
    try:
        kv.pushpull("big", grad, out=out)
    except KVStoreError as exc:
        print(f"FAILED after {time.monotonic() - t0:.1f}s: {exc}", flush=True)
        sys.exit(3)
    sys.exit("round 2 completed without rank 1")
kv.close()
print("rank 0 OK", flush=True)
