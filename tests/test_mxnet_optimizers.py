"""Every optimizer against trajectories recorded from MXNet 1.9.1's own updaters.

``tests/data/mxnet_optimizers.json`` comes from ``tests/data/record_mxnet_optimizers.py``, run
with MXNet 1.9.1 (``mx.optimizer.get_updater``, what an MXNet server runs): the same seeded
weight and gradients go through kvstore's :class:`~kvstore.optimizer.Updater` here, and every
step's weight must match to float32 precision (float16 for the multi-precision cases, whose
weights are float16 in both).
"""

import json
import pathlib

import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt

DATA = json.loads((pathlib.Path(__file__).parent / "data" / "mxnet_optimizers.json").read_text())
CASES = DATA["cases"]


def case_id(case) -> str:
    params = ",".join(f"{k}={v}" for k, v in case["params"].items() if k != "learning_rate")
    return f"{case['optimizer']}[{params}]"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_trajectory_matches_mxnet(case):
    dtype = np.dtype(case["dtype"])
    optimizer = opt.create(case["optimizer"], **case["params"])
    updater = opt.Updater(optimizer)
    weight = np.array(case["weight"], dtype)
    for step, (grad, expected) in enumerate(zip(case["grads"], case["trajectory"], strict=True), 1):
        updater(0, np.array(grad, dtype), weight)
        tol = dict(rtol=1e-3, atol=1e-3) if dtype == np.float16 else dict(rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            weight, np.array(expected, dtype), **tol, err_msg=f"{case_id(case)} step {step}"
        )


def test_recorded_with_mxnet_1_9_1():
    assert DATA["mxnet"] == "1.9.1"
    names = {c["optimizer"] for c in CASES}
    assert {"signum", "ftrl", "adamw", "lamb", "adam", "rmsprop"} <= names


def test_adam_and_rmsprop_clip_after_weight_decay():
    """A large weight makes ``wd * w`` dominate: clipping first, then adding it, would step
    by more than the clip allows; MXNet clips the sum."""
    for optimizer in (
        opt.Adam(learning_rate=0.1, wd=1.0, clip_gradient=0.1),
        opt.RMSProp(learning_rate=0.1, wd=1.0, clip_gradient=0.1),
    ):
        g = optimizer.prepare_grad(
            np.zeros(1, np.float32), np.full(1, 10.0, np.float32), True, clip_after_wd=True
        )
        assert g[0] == pytest.approx(0.1)


def test_multi_precision_keeps_a_float32_master_copy():
    """Steps far below float16's resolution at 1.0 add up in the float32 master copy."""
    updater = opt.Updater(opt.SGD(learning_rate=1e-4, multi_precision=True))
    plain = opt.Updater(opt.SGD(learning_rate=1e-4))
    w, w_plain = np.ones(4, np.float16), np.ones(4, np.float16)
    for _ in range(100):
        updater(0, np.ones(4, np.float16), w)
        plain(0, np.ones(4, np.float16), w_plain)
    assert w.dtype == np.float16 and float(w[0]) == pytest.approx(0.99, abs=1e-3)
    assert float(w_plain[0]) == 1.0  # each step rounds away in float16
    master = updater.states[0][0]
    assert master.dtype == np.float32 and float(master[0]) == pytest.approx(0.99, abs=1e-5)


@pytest.mark.parametrize(
    "optimizer",
    [
        opt.Signum(momentum=0.8, wd_lh=0.01),
        opt.FTRL(lamda1=0.1),
        opt.Ftrl(beta=2.0),
        opt.AdamW(correct_bias=False, wd=0.1),
        opt.LAMB(lower_bound=0.1, upper_bound=10.0, bias_correction=False),
        opt.Adam(multi_precision=True),
        opt.RMSProp(clip_weights=2.0),
    ],
    ids=lambda o: o.name,
)
def test_new_optimizers_round_trip_their_spec(optimizer):
    again = opt.from_spec(optimizer.spec())
    assert again.spec() == optimizer.spec() and type(again) is type(optimizer)


def test_old_specs_still_load():
    """Specs written before multi_precision and clip_weights existed keep working."""
    for spec in (
        {"name": "sgd", "params": {"learning_rate": 0.1, "momentum": 0.9}},
        {"name": "rmsprop", "params": {"learning_rate": 0.01, "centered": True}},
        {"name": "block_momentum", "params": {"momentum": 0.5, "nesterov": True}},
    ):
        assert "multi_precision" not in opt.from_spec(spec).spec()["params"]


def test_state_file_round_trip_with_multi_precision(tmp_path):
    kv = kvstore.create("local")
    kv.set_optimizer(opt.LAMB(learning_rate=0.01, multi_precision=True))
    kv.init("w", np.ones(5, np.float16))
    kv.push("w", np.full(5, 0.5, np.float16))
    kv.save_optimizer_states(str(tmp_path / "s"))
    kv2 = kvstore.create("local")
    kv2.set_optimizer(opt.LAMB(learning_rate=0.01, multi_precision=True))
    kv2.init("w", np.ones(5, np.float16))
    kv2.load_optimizer_states(str(tmp_path / "s"))
    for store in (kv, kv2):
        store.push("w", np.full(5, 0.5, np.float16))
    a, b = np.empty(5, np.float16), np.empty(5, np.float16)
    kv.pull("w", out=a)
    kv2.pull("w", out=b)
    np.testing.assert_array_equal(a, b)
