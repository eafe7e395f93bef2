"""The status page of a running W2S2 job in a real browser (Debian's headless Chromium).

Chromium renders the page (its script included); the test reads the DOM it dumps, keeps a
screenshot as an artifact (``$KVSTORE_ARTIFACTS`` or the test's tmp dir), then kills a worker
and loads the page again: that worker shows as failed, and the round it left waiting as a
stall. Also: the endpoint refuses a request from another address without the page's
token (derived from the job's secret, never the secret itself), trades a query token for a
cookie, and logs neither.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvstore import status as status_module
from kvstore.launch.cli import status_page
from kvstore.status import StatusServer, page_token

from .cluster import ROOT, free_port, poll_until

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

        # frozen, not killed: a killed worker's closed connection fails it within two
        # heartbeats, before worker 0's wait on its round is a stall worth showing
        workers[1].send_signal(signal.SIGSTOP)

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
    """A non-loopback client gets 403 without the page's token, 200 with it (as a query
    token, a bearer header or the cookie); the job's secret itself is no token; loopback
    clients need none."""
    server = StatusServer(_Cfg())
    try:
        secret = _Cfg.secret.decode()
        token = page_token(_Cfg.secret)
        assert token != secret and secret not in token and len(token) == 64
        assert server.allowed("127.0.0.1", {}, {})
        assert server.allowed("::1", {}, {})
        assert not server.allowed("10.1.2.3", {}, {})
        assert not server.allowed("10.1.2.3", {"token": ["wrong"]}, {})
        assert not server.allowed("10.1.2.3", {"token": [secret]}, {})
        assert not server.allowed("10.1.2.3", {}, {"Authorization": f"Bearer {secret}"})
        assert server.allowed("10.1.2.3", {"token": [token]}, {})
        assert server.allowed("10.1.2.3", {}, {"Authorization": f"Bearer {token}"})
        assert server.allowed("10.1.2.3", {}, {"Cookie": f"kvstore_token={token}"})
        assert not server.allowed("10.1.2.3", {}, {"Cookie": f"kvstore_token={secret}"})
        assert not server.allowed("10.1.2.3", {}, {"Cookie": "kvstore_token=\x00;;=bad"})
        assert fetch(f"http://127.0.0.1:{server.port}/").startswith("<!doctype html>")
    finally:
        server.close()


def _get(port: int, path: str, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def test_query_token_is_traded_for_a_cookie_and_never_logged(monkeypatch, caplog):
    """``?token=`` is answered once with a redirect to the clean URL that sets an HttpOnly,
    SameSite=Strict cookie; the cookie and a bearer header then open the page; the secret
    opens nothing; the request log shows neither the token nor any query."""
    monkeypatch.setattr(status_module, "_is_loopback", lambda host: False)  # as from afar
    caplog.set_level(logging.DEBUG, logger="kvstore.status")
    server = StatusServer(_Cfg())
    try:
        secret = _Cfg.secret.decode()
        token = page_token(_Cfg.secret)
        code, headers, _ = _get(server.port, f"/?token={token}&x=1")
        assert code == 303, code
        assert headers["Location"] == "/?x=1"
        cookie = headers["Set-Cookie"]
        assert cookie.startswith(f"kvstore_token={token};"), cookie
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
        assert _get(server.port, "/", {"Cookie": f"kvstore_token={token}"})[0] == 200
        code, _, body = _get(server.port, "/metrics", {"Authorization": f"Bearer {token}"})
        assert code in (200, 501), body
        assert _get(server.port, "/")[0] == 403
        assert _get(server.port, f"/?token={secret}")[0] == 403
        assert _get(server.port, "/", {"Authorization": f"Bearer {secret}"})[0] == 403
        assert _get(server.port, "/", {"Cookie": f"kvstore_token={secret}"})[0] == 403
        _get(server.port, f"/status.json?token={token}")
    finally:
        server.close()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "GET /" in logged and "303" in logged and "403" in logged, logged
    assert token not in logged and secret not in logged and "token=" not in logged, logged


def test_nothing_at_ps_verbose_2_shows_the_secret_or_the_token(cluster, tmp_path):
    """A real job at PS_VERBOSE=2 whose page is read with the token (a query, a bearer
    header), and even with the secret as a query: no process prints either."""
    port = free_port()
    c = cluster(1, 2, PS_VERBOSE=2, KVSTORE_STATUS_PORT=port)
    secret = c.env["KVSTORE_SECRET"]
    token = page_token(secret.encode())
    release = tmp_path / "release"
    workers = c.start_workers("traffic.py", [5, 4096, release])
    try:
        for i in range(2):
            c.wait_for_output(f"worker{i}", "done", 60)
        for query in (f"?token={token}", f"?token={secret}", ""):
            _get(port, f"/{query}", {"Authorization": f"Bearer {token}"})
            _get(port, f"/metrics{query}")

        def logged():  # the request log has caught up with the reads
            return c.output("scheduler").count("status: 127.0.0.1 GET") >= 6

        assert poll_until(logged, 20), c.output("scheduler")[-3000:]
    finally:
        release.touch()
    assert c.wait(workers, 60) == [0, 0], c.dump()
    assert c.wait([c.procs["scheduler"], c.procs["server0"]], 30) == [0, 0], c.dump()
    assert "recv heartbeat" in c.output("scheduler")  # every message logged
    for name in c.logs:
        out = c.output(name)
        assert secret not in out, (name, "the secret")
        assert token not in out, (name, "the token")


def test_status_token_command_prints_the_derived_token(tmp_path):
    env = {**os.environ, "KVSTORE_SECRET": _Cfg.secret.decode(), "PYTHONPATH": str(ROOT)}
    env.pop("KVSTORE_SECRET_FILE", None)

    def status_token():
        command = [sys.executable, "-m", "kvstore", "status-token"]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    done = status_token()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == page_token(_Cfg.secret)
    env.pop("KVSTORE_SECRET")
    done = status_token()
    assert done.returncode == 2 and "no job secret" in done.stderr, done.stderr


def test_launcher_names_the_page_token_not_the_secret():
    secret = _Cfg.secret.decode()
    url = status_page(
        {"KVSTORE_STATUS_ADDR": "10.1.2.3", "KVSTORE_STATUS_PORT": "8080", "KVSTORE_SECRET": secret}
    )
    assert page_token(_Cfg.secret) in url and secret not in url, url
