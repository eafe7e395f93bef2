"""The benchmarks keep working: run them at a tiny size (no timing is asserted)."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .cluster import ROOT, poll_until


def run_benchmark(script: str, *args: str, timeout: float) -> tuple[str, list[dict]]:
    """Run ``benchmarks/<script>`` with ``args`` from the repository root: what it printed and
    the JSON rows among it. The test fails, with its output, when it does not exit 0."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.stdout, rows


def test_pushpull_benchmark_smoke():
    stdout, rows = run_benchmark(
        "pushpull.py",
        *("-w", "2", "-s", "1", "--sizes", "4K,256K", "--keys", "20", "--reps", "3"),
        *("--budget", "0.5", "--no-gloo"),
        timeout=240,
    )
    seen = {(r["config"], r["size"]) for r in rows}
    for config in ("zmq", "kvstore dist_sync", "kvstore dist_async", "kvstore dist_sync 2bit"):
        for size in ("4K", "256K", "20x1K"):
            assert (config, size) in seen, (config, size, seen)
    assert ("numpy copy", "64M") in seen
    for r in rows:  # the unit the size implies, a positive rate, as many samples as asked
        assert r["unit"] == ("steps/s" if "x" in r["size"] else "B/s"), r
        assert r["median"] > 0 and 1 <= r["n"] <= 3 or r["config"].startswith("numpy"), r
    table = stdout.split("vs zmq", 1)[1]
    for config in ("kvstore dist_sync", "kvstore dist_async"):  # a ratio to the bound per row
        ratios = [line.split()[-1] for line in table.splitlines() if line.split("  ")[0] == config]
        assert len(ratios) == 3 and all(x.endswith("%") and float(x[:-1]) > 0 for x in ratios)


def mxnet_python() -> str:
    """The Python with MXNet 1.9.1 named by KVSTORE_BENCH_MXNET, or skip saying why."""
    python = os.environ.get("KVSTORE_BENCH_MXNET")
    if not python:
        pytest.skip("KVSTORE_BENCH_MXNET (a Python with MXNet 1.9.1) is not set")
    if not Path(python).exists():
        pytest.skip(f"KVSTORE_BENCH_MXNET={python}: no such file")
    return python


@pytest.mark.timeout(300)
def test_pushpull_benchmark_beside_mxnet_smoke():
    """--mxnet: MXNet's ps-lite rows and the paired kvstore/MXNet ratios, per size."""
    python = mxnet_python()
    stdout, rows = run_benchmark(
        "pushpull.py",
        *("-w", "2", "-s", "1", "--sizes", "4K,256K", "--keys", "20", "--reps", "3"),
        *("--budget", "0.5", "--modes", "dist_sync", "--no-gloo", "--no-compression"),
        *("--mxnet", python, "--repeats", "2", "--timeout", "120"),
        timeout=280,
    )
    by = {(r["config"], r["size"]): r for r in rows}
    for size in ("4K", "256K", "20x1K"):
        for config in ("kvstore dist_sync", "mxnet dist_sync"):  # one row over both rounds
            r = by[(config, size)]
            assert r["unit"] == ("steps/s" if "x" in size else "B/s"), r
            assert len(r["rounds"]) == 2 and 0 < r["min"] <= r["median"] <= r["max"], r
        ratio = by[("kvstore/mxnet dist_sync", size)]
        assert ratio["unit"] == "ratio" and len(ratio["pairs"]) == 2, ratio
        assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"], ratio
    table = stdout.split("vs zmq", 1)[1]
    ratios = [line.split() for line in table.splitlines() if line.startswith("kvstore/mxnet")]
    assert len(ratios) == 3 and all(cell.endswith("x") for line in ratios for cell in line[3:])


def test_zmq_bound_smoke():
    stdout, _ = run_benchmark(
        "zmq_bound.py", "--sizes", "4K", "--reps", "3", "--budget", "0.5", timeout=120
    )
    assert "zmq" in stdout and "numpy add" in stdout


def test_simulated_network_benchmark_smoke():
    """Two namespaces and a shaped link, made and removed by the benchmark (root only)."""
    stdout, rows = run_benchmark(
        "netsim.py",
        *("--rates", "1gbit", "--sizes", "256K", "--reps", "3", "--budget", "1", "--no-gloo"),
        timeout=240,
    )
    if "skipped" in stdout:
        pytest.skip(stdout.strip())
    configs = {r["config"] for r in rows}
    for config in ("kvstore dist_sync", "kvstore dist_sync 2bit", "kvstore dist_sync 1bit"):
        assert f"1gbit {config}" in configs, configs
    assert all(r["median"] > 0 for r in rows)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "kvsim" not in namespaces  # removed


def test_sparse_benchmark_smoke():
    """The grid and its bare ZeroMQ bounds, twice alternated (--pairs 2): each pair's ratios."""
    stdout, rows = run_benchmark(
        "sparse.py",
        *("--dims", "16", "--reqs", "1K", "--reps", "2", "--rows", "100000", "--no-memory"),
        *("--pairs", "2"),
        timeout=240,
    )
    seen = sorted((r["config"], r["op"], r["pair"]) for r in rows)
    ops = [("kvstore", op) for op in ("pull", "push", "pushpull", "step")]
    expected = [(*c, p) for c in [*ops, ("zmq", "step"), ("zmq job", "step")] for p in (0, 1)]
    assert seen == sorted(expected), seen
    assert all(r["median"] > 0 for r in rows)
    assert "vs pair" in stdout and "vs job" in stdout
    spread = stdout.split("alternated pairs", 1)[1].splitlines()[1]
    assert spread.startswith("  16       1K: ") and spread.count("%/") == 2, stdout


def test_sparse_benchmark_call_counts_and_a_pair_missing_a_cell():
    """The calls a measurement times (from its bytes), and the grid's table when one pair
    lacks a cell: the medians leave it out rather than printing nan or taking the other."""
    import argparse
    import doctest
    import importlib.util

    spec = importlib.util.spec_from_file_location("sparse_bench", ROOT / "benchmarks" / "sparse.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert doctest.testmod(bench).failed == 0
    assert bench.calls_for(0, 16, 4096) == 300 and bench.calls_for(0, 64, 65536) == 10

    def row(config, op, median, pair):
        return {"config": config, "op": op, "dim": 16, "req": "4K", "median": median, "pair": pair}

    results = []
    for pair, best in ((0, 2e6), (1, 4e6), (2, 3e6)):
        results += [row("kvstore", op, 1e6, pair) for op in ("push", "pull")]
        results += [row("zmq", "step", 1e7, pair), row("zmq job", "step", 8e6, pair)]
        if pair == 0:  # pair 0 lost its push+pull: its pushpull counts alone
            results.append(row("kvstore", "pushpull", best, pair))
        else:
            results += [row("kvstore", "step", best, pair), row("kvstore", "pushpull", 1e6, pair)]
    args = argparse.Namespace(workers=2, servers=2, replicas=1, sharding="hash", anchor="")
    text = bench.table(results, args)
    line = next(x for x in text.splitlines() if x.startswith("  16       4K "))
    assert "nan" not in line, text
    assert line.split()[-1] == "38%", text  # the median of 2/8, 4/8, 3/8
    assert "20%/25%, 40%/50%, 30%/38%" in text, text


def _floor_dirs() -> set:
    return set(Path("/dev/shm").glob("kvstore-floor-*"))


# the runs of sparse_floor.py, one at a time (scripts/test.sh runs tests two at a time,
# --dist loadgroup): the smoke test checks that none of its /dev/shm directories is left
FLOOR = pytest.mark.xdist_group("sparse-floor")


@FLOOR
@pytest.mark.timeout(300)
def test_sparse_benchmark_floor_smoke():
    """--floor: the anchor step beside each bare design (sparse_floor.py), in the same run;
    with --pairs 2, kvstore's anchor twice (each pair's)."""
    before = _floor_dirs()
    stdout, rows = run_benchmark(
        "sparse.py",
        *("--dims", "", "--no-memory", "--floor", "--anchor", "2000x16x256"),
        *("--anchor-steps", "20", "--anchor-repeats", "2", "--pairs", "2"),
        timeout=280,
    )
    floor = {(r["config"], r["sharding"]): r for r in rows if r["config"].startswith("floor")}
    designs = ("zmq", "zmq-whole", "zmq-block", "pipe-block")
    assert sorted(floor) == sorted((f"floor {d}", s) for d in designs for s in ("hash", "range"))
    assert all(len(r["runs"]) == 2 and r["median"] > 0 for r in floor.values()), rows
    anchors = [(r["op"], r["sharding"], r["pair"]) for r in rows if r["config"] == "kvstore"]
    ops = ("anchor", "anchor pushpull")
    assert sorted(anchors) == sorted(itertools.product(ops, ("hash", "range"), (0, 1)))
    assert stdout.count("% of pipe-block") == 4, stdout

    def left() -> dict:  # its segments and pipes must be gone
        return {d: sorted(f.name for f in d.iterdir()) for d in _floor_dirs() - before}

    assert poll_until(lambda: not left(), 5), left()


# (design, a line of sparse_floor.py, what breaks it): a second push of a row not added, for
# every design; and one step of each design's own way back dropped
BREAKS = [
    (design, "block[slots[again]] += rows[again]", "block[slots[again]] = rows[again]")
    for design in ("zmq", "zmq-whole", "zmq-block", "pipe-block")
] + [
    # the server's gather back into the worker's segment
    ("zmq", "take(block, slots, axis=0, out=rows,", "take(block, slots[:0], axis=0, out=rows[:0],"),
    ("zmq-whole", "slots, out=_whole_rows(rows),", "slots[:0], out=_whole_rows(rows)[:0],"),
    # the worker's gather from the server's block
    ("zmq-block", "out=out_whole[part], mode=", "out=seg_whole[part], mode="),
]


@FLOOR
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("design", "right", "wrong"), BREAKS)
def test_sparse_floor_refuses_a_wrong_sum(design, right, wrong, tmp_path):
    """Each floor design checks its rows against the pushes: a design that skips part of the
    step fails, so none can look fast by doing less."""
    source = (ROOT / "benchmarks" / "sparse_floor.py").read_text()
    assert source.count(right) == 1, right
    broken = tmp_path / "sparse_floor.py"
    broken.write_text(source.replace(right, wrong))
    (tmp_path / "kvstore").symlink_to(ROOT / "kvstore")
    done = subprocess.run(
        [sys.executable, str(broken), "--steps", "10", "--repeats", "1", "--designs", design],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert "not the sum of its pushes" in done.stderr, done.stderr


def test_sum_order_smoke():
    stdout, _ = run_benchmark(
        "sum_order.py", "-w", "1,3", "--sizes", "4K", "--budget", "0.1", timeout=120
    )
    rows = [line.split() for line in stdout.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "4K"), ("3", "4K")], stdout
    script = str(ROOT / "benchmarks" / "sum_order.py")
    one = subprocess.run(
        [sys.executable, script, "--mode", "on", "--rounds", "3", "-w", "5"], timeout=120, cwd=ROOT
    )
    assert one.returncode == 0
    stdout, _ = run_benchmark(
        "sum_order.py",
        *("-w", "2", "--sizes", "4M", "--budget", "0.1", "--dtype", "float16"),
        timeout=120,
    )
    assert [r.split()[:2] for r in stdout.splitlines()[1:]] == [["2", "4M"]], stdout
