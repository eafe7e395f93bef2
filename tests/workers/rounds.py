"""N dist_sync rounds of integer-valued pushes; every pull must equal the NumPy result.

argv: kv type, rounds, optimizer ('none' or 'sgd'), key kind ('int' or 'str').
"""

import sys

import numpy as np

import kvstore

kind, rounds, optimizer, key_kind = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
kv = kvstore.create(kind)
W = kv.num_workers
shapes = [(3,), (4, 5), (2, 3, 4), (2500,), (7,)] + [(i + 1,) for i in range(40)]  # 2500: split
keys = (
    list(range(len(shapes))) if key_kind == "int" else [f"layer{i}.w" for i in range(len(shapes))]
)
init = [np.arange(np.prod(s), dtype=np.float32).reshape(s) / 8 for s in shapes]
kv.init(keys, init)
weights = [w.copy() for w in init]
moms = [np.zeros_like(w) for w in init]
lr, momentum, wd = np.float32(0.1), np.float32(0.9), np.float32(0.01)
if optimizer == "sgd":
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01))


def grads(rank, rnd):
    rng = np.random.default_rng(1000 * rnd + rank)
    return [rng.integers(-8, 8, size=s).astype(np.float32) for s in shapes]


for rnd in range(rounds):
    mine = grads(kv.rank, rnd)
    outs = [np.empty(s, np.float32) for s in shapes]
    if rnd % 2:
        kv.pushpull(keys, mine, out=outs)
    else:
        kv.push(keys, mine)
        kv.pull(keys, out=outs)
    total = [
        sum(g) for g in zip(*(grads(r, rnd) for r in range(W)), strict=False)
    ]  # exact: small integers
    for i, g in enumerate(total):
        if optimizer == "sgd":
            g = g + wd * weights[i]
            moms[i] = momentum * moms[i] - lr * g
            weights[i] = weights[i] + moms[i]
            np.testing.assert_allclose(outs[i], weights[i], rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(outs[i], g)
kv.close()
print(f"rank {kv.rank} OK after {rounds} rounds", flush=True)
