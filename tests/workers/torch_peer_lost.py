"""kvstore.torch as a Horovod script handles a failed collective: allreduce in a loop (bounded
in rounds and time); a HorovodInternalError is caught, printed with its kvstore type, and
ends the worker with exit 3."""

import sys
import time

import torch

import kvstore.torch as hvd

hvd.init()
torch.set_num_threads(1)
started = time.monotonic()
try:
    for step in range(100000):
        total = hvd.allreduce(torch.ones(1000), name="loop", op=hvd.Sum)
        assert total[0].item() == hvd.size(), total[0]
        print(f"round {step}", flush=True)
        if time.monotonic() - started > 60:
            break
except hvd.HorovodInternalError as exc:
    print(f"HorovodInternalError ({type(exc).__name__}): {exc}", flush=True)
    sys.exit(3)
