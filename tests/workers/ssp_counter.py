"""dist_ssp's contract with real processes: counter keys, random delays, one slow worker.

Every worker pushes each key once per clock, the keys of a step in the same order (a worker
that pushes key x again while another pushes y again would wait for it for ever, each held
back by the other): at its clock n rank r pushes n + 1 where ``i % W == r`` (a counter per
rank in every key) and ``SGD(learning_rate=1)`` subtracts the round's sum, so after d
complete rounds every element holds ``-(1 + 2 + ... + d)``. A read at clock c (this worker's
pushes of the key) must find in every element a d with ``c - s <= d <= c``: all rounds
through ``c - s - 1`` from every worker, none the reader has not pushed (the parts of a big
key live on different servers, each with its own rounds, so they may hold different d within
the bound). Every pull is checked; the worker prints how many reads were stale (``d < c``).

argv: staleness, steps, seed, slow rank (-1: none).
"""

import random
import sys
import time

import numpy as np

import kvstore

s, steps, seed, slow = (int(a) for a in sys.argv[1:5])
kv = kvstore.create("dist_ssp", staleness=s)
rank, W = kv.rank, kv.num_workers
shapes = {"small": (W,), "big": (40000,)}  # big: split over the servers, shared memory
names = sorted(shapes)
kv.init(names, [np.zeros(shapes[k], np.float32) for k in names])
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
mine = {k: (np.arange(np.prod(shapes[k])) % W == rank).astype(np.float32) for k in names}
shared = random.Random(seed)  # the keys of each step, the same for every worker (a model)
plan = [shared.sample(names, shared.randint(1, 2)) for _ in range(steps)]
rng = random.Random(seed * 7919 + rank)  # this worker's delays and calls
clock = dict.fromkeys(names, 0)
stale = checks = 0


def grad(key):
    """This worker's push at its current clock n of ``key``: n + 1 in its own elements (a new
    value each time, so a server that read a reused buffer would be caught)."""
    return mine[key] * np.float32(clock[key] + 1)


def check(key, out):
    """Each element holds the sum 1 + 2 + ... + d of d complete rounds, d in the bound (a
    part of a big key lives on its own server, with its own rounds)."""
    global stale, checks
    d, c = (np.sqrt(8 * -out.ravel().astype(np.float64) + 1) - 1) / 2, clock[key]
    if not ((c - s <= d) & (d <= c) & (d == np.round(d))).all():
        print(f"rank {rank}: {key} at clock {c} read {sorted(set(d.tolist()))[:8]} (bound {s})")
        sys.exit(5)
    stale += int((d < c).any())
    checks += 1


outs = {k: np.empty(shapes[k], np.float32) for k in names}
for keys in plan:
    time.sleep(rng.uniform(0, 0.02) * (4 if rank == slow else 1))
    how = rng.choice(["pushpull", "push+pull", "push"])
    if how == "push":
        kv.push(keys, [grad(k) for k in keys])
        for k in keys:
            clock[k] += 1
        continue
    if how == "pushpull":
        kv.pushpull(keys, [grad(k) for k in keys], out=[outs[k] for k in keys])
        for k in keys:
            clock[k] += 1
    else:
        kv.push(keys, [grad(k) for k in keys])
        for k in keys:
            clock[k] += 1
        kv.pull(keys, out=[outs[k] for k in keys])
    for k in keys:
        check(k, outs[k])
# every worker pushes each key equally often: top the keys up to ``steps`` pushes
for k in names:
    while clock[k] < steps:
        kv.push(k, grad(k))
        clock[k] += 1
    kv.pull(k, out=outs[k])
    check(k, outs[k])
kv.barrier()  # everyone's pushes are in: a pull now reads every round
for k in names:
    kv.pull(k, out=outs[k])
    if not (outs[k] == -steps * (steps + 1) / 2).all():
        print(f"rank {rank}: {k} ends at {-outs[k].max()}..{-outs[k].min()}, not {steps} rounds")
        sys.exit(5)
print(f"rank {rank}: OK {checks} reads checked, {stale} stale", flush=True)
