"""MXNet's KVStore API as its scripts use it: store names, underscore methods, row_sparse_pull,
gradient compression after other keys, re-init, server commands; local and through a cluster."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore import optimizer as opt

from .cluster import Cluster

WORKER = Path(__file__).parent / "data" / "mxnet_api_worker.py"


@pytest.mark.parametrize(
    "name,kind",
    [
        ("local", "local"),
        ("LOCAL", "local"),
        ("Device", "device"),
        ("nccl", "device"),
        ("local_allreduce_cpu", "local"),
        ("local_allreduce_device", "device"),
        ("local_update_cpu", "local"),
    ],
)
def test_mxnet_local_names(name, kind):
    kv = kvstore.create(name)
    assert kv.type == name.lower()  # MXNet's kv.type: the name given, lower-cased
    assert kv._on_device == (kind == "device")


def test_every_mxnet_dist_name_maps_to_a_store_type():
    assert kvstore.ALIASES["dist"] == "dist_sync"
    assert kvstore.ALIASES["dist_sync_device"] == "dist_device_sync"
    assert kvstore.ALIASES["dist_async_device"] == "dist_async"
    assert set(kvstore.ALIASES.values()) == set(kvstore.TYPES)


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown KVStore type 'horovod'.*dist_sync_device"):
        kvstore.create("horovod")
    with pytest.raises(TypeError, match="must be a str"):
        kvstore.create(3)


def test_set_updater_as_mxnet_docs():
    """The example of MXNet's ``_set_updater`` docstring."""
    kv = kvstore.create("local")
    kv.init("3", np.ones((2, 3), np.float32))

    def update(key, grad, stored):
        stored += grad * 2

    kv._set_updater(update)
    kv.push("3", np.ones((2, 3), np.float32))
    out = np.empty((2, 3), np.float32)
    kv.pull("3", out=out)
    assert np.all(out == 3.0)


def test_barrier_and_capability():
    kv = kvstore.create("local")
    kv._barrier()
    assert kv.is_capable("optimizer") and kv.is_capable(kvstore.KVStore.OPTIMIZER)
    with pytest.raises(ValueError, match="Unknown capability: p3"):
        kv.is_capable("p3")


def test_row_sparse_pull_local():
    kv = kvstore.create("local")
    value = np.arange(12, dtype=np.float32).reshape(4, 3)
    kv.init(9, value)
    outs = [np.full((4, 3), 7, np.float32) for _ in range(2)]
    kv.row_sparse_pull(9, out=outs, row_ids=[np.array([1, 1, 3]), np.array([0])])
    np.testing.assert_array_equal(outs[0][[1, 3]], value[[1, 3]])
    assert not outs[0][[0, 2]].any()
    np.testing.assert_array_equal(outs[1][0], value[0])
    assert not outs[1][1:].any()
    one = [np.empty((4, 3), np.float32) for _ in range(2)]
    kv.row_sparse_pull(9, out=one, row_ids=np.array([2.0], np.float32))  # one id array for all
    assert all(np.array_equal(o[2], value[2]) and not o[[0, 1, 3]].any() for o in one)
    with pytest.raises(ValueError, match=r"row id 4 is outside \[0, 4\)"):
        kv.row_sparse_pull(9, out=one[0], row_ids=np.array([4]))
    with pytest.raises(ValueError, match="row_ids= is required"):
        kv.row_sparse_pull(9, out=one[0])
    kv.init(10, np.ones((2, 2), np.float32))
    a, b = np.empty((4, 3), np.float32), np.empty((2, 2), np.float32)
    kv.row_sparse_pull([9, 10], out=[a, b], row_ids=[np.array([0]), np.array([1])])
    assert a[0].tolist() == value[0].tolist() and b.tolist() == [[0, 0], [1, 1]]


def test_reinit_is_refused_as_in_mxnet():
    kv = kvstore.create("local")
    kv.init(1, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="duplicate init of key"):
        kv.init(1, np.ones(2, np.float32))
    out = np.empty(2, np.float32)
    kv.pull(1, out=out)
    assert not out.any()  # the first value stays


def test_compression_after_other_keys_were_pushed():
    kv = kvstore.create("device")
    kv.init("a", np.zeros(3, np.float32))
    kv.push("a", np.ones(3, np.float32))
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("b", np.zeros(3, np.float32))
    kv.push("b", np.array([0.7, -2.0, 0.1], np.float32))
    out = np.empty(3, np.float32)
    kv.pull("b", out=out)
    assert out.tolist() == [0.5, -0.5, 0.0]  # 2-bit: +-threshold or 0
    kv.push("a", np.full(3, 0.2, np.float32))  # an old key is compressed from now on too
    kv.pull("a", out=out)
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_send_command_to_servers_local():
    kv = kvstore.create("local")
    kv.init(0, np.ones(2, np.float32))
    kv._send_command_to_servers(0, json.dumps(opt.SGD(learning_rate=0.5).spec()))
    kv._send_command_to_servers(3, "")  # kSyncMode: the type decides
    kv.push(0, np.ones(2, np.float32))
    out = np.empty(2, np.float32)
    kv.pull(0, out=out)
    assert out.tolist() == [0.5, 0.5]
    kv._send_command_to_servers(1, "")  # kSetMultiPrecision
    assert kv._optimizer.multi_precision
    kv._send_command_to_servers(4, {"type": "2bit", "threshold": 1.0})
    assert kv._compression is not None
    with pytest.raises(TypeError, match="pickle"):
        kv._send_command_to_servers(0, "(cmxnet.optimizer\nSGD\n")
    with pytest.raises(ValueError, match="kStopServer"):
        kv._send_command_to_servers(2, "")
    with pytest.raises(ValueError, match="unknown command head 9"):
        kv._send_command_to_servers(9, "")


@pytest.mark.parametrize("name", ["Dist", "dist_sync_device"])
def test_mxnet_worker_script_through_a_cluster(tmp_path, name):
    c = Cluster(2, 2, tmp_path, KVSTORE_BIGARRAY_BOUND=20)
    try:
        workers = [
            c._spawn(f"worker{i}", [sys.executable, str(WORKER), name], "worker") for i in range(2)
        ]
        codes = c.wait(workers, 60)
        assert codes == [0, 0], c.dump()
        assert all("MXNET API OK" in c.output(f"worker{i}") for i in range(2)), c.dump()
    finally:
        c.stop()


def test_launch_env_worker_and_env_server(tmp_path):
    """MXNet's launch.py options: --env-worker reaches the workers only (the servers' own
    --env-server value is checked in the Kubernetes manifests, tests/test_kubernetes.py)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    probe = (
        "import os, kvstore; kv = kvstore.create('dist_sync'); "
        "print('W', os.environ.get('ONLY_WORKER'), os.environ.get('ONLY_SERVER'))"
    )
    out = subprocess.run(
        [sys.executable, str(root / "launch.py"), "-n", "1", "-s", "1", "--launcher", "local"]
        + ["--env-server", "ONLY_SERVER:s", "--env-worker", "ONLY_WORKER=w"]
        + [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "W w None" in out.stdout
