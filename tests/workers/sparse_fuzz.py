"""Random steps of push / pushpull / row_sparse_pull on hash and range keys (and a 10^9-row
range key with ids at the bounds), checked bit for bit against a NumPy model of dist_sync
without an optimizer: a round's touched rows become 0 + a + b in rank order of each worker's
canonical push (its own sum of devices and repeated ids, kv._rows_value). Values mix 0.0,
-0.0, NaN, huge and tiny numbers; pushes come from one or two devices, in another dtype,
unsorted, repeated, or empty; small keys (packed in the message) and big ones (shared memory
or their own frames). Each worker sleeps a random while between steps, so workers run ahead
of each other. It counts the delta replies, the full ones and the pulls read from a push's
reply, and prints them.

argv: dtype, steps, seed (printed by the test).
"""

import json
import os
import sys
import time

import numpy as np

import kvstore
from kvstore import sparse as _sp
from kvstore.sharding import row_bounds
from kvstore.sparse import RowSparse

dtype, steps, seed = np.dtype(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
kv = kvstore.create(os.environ.get("FUZZ_KIND", "dist_sync"))
rank, W = kv.rank, kv.num_workers
shapes = {"h": (60, 3), "r": (61, 3), "g": (10**9, 3), "b": (5000, 64), "c": (5001, 64)}
shard = {"h": "hash", "r": "range", "g": "range", "b": "hash", "c": "range"}
BIG = {"b", "c"}
kv.init(list(shapes), [RowSparse.empty(shapes[k], dtype, sharding=shard[k]) for k in shapes])
model = {k: ({} if k not in BIG else np.zeros(shapes[k], dtype)) for k in shapes}
counts = {"delta": 0, "delta_rows": 0, "full": 0, "served": 0}
_orig_receive = _sp.RowCollector.receive


def _receive(self, request, keys, arrays, codes=None, delta=None):
    if delta is not None:
        counts["delta"] += 1
        counts["delta_rows"] += sum(a.shape[0] for a in arrays)
    else:
        counts["full"] += 1
    return _orig_receive(self, request, keys, arrays, codes, delta)


_sp.RowCollector.receive = _receive
_orig_pfp = kv._pull_from_push


def _pfp(items):
    r = _orig_pfp(items)
    counts["served"] += bool(r)
    return r


kv._pull_from_push = _pfp
SPECIAL = np.array([0.0, -0.0, np.nan, 1.0, -1.0, 1.5, -2.25, 3e4, -3e4, 1e-7, 65504.0])
nservers = len(kv._servers)


def ids_for(key, rng, n):
    rows = shapes[key][0]
    if key == "g":
        b = np.array(row_bounds(rows, nservers))
        cand = np.concatenate(
            [b[:-1], b[1:] - 1, np.maximum(b[1:-1] - 1, 0), rng.integers(0, rows, 8)]
        )
        return rng.choice(cand, n)
    return rng.integers(0, rows, n)


def values(rng, n, dim, as_dtype):
    def part():
        v = np.where(
            rng.random((n, dim)) < 0.5,
            rng.choice(SPECIAL, (n, dim)),
            rng.standard_normal((n, dim)) * 10,
        )
        return v

    v = part()
    if as_dtype.kind == "c":
        v = v + 1j * part()
    return v.astype(as_dtype)


def pushed_value(step, r, key):
    """Worker r's value for key at step (deterministic): one or two devices, duplicates,
    unsorted, other dtypes, sometimes no rows."""
    rng = np.random.default_rng([seed, step, r, ord(key)])
    shape = shapes[key]
    n = 0 if rng.random() < 0.15 else int(rng.integers(1, 12))
    if key in BIG:
        n = 0 if n == 0 else int(rng.integers(200, 2500))
    form = rng.integers(0, 4)
    src = dtype
    if form == 1 and dtype == np.float32:
        src = np.dtype(np.float64)  # same-kind cast on the worker
    devs = 2 if form == 2 else 1
    vals = []
    for _ in range(devs):
        ids = ids_for(key, rng, n)  # repeats, any order
        vals.append(RowSparse(ids, values(rng, n, shape[1], src), shape))
    return vals if devs > 1 else vals[0]


def canonical(step, r, key):
    c = kv._rows_value("push", key, pushed_value(step, r, key))
    return c.indices.copy(), c.data.copy()


def apply_round(step, key):
    parts = [canonical(step, r, key) for r in range(W)]
    if key in BIG:
        touched = np.unique(np.concatenate([p[0] for p in parts]))
        total = np.zeros((touched.size, shapes[key][1]), dtype)
        for ids, rows in parts:
            pos = np.searchsorted(touched, ids)
            total[pos] = total[pos] + rows
        model[key][touched] = total
        return
    touched = {}
    for ids, rows in parts:  # rank order
        for i, row in zip(ids.tolist(), rows, strict=False):
            acc = touched.get(i)
            if acc is None:
                acc = np.zeros_like(row)
            touched[i] = acc + row
    model[key].update(touched)


def want(key, ids):
    if key in BIG:
        return model[key][np.asarray(ids, np.int64)]
    dim = shapes[key][1]
    return (
        np.array([model[key].get(int(i), np.zeros(dim, dtype)) for i in ids])
        .reshape(-1, dim)
        .astype(dtype)
    )


def same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()


def check(what, key, out, ids):
    u = np.unique(np.asarray(ids).reshape(-1))
    w = want(key, u)
    if isinstance(out, RowSparse):
        ok = np.array_equal(out.indices, u) and same_bits(out.data, w)
        got = out.data
    else:
        got = out[u]
        ok = same_bits(got, w)
    if not ok:
        bad = [k for k in range(len(u)) if not same_bits(got[k], w[k])]
        print(f"{len(bad)} of {len(u)} rows differ", flush=True)
        bad = bad[:3]
        msg = "; ".join(f"id {u[k]}: got {got[k].tolist()} want {w[k].tolist()}" for k in bad)
        print(f"rank {rank} step {step} {what} key {key}: MISMATCH {msg}", flush=True)
        sys.exit(7)


for step in range(steps):
    time.sleep(np.random.default_rng([seed, step, rank, 7]).random() * 0.003)  # run ahead
    g = np.random.default_rng([seed, step // 3, 999])  # an op and keys for 3 steps in a row
    op = g.choice(["pushpull", "push_same", "push_other", "pull"])
    keys = [k for k in shapes if g.random() < 0.6] or ["h"]
    mine = [pushed_value(step, rank, k) for k in keys]
    if op == "pull":
        rng = np.random.default_rng([seed, step, rank, 5])
        for k in keys:
            ids = ids_for(k, rng, 7)
            out = RowSparse.empty(shapes[k], dtype)
            kv.row_sparse_pull(k, out=out, row_ids=ids)
            check(op, k, out, ids)
        continue
    for k in keys:
        apply_round(step, k)
    canon = [kv._rows_value("push", k, v).indices.copy() for k, v in zip(keys, mine, strict=False)]
    if op == "pushpull":
        outs = [RowSparse.empty(shapes[k], dtype) for k in keys]
        kv.pushpull(keys, mine, out=outs)
        for k, o, c in zip(keys, outs, canon, strict=False):
            check(op, k, o, c)
        continue
    kv.push(keys, mine)
    rng = np.random.default_rng([seed, step, rank, 6])
    for k, c in zip(keys, canon, strict=False):
        if op == "push_same":
            ids = c
        else:
            ids = np.concatenate([c[:2], ids_for(k, rng, 4)])
        outs = (
            [RowSparse.empty(shapes[k], dtype), np.full(shapes[k], 7, dtype)]
            if k != "g"
            else [RowSparse.empty(shapes[k], dtype)]
        )
        kv.row_sparse_pull(k, out=outs, row_ids=ids)
        for o in outs:
            check(op, k, o, ids)
segments = len(kv._segments.segments)
kv.close()
print(f"rank {rank}: OK fuzz {steps} steps {dtype}, {segments} segments", flush=True)
print("COUNTS " + json.dumps(counts), flush=True)
