"""Keys of a group of workers (Horovod's process sets): W=3, group [0, 2].

Ranks 0 and 2 initialise "g" (small), "big" (split over the servers) and "rows" (a
row-sparse key) with members=[0, 2], in one call, and no barrier with rank 1, which meanwhile
runs rounds of a global key alone with the others later. Each member pushes rank + 1 (times
the step) for 5 steps, and rows of its own and one row both push; every pull is checked
exactly. Prints ``OK``."""

import sys

import numpy as np

import kvstore
from kvstore.sparse import RowSparse

kv = kvstore.create("dist_sync")
rank = kv.rank
group = [0, 2]
kv.init("w", np.zeros(3, np.float32))  # a global key: every worker, with a barrier
if rank in group:
    shape = (50, 3)
    kv.init(
        ["g", "big", "rows"],
        [np.zeros(5, np.float32), np.zeros(3000, np.float32), RowSparse.empty(shape, np.float32)],
        members=group,
    )
    out = {"g": np.empty(5, np.float32), "big": np.empty(3000, np.float32)}
    got = RowSparse.empty(shape, np.float32)
    for step in range(1, 6):
        grads = [np.full(5, (rank + 1) * step, np.float32), np.full(3000, step, np.float32)]
        ids = np.array([rank, 10 + step])  # its own row, and one both members push
        rows = RowSparse(ids, np.full((2, 3), (rank + 1) * step, np.float32), shape)
        kv.pushpull(["g", "big", "rows"], grads + [rows], out=[out["g"], out["big"], got])
        want_g, want_big = (1 + 3) * step, 2 * step  # ranks 0 and 2 push rank + 1, and 1
        if not (out["g"] == want_g).all() or not (out["big"] == want_big).all():
            print(f"rank {rank} step {step}: {out['g'][0]} {out['big'][0]}", flush=True)
            sys.exit(5)
        kv.row_sparse_pull("rows", out=got, row_ids=np.array([0, 2, 10 + step]))
        want = np.repeat(np.array([[1], [3], [4]], np.float32) * step, 3, axis=1)
        if got.indices.tolist() != [0, 2, 10 + step] or not np.array_equal(got.data, want):
            print(f"rank {rank} step {step}: rows {got.indices} {got.data}", flush=True)
            sys.exit(5)
else:
    try:
        kv.init("g", np.zeros(5, np.float32), members=group)
        print("rank 1 could init a key of a group it is not in", flush=True)
        sys.exit(5)
    except ValueError as exc:
        print("refused:", exc, flush=True)
out = np.empty(3, np.float32)
kv.pushpull("w", np.ones(3, np.float32), out=out)
if not (out == kv.num_workers).all():
    print(f"rank {rank}: w {out}", flush=True)
    sys.exit(5)
print("OK", flush=True)
