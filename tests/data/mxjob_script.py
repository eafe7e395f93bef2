"""One script for every role, as a Kubeflow MXJob runs it: DMLC_ROLE decides (the scheduler
and the servers run their role inside kvstore.create and exit when the job ends)."""

import json
import os

import numpy as np

import kvstore

kv = kvstore.create("dist_sync")
config = json.loads(os.environ["MX_CONFIG"])
assert config["task"]["type"] == "worker"
kv.init("w", np.zeros(4, np.float32))
kv.push("w", np.full(4, kv.rank + 1, np.float32))
out = np.empty(4, np.float32)
kv.pull("w", out=out)
n = kv.num_workers
assert np.all(out == n * (n + 1) / 2), out
assert kv.rank == config["task"]["index"], (kv.rank, config)  # the rank hint was followed
worker_id = os.environ.get("DMLC_WORKER_ID", "unset: MX_CONFIG only")
print(f"worker {kv.rank} of {n} (DMLC_WORKER_ID {worker_id}) OK", flush=True)
