"""Metrics: a job of known traffic gives exact counters at /metrics (read with
prometheus_client's own parser); 10,000 keys keep a heartbeat small; what a node sends is
checked before the scheduler keeps it."""

from __future__ import annotations

import math
import urllib.request

import msgpack
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import metrics
from kvstore.config import Config
from kvstore.store import Item

from .cluster import base_env, free_port, poll_until


def scrape(port: int) -> dict:
    """{(sample name, frozenset(labels)): value} of the scheduler's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_known_traffic_gives_exact_counters(cluster, tmp_path):
    steps, nbytes, workers = 30, 8192, 2
    port = free_port()
    c = cluster(2, workers, KVSTORE_STATUS_PORT=port)
    release = tmp_path / "release"
    procs = c.start_workers("traffic.py", [steps, nbytes, release])
    try:
        for i in range(workers):
            c.wait_for_output(f"worker{i}", "done", 30)

        def counted():
            got = scrape(port)
            return all(
                got.get(("kvstore_pushes_total", frozenset({("rank", str(r))}))) == steps
                for r in range(workers)
            )

        assert poll_until(counted, 20), scrape(port)
        got = scrape(port)
        for r in range(workers):
            rank = frozenset({("rank", str(r))})
            call = frozenset({("rank", str(r)), ("call", "pushpull")})
            assert got[("kvstore_pulls_total", rank)] == steps
            assert got[("kvstore_bytes_pushed_total", rank)] == steps * nbytes
            assert got[("kvstore_bytes_pulled_total", rank)] == steps * nbytes
            assert got[("kvstore_key_rounds_total", rank)] == steps
            assert got[("kvstore_calls_total", call)] == steps
            assert got[("kvstore_call_seconds_count", call)] == steps
            inf = frozenset({*call, ("le", "+Inf")})
            assert got[("kvstore_call_seconds_bucket", inf)] == steps
            assert got[("kvstore_call_seconds_sum", call)] > 0
        key = frozenset({("key", "w")})
        assert got[("kvstore_key_bytes_total", key)] == workers * 2 * steps * nbytes
        assert got[("kvstore_key_pushes_total", key)] == steps
        served = sum(
            v
            for (name, labels), v in got.items()
            if name == "kvstore_server_requests_total" and ("kind", "pushpull") in labels
        )
        assert served == workers * steps
        received = sum(v for (n, _), v in got.items() if n == "kvstore_server_bytes_received_total")
        assert received == workers * steps * nbytes
        assert got[("kvstore_job_rounds_total", frozenset())] == steps
        assert got[("kvstore_job_running", frozenset())] == 1
        nodes = [labels for name, labels in got if name == "kvstore_node_up"]
        assert sorted(dict(n)["role"] for n in nodes) == ["server"] * 2 + ["worker"] * 2
        for labels in nodes:
            assert got[("kvstore_heartbeat_age_seconds", labels)] < 3
            assert got[("kvstore_process_resident_memory_bytes", labels)] > 1 << 20
            assert got[("kvstore_process_cpu_seconds_total", labels)] > 0
    finally:
        release.touch()
    assert c.wait(procs, 30) == [0] * workers


def test_dist_ssp_shows_clocks_and_how_stale_each_read_was(cluster, tmp_path):
    steps, workers = 20, 2
    port = free_port()
    c = cluster(1, workers, KVSTORE_STATUS_PORT=port, KVSTORE_STALENESS=1)
    release = tmp_path / "release"
    env = dict(c.env, TRAFFIC_STORE="dist_ssp")
    procs = c.start_workers("traffic.py", [steps, 64, release], env=env)
    try:
        for i in range(workers):
            c.wait_for_output(f"worker{i}", "done", 30)
        reads = ("kvstore_staleness_rounds_count", frozenset())

        def counted():
            return scrape(port).get(reads) == workers * steps

        assert poll_until(counted, 20), scrape(port)
        got = scrape(port)
        for r in range(workers):
            assert got[("kvstore_worker_clock", frozenset({("rank", str(r))}))] == steps
            assert got[("kvstore_worker_ahead_rounds", frozenset({("rank", str(r))}))] == 0
        # no read lacked more than KVSTORE_STALENESS=1 of the reader's rounds
        buckets = {
            float(dict(labels)["le"]): v
            for (name, labels), v in got.items()
            if name == "kvstore_staleness_rounds_bucket"
        }
        assert min(le for le, v in buckets.items() if v == workers * steps) <= 1, buckets
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as reply:
            page = reply.read().decode()
        assert "Staleness (dist_ssp)" in page and "reads by rounds behind" in page, page
    finally:
        release.touch()
    assert c.wait(procs, 30) == [0] * workers


def test_ten_thousand_keys_keep_a_heartbeat_small():
    m = metrics.NodeMetrics("worker")
    items = [Item(k, [np.ones(k % 50 + 1, np.float32)], []) for k in range(10_000)]
    for _ in range(3):
        m.done("push", items, 0.01)
    snap = m.snapshot()
    assert snap["nkeys"] == 10_000 and len(snap["keys"]) == metrics.TOP
    assert [row[1] for row in snap["keys"]] == [3 * 50 * 4] * metrics.TOP  # the biggest keys
    assert len(msgpack.packb(snap)) < 4096
    assert snap["pushes"] == 3 and snap["rounds"] == 30_000
    assert snap["bp"] == 3 * sum(i.values[0].nbytes for i in items)
    assert metrics.clean(snap)["keys"] == snap["keys"]


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"pushes": -1},
        {"bp": math.nan},
        {"bp": "1"},
        {"keys": [[1, 2, 3, 4]] * (metrics.TOP + 1)},
        {"keys": [[1, 2, 3]]},
        {"hist": {"pushpull": [1, 2]}},
        {"calls": {str(i): 1 for i in range(100)}},
        {"store": 5},
    ],
)
def test_the_scheduler_refuses_malformed_metrics(bad):
    with pytest.raises(ValueError):
        metrics.clean(bad)


def test_settings():
    env = base_env(1, 1, DMLC_ROLE="worker")
    cfg = Config.from_env(env)
    assert cfg.metrics and cfg.status_port == -1 and cfg.status_addr == "127.0.0.1"
    assert cfg.timeline == "" and cfg.status_linger == 0
    cfg = Config.from_env({**env, "KVSTORE_METRICS": "0", "KVSTORE_STATUS_PORT": "0"})
    assert not cfg.metrics and cfg.status_port == 0
    with pytest.raises(ValueError, match="KVSTORE_STATUS_PORT"):
        Config.from_env({**env, "KVSTORE_STATUS_PORT": "70000"})
    with pytest.raises(ValueError, match="KVSTORE_METRICS"):
        Config.from_env({**env, "KVSTORE_METRICS": "maybe"})
