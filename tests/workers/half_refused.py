"""A call that one server refuses after another took its part, and a worker that goes on.

Key "a" is split over two servers; "b" is small and lives on one of them. Rank 1 initialises
"b" as int32 while rank 0 (whose init the servers store) made it float32, so the server of
"b" refuses rank 1's ``pushpull(["a", "b"])`` (and the part of "a" in the same message),
while the other server takes its part of "a". Rank 1 catches the error and goes on pushing
"a"; rank 0 pushes "a" only.

Call k of rank r pushes ``k + 100 * r`` everywhere, so a round's sum is one number: a value
made of two different numbers mixes rounds. Every outcome is printed: ``call k got [...]``
or ``call k raised: ...``.

argv: calls of rank 0, calls of rank 1 (the first of them is the refused one).
"""

import sys

import numpy as np

import kvstore

calls = {0: int(sys.argv[1]), 1: int(sys.argv[2])}
n = 2000  # over KVSTORE_BIGARRAY_BOUND: one part on each server
kv = kvstore.create("dist_sync")
rank = kv.rank
kv.init("a", np.zeros(n, np.float32))
kv.init("b", np.zeros(10, np.float32 if rank == 0 else np.int32))
out, out_b = np.empty(n, np.float32), np.empty(10, np.float32 if rank == 0 else np.int32)
raised = 0
for k in range(1, calls[rank] + 1):
    grad = np.full(n, k + 100 * rank, np.float32)
    try:
        if rank == 1 and k == 1:
            kv.pushpull(["a", "b"], [grad, np.ones(10, np.int32)], out=[out, out_b])
        else:
            kv.pushpull("a", grad, out=out)
    except kvstore.KVStoreError as exc:
        raised += 1
        print(f"rank {rank} call {k} raised {type(exc).__name__}: {exc}", flush=True)
        if rank == 0:
            sys.exit(3)
        continue
    values = np.unique(out)
    print(f"rank {rank} call {k} got {values.tolist()[:4]}", flush=True)
print(f"rank {rank} done: {raised} calls raised", flush=True)
