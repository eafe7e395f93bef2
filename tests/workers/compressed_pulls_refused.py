"""dist_async refuses compressed pulls (a pull there reads no round's sum); dist_sync takes
them, then refuses an optimizer; a server refuses codes asked with different parameters
in one round.

argv: kv type.
"""

import os
import sys

import numpy as np

import kvstore
from kvstore.compression import Compression

kv = kvstore.create(sys.argv[1])
if os.environ.get("KVSTORE_REPLICAS") == "2":
    try:
        kv.set_gradient_compression({"type": "2bit", "pull": True})
    except ValueError as exc:
        assert "not available with KVSTORE_REPLICAS > 1" in str(exc), exc
    else:
        raise AssertionError("a replicated job took compressed pulls")
    print("rank 0 OK", flush=True)
    sys.exit(0)
if kv.type == "dist_async":
    try:
        kv.set_gradient_compression({"type": "2bit", "pull": True})
    except ValueError as exc:
        assert "need dist_sync" in str(exc), exc
    else:
        raise AssertionError("dist_async took compressed pulls")
    kv.set_gradient_compression({"type": "2bit"})  # pushes alone: as before
    print("rank 0 OK", flush=True)
    sys.exit(0)
kv.init("w", np.zeros(4, np.float32))
kv.set_gradient_compression({"type": "2bit", "threshold": 0.5, "pull": True})
try:
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))
except ValueError as exc:
    assert "compressed pulls carry sums of gradients" in str(exc), exc
else:
    raise AssertionError("set_optimizer was taken with compressed pulls on")
out = np.empty(4, np.float32)
kv.pushpull("w", np.array([0.7, -0.6, 0.1, 0.5], np.float32), out=out)
np.testing.assert_array_equal(out, [0.5, -0.5, 0, 0.5])
# the same round pulled with another threshold: a clear error, not other floats
kv._compression = Compression.from_params({"type": "2bit", "threshold": 0.25, "pull": True})
try:
    kv.pull("w", out=out)
except kvstore.KVStoreError as exc:
    assert "different gradient compressions" in str(exc), exc
else:
    raise AssertionError("a pull with other compression parameters was answered")
print("rank 0 OK", flush=True)
