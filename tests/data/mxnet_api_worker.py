"""A worker written as MXNet's scripts and nightly tests use the KVStore (tests/test_mxnet_api.py).

argv: the store name as MXNet spells it (e.g. Dist, dist_sync_device).
"""

import json
import sys

import numpy as np

import kvstore

kv = kvstore.create(sys.argv[1])
assert kv.type == sys.argv[1].lower(), kv.type
assert kv.is_capable(kv.OPTIMIZER) and kv.is_capable("OPTIMIZER")
nworker, rank = kv.num_workers, kv.rank
shape = (6, 3)

# keys first, pushed, then compression for later keys (MXNet's nightly dist_sync_kvstore.py)
kv.init("3", np.ones(shape, np.float32))
kv._barrier()
kv.push("3", np.ones(shape, np.float32))
out = np.empty(shape, np.float32)
kv.pull("3", out=out)
assert np.all(out == nworker), out  # no optimizer: the round's sum is stored

kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
kv.init("11221", np.zeros(shape, np.float32))
kv.push("11221", np.full(shape, 0.7, np.float32))
kv.pull("11221", out=out)
assert np.allclose(out, 0.5 * nworker), out  # each worker's push quantised to the threshold

# row_sparse_pull: only the rows asked for, the others 0
kv.init("emb", np.arange(18, dtype=np.float32).reshape(shape))
rows = np.empty(shape, np.float32)
kv.row_sparse_pull("emb", out=rows, row_ids=np.array([4, 0, 4], np.float32))
expected = np.zeros(shape, np.float32)
expected[[0, 4]] = np.arange(18, dtype=np.float32).reshape(shape)[[0, 4]]
assert np.array_equal(rows, expected), rows

# the optimizer through MXNet's command head 0, as a spec (never a pickle)
spec = kvstore.optimizer.SGD(learning_rate=0.1).spec()
kv._send_command_to_servers(0, json.dumps(spec))
kv.init("w", np.zeros(4, np.float32))
kv.push("w", np.ones(4, np.float32))
w = np.empty(4, np.float32)
kv.pull("w", out=w)
assert np.allclose(w, -0.1 * 0.5 * nworker), w  # pushes still 2-bit: 1 -> 0.5
try:
    kv._send_command_to_servers(0, "(ccopy_reg\n_reconstructor\n")
except TypeError as exc:
    assert "pickle" in str(exc)
else:
    raise AssertionError("a pickled optimizer was accepted")
kv._barrier()
print(f"rank {rank} MXNET API OK", flush=True)
