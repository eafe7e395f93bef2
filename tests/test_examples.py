"""Distributed training gives the model one process gives: the examples, run for real."""

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from .cluster import ROOT

MLP = ROOT / "examples" / "train_mlp.py"
TORCH_EXAMPLE = ROOT / "examples" / "pytorch_dist.py"
FAST = ["--env", "KVSTORE_HEARTBEAT_INTERVAL=0.5"]


def run_local(tmp_path, *args, script=MLP, name="local.npz"):
    out = tmp_path / name
    done = subprocess.run(
        [sys.executable, str(script), *map(str, args), "--save-weights", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(np.load(out)), done.stdout


def run_launch(
    tmp_path, workers, servers, *args, launcher=(), script=MLP, name="dist.npz", cwd=ROOT
):
    out = tmp_path / name
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "-n",
            str(workers),
            "-s",
            str(servers),
            *FAST,
            *map(str, launcher),
            sys.executable,
            str(script),
            *map(str, args),
            "--save-weights",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(np.load(out)), done.stdout


def final_accuracy(out: str) -> float:
    """Rank 0's final test accuracy from an example's output."""
    return float(out.split("rank 0: test accuracy ")[1].split()[0])


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def assert_differ(a, b):
    assert any(not np.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


STEPS = ["--max-steps", 30, "--epochs", 5]


# Adam divides by sqrt(v): where a gradient is ~0, summation order alone moves the step by
# ~1e-5, so its tolerance is wider than SGD's.
@pytest.mark.parametrize("workers,optimizer,atol", [(2, "sgd", 1e-6), (4, "adam", 1e-4)])
def test_dist_sync_equals_local_on_union_batch(tmp_path, workers, optimizer, atol):
    union = 32
    local, _ = run_local(
        tmp_path, "--kv-store", "local", "--batch-size", union, "--optimizer", optimizer, *STEPS
    )
    dist, out = run_launch(
        tmp_path,
        workers,
        2,
        "--kv-store",
        "dist_sync",
        "--batch-size",
        union // workers,
        "--optimizer",
        optimizer,
        *STEPS,
    )
    assert_same(local, dist, atol=atol)
    assert "after 30 steps" in out
    # the comparison can fail: a different batch gives different weights
    other, _ = run_local(
        tmp_path,
        "--kv-store",
        "local",
        "--batch-size",
        union // 2,
        "--optimizer",
        optimizer,
        *STEPS,
        name="other.npz",
    )
    assert_differ(local, other)


def test_device_store_with_several_device_arrays(tmp_path):
    local, _ = run_local(tmp_path, "--kv-store", "local", "--batch-size", 30, *STEPS)
    device, _ = run_local(
        tmp_path,
        "--kv-store",
        "device",
        "--num-devices",
        3,
        "--batch-size",
        30,
        *STEPS,
        name="device.npz",
    )
    assert_same(local, device)
    dist, _ = run_launch(
        tmp_path,
        2,
        1,
        "--kv-store",
        "dist_device_sync",
        "--num-devices",
        3,
        "--batch-size",
        15,
        *STEPS,
    )
    assert_same(local, dist)


def test_warmup_then_synchronise(tmp_path):
    local, _ = run_local(tmp_path, "--batch-size", 32, "--warmup-steps", 10, *STEPS)
    dist, out = run_launch(
        tmp_path, 2, 2, "--kv-store", "dist_sync", "--batch-size", 16, "--warmup-steps", 10, *STEPS
    )
    assert "10 warm-up steps done" in out
    assert_same(local, dist)


def test_checkpoint_kill_resume(tmp_path):
    args = ["--kv-store", "dist_sync", "--batch-size", 16, "--optimizer", "adam", "--epochs", 12]
    whole, _ = run_launch(tmp_path, 2, 2, *args, name="whole.npz")
    ckpt = tmp_path / "ckpt"
    launch = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "-n",
            "2",
            "-s",
            "2",
            *FAST,
            sys.executable,
            str(MLP),
            *map(str, args),
            "--checkpoint-dir",
            str(ckpt),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    victim = None
    for line in launch.stdout:  # bounded by the 12 epochs
        if line.startswith("launch: started worker 1 on localhost (pid "):
            victim = int(line.split("(pid ")[1].rstrip(")\n"))
        if "checkpoint saved for epoch 2" in line:
            break
    os.kill(victim, signal.SIGKILL)  # a worker dies; the launcher stops the rest
    rest, _ = launch.communicate(timeout=60)
    assert launch.returncode == 137 and "worker 1 on localhost was killed by SIGKILL" in rest
    saved = int(np.load(ckpt / "weights.npz")["epoch"])
    assert 2 <= saved < 11, saved
    resumed, out = run_launch(
        tmp_path, 2, 2, *args, "--checkpoint-dir", ckpt, "--resume", name="resumed.npz"
    )
    assert f"resuming from epoch {saved + 1}" in out
    assert_same(whole, resumed, rtol=1e-6, atol=1e-7)


ACCURACY_FLOOR = 0.85


def test_dist_async_converges(tmp_path):
    _, out = run_launch(
        tmp_path, 2, 2, "--kv-store", "dist_async", "--batch-size", 16, "--epochs", 8
    )
    assert final_accuracy(out) > ACCURACY_FLOOR, out


def test_pytorch_adapter_matches_single_process(tmp_path):
    pytest.importorskip("torch")
    local, _ = run_local(tmp_path, "--batch-size", 32, "--epochs", 2, script=TORCH_EXAMPLE)
    dist, _ = run_launch(
        tmp_path,
        2,
        1,
        "--kv-store",
        "dist_sync",
        "--batch-size",
        16,
        "--epochs",
        2,
        script=TORCH_EXAMPLE,
    )
    assert_same(local, dist, rtol=1e-4, atol=1e-5)


def assert_launcher_matches_local(tmp_path, launcher):
    local, _ = run_local(tmp_path, "--batch-size", 32, *STEPS)
    dist, _ = run_launch(
        tmp_path, 2, 2, "--kv-store", "dist_sync", "--batch-size", 16, *STEPS, launcher=launcher
    )
    assert_same(local, dist)


def test_training_through_ssh_equals_local(tmp_path, sshd):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n127.0.0.2\n")
    assert_launcher_matches_local(tmp_path, ["--launcher", "ssh", "-H", hosts, *sshd.ssh_options()])


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_training_through_mpi_equals_local(tmp_path):
    assert_launcher_matches_local(tmp_path, ["--launcher", "mpi"])


CTR = ROOT / "examples" / "ctr.py"


@pytest.mark.parametrize("sharding", ["hash", "range"])
def test_ctr_example_learns_the_planted_clicks_through_launch(sharding):
    """examples/ctr.py through launch.py (2 workers, 2 servers): a row-sparse embedding bag
    and an MLP learn the planted click model (a held-out AUC well above chance, near the
    planted model's), and rank 0 reports rows/s and what the servers hold, per epoch."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "-n", "2", "-s", "2", *FAST]
        + [sys.executable, str(CTR), "--kv-store", "dist_sync", "--samples", "100000"]
        + ["--epochs", "2", "--sharding", sharding],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    planted = float(out.split("the planted model's test AUC: ")[1].split()[0])
    got = float(out.split("rank 0: test AUC ")[1].split()[0])
    assert 0.7 < got <= planted, out
    epochs = [line for line in out.splitlines() if "] epoch " in line]
    assert len(epochs) == 2, out
    for line in epochs:
        assert "rows/s pulled and pushed; servers:" in line and "in 2 server process(es)" in line
        stored = int(line.split("servers: ")[1].split()[0].replace(",", ""))
        assert 10_000 < stored <= 100_000 * 8, line  # the rows touched, not 2^30
