"""Two mistakes with the servers' optimizer, each caught with a clear error.

- ``load-first``: ``load_optimizer_states`` before any ``set_optimizer`` (every server
  refuses it alike, nothing changed): the error says what to do and the store goes on, here
  to set the optimizer and push, with the right sum.
- ``different``: the workers set different optimizers in the same call (each its own
  learning rate): refused (which worker hears it depends on which came first to each
  server), never left to timing. Prints ``REFUSED`` with the error, or ``SET``.
- ``changed``: every worker sets A, pushes, then every worker sets B (a schedule changed
  by hand, as MXNet allows): B replaces A; the last worker to set B changes nothing.

argv: mode, state file (load-first).
"""

import os
import sys
import time

import msgpack
import numpy as np

import kvstore
from kvstore.errors import KVStoreError
from kvstore.optimizer import SGD

mode = sys.argv[1]
kv = kvstore.create("dist_sync")
rank, W = kv.rank, kv.num_workers
kv.init("w", np.ones(4, np.float32))
out = np.empty(4, np.float32)

if mode == "load-first":
    path = f"{sys.argv[2]}.{rank}"
    with open(path, "wb") as f:
        f.write(msgpack.packb({"servers": [b"x"] * int(os.environ["DMLC_NUM_SERVER"])}))
    try:
        kv.load_optimizer_states(path)
        raise SystemExit("load_optimizer_states without an optimizer was taken")
    except KVStoreError as exc:
        print("REFUSED", exc, flush=True)
        assert "call set_optimizer first" in str(exc), exc
    kv.barrier()  # every worker's load refused before anyone sets the optimizer
    kv.set_optimizer(SGD(learning_rate=1.0))
    kv.pushpull("w", np.full(4, 1.0, np.float32), out=out)
    want = 1.0 - W  # one round: every worker's 1, at rate 1
    assert (out == want).all(), (out, want)
    print(f"OK {want}", flush=True)
elif mode == "different":
    try:
        kv.set_optimizer(SGD(learning_rate=0.1 * (rank + 1)))
        print("SET", flush=True)
    except KVStoreError as exc:
        print("REFUSED", exc, flush=True)
elif mode == "changed":
    kv.set_optimizer(SGD(learning_rate=1.0))
    kv.pushpull("w", np.full(4, 1.0, np.float32), out=out)
    assert (out == 1.0 - W).all(), out
    kv.barrier()
    if rank == W - 1:
        time.sleep(0.3)  # its second set_optimizer comes last
    kv.set_optimizer(SGD(learning_rate=0.5))
    kv.pushpull("w", np.full(4, 1.0, np.float32), out=out)
    want = 1.0 - W - 0.5 * W
    assert (out == want).all(), (out, want)
    print(f"OK {want}", flush=True)
kv.close()
