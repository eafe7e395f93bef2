"""Row-sparse rows through same-host shared segments, exactly: pushes of growing and
shrinking row sets (each key's segment is made, replaced by a bigger one twice, then reused),
answered by push + row_sparse_pull, pushpull, and pulls of other ids (more than a segment
holds: TCP), and a push made again before the first is answered (TCP); each checked bit for
bit against a NumPy model of the rounds (no optimizer: a round's touched rows become 0 + the
pushes in rank order; a pushed -0.0 comes back 0.0).

argv: steps.
"""

import sys

import numpy as np

import kvstore
from kvstore.sparse import RowSparse, init_rows, uniform

steps = int(sys.argv[1])
kv = kvstore.create("dist_sync")
rank, W = kv.rank, kv.num_workers
shape = (6000, 64)  # 256-byte rows: 256 of them to a server fill the 64 KiB threshold
init = uniform(-1, 1, seed=3)
kv.init("e", RowSparse.empty(shape, np.float32, init=init))
want = init_rows(init, np.arange(shape[0]), shape[1], np.float32)
sizes = [300, 900, 2500, 600, 4000]
checks = 0


def pushes(step):
    """Every worker's push of a step: (ids, rows) per rank."""
    out = []
    for r in range(W):
        rng = np.random.default_rng([r, step])
        ids = np.unique(rng.integers(0, shape[0], sizes[step % len(sizes)]))
        rows = rng.standard_normal((ids.size, shape[1]), dtype=np.float32)
        rows[rng.random(rows.shape) < 0.05] = -0.0  # a round makes it 0.0 (0 + a + b)
        out.append((ids, rows))
    return out


for step in range(steps):
    every = pushes(step)
    total = np.zeros(shape, np.float32)
    for ids, rows in every:  # rank order
        total[ids] += rows
    touched = np.unique(np.concatenate([ids for ids, _ in every]))
    want[touched] = total[touched]
    ids, rows = every[rank]
    grad = RowSparse(ids, rows, shape)
    # 0: push, pull the same ids; 1: pushpull; 2: push, pull others; 3: push twice, pull.
    # A 0 after a 2 pushes without asking for its rows back (the pull before asked for
    # others): its rows go through the segment as pushed, 0 + in place, and the pull
    # reads them from the servers
    how = (0, 1, 2, 0, 3)[step % 5]
    if how in (0, 3):
        kv.push("e", grad)
        if how == 3:  # again, the first unanswered: TCP (the same rows: the same result)
            kv.push("e", grad)
        out = RowSparse.empty(shape, np.float32)
        kv.row_sparse_pull("e", out=out, row_ids=ids)
        got, asked = out.data, out.indices
    elif how == 1:
        out = RowSparse.empty(shape, np.float32)
        kv.pushpull("e", grad, out=out)
        got, asked = out.data, out.indices
    else:
        kv.push("e", grad)
        asked = np.random.default_rng([step, 99]).integers(0, shape[0], 5000)
        dense = np.zeros(shape, np.float32)
        kv.row_sparse_pull("e", out=dense, row_ids=asked)
        asked = np.unique(asked)
        got = dense[asked]
    bits, wanted = got.view(np.uint32), want[asked].view(np.uint32)
    if not np.array_equal(bits, wanted):  # bit for bit (-0.0 is not 0.0)
        bad = asked[np.flatnonzero((bits != wanted).any(axis=1))]
        print(f"rank {rank} step {step}: rows {bad[:5]} differ", flush=True)
        sys.exit(5)
    checks += 1
segments = len([w for w in kv._segments.segments if w[0] == "e"])
kv.close()
print(f"rank {rank} shares memory with {len(kv._planner.shm_servers)} servers", flush=True)
print(f"rank {rank} rows through {segments} segments; OK {checks} steps exact", flush=True)
