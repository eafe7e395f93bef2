"""A save_rows / load_rows checkpoint of a row-sparse key holds every stored row.

Key "e" starts with rows 1 and 2 (never pushed); each worker pushes one row per round.
``save_rows("e")`` gives every stored row (the starting ones too) and the step; loaded into
a fresh key "f" with that step, ``save_rows("f")`` gives the same rows and step, and
``save_rows("f", since=step)`` nothing until a new push. A fresh key asked for rows since a
step it never reached is refused, saying what to do.

argv: kv type.
"""

import sys

import numpy as np

import kvstore
from kvstore.sparse import RowSparse

kv = kvstore.create(sys.argv[1])
rank, W = kv.rank, kv.num_workers
shape = (40, 3)
start = RowSparse([1, 2], np.full((2, 3), 5.0, np.float32), shape)
kv.init("e", start)
kv.init(["f", "g"], [RowSparse.empty(shape, np.float32)] * 2)
rows, step = kv.save_rows("e")
assert rows.indices.tolist() == [1, 2] and step == 0, (rows.indices, step)
kv.barrier()  # dist_async applies a push on arrival: none before every worker has looked
for n in range(3):
    kv.push("e", RowSparse([10 + W * n + rank], np.full((1, 3), rank + 1.0, np.float32), shape))
kv.barrier()
rows, step = kv.save_rows("e")
want = sorted([1, 2] + [10 + W * n + r for n in range(3) for r in range(W)])
assert rows.indices.tolist() == want, (rows.indices, want)
if rank == 0:
    kv.load_rows("f", rows, step=step)
kv.barrier()
again, step_f = kv.save_rows("f")
assert again.indices.tolist() == want and np.array_equal(again.data, rows.data)
assert step_f == step, (step_f, step)
assert kv.save_rows("f", since=step)[0].nnz == 0
try:
    kv.save_rows("g", since=step)
except ValueError as exc:
    assert "past the current step 0" in str(exc) and "since=None" in str(exc), exc
else:
    raise AssertionError("save_rows since a step never reached was not refused")
kv.close()
print(f"rank {rank} OK checkpoint rows", flush=True)
