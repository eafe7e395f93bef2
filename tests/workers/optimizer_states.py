"""Adam on the servers, its states saved and loaded, every value checked against a local
store doing the same.

Three pushpulls, save (both stores), two more, load (both), two more: a load that did not
restore the state would leave the two stores apart.

argv: the state file of the distributed store.
"""

import sys

import numpy as np

import kvstore

path = sys.argv[1]
n = 1 << 20
kv = kvstore.create("dist_sync")
local = kvstore.create("local")
init = np.random.default_rng(1).standard_normal(n).astype(np.float32)
for store in (kv, local):
    store.init("w", init)
    store.set_optimizer(kvstore.optimizer.Adam(learning_rate=0.01))
out, want = np.empty(n, np.float32), np.empty(n, np.float32)


def step(k):
    grad = np.random.default_rng([2, k]).standard_normal(n).astype(np.float32)
    kv.pushpull("w", grad, out=out)
    local.push("w", grad)
    local.pull("w", out=want)
    if not np.array_equal(out, want):
        print(f"step {k}: {int(np.sum(out != want))} values differ from the local store")
        sys.exit(5)


for k in range(3):
    step(k)
kv.save_optimizer_states(path)
local.save_optimizer_states(path + ".local")
for k in range(3, 5):
    step(k)
kv.load_optimizer_states(path)
local.load_optimizer_states(path + ".local")
for k in range(5, 7):
    step(k)
kv.close()
print("7 steps equal to the local store's, with a save and a load", flush=True)
