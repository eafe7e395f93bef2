"""Row-sparse training with replicated servers: per-rank random row sets (some empty, some
rows pushed by several workers), random delays; prints the hash of every stored row and, with
an optimizer, of the optimizer state the servers give back. The hash must not depend on the
timing, on KVSTORE_REPLICAS, nor on a server killed or frozen on the way.

argv: steps, optimizer (none | sgd | adam), call (pushpull | push: a push, then a
row_sparse_pull of the same rows). The hash covers each table's step and the rows changed in
its last rounds too, and one table admits and evicts rows. Every worker prints "step N at T"
as it goes, so a test can kill a server mid-run.
"""

import hashlib
import os
import random
import sys
import time

import numpy as np

import kvstore
from kvstore.sparse import RowSparse, uniform

steps, which, call = int(sys.argv[1]), sys.argv[2], sys.argv[3]
kv = kvstore.create("dist_sync")
rank = kv.rank
# a hashed 10^6-row table (rows created on first push), a range-sharded one loaded with rows
# at init, and a dense key beside them
emb, cat = (1_000_000, 64), (5_000, 4)
kv.init("emb", RowSparse.empty(emb, np.float32, init=uniform(-0.1, 0.1, seed=3)))
start = np.arange(0, cat[0], 7)
kv.init(
    "cat", RowSparse(start, np.full((start.size, cat[1]), 0.25, np.float32), cat, None, "range")
)
# admission (a row stored from its 2nd round) and eviction (after 6 rounds untouched)
adm = (3_000, 4)
kv.init("adm", RowSparse.empty(adm, np.float32, admit_after=2, evict_after=6))
kv.init("w", np.full(7, 0.5, np.float32))
if rank == 0:  # rows loaded into every replica (a checkpoint's), before training
    loaded = np.arange(3, cat[0], 11)
    kv.load_rows("cat", RowSparse(loaded, np.full((loaded.size, cat[1]), 0.75, np.float32), cat))
kv.barrier()
if which == "sgd":
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
elif which == "adam":
    kv.set_optimizer(kvstore.optimizer.Adam(learning_rate=0.01))
delays = random.Random(os.urandom(8))  # a different timing in every run


def grad(shape, step, salt):
    g = np.random.default_rng([rank, step, salt])
    count = int(g.choice([0, 1, 40, 1500]))
    # a narrow id range: workers push some of the same rows (and "emb"'s biggest pushes go
    # through shared segments, over 64 KiB a server)
    ids = np.unique(g.integers(0, min(shape[0], 4_000), count))
    return RowSparse(ids, g.standard_normal((ids.size, shape[1])).astype(np.float32), shape)


out_w = np.empty(7, np.float32)
for step in range(steps):
    time.sleep(delays.choice([0, 0, 0.002, 0.01, 0.03]))
    for name, shape, salt in (("emb", emb, 1), ("cat", cat, 2), ("adm", adm, 3)):
        g = grad(shape, step, salt)
        out = RowSparse.empty(shape, np.float32)
        if call == "push":
            kv.push(name, g)
            kv.row_sparse_pull(name, out=out, row_ids=g.indices)
        else:
            kv.pushpull(name, g, out=out)
        assert np.array_equal(out.indices, g.indices), (name, step)
    w = np.random.default_rng([rank, step, 9]).standard_normal(7).astype(np.float32)
    kv.pushpull("w", w, out=out_w)
    print(f"step {step} at {time.time():.3f}", flush=True)
digest = hashlib.sha256()
stats = kv.server_stats()  # each part counted once: by its primary, or whoever took it over
for name in ("emb", "cat", "adm"):
    rows, step = kv.save_rows(name)  # the step too: every copy counted the same rounds
    digest.update(rows.indices.tobytes() + rows.data.tobytes() + str(step).encode())
    changed, _ = kv.save_rows(name, since=step - 3)  # and stamped its rows alike
    digest.update(changed.indices.tobytes())
    counted = sum(s["rows"][name]["rows"] for s in stats)
    assert counted == rows.nnz, (name, counted, rows.nnz, stats)
kv.pull("w", out=out_w)
digest.update(out_w.tobytes())
if which != "none":
    kv.save_optimizer_states(f"states{rank}.bin")
    with open(f"states{rank}.bin", "rb") as f:
        digest.update(f.read())
kv.close()
print(f"rank {rank} weights {digest.hexdigest()}", flush=True)
