"""dist_async counters under replicas: every worker pushes +1 into every key, and into every
row of a row-sparse key, N times (small random pauses, so a server can be killed half way),
then pulls. Prints "counters C" when every element of every key and row is the same C (the
test expects W * N: no acknowledged push lost, none applied twice), else the values seen.

argv: N.
"""

import random
import sys
import time

import numpy as np

import kvstore
from kvstore.sparse import RowSparse

pushes = int(sys.argv[1])
kv = kvstore.create("dist_async")
shapes = {"a": (10,), "b": (3000,), "c": (3,), "d": (100_000,)}
names = sorted(shapes)
kv.init(names, [np.zeros(shapes[k], np.float32) for k in names])
ones = [np.ones(shapes[k], np.float32) for k in names]
table = (10_000, 4)  # row-sparse, hashed over the servers: every row pushed each time
kv.init("rows", RowSparse.empty(table, np.float32))
every = RowSparse(np.arange(table[0]), np.ones(table, np.float32), table)
for i in range(pushes):
    kv.push(names, ones)
    kv.push("rows", every)
    print(f"pushed {i}", flush=True)
    time.sleep(random.choice([0, 0.005, 0.02]))
kv.barrier()
outs = [np.empty(shapes[k], np.float32) for k in names]
kv.pull(names, out=outs)
rows, _ = kv.save_rows("rows")
outs.append(rows.data if rows.nnz == table[0] else np.zeros(1, np.float32))
seen = sorted({float(v) for o in outs for v in np.unique(o)})
kv.close()
print(f"counters {seen[0]:g}" if len(seen) == 1 else f"counters differ: {seen}", flush=True)
