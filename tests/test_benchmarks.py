"""The benchmarks keep working: run them at a tiny size (no timing is asserted)."""

import json
import subprocess
import sys

import pytest

from .cluster import ROOT


def test_pushpull_benchmark_smoke():
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "pushpull.py"),
            "-w",
            "2",
            "-s",
            "1",
            "--sizes",
            "4K,256K",
            "--keys",
            "20",
            "--reps",
            "3",
            "--budget",
            "0.5",
            "--no-gloo",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    seen = {(r["config"], r["size"]) for r in rows}
    for config in ("zmq", "kvstore dist_sync", "kvstore dist_async", "kvstore dist_sync 2bit"):
        for size in ("4K", "256K", "20x1K"):
            assert (config, size) in seen, (config, size, seen)
    assert ("numpy copy", "64M") in seen
    for r in rows:  # the unit the size implies, a positive rate, as many samples as asked
        assert r["unit"] == ("steps/s" if "x" in r["size"] else "B/s"), r
        assert r["median"] > 0 and 1 <= r["n"] <= 3 or r["config"].startswith("numpy"), r
    table = done.stdout.split("vs zmq", 1)[1]
    for config in ("kvstore dist_sync", "kvstore dist_async"):  # a ratio to the bound per row
        ratios = [line.split()[-1] for line in table.splitlines() if line.split("  ")[0] == config]
        assert len(ratios) == 3 and all(x.endswith("%") and float(x[:-1]) > 0 for x in ratios)


def test_zmq_bound_smoke():
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "zmq_bound.py"),
            "--sizes",
            "4K",
            "--reps",
            "3",
            "--budget",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "zmq" in done.stdout and "numpy add" in done.stdout


def test_simulated_network_benchmark_smoke():
    """Two namespaces and a shaped link, made and removed by the benchmark (root only)."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "netsim.py"),
            "--rates",
            "1gbit",
            "--sizes",
            "256K",
            "--reps",
            "3",
            "--budget",
            "1",
            "--no-gloo",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    if "skipped" in done.stdout:
        pytest.skip(done.stdout.strip())
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    configs = {r["config"] for r in rows}
    for config in ("kvstore dist_sync", "kvstore dist_sync 2bit", "kvstore dist_sync 1bit"):
        assert f"1gbit {config}" in configs, configs
    assert all(r["median"] > 0 for r in rows)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "kvsim" not in namespaces  # removed
