"""Record optimizer trajectories from MXNet 1.9.1's own updaters (tests/data/mxnet_optimizers.json).

Run with MXNet's Python, never the project's (see ../shared/anchors/README.md):

    python3 -m venv /tmp/mxvenv && /tmp/mxvenv/bin/pip install mxnet==1.9.1 'numpy<1.24'
    /tmp/mxvenv/bin/python tests/data/record_mxnet_optimizers.py > tests/data/mxnet_optimizers.json

Every case: a float32 (or float16) weight of 8 values, 6 steps of seeded gradients through
``mx.optimizer.get_updater(optimizer)`` (what a kvstore server runs in MXNet), the weight after
every step. AdamW has no optimizer class in MXNet 1.x: it is MXNet 2.0's ``AdamW`` fused step,
run with 1.9.1's ``contrib.adamw_update`` kernel (``eta`` the bias-corrected rate, ``lr=1``).
"""

import json
import math
import sys

import mxnet as mx
import numpy as np

STEPS = 6
WD_CLIP = {"wd": 0.01, "rescale_grad": 0.5, "clip_gradient": 0.8}
CASES = [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, **WD_CLIP}),
    ("sgd", {"learning_rate": 0.1, **WD_CLIP}),
    ("nag", {"learning_rate": 0.1, "momentum": 0.9, "rescale_grad": 0.5, "clip_gradient": 0.8}),
    ("adam", {"learning_rate": 0.01, **WD_CLIP}),
    ("adam", {"learning_rate": 0.01, "wd": 0.1, "clip_gradient": 0.3}),
    ("adagrad", {"learning_rate": 0.1, **WD_CLIP}),
    ("rmsprop", {"learning_rate": 0.01, **WD_CLIP}),
    ("rmsprop", {"learning_rate": 0.01, "wd": 0.1, "clip_gradient": 0.3}),
    ("rmsprop", {"learning_rate": 0.01, "centered": True, "gamma2": 0.95, **WD_CLIP}),
    ("rmsprop", {"learning_rate": 0.01, "clip_weights": 0.9, "wd": 0.05}),
    ("signum", {"learning_rate": 0.01, "momentum": 0.9, "wd_lh": 0.02, **WD_CLIP}),
    ("signum", {"learning_rate": 0.01, "momentum": 0.0, "wd": 0.05}),
    ("ftrl", {"learning_rate": 0.1, "lamda1": 0.01, "beta": 1.0, **WD_CLIP}),
    ("ftrl", {"learning_rate": 0.5, "lamda1": 0.2, "beta": 0.5, "wd": 0.1}),
    ("lamb", {"learning_rate": 0.01, **WD_CLIP}),
    ("lamb", {"learning_rate": 0.01, "wd": 0.01, "bias_correction": False}),
    ("lamb", {"learning_rate": 0.01, "lower_bound": 0.5, "upper_bound": 1.5}),
    ("adamw", {"learning_rate": 0.01, **WD_CLIP}),
    ("adamw", {"learning_rate": 0.01, "wd": 0.1, "correct_bias": False}),
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "multi_precision": True, **WD_CLIP}),
    ("adam", {"learning_rate": 0.01, "multi_precision": True, **WD_CLIP}),
]


class AdamW:
    """MXNet 2.0's AdamW.fused_step on one weight, with 1.9.1's kernel."""

    def __init__(
        self,
        learning_rate,
        beta1=0.9,
        beta2=0.999,
        epsilon=1e-6,
        correct_bias=True,
        wd=0.0,
        rescale_grad=1.0,
        clip_gradient=None,
    ):
        self.lr, self.beta1, self.beta2, self.epsilon = learning_rate, beta1, beta2, epsilon
        self.correct_bias, self.wd = correct_bias, wd
        self.rescale_grad, self.clip_gradient = rescale_grad, clip_gradient
        self.t, self.mean, self.var = 0, None, None

    def __call__(self, index, grad, weight):
        if self.mean is None:
            self.mean, self.var = mx.nd.zeros_like(weight), mx.nd.zeros_like(weight)
        self.t += 1
        lr = self.lr
        if self.correct_bias:
            lr *= math.sqrt(1.0 - self.beta2**self.t) / (1.0 - self.beta1**self.t)
        kwargs = {"beta1": self.beta1, "beta2": self.beta2, "epsilon": self.epsilon}
        if self.clip_gradient:
            kwargs["clip_gradient"] = self.clip_gradient
        mx.nd.contrib.adamw_update(
            weight,
            grad,
            self.mean,
            self.var,
            mx.nd.array([self.rescale_grad]),
            out=weight,
            lr=1,
            wd=self.wd,
            eta=lr,
            **kwargs,
        )


def run(name, params, seed):
    rng = np.random.RandomState(seed)
    dtype = np.float16 if params.get("multi_precision") else np.float32
    w0 = rng.randn(8).astype(dtype)
    grads = [(rng.randn(8) * 2).astype(dtype) for _ in range(STEPS)]
    if name == "adamw":
        updater = AdamW(**params)
    else:
        updater = mx.optimizer.get_updater(mx.optimizer.create(name, **params))
    weight = mx.nd.array(w0, dtype=dtype)
    trajectory = []
    for g in grads:
        updater(0, mx.nd.array(g, dtype=dtype), weight)
        trajectory.append(weight.asnumpy().astype(np.float64).tolist())
    return {
        "optimizer": name,
        "params": params,
        "dtype": np.dtype(dtype).name,
        "weight": w0.astype(np.float64).tolist(),
        "grads": [g.astype(np.float64).tolist() for g in grads],
        "trajectory": trajectory,
    }


if __name__ == "__main__":
    out = {
        "mxnet": mx.__version__,
        "cases": [run(name, params, seed) for seed, (name, params) in enumerate(CASES)],
    }
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
