"""A KVStore script written for kvstore.elastic (Horovod's elastic loop, no framework): an
int-keyed store with an SGD optimizer on the servers (lr 1, so every round takes the count of
its pushes off the weight), epochs and batches kept in a ``State``, a commit every step.
Prints "start E.B rank R size N" at every (re)start of the training function, and "step E.B
w W rank R size N" at every step; a newcomer prints "late" first.

argv: epochs, batches per epoch, seconds per step.
"""

import sys
import time

import numpy as np

import kvstore
import kvstore.elastic

epochs, batches, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
kv = kvstore.create("dist_sync")
kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
kv.init(0, np.zeros(1, np.float32))
if getattr(kv, "_late", False):
    print(f"late: slot {kv._rank}", flush=True)
state = kvstore.elastic.State(kv, epoch=0, batch=0)
state.register_reset_callbacks([lambda: print(f"reset size {state.size}", flush=True)])


@kvstore.elastic.run
def train(state):
    print(f"start {state.epoch}.{state.batch} rank {state.rank} size {state.size}", flush=True)
    w = np.zeros(1, np.float32)
    for state.epoch in range(state.epoch, epochs):  # noqa: B020 (Horovod's idiom)
        for batch in range(state.batch, batches):
            kv.pushpull(0, np.ones(1, np.float32), out=w)
            print(f"step {state.epoch}.{batch} w {w[0]:g} rank {state.rank} size {state.size}")
            sys.stdout.flush()
            time.sleep(pause)
            state.batch = batch + 1  # the next batch to do
            state.commit()
        state.batch = 0


train(state)
print("done", flush=True)
