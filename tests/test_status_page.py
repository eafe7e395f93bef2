"""The status page of a running W2S2 job in a real browser (Debian's headless Chromium).

Chromium renders the page (its script included); the test reads the DOM it dumps, keeps a
screenshot as an artifact (``$KVSTORE_ARTIFACTS`` or the test's tmp dir), then kills a worker
and loads the page again: that worker shows as failed, and the round it left waiting as a
stall. Also: the endpoint refuses a request
from another address without the job's secret.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvstore.status import StatusServer

from .cluster import free_port, poll_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def browser(url: str, tmp: Path, screenshot: Path | None = None) -> str:
    """Load ``url`` in headless Chromium; return the rendered DOM (and save a screenshot)."""
    args = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # as root in a container
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={tmp / 'chromium-profile'}",
        "--window-size=1280,1000",
        "--virtual-time-budget=1500",  # run the page's script, not yet its 2 s refresh
    ]
    if screenshot is not None:
        args.append(f"--screenshot={screenshot}")
    else:
        args.append("--dump-dom")
    done = subprocess.run([*args, url], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    return done.stdout.decode(errors="replace")


def rows(dom: str) -> dict:
    """(role, rank) -> state of each node row of the rendered page."""
    found = re.findall(
        r'<tr class="node" data-role="(\w+)" data-rank="(\d+)" data-state="(\w+)"', dom
    )
    return {(role, int(rank)): state for role, rank, state in found}


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed: scripts/test.sh installs it when run as root "
    "(apt-get install chromium)",
)
def test_status_page_in_chromium(cluster, tmp_path):
    port = free_port()
    c = cluster(2, 2, KVSTORE_STATUS_PORT=port, KVSTORE_STATUS_LINGER=60)
    stop = tmp_path / "stop"
    workers = c.start_workers("traffic.py", [20, 65536, tmp_path / "release", stop])
    try:
        url = f"http://127.0.0.1:{port}/"
        for i in range(2):
            c.wait_for_output(f"worker{i}", "done", 30)

        def plotted():  # three seconds of throughput: the plot has its lines
            return "<polyline" in fetch(url)

        assert poll_until(plotted, 20), fetch(url)
        dom = browser(url, tmp_path)
        assert "kvstore job" in dom and "<svg" in dom and "polyline" in dom
        seen = rows(dom)
        expected = {("worker", 0), ("worker", 1), ("server", 0), ("server", 1)}
        assert set(seen) == expected, dom
        assert set(seen.values()) == {"running"}, seen
        shot = Path(os.environ.get("KVSTORE_ARTIFACTS", tmp_path)) / "status.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        browser(url, tmp_path, screenshot=shot)
        assert shot.stat().st_size > 10_000

        workers[1].send_signal(signal.SIGKILL)
        workers[1].wait(10)

        def failed():
            try:
                return rows(fetch(url)).get(("worker", 1)) == "failed"
            except (urllib.error.URLError, OSError):
                return False

        assert poll_until(failed, 20), c.dump()
        dom = browser(url, tmp_path)
        seen = rows(dom)
        assert seen[("worker", 1)] == "failed", dom
        assert "sent no heartbeat" in dom  # the reason is shown
        assert 'id="job-state">failed' in dom
        # worker 0 waited on the dead worker's round: the servers' stall report is shown
        assert re.search(r'class="stall".*waited \d+s for worker\(s\) \[1\]', dom), dom
    finally:
        stop.touch()


class _Cfg:
    status_port = 0
    status_addr = "127.0.0.1"
    secret = b"0123456789abcdef0123456789abcdef"
    heartbeat_interval = 1.0


def test_other_hosts_need_the_token():
    """A non-loopback client gets 403 without the job's secret, 200 with it (as a query
    token or a bearer header); loopback clients need none."""
    server = StatusServer(_Cfg())
    try:
        secret = _Cfg.secret.decode()
        assert server.allowed("127.0.0.1", {}, {})
        assert server.allowed("::1", {}, {})
        assert not server.allowed("10.1.2.3", {}, {})
        assert not server.allowed("10.1.2.3", {"token": ["wrong"]}, {})
        assert server.allowed("10.1.2.3", {"token": [secret]}, {})
        assert server.allowed("10.1.2.3", {}, {"Authorization": f"Bearer {secret}"})
        assert fetch(f"http://127.0.0.1:{server.port}/").startswith("<!doctype html>")
    finally:
        server.close()
