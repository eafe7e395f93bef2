"""Pushpull one big float32 key a few times; every value is checked exactly against NumPy.

Each worker pushes small integers, so the round's sum is exact in float32. Prints how many
servers this worker shares memory with (0: every part went through TCP).

argv: elements, rounds.
"""

import sys

import numpy as np

import kvstore

size, rounds = int(sys.argv[1]), int(sys.argv[2])
kv = kvstore.create("dist_sync")
rank, W = kv.rank, kv.num_workers
kv.init("w", np.zeros(size, np.float32))


def grad(r, n):
    return np.random.default_rng([r, n]).integers(-8, 9, size=size).astype(np.float32)


out = np.empty(size, np.float32)
for n in range(rounds):
    kv.pushpull("w", grad(rank, n), out=out)
    want = sum(grad(r, n) for r in range(W))
    if not np.array_equal(out, want):
        print(f"rank {rank}: round {n}: {int(np.sum(out != want))} values wrong", flush=True)
        sys.exit(5)
shared = len(kv._planner.shm_servers)
kv.close()
print(f"rank {rank} shares memory with {shared} servers", flush=True)
print(f"rank {rank} OK: {rounds} rounds of {size * 4} bytes exact", flush=True)
