"""A bad push is refused on the worker with a clear error, and the store still works."""

import sys

import numpy as np

import kvstore

kv = kvstore.create("dist_sync")
kv.init("w", np.zeros((4, 4), np.float32))
bad = np.zeros((4, 5), np.float32) if sys.argv[1] == "shape" else np.zeros((4, 4), np.complex64)
try:
    kv.push("w", bad)
except (ValueError, TypeError) as exc:
    print("refused:", exc)
    assert "push(key='w')" in str(exc)
else:
    raise SystemExit("bad push was accepted")
out = np.empty((4, 4), np.float32)
kv.pushpull("w", np.ones((4, 4), np.float32), out=out)
assert (out == 1).all()
kv.close()
