"""The values pulls return, with real processes: the bugs the round rework fixed, MXNet's
nightly checks, and a randomized mix of keys and delays. Every pulled value is checked
exactly by the worker scripts, and the tests read their reports."""

from __future__ import annotations

import signal

import pytest

from .cluster import poll_until

BOUND = {"KVSTORE_BIGARRAY_BOUND": 1000}  # 1200x1200 and 2500 elements are split


@pytest.mark.parametrize("slow", [-1, 1])
def test_pull_after_three_pushes_includes_them_all(cluster, slow):
    """Bug 1: a worker ahead of the others pulled 7 or 13 where 19 was right."""
    for trial in range(3):
        c = cluster(1, 3 if slow < 0 else 2)
        outs = c.run_workers("nightly.py", ["dist_sync", trial, slow])
        want = f"OK {1 + 2 * c.num_worker * (c.num_worker + 1) // 2 * 3}"
        assert all(want in o for o in outs), outs


def test_set_optimizer_holds_before_any_push_async(cluster):
    """Bug 2: in dist_async, pushes that arrived before rank 0's optimizer were added raw."""
    for trial in range(3):
        c = cluster(2, 2, **BOUND)
        outs = c.run_workers("nightly.py", ["dist_async", trial, 0])  # rank 0 sets it late
        assert all("OK 19" in o for o in outs), outs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dist_sync", "dist_async"])
@pytest.mark.parametrize("num_server,num_worker", [(1, 2), (2, 2), (1, 3), (2, 3)])
def test_mxnet_nightly_checks_repeatedly(cluster, kind, num_server, num_worker):
    want = f"OK {1 + 2 * num_worker * (num_worker + 1) // 2 * 3}"
    for trial in range(10 if num_worker == 2 else 5):
        c = cluster(num_server, num_worker, **BOUND)
        outs = c.run_workers("nightly.py", [kind, trial, -1])
        assert all(want in o for o in outs), (trial, outs)
        c.stop()


@pytest.mark.parametrize("seed,piece", [(1, 0), (2, 0), (3, 9000), (4, 70000)])
def test_random_delays_and_mixed_keys_exact(cluster, seed, piece):
    """``piece``: big keys travel in pieces of about that many bytes (each its own round and
    message; 70000: pieces still big enough for shared memory)."""
    c = cluster(2, 3, KVSTORE_PIECE_BYTES=piece, **BOUND)
    outs = c.run_workers("random_rounds.py", [seed, 25], timeout=90)
    for o in outs:
        assert "pulled values exact" in o, outs
        assert int(o.split("OK: ")[1].split()[0]) > 0, outs


def _freeze_rank1(c, go):
    workers = c.start_workers("frozen.py", [go, c.then])
    c.wait_for_output("worker1", "READY", 60)
    workers[1].send_signal(signal.SIGSTOP)
    # A stopped process shows state T; only then may rank 0 start its rounds.
    assert poll_until(lambda: _state(workers[1].pid) == "T", 10)
    go.write_text("go")
    return workers


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_frozen_worker_neither_stalls_the_server_nor_sees_torn_data(cluster, tmp_path):
    """Bugs 3 and 4: a big reply stuck on its way to a frozen worker. The server finishes
    the other rounds at once (it used to wait up to KVSTORE_TIMEOUT), and the reply, read
    after the thaw, holds the value of its own round (the update used to write into it)."""
    # the TCP path (a reply that ZeroMQ still sends): no shared memory
    c = cluster(1, 2, KVSTORE_TIMEOUT=40, KVSTORE_HEARTBEAT_TIMEOUT=30, KVSTORE_SHM=0)
    c.then = "resume"
    workers = _freeze_rank1(c, tmp_path / "go")
    try:
        c.wait_for_output("worker0", "ROUNDS DONE", 20)
    finally:
        workers[1].send_signal(signal.SIGCONT)
    took = float(c.output("worker0").split("ROUNDS DONE in ")[1].split("s")[0])
    assert took < 10, c.dump()  # not KVSTORE_TIMEOUT (40s)
    assert c.wait(workers, 60) == [0, 0], c.dump()
    assert "round-0 reply holds [4.]" in c.output("worker1"), c.dump()


def test_frozen_worker_is_declared_dead_within_the_heartbeat_timeout(cluster, tmp_path):
    """Bug 4: the job failed after 41s (KVSTORE_TIMEOUT) instead of ~5s (heartbeats)."""
    c = cluster(1, 2, KVSTORE_TIMEOUT=40, KVSTORE_HEARTBEAT_TIMEOUT=3, KVSTORE_SHM=0)
    c.then = "dead"
    workers = _freeze_rank1(c, tmp_path / "go")
    assert c.wait(workers[:1], 30) == [3], c.dump()
    out = c.output("worker0")
    assert "worker 1 (127.0.0.1" in out and "sent no heartbeat" in out, out
    after = float(out.split("FAILED after ")[1].split("s:")[0])
    assert after < 15, out  # the heartbeat timeout (3s) plus slack, far below 40s


@pytest.mark.parametrize("num_server,num_worker", [(1, 2), (2, 3)])
def test_join_lets_workers_with_more_data_train_on(cluster, num_server, num_worker):
    c = cluster(num_server, num_worker, **BOUND)
    outs = c.run_workers("uneven.py", [num_worker], timeout=90)
    assert all(" OK" in o for o in outs), outs
    last = {o.split("last to join: ")[1].split()[0] for o in outs}
    assert last == {str(num_worker - 1)}, outs  # the rank with the most batches joins last
