"""kvstore.torch in an elastic job (``launch.py -n 2:3``): an nn.Embedding(sparse=True)
marked with row_sparse trains through hvd.elastic.run; a worker killed mid-way is replaced.
Each reset moves the row-sparse gradient keys to the new workers (the old ones had the dead
worker among their members), so no step waits for it. Every worker prints a digest of its
weights at the end: the survivors and the newcomer (synced from rank 0 at its reset, then
stepping on the same averaged gradients) must print the same.

argv: steps, then ``raise``: every worker raises HorovodInternalError once, at step 5 (a
reset with the same workers: the same keys go on); or ``fail``: every worker raises a
ValueError at step 3 (the user's own error: uncaught, the job fails); ``fail-shutdown``: the
same, with ``hvd.shutdown()`` in a ``finally`` (the store closes before the error is seen)."""

import hashlib
import os
import sys
import time

import torch

import kvstore.torch as hvd

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
MODE = sys.argv[2] if len(sys.argv) > 2 else ""
RAISE, FAIL = MODE == "raise", MODE.startswith("fail")
raised = False
hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.ModuleDict(
    {"emb": torch.nn.Embedding(1000, 8, sparse=True), "lin": torch.nn.Linear(8, 1)}
)
hvd.row_sparse(model["emb"])
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
)


def loss_of(step: int, r: int):
    g = torch.Generator().manual_seed(1000 * step + r)
    ids = torch.randint(0, 1000, (16,), generator=g)  # rows differ by rank and step
    return model["lin"](model["emb"](ids)).pow(2).mean()


@hvd.elastic.run
def train(state):
    global raised
    while state.step < STEPS:
        if RAISE and state.step == 5 and not raised:
            raised = True
            raise hvd.HorovodInternalError("raised by the test")
        if FAIL and state.step == 3:
            raise ValueError("the user's own error")
        opt.zero_grad()
        loss_of(state.step, hvd.rank()).backward()
        opt.step()
        state.step += 1
        print(f"step {state.step} of {hvd.size()} workers", flush=True)
        state.commit()
        # room for the test's kill mid-way; while a worker is missing (a replacement importing
        # torch on a loaded machine takes seconds), slower: it joins before the last step
        time.sleep(0.05 if hvd.size() == int(os.environ["DMLC_NUM_WORKER"]) else 0.5)


state = hvd.elastic.TorchState(model, opt, step=0)
try:
    train(state)
finally:
    if MODE == "fail-shutdown":
        hvd.shutdown()
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print(f"FINAL {hashlib.sha256(weights).hexdigest()[:16]} at step {state.step}", flush=True)
