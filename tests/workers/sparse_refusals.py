"""A server refuses bad row-sparse requests, saying why, and serves on.

The worker sends raw ``sparse_pull`` requests (not mutating: a refusal does not fail the
store) with ids unsorted, out of range, of the other server and of the wrong dtype, and
requests of the other kind of key; each is refused with its reason, then a normal pushpull
still works. Then save_optimizer_states
and load_optimizer_states carry a row-sparse key's Adam state through two servers.
"""

import os
import tempfile

import numpy as np

import kvstore
from kvstore.errors import KVStoreError
from kvstore.sharding import row_server
from kvstore.sparse import RowSparse, uniform

kv = kvstore.create("dist_sync")
shape = (100, 2)
kv.init("e", RowSparse.empty(shape, np.float32))
kv.init("r", RowSparse.empty(shape, np.float32, sharding="range"))  # server 0: [0, 50)
ids = np.arange(100)
theirs = ids[row_server(ids, 2) == 1][:2].astype(np.int64)
mine = ids[row_server(ids, 2) == 0][:2].astype(np.int64)
cases = [
    (mine[::-1].copy(), "sorted, unique and in [0, 100)"),
    (np.array([mine[0], 100], np.int64), "sorted, unique and in [0, 100)"),
    (theirs, "row ids of another server"),
    (mine.astype(np.int32), "row ids must be 1-D int64"),
]
cases = [("e", bad, reason) for bad, reason in cases]
cases += [
    ("r", np.array([3, 50], np.int64), "row ids of another server (this one holds [0, 50)"),
    ("r", np.array([49, 99], np.int64), "row ids of another server"),
]
for key, bad, reason in cases:
    request = kv._send(0, "sparse_pull", {"keys": [[key, 0]]}, [bad])
    try:
        kv._wait("raw sparse_pull", [request])
    except KVStoreError as exc:
        assert reason in str(exc) and "sparse_pull refused" in str(exc), exc
    else:
        raise AssertionError(f"{bad} was not refused")
# a request of the other kind of key (a worker that initialised the key otherwise than
# rank 0, whose init the servers took): it says so, not "never initialised"
kv.init("dense", np.zeros(4, np.float32))
said = []
for server in range(2):
    for kind, key, arrays in (("pull", ["e", server], []), ("sparse_pull", ["dense", 0], [mine])):
        request = kv._send(server, kind, {"keys": [key]}, arrays)  # (dense: part 0, one home)
        try:
            kv._wait(f"raw {kind}", [request])
        except KVStoreError as exc:
            said.append(str(exc))
assert any("is a row-sparse key here, but this request is a dense key's" in x for x in said), said
assert any("is a dense key here, but this request is a row-sparse key's" in x for x in said), said
g = RowSparse([3, 50], np.ones((2, 2), np.float32), shape)
kv.pushpull("e", g)
assert g.data.tolist() == [[1, 1], [1, 1]], g.data
g = RowSparse([3, 50, 99], np.ones((3, 2), np.float32), shape)  # on both servers
kv.pushpull("r", g)
assert g.data.tolist() == [[1, 1]] * 3, g.data

# save_optimizer_states holds the row-sparse key's Adam state: rows and states saved, two
# more steps; then both loaded back and the same two steps again give the same rows
kv.init("s", RowSparse.empty(shape, np.float32, init=uniform(-1, 1, seed=3)))
kv.set_optimizer(kvstore.optimizer.Adam(learning_rate=0.1))
rng = np.random.default_rng(0)
ids = np.arange(0, 100, 7)
grads = [RowSparse(ids, rng.standard_normal((ids.size, 2)).astype(np.float32), shape)]
grads += [RowSparse(ids[::2], np.ones((ids[::2].size, 2), np.float32), shape)] * 3
for g in grads[:2]:
    kv.push("s", g)
rows, _ = kv.save_rows("s")
states = os.path.join(tempfile.mkdtemp(), "states")
kv.save_optimizer_states(states)
after = []
for _ in range(2):
    for g in grads[2:]:
        kv.push("s", g)
    out = np.zeros(shape, np.float32)
    kv.row_sparse_pull("s", out=out, row_ids=np.arange(100))
    after.append(out)
    kv.load_rows("s", rows)
    kv.load_optimizer_states(states)
assert np.array_equal(after[0], after[1]), np.abs(after[0] - after[1]).max()
kv.close()
print("OK refusals", flush=True)
