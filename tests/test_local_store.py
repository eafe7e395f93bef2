"""The single-process stores against NumPy: every API call, both types, every error."""

import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt

TYPES = ["local", "device"]
rng = np.random.default_rng(0)


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture(params=TYPES)
def kv(request):
    return kvstore.create(request.param)


def test_issue_example(kv):
    kv.init(3, np.ones((2, 3), np.float32))
    kv.push(3, [np.ones((2, 3)) * 2, np.ones((2, 3)) * 3])
    out = np.empty((2, 3), np.float32)
    kv.pull(3, out=out)
    np.testing.assert_array_equal(out, np.full((2, 3), 5, np.float32))


def test_identity(kv):
    assert kv.rank == 0 and kv.num_workers == 1 and kv.type in TYPES
    kv.barrier()


def test_push_list_of_keys_and_devices(kv):
    keys = ["a", "b", "c"]
    init = [randn(4), randn(2, 2), randn(3, 1, 2)]
    kv.init(keys, init)
    grads = [[randn(*a.shape) for _ in range(3)] for a in init]
    kv.push(keys, grads)
    outs = [[np.empty_like(a), np.empty_like(a)] for a in init]
    kv.pull(keys, out=outs)
    for devs, per_dev in zip(grads, outs, strict=False):
        for o in per_dev:
            np.testing.assert_allclose(o, sum(devs), rtol=1e-6)


def test_pull_without_push_gives_init(kv):
    value = randn(5)
    kv.init(0, value)
    out = np.zeros(5, np.float32)
    kv.pull(0, out=out)
    np.testing.assert_array_equal(out, value)


def test_init_copies_the_value(kv):
    value = randn(3)
    kv.init(1, value)
    expected = value.copy()
    value[:] = 0
    out = np.empty(3, np.float32)
    kv.pull(1, out=out)
    np.testing.assert_array_equal(out, expected)


def test_pushpull_in_place_and_out(kv):
    kv.init(["w", "b"], [np.zeros(3, np.float32), np.zeros(2, np.float32)])
    gw, gb = randn(3), randn(2)
    w, b = np.empty(3, np.float32), np.empty(2, np.float32)
    kv.pushpull(["w", "b"], [gw, gb], out=[w, b])
    np.testing.assert_array_equal(w, gw)
    np.testing.assert_array_equal(b, gb)
    g = randn(3)
    expected = g.copy()
    kv.pushpull("w", g)  # no out: result written back into the value
    np.testing.assert_array_equal(g, expected)


def test_broadcast(kv):
    value = randn(2, 2)
    outs = [np.empty_like(value), np.empty_like(value)]
    kv.broadcast("p", value, out=outs)
    for o in outs:
        np.testing.assert_array_equal(o, value)


def test_set_updater(kv):
    calls = []

    def updater(key, grad, weight):
        calls.append(key)
        weight += 2 * grad

    kv.set_updater(updater)
    kv.init(7, np.ones(3, np.float32))
    kv.push(7, [np.ones(3, np.float32), np.ones(3, np.float32)])
    out = np.empty(3, np.float32)
    kv.pull(7, out=out, priority=-1)
    np.testing.assert_array_equal(out, np.full(3, 5, np.float32))
    assert calls == [7]


def test_set_optimizer_sgd_matches_numpy(kv):
    kv.set_optimizer(opt.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4))
    w0 = randn(6)
    kv.init("w", w0)
    w, mom = w0.astype(np.float64), np.zeros(6)
    out = np.empty(6, np.float32)
    for _ in range(4):
        grads = [randn(6), randn(6)]
        kv.pushpull("w", grads, out=out)
        g = sum(x.astype(np.float64) for x in grads) + 1e-4 * w
        mom = 0.9 * mom - 0.1 * g
        w = w + mom
        np.testing.assert_allclose(out, w, rtol=1e-5, atol=1e-6)


def test_dtype_cast_and_int_store(kv):
    kv.init(1, np.zeros(3, np.int32))
    kv.push(1, [np.array([1, 2, 3], np.int64), np.array([1, 1, 1], np.int16)])
    out = np.empty(3, np.int64)
    kv.pull(1, out=out)
    np.testing.assert_array_equal(out, [2, 3, 4])


def test_optimizer_state_save_load(kv, tmp_path):
    kv.set_optimizer(opt.Adam(learning_rate=0.01))
    kv.init(0, np.ones(4, np.float32))
    g1, g2 = randn(4), randn(4)
    w1, w2 = np.empty(4, np.float32), np.empty(4, np.float32)
    kv.pushpull(0, g1, out=w1)
    path = str(tmp_path / "states")
    kv.save_optimizer_states(path)
    kv.pushpull(0, g2, out=w2)
    # a new store at the weights of step 1 with the saved state takes exactly step 2
    resumed = kvstore.create(kv.type)
    resumed.set_optimizer(opt.Adam(learning_rate=0.01))
    resumed.init(0, w1)
    resumed.load_optimizer_states(path)
    w = np.empty(4, np.float32)
    resumed.pushpull(0, g2, out=w)
    np.testing.assert_array_equal(w, w2)
    # without the state the step differs (Adam's moments and t), so the test can fail
    plain = kvstore.create(kv.type)
    plain.set_optimizer(opt.Adam(learning_rate=0.01))
    plain.init(0, w1)
    plain.pushpull(0, g2, out=w)
    assert not np.allclose(w, w2)


# ---------------------------------------------------------------- errors


def test_unknown_type():
    with pytest.raises(ValueError, match="valid types: local, device, dist_sync"):
        kvstore.create("dist_magic")


def test_init_twice(kv):
    kv.init(0, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="already initialised"):
        kv.init(0, np.zeros(2, np.float32))


def test_push_pull_uninitialised(kv):
    with pytest.raises(KeyError, match="never initialised"):
        kv.push(5, np.zeros(2, np.float32))
    with pytest.raises(KeyError, match="never initialised"):
        kv.pull(5, out=np.zeros(2, np.float32))


def test_shape_mismatch_names_key_got_expected(kv):
    kv.init("w", np.zeros((4, 4), np.float32))
    with pytest.raises(ValueError, match=r"push\(key='w'\).*\(4, 5\).*\(4, 4\)"):
        kv.push("w", np.zeros((4, 5), np.float32))


def test_dtype_mismatch(kv):
    kv.init("i", np.zeros(3, np.int32))
    with pytest.raises(TypeError, match=r"push\(key='i'\): value dtype float32.*int32"):
        kv.push("i", np.zeros(3, np.float32))


def test_mixed_keys(kv):
    with pytest.raises(TypeError, match="cannot be mixed"):
        kv.init([1, "a"], [np.zeros(1), np.zeros(1)])
    kv.init(1, np.zeros(1))
    with pytest.raises(TypeError, match="cannot be mixed"):
        kv.init("a", np.zeros(1))


def test_keys_values_length(kv):
    kv.init([1, 2], [np.zeros(1), np.zeros(1)])
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        kv.push([1, 2], [np.zeros(1)])


def test_out_wrong_shape(kv):
    kv.init(0, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"out shape \(4,\) does not match"):
        kv.pull(0, out=np.zeros(4, np.float32))


def test_bad_key_type(kv):
    with pytest.raises(TypeError, match="keys must be int or str"):
        kv.init(1.5, np.zeros(1))


def test_failed_call_changes_nothing(kv):
    kv.init([1, 2], [np.ones(2, np.float32), np.ones(3, np.float32)])
    with pytest.raises(ValueError):
        kv.push([1, 2], [np.full(2, 9, np.float32), np.zeros(4, np.float32)])
    out = np.empty(2, np.float32)
    kv.pull(1, out=out)
    np.testing.assert_array_equal(out, np.ones(2, np.float32))
    with pytest.raises(ValueError):
        kv.init([3, 1], [np.zeros(1), np.zeros(1)])
    with pytest.raises(KeyError):
        kv.pull(3, out=np.zeros(1))


def test_optimizer_state_needs_optimizer(kv, tmp_path):
    with pytest.raises(ValueError, match="set_optimizer first"):
        kv.save_optimizer_states(str(tmp_path / "x"))


def test_set_updater_not_callable(kv):
    with pytest.raises(TypeError, match="callable"):
        kv.set_updater(3)


def test_pushpull_async_in_one_process_is_done_at_once():
    kv = kvstore.create("local")
    kv.init("w", np.zeros(3, np.float32))
    out = np.empty(3, np.float32)
    pending = kv.pushpull_async("w", np.ones(3, np.float32), out=out)
    assert pending.done and (out == 1).all()
    pending.wait()  # a second wait is harmless
    assert pending.done


def test_a_remembered_key_list_is_still_checked_for_bools_and_numpy_ints():
    """A call on many keys remembers its checked key list; a list equal to it in a set (True
    == 1, np.int64(2) == 2) is still checked: a bool refused, NumPy ints converted."""
    kv = kvstore.create("local")
    keys = list(range(1, 11))
    kv.init(keys, [np.zeros(2, np.float32) for _ in keys])
    outs = [np.empty(2, np.float32) for _ in keys]
    kv.pull(keys, out=outs)
    kv.pull(list(keys), out=outs)  # remembered
    with pytest.raises(TypeError, match="keys must be int or str"):
        kv.pull([True, *keys[1:]], out=outs)
    kv.pushpull([np.int64(k) for k in keys], [np.ones(2, np.float32) for _ in keys], out=outs)
    assert all((o == 1).all() for o in outs)
    with pytest.raises(ValueError, match="duplicate keys"):
        kv.pull([*keys[:9], 1], out=outs)
