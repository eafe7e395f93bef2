"""dist_sync rounds with random per-worker delays and a random mix of small and big keys in
the same calls; every pulled value is checked exactly.

Every worker follows the same sequence of steps (a step pushes a subset of the keys, as one
list), drawn from the shared seed; each worker draws its own delays and its own choice of
push + pull, pushpull, pushpull_async (finished a few steps later, several in flight, the
same keys again meanwhile), or push alone (pulled later), so workers run rounds ahead of each
other. ``SGD(learning_rate=0.5)`` is set before the first push, so after n rounds a key holds
``init - 0.5 * (sum of every worker's first n pushes)``: exact in float32 for these small
integers.

argv: seed, steps.
"""

import random
import sys
import time

import numpy as np

import kvstore

seed, steps = int(sys.argv[1]), int(sys.argv[2])
kv = kvstore.create("dist_sync")
rank, W = kv.rank, kv.num_workers
# small (packed into one frame), medium (its own frame), split over servers, and big
shapes = {"s1": (3,), "s2": (5, 4), "m": (3000,), "split": (2500,), "big": (40000,)}
names = sorted(shapes)
init = {k: (np.arange(np.prod(s), dtype=np.float32) % 7).reshape(s) for k, s in shapes.items()}
kv.init(names, [init[k] for k in names])
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.5))
shared = random.Random(seed)
plan = [shared.sample(names, shared.randint(1, len(names))) for _ in range(steps)]
mine = random.Random(seed * 7919 + rank)


def grad(r, key, n):
    g = np.random.default_rng([seed, r, names.index(key), n])
    return g.integers(-8, 9, size=shapes[key]).astype(np.float32)


def expected(key, n):
    total = sum(grad(r, key, i) for r in range(W) for i in range(n))
    return init[key] - np.float32(0.5) * total if n else init[key]


pushed = dict.fromkeys(names, 0)
unchecked = set()
checks = 0


def check(keys, outs):
    global checks
    for key, out in zip(keys, outs, strict=True):
        want = expected(key, pushed[key])
        if not np.array_equal(out, want):
            bad = int(np.sum(out != want))
            print(f"rank {rank}: {key} after {pushed[key]} pushes: {bad} wrong", flush=True)
            sys.exit(5)
        checks += 1


in_flight: list = []  # (pending, keys, outs, the push counts it must show)


def finish(count):
    while len(in_flight) > count:
        pending, keys, outs, counts = in_flight.pop(0)
        pending.wait()
        for key, out, n in zip(keys, outs, counts, strict=True):
            want = expected(key, n)
            if not np.array_equal(out, want):
                print(f"rank {rank}: async {key} after {n} pushes: wrong", flush=True)
                sys.exit(5)


for step, keys in enumerate(plan):
    time.sleep(mine.choice([0, 0, 0.001, 0.01, 0.05]))
    grads = [grad(rank, k, pushed[k]) for k in keys]
    outs = [np.empty(shapes[k], np.float32) for k in keys]
    how = mine.choice(["push+pull", "pushpull", "push", "async", "async"])
    for k in keys:
        pushed[k] += 1
    if how == "async":
        pending = kv.pushpull_async(keys, grads, out=outs)
        in_flight.append((pending, keys, outs, [pushed[k] for k in keys]))
        finish(mine.randint(0, 3))
    elif how == "pushpull":
        kv.pushpull(keys, grads, out=outs)
        check(keys, outs)
    else:
        kv.push(keys, grads)
        unchecked.update(keys)
        if how == "push+pull" or step == steps - 1:
            later = sorted(unchecked)
            outs = [np.empty(shapes[k], np.float32) for k in later]
            kv.pull(later, out=outs)
            check(later, outs)
            unchecked.clear()
finish(0)
channels = len(kv._channels)  # (closed by close)
kv.close()
print(f"rank {rank} shares memory with {len(kv._planner.shm_servers)} servers", flush=True)
print(f"rank {rank} talks by channel with {channels} servers", flush=True)
print(f"rank {rank} OK: {checks} pulled values exact", flush=True)
