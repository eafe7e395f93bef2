"""MXNet's nightly dist_sync_kvstore.py row-sparse checks, in our API, batched in one script.

- ``check_row_sparse_keys``: each worker pushes one row (``rank % rows``) of a small key; each
  pulls a random multiset of ids (repeats, unsorted, a 2-D id array) and sees every worker's
  pushes so far, and 0 in the rows it did not ask for.
- ``check_row_sparse_keys_with_zeros``: every worker pushes no rows (a small and a big key);
  the values stay 1, and a pull of no ids gives all 0.
- ``check_big_row_sparse_keys``: a 1200 x 1200 key; each worker pushes a strided subset of
  30% of the rows; a pull of 1200 random ids per worker.
- beyond MXNet: a 10^9-row key with a seeded initializer (the same first values on every
  worker and server), several outputs with one id set and with one per output, pushes from
  two "devices" summed, keys with zero rows among others in a list, pushpull, save_rows,
  row admission after 2 rounds.

With ``SGD(learning_rate=1, rescale_grad=rate)`` and pushes of ``-(rank + 1)``, a row pushed
by a set of workers gains ``rate * sum(rank + 1)`` per round, as MXNet's 'test' optimizer.

argv: kv type (dist_sync), dtype, seed, and optionally the keys' sharding (hash, range).
"""

import sys

import numpy as np

import kvstore
from kvstore.sparse import RowSparse, init_rows, keyed, uniform

kind, dtype, seed = sys.argv[1], np.dtype(sys.argv[2]), int(sys.argv[3])
sharding = sys.argv[4] if len(sys.argv) > 4 else None


def table(v):  # a key's initial value, with the sharding asked
    return RowSparse(v.indices, v.data, v.shape, v.init, sharding=sharding)


kv = kvstore.create(kind)
rank, W = kv.rank, kv.num_workers
rate, nrepeat = 2.0, 3
shape, big_shape, huge = (2, 3), (1200, 1200), (10**9, 16)
kv.init(["9", "11"], [table(RowSparse.from_dense(np.ones(shape, dtype)))] * 2)
kv.init("97", table(RowSparse.from_dense(np.ones(big_shape, dtype))))
init = uniform(-0.5, 0.5, seed=42)
kv.init("huge", RowSparse.empty(huge, dtype, init=init, sharding=sharding))
kv.init("dense", np.ones(shape, dtype))
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0, rescale_grad=rate))


def check(name, got, want):
    if not np.array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64)):
        bad = np.argwhere(np.asarray(got) != np.asarray(want))[:5].tolist()
        print(f"rank {rank}: {name}: mismatch at {bad}", flush=True)
        sys.exit(5)


def grad(rows, shape_, value):
    rows = np.asarray(rows, np.int64)
    return RowSparse(rows, np.full((rows.size, shape_[1]), value, dtype), shape_)


# check_row_sparse_keys
rng = np.random.default_rng(seed * 100 + rank)
for i in range(nrepeat):
    kv.push("9", grad([rank % shape[0]], shape, -(rank + 1)))
    ids = rng.integers(0, shape[0], size=shape[0]).reshape(shape[0] // 2, 2)
    out = np.zeros(shape, dtype)
    kv.row_sparse_pull("9", out=out, row_ids=ids)
    updated = np.ones(shape)
    for r in range(W):
        updated[r % shape[0]] += (r + 1) * rate * (i + 1)
    want = np.zeros(shape)
    want[ids.ravel()] = updated[ids.ravel()]
    check("row_sparse_keys", out, want)

# check_row_sparse_keys_with_zeros (a small and a big key, no rows pushed)
for _ in range(nrepeat):
    kv.push("11", RowSparse.empty(shape, dtype))
    kv.push("97", RowSparse.empty(big_shape, dtype))
    val = np.zeros(shape, dtype)
    kv.row_sparse_pull("11", out=val, row_ids=np.arange(shape[0]))
    check("zeros small", val, np.ones(shape))
    big_val = np.zeros(big_shape, dtype)
    kv.row_sparse_pull("97", out=big_val, row_ids=np.arange(big_shape[0]))
    check("zeros big", big_val, np.ones(big_shape))
    kv.row_sparse_pull("97", out=big_val, row_ids=np.array([], np.int64))
    check("zeros big empty pull", big_val, np.zeros(big_shape))
    kv.row_sparse_pull("11", out=val, row_ids=np.array([], np.int64))
    check("zeros empty pull", val, np.zeros(shape))

# check_big_row_sparse_keys
pick = np.random.default_rng(123).random(big_shape[0])
indices = np.argwhere(pick < 0.3).ravel()
update_rows = [indices[:: (r + 1) * 2] for r in range(W)]
rows_me = update_rows[rank]
for i in range(nrepeat):
    kv.push("97", grad(rows_me, big_shape, -(rank + 1)))
    ids = np.random.default_rng(rank).integers(0, big_shape[0], size=big_shape[0])
    val = RowSparse.empty(big_shape, dtype)
    kv.row_sparse_pull("97", out=val, row_ids=ids.reshape(-1, 2))
    updated = np.ones(big_shape[0])
    for r in range(W):
        updated[update_rows[r]] += (r + 1) * rate * (i + 1)
    check("big ids", val.indices, np.unique(ids))
    check("big rows", val.data, np.repeat(updated[np.unique(ids)][:, None], big_shape[1], 1))

# a 10^9-row table: rows start from the seeded initializer, every worker pushes rows that
# overlap (duplicates within a push are summed), from two "devices"
mine = np.array([5, 10**9 - 1, 123456789, 5, 7 * (rank + 1)], np.int64)
dev = grad(mine, huge, -1.0)
kv.push("huge", [dev, dev])  # two devices: summed, duplicates too
seen = np.unique(np.concatenate([[5, 10**9 - 1, 123456789, 7 * (r + 1)] for r in range(W)]))
counts = {int(x): 0.0 for x in seen}
for r in range(W):
    for x in [5, 10**9 - 1, 123456789, 5, 7 * (r + 1)]:
        counts[x] += 2 * rate  # -(-1) * 2 devices * rate
ask = np.array([10**9 - 1, 5, 42, 5] + [7 * (r + 1) for r in range(W)], np.int64)
outs = [RowSparse.empty(huge, dtype), RowSparse.empty(huge, dtype)]
kv.row_sparse_pull("huge", out=outs, row_ids=[ask, ask[:2]])
first = init_rows(init, np.unique(ask), huge[1], dtype)
want = first + np.array([counts.get(int(x), 0.0) for x in np.unique(ask)], dtype)[:, None]
check("huge ids", outs[0].indices, np.unique(ask))
check("huge rows", outs[0].data, want)
check("huge second out", outs[1].data, want[np.searchsorted(np.unique(ask), np.unique(ask[:2]))])

# a list of keys, one with no rows, beside a dense key; then pushpull writes rows back
kv.push(
    ["11", "dense", "huge"],
    [RowSparse.empty(shape, dtype), np.ones(shape, dtype), RowSparse.empty(huge, dtype)],
)
back = grad([5], huge, 0.0)
kv.pushpull("huge", back)
check("pushpull ids", back.indices, [5])
check("pushpull rows", back.data, want[np.searchsorted(np.unique(ask), [5])])

# save_rows: every row touched so far (created rows count), then nothing new
rows, step = kv.save_rows("huge", since=0)
check("save_rows ids", rows.indices, seen)
again, step2 = kv.save_rows("huge", since=step)
check("save_rows since", again.nnz, 0)
# admission: a row is stored from the 2nd round that pushes it (a round counts once,
# whatever the number of workers pushing the row); the SGD update then starts from its
# initial value (0 here)
kv.init("adm", RowSparse.empty(shape, dtype, admit_after=2, sharding=sharding))
for i in range(2):
    kv.push("adm", grad([1], shape, -(rank + 1)))
    got = np.zeros(shape, dtype)
    kv.row_sparse_pull("adm", out=got, row_ids=[1])
    check(f"admission round {i}", got[1], [0.0 if i == 0 else rate * W * (W + 1) / 2] * 3)
# two tables with the default seed (a user's two-tower model) start apart: each key's own
# seed, the same on every server and worker
for name in ("user", "item"):
    kv.init(name, RowSparse.empty(huge, dtype, init=uniform(-1, 1), sharding=sharding))
ask = np.array([0, 7, 10**8, 10**9 - 1])
first = {}
for name in ("user", "item"):
    got = RowSparse.empty(huge, dtype)
    kv.row_sparse_pull(name, out=got, row_ids=ask)
    spec = keyed(uniform(-1, 1), name)
    check(f"{name} first rows", got.data, init_rows(spec, ask, huge[1], dtype))
    first[name] = got.data
if np.array_equal(first["user"], first["item"]):
    print(f"rank {rank}: two tables with the default seed start alike", flush=True)
    sys.exit(5)
kv.close()
print(f"rank {rank} OK sparse {dtype}", flush=True)
