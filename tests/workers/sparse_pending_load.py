"""A row_sparse_pull after a push, with a load_rows of another worker ordered before the pull
by the round of a dense pushpull_async this worker waited for.

Worker 0: push e (round 1), load_rows e (rows 1, 2 = 100), then pushpull d.
Worker 1: pushpull_async d, push e (round 1, asking its rows back), wait for d (its round
needs worker 0's pushpull, sent after its load_rows returned), row_sparse_pull e: the load is
ordered before the pull by a store call between (pending.wait()), so the pull must read 100.
"""

import os
import time

import numpy as np

import kvstore
from kvstore.sparse import RowSparse

kv = kvstore.create("dist_sync")
rank = kv.rank
shape = (10, 2)
ids = np.array([1, 2])
kv.init("e", RowSparse.empty(shape, np.float32))
kv.init("d", np.zeros(4, np.float32))
grad = RowSparse(ids, np.ones((2, 2), np.float32), shape)
out = RowSparse.empty(shape, np.float32)
# step 0: push then pull of the same rows: key e learns to ask for its rows back
kv.push("e", grad)
kv.row_sparse_pull("e", out=out, row_ids=ids)
assert np.array_equal(out.data, 2 * np.ones((2, 2))), out.data
kv.barrier()
loaded = RowSparse(ids, np.full((2, 2), 100, np.float32), shape)
if rank == 0:
    kv.push("e", grad)  # round 1 of e
    time.sleep(1.5)  # worker 1's push of e arrives: round 1 applied, worker 1 answered
    kv.load_rows("e", loaded)
    kv.pushpull("d", np.ones(4, np.float32))
else:
    sent = []
    transmit = kv._transmit
    kv._transmit = lambda s, m: (sent.append(m.kind), transmit(s, m))[1]
    pending = kv.pushpull_async("d", np.ones(4, np.float32))
    kv.push("e", grad)  # round 1 of e
    pending.wait()  # worker 0's load_rows returned before this round of d completed
    if os.environ.get("SPARSE_CONTROL"):  # a real sparse_pull: what the pull must read
        kv._rows_pushed = {}
    kv.row_sparse_pull("e", out=out, row_ids=ids)
    print("sent", sent, "pulled", out.data.tolist())
    assert np.array_equal(out.data, loaded.data), f"stale rows {out.data.tolist()}, want 100"
kv.barrier()
print("OK pending load")
