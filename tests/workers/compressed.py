"""Compressed pushes through a distributed store: every pull equals the sum of what each
worker's quantiser sends (each worker replays every rank's quantiser to know it).

argv: kv type, compression type.
"""

import sys

import numpy as np

import kvstore
from kvstore.compression import Compression

kind, scheme = sys.argv[1], sys.argv[2]
params = {"type": scheme, "threshold": 0.5} if scheme == "2bit" else {"type": scheme}
kv = kvstore.create(kind)
kv.set_gradient_compression(params)
W = kv.num_workers
shapes = {"small": (5, 3), "big": (3001,)}  # big: split over the servers
kv.init(list(shapes), [np.zeros(s, np.float32) for s in shapes.values()])
replay = Compression.from_params(params)
residuals = [{} for _ in range(W)]
expected = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
layout = {k: kv._planner.layout[k] for k in shapes}


def grad(rank, rnd, shape):
    return np.random.default_rng(rnd * 10 + rank).standard_normal(shape).astype(np.float32)


rounds = 4
for rnd in range(rounds):
    kv.push(list(shapes), [grad(kv.rank, rnd, s) for s in shapes.values()])
    for key, shape in shapes.items():
        sent = np.zeros(int(np.prod(shape)), np.float32)
        for r in range(W):
            flat = grad(r, rnd, shape).reshape(-1)
            for _, part, lo, hi in layout[key]:  # the worker quantises each server's part
                sent[lo:hi] += replay.roundtrip(residuals[r], (key, part), flat[lo:hi])
        expected[key] = (
            sent.reshape(shape) if kind != "dist_async" else expected[key] + sent.reshape(shape)
        )
    if kind != "dist_async":
        for key, shape in shapes.items():
            out = np.empty(shape, np.float32)
            kv.pull(key, out=out)
            np.testing.assert_allclose(out, expected[key], rtol=1e-6, atol=1e-6)
kv.barrier()
for key, shape in shapes.items():
    out = np.empty(shape, np.float32)
    kv.pull(key, out=out)
    np.testing.assert_allclose(out, expected[key], rtol=1e-5, atol=1e-5)
    assert np.abs(out).sum() > 0
kv.close()
print(f"rank {kv.rank} OK", flush=True)
