"""BMUF through a real cluster on the data the test wrote; saves this worker's models.

argv: data.npz, output prefix, outer ("bmuf" or "nag"), nesterov (0/1), reset (0/1).
"""

import sys

import numpy as np

import kvstore
from kvstore.block import BlockTrainer, block_momentum

data_path, out_prefix, outer, nesterov, reset = sys.argv[1:6]
data = np.load(data_path)
kv = kvstore.create("dist_sync")
rank, workers = kv.rank, kv.num_workers
x, y = data[f"x{rank}"], data[f"y{rank}"]
batch, block_size = int(data["batch"]), int(data["block_size"])
eta, zeta = float(data["eta"]), float(data["zeta"])
if outer == "bmuf":
    kv.set_optimizer(
        block_momentum(workers, momentum=eta, learning_rate=zeta, nesterov=nesterov == "1")
    )
else:  # DiLoCo's outer Nesterov: NAG on the look-ahead point is BMUF with Nesterov
    kv.set_optimizer(
        kvstore.optimizer.NAG(learning_rate=zeta, momentum=eta, rescale_grad=1.0 / workers)
    )
params = {"w": data["w0"].copy(), "b": data["b0"].copy()}
if rank != 0:  # the store's value wins: the first block starts from rank 0's
    params = {k: np.zeros_like(v) for k, v in params.items()}
kv.init(list(params), list(params.values()))
local = kvstore.optimizer.SGD(
    learning_rate=float(data["lr"]), momentum=float(data["mu"]), wd=float(data["wd"])
)
trainer = BlockTrainer(kv, params, local, block_size, reset_momentum=reset == "1")
starts = []
for s in range(int(data["steps"])):
    xb, yb = x[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]
    r = xb @ params["w"] + params["b"] - yb
    grads = {"w": xb.T @ r / len(yb), "b": r.sum(axis=0) / len(yb)}
    if trainer.step(grads, len(yb)):
        starts.append(np.concatenate([params["w"].ravel(), params["b"]]))
trainer.finish()
starts.append(np.concatenate([params["w"].ravel(), params["b"]]))
np.savez(f"{out_prefix}{rank}.npz", starts=np.array(starts), blocks=trainer.blocks)
print(f"rank {rank}: {trainer.blocks} blocks", flush=True)
kv.close()
