"""The benchmarks keep working: run them at a tiny size (no timing is asserted)."""

import json
import subprocess
import sys

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
    assert all(r["min"] <= r["median"] <= r["max"] and r["median"] > 0 for r in rows)
    assert "vs zmq" in done.stdout


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
