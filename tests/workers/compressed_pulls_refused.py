"""dist_async and replicated jobs refuse compressed pulls (a pull there reads no round's sum,
or a backup would hold no codes); dist_sync takes them, then refuses an optimizer; a server
refuses codes asked with different parameters in one round.

argv: kv type.
"""

import os
import sys

import numpy as np

import kvstore
from kvstore.compression import Compression


def refused(call, error, text: str) -> None:
    """``call()`` raises ``error`` saying ``text``."""
    try:
        call()
    except error as exc:
        assert text in str(exc), exc
    else:
        raise AssertionError(f"taken, where {text!r} was expected")


kv = kvstore.create(sys.argv[1])
both_ways = {"type": "2bit", "threshold": 0.5, "pull": True}
if os.environ.get("KVSTORE_REPLICAS") == "2":
    refused(lambda: kv.set_gradient_compression(both_ways), ValueError, "KVSTORE_REPLICAS > 1")
elif kv.type == "dist_async":
    refused(lambda: kv.set_gradient_compression(both_ways), ValueError, "need dist_sync")
    kv.set_gradient_compression({"type": "2bit"})  # pushes alone: as before
else:
    kv.init("w", np.zeros(4, np.float32))
    kv.set_gradient_compression(both_ways)
    sgd = kvstore.optimizer.SGD(learning_rate=0.1)
    refused(lambda: kv.set_optimizer(sgd), ValueError, "compressed pulls carry sums of gradients")
    out = np.empty(4, np.float32)
    kv.pushpull("w", np.array([0.7, -0.6, 0.1, 0.5], np.float32), out=out)
    np.testing.assert_array_equal(out, [0.5, -0.5, 0, 0.5])
    # the same round pulled with another threshold: a clear error, not other floats
    kv._compression = Compression.from_params({**both_ways, "threshold": 0.25})
    refused(lambda: kv.pull("w", out=out), kvstore.KVStoreError, "different gradient compressions")
print("rank 0 OK", flush=True)
