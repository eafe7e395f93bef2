"""Record MXNet 1.9.1's lazy (row-sparse) optimizer updates (tests/data/mxnet_lazy.json).

Run with MXNet's Python, never the project's:

    /work/mxnet-venv/bin/python tests/data/record_mxnet_lazy.py > tests/data/mxnet_lazy.json

Every case: a 6 x 3 float32 weight (a full table, as a kvstore server holds it), 5 steps of
seeded row-sparse gradients whose row sets differ from step to step (a row untouched in a step
keeps its value and state with ``lazy_update``), through ``mx.optimizer.get_updater``; the
weight after every step.
"""

import json

import mxnet as mx
import numpy as np

STEPS = 5
ROWS, DIM = 6, 3
ROW_SETS = [[0, 2, 5], [2, 3], [], [0, 1, 2, 3, 4, 5], [1, 5]]  # sorted, as MXNet requires
CASES = [
    (
        "sgd",
        {
            "learning_rate": 0.1,
            "momentum": 0.9,
            "wd": 0.01,
            "rescale_grad": 0.5,
            "clip_gradient": 0.8,
        },
    ),
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01, "lazy_update": False}),
    ("sgd", {"learning_rate": 0.1, "wd": 0.01, "rescale_grad": 0.5}),
    ("adagrad", {"learning_rate": 0.1, "rescale_grad": 0.5, "clip_gradient": 0.8}),
    ("adam", {"learning_rate": 0.01, "wd": 0.01, "rescale_grad": 0.5, "clip_gradient": 0.8}),
    ("adam", {"learning_rate": 0.01, "wd": 0.01, "lazy_update": False}),
]


def main():
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    grads = [rng.standard_normal((len(rows), DIM)).astype(np.float32) for rows in ROW_SETS]
    out = {
        "w0": w0.tolist(),
        "row_sets": ROW_SETS,
        "grads": [g.tolist() for g in grads],
        "cases": [],
    }
    for name, params in CASES:
        opt = mx.optimizer.create(name, **params)
        updater = mx.optimizer.get_updater(opt)
        weight = mx.nd.array(w0)
        trajectory = []
        for rows, g in zip(ROW_SETS, grads, strict=True):
            grad = mx.nd.sparse.row_sparse_array(
                (g.reshape(len(rows), DIM), np.array(rows, np.int64)), shape=(ROWS, DIM)
            )
            updater(0, grad, weight)
            trajectory.append(weight.asnumpy().tolist())
        out["cases"].append({"name": name, "params": params, "weights": trajectory})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
