"""The same calls on dist_sync (compressed pulls, W workers) and on a ``local`` store (each
push one array per dist worker, summed as the servers sum W = 2 pushes); every value pulled
must be the same floats (the local store emulates the servers).

argv: compression type, sequence ('push-push-pull' or 'pushpull').
"""

import sys

import numpy as np

import kvstore

scheme, sequence = sys.argv[1], sys.argv[2]
params = {"type": scheme, "pull": True}
shape = (3001,)  # over KVSTORE_BIGARRAY_BOUND: cut in parts over the servers
dist, local = kvstore.create("dist_sync"), kvstore.create("local")
W, rank = dist.num_workers, dist.rank
assert W <= 2  # local's reduce_sum of W arrays is the servers' pairwise sum for W <= 2
for kv in (dist, local):
    kv.init("w", np.zeros(shape, np.float32))
    kv.set_gradient_compression(params)


def grads(rnd, kv):
    every = [
        np.random.default_rng([rnd, r]).standard_normal(shape).astype(np.float32) for r in range(W)
    ]
    return every[rank] if kv is dist else every


for rnd in range(4):
    got = []
    for kv in (dist, local):
        out = np.empty(shape, np.float32)
        if sequence == "push-push-pull":  # a round nobody pulls, then one pulled
            kv.push("w", grads(2 * rnd, kv))
            kv.push("w", grads(2 * rnd + 1, kv))
            kv.pull("w", out=out)
        else:
            kv.pushpull("w", grads(rnd, kv), out=out)
        got.append(out)
    np.testing.assert_array_equal(got[0], got[1], err_msg=f"dist vs local, round {rnd}")
dist.close()
print("OK", flush=True)
