"""An elastic job's counter: every worker pushes 1 into key "count" once per step (pushpull,
no optimizer), so each round's value is the number of workers whose push it holds. Prints
each step's value with the job's size as this worker saw it ("step S value V workers N
epoch E min A max B": V the first element, A and B the least and greatest); a newcomer (a
worker that took a slot after the start) prints "late". Steps take a little while, so a
test can kill or add workers half way. A key of many elements (with a small
KVSTORE_BIGARRAY_BOUND) is cut into parts on every server.

argv: steps, seconds per step[, elements of the key (1)[, "rows": a row-sparse key of that
many rows, all pushed and pulled each step]].
"""

import sys
import time

import numpy as np

import kvstore
from kvstore.sparse import RowSparse

steps, pause = int(sys.argv[1]), float(sys.argv[2])
size = int(sys.argv[3]) if len(sys.argv) > 3 else 1
rows = sys.argv[4:] == ["rows"]
kv = kvstore.create("dist_sync")
if rows:
    ids = np.arange(size, dtype=np.int64)
    kv.init("count", RowSparse.empty((size, 1), np.float32))
else:
    kv.init("count", np.zeros(size, np.float32))
if getattr(kv, "_late", False):
    print(f"late: slot {kv._rank}, epoch {kv.epoch}", flush=True)
out = np.zeros(size, np.float32)
for step in range(steps):
    if rows:
        kv.push("count", RowSparse(ids, np.ones((size, 1), np.float32), (size, 1)))
        kv.row_sparse_pull("count", out=out.reshape(size, 1), row_ids=ids)
    else:
        kv.pushpull("count", np.ones(size, np.float32), out=out)
    print(
        f"step {step} value {out[0]:g} workers {kv.num_workers} epoch {kv.epoch} "
        f"min {out.min():g} max {out.max():g}",
        flush=True,
    )
    time.sleep(pause)
kv.close()
print("done", flush=True)
