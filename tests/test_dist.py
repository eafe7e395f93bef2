"""dist_sync / dist_async / dist_device_sync with real processes on 127.0.0.1."""

import pytest

MATRIX = [(s, w) for w in (1, 2, 4) for s in (1, 2)]


@pytest.mark.parametrize("num_server,num_worker", MATRIX)
def test_sync_rounds_sum(cluster, num_server, num_worker):
    c = cluster(num_server, num_worker, KVSTORE_BIGARRAY_BOUND=2000)
    outs = c.run_workers("rounds.py", ["dist_sync", 4, "none", "int"])
    assert all("OK after 4 rounds" in o for o in outs)


@pytest.mark.parametrize("num_server,num_worker", [(1, 2), (2, 4)])
def test_sync_rounds_sgd_str_keys(cluster, num_server, num_worker):
    c = cluster(num_server, num_worker, KVSTORE_BIGARRAY_BOUND=2000)
    outs = c.run_workers("rounds.py", ["dist_sync", 4, "sgd", "str"])
    assert sorted(o.split("rank ")[1][0] for o in outs) == [str(r) for r in range(num_worker)]
    assert all("OK after 4 rounds" in o for o in outs)


def test_device_sync(cluster):
    c = cluster(2, 2, KVSTORE_BIGARRAY_BOUND=2000)
    outs = c.run_workers("rounds.py", ["dist_device_sync", 3, "sgd", "int"])
    assert all("OK after 3 rounds" in o for o in outs), outs


@pytest.mark.parametrize("num_server,num_worker", [(1, 2), (2, 4)])
def test_async_no_lost_update(cluster, num_server, num_worker):
    c = cluster(num_server, num_worker, KVSTORE_BIGARRAY_BOUND=2000)
    outs = c.run_workers("async_sum.py", [30])
    assert all(" OK" in o for o in outs), outs


def test_ps_verbose_levels(cluster):
    c = cluster(1, 1, PS_VERBOSE=1)
    c.run_workers("loop.py", [3])
    c.wait([c.procs["scheduler"], c.procs["server0"]], 20)
    log = c.output("scheduler")
    for text in ("registered server", "registered worker", "barrier(worker)", "heartbeat from"):
        assert text in log, log
    assert "pushpull [['w', 0]" not in c.output("server0")  # every message: level 2 only
    c2 = cluster(1, 1, PS_VERBOSE=2)
    c2.run_workers("loop.py", [3])
    c2.wait([c2.procs["server0"]], 20)
    assert "pushpull [['w', 0], ['b', 0]] from worker-0" in c2.output("server0")


def test_scheduler_address_given_as_a_name(cluster):
    c = cluster(1, 2, DMLC_PS_ROOT_URI="localhost")
    outs = c.run_workers("loop.py", [2])
    assert all("round 1" in o for o in outs), outs


@pytest.mark.parametrize("num_server,num_worker", [(1, 2), (2, 3)])
def test_many_small_keys_of_mixed_dtypes_and_shapes(cluster, num_server, num_worker):
    """300 keys of 7 dtypes and 1-D, N-d, 0-d and big shapes in one pushpull: the runs the
    protocol packs them in come apart into exact sums."""
    c = cluster(num_server, num_worker)
    outs = c.run_workers("mixed_keys.py", [3])
    assert all("OK after 3 rounds of 300 mixed keys" in o for o in outs), outs
