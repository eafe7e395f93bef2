"""Row-sparse keys on real clusters: MXNet's nightly row-sparse checks and more, one worker
script per cluster (tests/workers/sparse_nightly.py)."""

import json
import os

import pytest

from .cluster import poll_until, shm_left


@pytest.mark.parametrize(
    "num_server,num_worker,dtype,sharding",
    [
        (1, 2, "float32", "hash"),
        (2, 2, "float16", "hash"),
        (2, 3, "float32", "hash"),
        (1, 3, "float16", "hash"),
        (2, 2, "float32", "range"),
        (3, 3, "float32", "range"),
    ],
)
def test_sparse_nightly(cluster, num_server, num_worker, dtype, sharding):
    c = cluster(num_server, num_worker)
    outs = c.run_workers("sparse_nightly.py", ["dist_sync", dtype, 1, sharding], timeout=120)
    assert all(f"OK sparse {dtype}" in o for o in outs), outs


def test_sparse_async_loses_no_push(cluster):
    c = cluster(2, 2)
    outs = c.run_workers("sparse_async.py", ["dist_async"], timeout=120)
    assert all("OK async rows" in o for o in outs), outs


def test_server_refuses_bad_row_requests_and_serves_on(cluster):
    c = cluster(2, 1)
    outs = c.run_workers("sparse_refusals.py", timeout=60)
    assert "OK refusals" in outs[0], outs
    assert "Traceback" not in c.output("server0")


@pytest.mark.parametrize("mode", ["global", "set"])
def test_torch_embedding_gradients_travel_as_rows(cluster, mode):
    """Through the global set (W=2), and through a process set [0, 2] of W=3 (its own
    row-sparse key: rank 1, outside, steps alone)."""
    pytest.importorskip("torch")
    c = cluster(2, 3 if mode == "set" else 2)
    outs = c.run_workers("torch_rows.py", [mode], timeout=120)
    assert all(f"OK torch rows {mode}" in o for o in outs), outs


def test_torch_rows_after_join_are_the_step_s_own(cluster):
    pytest.importorskip("torch")
    outs = cluster(1, 2).run_workers("torch_rows_join.py", timeout=120)
    assert all("OK rows after join" in o for o in outs), outs


def test_sparse_join_uneven_inputs(cluster):
    c = cluster(2, 3)
    outs = c.run_workers("sparse_join.py", timeout=120)
    assert all("OK join rows" in o for o in outs), outs


@pytest.mark.parametrize("kind", ["dist_sync", "dist_async"])
def test_checkpoint_of_rows_holds_rows_never_pushed(cluster, kind):
    c = cluster(2, 2)
    outs = c.run_workers("sparse_checkpoint.py", [kind], timeout=120)
    assert all("OK checkpoint rows" in o for o in outs), outs


@pytest.mark.parametrize("use", ["1", "0"])
def test_rows_through_shared_memory_are_exact(cluster, use):
    """The rows of a same-host worker go through shared segments (grown as pushes grow),
    with the same results as through TCP, and leave no file behind."""
    from kvstore import shm

    before = set(os.listdir(shm.SHM_DIR))
    c = cluster(2, 2, KVSTORE_SHM=use)
    outs = c.run_workers("sparse_shm.py", [15], timeout=120)
    for out in outs:
        assert f"shares memory with {2 if use == '1' else 0} servers" in out, out
        assert f"rows through {2 if use == '1' else 0} segments; OK 15 steps exact" in out, out
    c.wait([c.procs["server0"], c.procs["server1"]], 20)
    # (the names a worker unlinks once its server mapped them go within ms)
    assert poll_until(lambda: not shm_left(before), 5), shm_left(before)


@pytest.mark.parametrize(
    "num_server,num_worker,kind,sharding,shm",
    [
        (1, 2, "dist_sync", "hash", "1"),
        (2, 2, "dist_sync", "hash", "1"),
        (2, 3, "dist_sync", "hash", "1"),
        (2, 2, "dist_async", "hash", "1"),
        (3, 2, "dist_sync", "range", "1"),
        (2, 2, "dist_async", "range", "1"),
        (2, 2, "dist_sync", "range", "0"),
    ],
)
def test_row_sparse_pull_after_push(cluster, num_server, num_worker, kind, sharding, shm):
    """A pull of rows just pushed reads them from the push's reply (dist_sync): the same
    values as a pull, for repeats, several outputs, two keys and a second pull; with the
    rows spread by hash and by range (a range's rows go as views of the pushed value's:
    through TCP too, KVSTORE_SHM=0)."""
    c = cluster(num_server, num_worker, KVSTORE_SHM=shm)
    outs = c.run_workers("sparse_pull_after_push.py", [kind, sharding], timeout=120)
    assert all(f"OK 33 pulls after pushes ({kind})" in o for o in outs), outs


@pytest.mark.parametrize("what", ["pull", "push_then_pull_twice"])
def test_a_row_sparse_key_named_twice_is_refused(cluster, what):
    c = cluster(1, 1)
    outs = c.run_workers("sparse_dup_keys.py", [what])
    assert "OK dup keys" in outs[0], outs


@pytest.mark.parametrize("control", ["", "1"])
def test_a_pull_after_push_reads_a_load_a_pending_wait_ordered(cluster, control):
    """A dense pushpull_async's answer can order another worker's load_rows before this
    worker's row_sparse_pull: the push's reply no longer serves it. (control: the pull is
    sent to the server, the same value.)"""
    c = cluster(1, 2, SPARSE_CONTROL=control)
    outs = c.run_workers("sparse_pending_load.py")
    assert all("OK pending load" in o for o in outs), outs


def test_push_every_key_then_pull_every_key_reads_the_replies(cluster):
    """MXNet's trainer order over two keys: once learned, no pull is sent."""
    c = cluster(1, 1)
    outs = c.run_workers("sparse_two_keys_loop.py")
    assert "OK two keys loop" in outs[0], outs


@pytest.mark.parametrize(
    "num_server,num_worker,dtype,shm,kind",
    [
        (2, 2, "float32", "1", "dist_sync"),
        (3, 2, "float16", "0", "dist_sync"),
        (2, 3, "complex64", "1", "dist_sync"),
        (2, 2, "float64", "1", "dist_device_sync"),
    ],
)
def test_row_sparse_fuzz_is_exact(cluster, num_server, num_worker, dtype, shm, kind):
    """Random push / pushpull / row_sparse_pull steps on hash and range keys, bit for bit
    against a NumPy model (tests/workers/sparse_fuzz.py); the seed is printed. Replies come
    as deltas and as every row, and pulls are read from a push's reply, in every run."""
    import random

    seed = random.randrange(1 << 30)
    print(f"sparse fuzz seed {seed}")
    c = cluster(num_server, num_worker, KVSTORE_SHM=shm, FUZZ_KIND=kind)
    outs = c.run_workers("sparse_fuzz.py", [dtype, 120, seed], timeout=120)
    for out in outs:
        assert "OK fuzz 120 steps" in out, (seed, outs)
        counts = json.loads(out.split("COUNTS ")[1].splitlines()[0])
        assert counts["delta"] > 0 and counts["full"] > 0 and counts["served"] > 0, (seed, out)
