"""Keys of a group of workers (Horovod's process sets): W=3, group [0, 2].

Ranks 0 and 2 initialise "g" (small) and "big" (split over the servers) with members=[0, 2]
and no barrier with rank 1, which meanwhile runs rounds of a global key alone with the others
later. Each member pushes rank + 1 (times the step) for 5 steps; every pull is checked
exactly. Prints ``OK``."""

import sys

import numpy as np

import kvstore

kv = kvstore.create("dist_sync")
rank = kv.rank
group = [0, 2]
kv.init("w", np.zeros(3, np.float32))  # a global key: every worker, with a barrier
if rank in group:
    kv.init(["g", "big"], [np.zeros(5, np.float32), np.zeros(3000, np.float32)], members=group)
    out = {"g": np.empty(5, np.float32), "big": np.empty(3000, np.float32)}
    for step in range(1, 6):
        grads = [np.full(5, (rank + 1) * step, np.float32), np.full(3000, step, np.float32)]
        kv.pushpull(["g", "big"], grads, out=[out["g"], out["big"]])
        want_g, want_big = (1 + 3) * step, 2 * step  # ranks 0 and 2 push rank + 1, and 1
        if not (out["g"] == want_g).all() or not (out["big"] == want_big).all():
            print(f"rank {rank} step {step}: {out['g'][0]} {out['big'][0]}", flush=True)
            sys.exit(5)
else:
    try:
        kv.init("g", np.zeros(5, np.float32), members=group)
        print("rank 1 could init a key of a group it is not in", flush=True)
        sys.exit(5)
    except ValueError as exc:
        print("refused:", exc, flush=True)
out = np.empty(3, np.float32)
kv.pushpull("w", np.ones(3, np.float32), out=out)
if not (out == kv.num_workers).all():
    print(f"rank {rank}: w {out}", flush=True)
    sys.exit(5)
print("OK", flush=True)
