"""Many small keys of mixed dtypes and shapes in one call (the protocol packs consecutive
small 1-D arrays of one dtype as one run): every pulled value must equal the NumPy sum, to
the bit. Integer-valued pushes, so any order of adding gives the same bits.

argv: rounds.
"""

import sys

import numpy as np

import kvstore

rounds = int(sys.argv[1])
kv = kvstore.create("dist_sync")
W = kv.num_workers
rng = np.random.default_rng(7)  # the same keys on every worker
dtypes = [np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8, np.complex64]
shapes = [(1,), (3,), (256,), (4, 5), (), (5000,), (2, 1, 3)]
specs = [(dtypes[rng.integers(len(dtypes))], shapes[rng.integers(len(shapes))]) for _ in range(300)]
keys = [f"mixed{i}" for i in range(len(specs))]
kv.init(keys, [np.zeros(s, d) for d, s in specs])


def grads(rank, rnd):
    g = np.random.default_rng(1000 * rnd + rank)
    return [g.integers(0, 4, size=s).astype(d) for d, s in specs]


for rnd in range(rounds):
    outs = [np.empty(s, d) for d, s in specs]
    kv.pushpull(keys, grads(kv.rank, rnd), out=outs)
    # no optimizer: a round's sum replaces the value
    want = [sum(gs[i] for gs in (grads(r, rnd) for r in range(W))) for i in range(len(specs))]
    for key, got, w, (d, s) in zip(keys, outs, want, specs, strict=True):
        w = np.asarray(w, d).reshape(s)
        if got.dtype != w.dtype or got.shape != w.shape or got.tobytes() != w.tobytes():
            sys.exit(f"{key} ({np.dtype(d)}, {s}) round {rnd}: got {got!r:.80}, want {w!r:.80}")
kv.close()
print(f"rank {kv.rank}: OK after {rounds} rounds of {len(keys)} mixed keys", flush=True)
