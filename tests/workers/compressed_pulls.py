"""Compressed pushes and pulls (``'pull': True``) through dist_sync: every worker replays
every rank's quantiser and each server part's (its own error feedback over the round's sum,
in the fixed pairwise order; 2-bit with W times the threshold), and every value pulled must
be those floats exactly. Workers
sleep at random between calls, so they run ahead of each other.

argv: compression type, seed.
"""

import sys
import time

import numpy as np

import kvstore
from kvstore.compression import Compression
from kvstore.rounds import pairwise_sum

scheme, seed = sys.argv[1], int(sys.argv[2])
params = {"type": scheme, "pull": True}
if scheme == "2bit":
    params["threshold"] = 0.5
kv = kvstore.create("dist_sync")
W, rank = kv.num_workers, kv.rank
print(f"rank {rank}: seed {seed}", flush=True)
delays = np.random.default_rng(seed * 100 + rank)
# big: split over the servers; huge: parts over 64 KiB, which a same-host worker would
# otherwise read through its shared segment, and pieces when KVSTORE_PIECE_BYTES is small
shapes = {"small": (5, 3), "big": (3001,), "three": (3,), "huge": (70001,)}
start = np.arange(3, dtype=np.float32) + 0.3  # "three" starts at a value that is no sum
kv.init(
    list(shapes), [np.zeros(s, np.float32) if k != "three" else start for k, s in shapes.items()]
)
kv.set_gradient_compression(params)

# a value init left goes exact, not quantised
out = np.empty(3, np.float32)
kv.pull("three", out=out)
np.testing.assert_array_equal(out, start)

codec = Compression.from_params(params)
push_residuals = [{} for _ in range(W)]
pull_residuals: dict = {}
layout = {k: kv._planner.layout[k] for k in shapes}


def grad(r, rnd, shape):
    return np.random.default_rng([seed, rnd, r]).standard_normal(shape).astype(np.float32)


def expected_pull(key, rnd):
    """What every worker must read after round ``rnd`` of ``key``."""
    flat = np.empty(int(np.prod(shapes[key])), np.float32)
    for _, part, lo, hi in layout[key]:
        sent = [
            codec.roundtrip(
                push_residuals[r], (key, part), grad(r, rnd, shapes[key]).reshape(-1)[lo:hi]
            )
            for r in range(W)
        ]
        total = pairwise_sum(sent)
        flat[lo:hi] = codec.for_sums_of(W).roundtrip(pull_residuals, (key, part), total)
    return flat.reshape(shapes[key])


rounds = 6
for rnd in range(rounds):
    time.sleep(delays.uniform(0, 0.02))
    outs = {k: np.empty(s, np.float32) for k, s in shapes.items()}
    keys = list(shapes)
    kv.pushpull(keys, [grad(rank, rnd, shapes[k]) for k in keys], out=[outs[k] for k in keys])
    for key in keys:
        want = expected_pull(key, rnd)
        np.testing.assert_array_equal(outs[key], want, err_msg=f"{key} round {rnd}")
        again = np.empty(shapes[key], np.float32)
        kv.pull(key, out=again)  # a pull of the same round reads the same codes
        np.testing.assert_array_equal(again, want, err_msg=f"pull of {key} round {rnd}")
    assert np.abs(outs["big"]).sum() > 0
kv.close()
print(f"rank {rank} OK", flush=True)
