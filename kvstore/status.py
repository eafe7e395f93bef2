"""The scheduler's HTTP endpoint: a live status page at ``/``, Prometheus text at ``/metrics``.

The scheduler's loop builds a :func:`job_view` (plain data, copied from its own state) about
twice a second and hands it over with :meth:`StatusServer.publish`, which only replaces one
reference. The HTTP server runs in its own threads and renders from the latest view, so a slow
or hostile client never holds up the loop, and the loop never waits for a lock.

It listens on 127.0.0.1 by default (``KVSTORE_STATUS_PORT``: the port, 0 to turn it off;
unset, any free port). With ``KVSTORE_STATUS_ADDR`` it listens elsewhere, and then answers a
request that does not come from the loopback only with the page's token, :func:`page_token`
(derived from the job's secret, so a leaked token never leaks the secret):
``Authorization: Bearer TOKEN``, or ``?token=TOKEN`` once: that is answered with a redirect to
the clean URL that sets the token as an HttpOnly, SameSite=Strict cookie, so the token stays
out of the address bar, the history and any later request line. Neither the token nor a query
string is ever logged. ``python -m kvstore status-token`` prints the token.

The page needs no network: inline CSS, an inline SVG plot, and a few lines of script that
fetch the page again every 2 seconds and swap in its content.

>>> server = StatusServer(cfg)  # doctest: +SKIP
>>> server.url
'http://127.0.0.1:41234/'
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from collections import deque
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlencode, urlsplit

from .metrics import BUCKETS, STALE_MAX, TOP

log = logging.getLogger("kvstore.status")

HISTORY = 300  # samples of the throughput plot, one per second: the last 5 minutes
PUBLISH_EVERY = 0.5  # seconds between the loop's views
COOKIE = "kvstore_token"
_TOKEN_LABEL = b"kvstore status page token v1"


def page_token(secret: bytes) -> str:
    """The status page's token: HMAC-SHA256 of a fixed label under the job's secret, in hex.
    Whoever holds it can read the page, not join the job.

    >>> page_token(b"0123456789abcdef0123456789abcdef")[:16]
    '52d0502b149c5913'
    """
    return hmac.new(secret, _TOKEN_LABEL, hashlib.sha256).hexdigest()


class StatusServer:
    """The HTTP server and the latest view; :meth:`publish` is the loop's only call."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.view: dict | None = None
        self.history: deque = deque(maxlen=HISTORY)  # (wall time, bytes, rounds)
        self._next_sample = 0.0
        port = max(cfg.status_port, 0)
        server_class = _V6Server if ":" in cfg.status_addr else _Server
        self.httpd = server_class((cfg.status_addr, port), _Handler)
        self.httpd.status = self
        self.port = self.httpd.server_address[1]
        self.loopback_only = _is_loopback(cfg.status_addr)
        self.token = page_token(cfg.secret) if cfg.secret else ""
        self._registry = None
        self._thread = threading.Thread(
            target=self.httpd.serve_forever,
            kwargs={"poll_interval": 0.1},  # shutdown() waits up to this long
            name="kvstore-status",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host = self.cfg.status_addr
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/"

    def publish(self, view: dict) -> None:
        """Called by the scheduler's loop: keep one throughput sample a second, swap the view."""
        if view["time"] >= self._next_sample:
            self._next_sample = view["time"] + 1.0
            self.history.append((view["time"], view["bytes"], view["rounds"]))
        view["history"] = list(self.history)
        self.view = view  # one reference replaced: the HTTP threads see the old or the new

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- what the HTTP threads call
    def allowed(self, client: str, query: dict, headers) -> bool:
        """Loopback clients always; others with the page's token (a query, a bearer header
        or the cookie the query's redirect set)."""
        return _is_loopback(client) or self.valid(query, headers)

    def valid(self, query: dict, headers) -> bool:
        if not self.token:
            return False  # KVSTORE_INSECURE: no secret to derive it from, so the loopback only
        offered = [(query.get("token") or [""])[0]]
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            offered.append(auth[7:].strip())
        try:
            cookie = SimpleCookie(headers.get("Cookie", ""))
        except CookieError:
            cookie = {}
        if COOKIE in cookie:
            offered.append(cookie[COOKIE].value)
        token = self.token.encode()
        return any(hmac.compare_digest(o.encode(errors="replace"), token) for o in offered if o)

    def prometheus(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from prometheus_client.registry import CollectorRegistry

        if self._registry is None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Collector(self))
            self._registry = registry
        return generate_latest(self._registry), CONTENT_TYPE_LATEST


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _V6Server(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server_version = "kvstore-status"
    timeout = 10  # a client that sends nothing frees its thread

    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        status: StatusServer = self.server.status
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if not status.allowed(self.client_address[0], query, self.headers):
            self._send(
                403,
                b"kvstore status: a request from another host needs the page's token "
                b"(`python -m kvstore status-token` prints it from KVSTORE_SECRET): "
                b"?token=TOKEN once, or 'Authorization: Bearer TOKEN'\n",
                "text/plain; charset=utf-8",
            )
            return
        if "token" in query:  # once: from now on the cookie carries it, not the URL
            rest = {k: v for k, v in query.items() if k != "token"}
            self.send_response(303)
            self.send_header(
                "Location", url.path + (f"?{urlencode(rest, doseq=True)}" if rest else "")
            )
            if status.valid(query, {}):
                self.send_header(
                    "Set-Cookie",
                    f"{COOKIE}={status.token}; Path=/; HttpOnly; SameSite=Strict",
                )
            self.send_header("Content-Length", "0")
            self.send_header("Cache-Control", "no-store")
            self.send_header("Referrer-Policy", "no-referrer")
            self.end_headers()
            return
        view = status.view
        try:
            if url.path == "/":
                body = render_page(view, status.cfg).encode()
                self._send(200, body, "text/html; charset=utf-8")
            elif url.path == "/metrics":
                try:
                    body, kind = status.prometheus()
                except ImportError:
                    self._send(501, b"prometheus_client is not installed\n", "text/plain")
                    return
                self._send(200, body, kind)
            elif url.path == "/status.json":
                self._send(200, json.dumps(view, default=str).encode(), "application/json")
            else:
                self._send(404, b"not found: try / or /metrics or /status.json\n", "text/plain")
        except Exception:  # a page that fails to render never takes the scheduler down
            log.exception("status: rendering %s failed", url.path)
            text = b"kvstore status: rendering failed (see the scheduler log)\n"
            self._send(500, text, "text/plain")

    def _send(self, code: int, body: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_request(self, code="-", size="-") -> None:
        # never the request line: its query may hold the token
        path = urlsplit(self.path).path if hasattr(self, "path") else "?"
        log.debug("status: %s %s %s %s", self.address_string(), self.command, path, code)

    def log_message(self, fmt, *args) -> None:
        # an error's text may quote the raw request line: drop any query and token from it
        text = _QUERY.sub("?<hidden>", fmt % args)
        token = self.server.status.token
        log.debug(
            "status: %s %s",
            self.address_string(),
            text.replace(token, "<hidden>") if token else text,
        )


_QUERY = re.compile(r"\?[^\s'\"]*")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


# ---------------------------------------------------------------- the view (loop thread)


def job_view(
    snapshot: dict,
    metrics: dict,
    stalls: dict,
    stalls_seen: int,
    cfg,
    now: float,
    ended: str = "",
) -> dict:
    """Everything the page and /metrics show, as plain data: the membership's ``snapshot``
    (:meth:`kvstore.membership.Membership.snapshot`), each node's counters by identity, and
    the stall reports the scheduler keeps."""
    nodes = []
    by_rank: dict = {}  # worker rank -> its counters
    moved = {f["server"] for f in snapshot.get("failovers", ())}  # servers failed over
    for node in sorted(
        snapshot["nodes"], key=lambda n: (n["role"] != "worker", n["rank"], n["pid"])
    ):
        m = metrics.get(node["identity"]) or {}
        if node["role"] == "worker":
            by_rank[node["rank"]] = m
        if node["failed"] and node["role"] == "server" and node["rank"] in moved:
            state = "failed over"
        elif node.get("left"):  # an elastic job's worker that is gone: the job goes on
            state = "left"
        elif node["failed"]:
            state = "failed"
        elif node["finalized"]:
            state = "finished"
        elif node["joined"]:
            state = "joined"
        elif not snapshot["ready"]:
            state = "registered"
        else:
            state = "running"
        current = m.get("cur", "")
        if not current and node["in_barrier"]:
            current = "barrier"
        nodes.append(
            {
                "role": node["role"],
                "rank": node["rank"],
                "host": node["host"],
                "port": node["port"],
                "pid": node["pid"],
                "state": state,
                "reason": node["failed"],
                "current": current if state in ("running", "joined") else "",
                "current_for": m.get("for", 0.0),
                "heartbeat_age": node["heartbeat_age"],
                "metrics": m,
            }
        )
    workers = [n for n in nodes if n["role"] == "worker"]
    servers = [n for n in nodes if n["role"] == "server"]
    keys: dict = {}
    for w in workers:
        for key, nbytes, rounds, last in w["metrics"].get("keys", ()):
            entry = keys.setdefault(key, [0, 0, 0.0])
            entry[0] += nbytes
            entry[1] = max(entry[1], rounds)
            entry[2] = max(entry[2], last)
    top = sorted(keys.items(), key=lambda kv: -kv[1][0])[:TOP]
    parts = sorted(
        (
            (s["rank"], key, part, nbytes, count)
            for s in servers
            for key, part, nbytes, count in s["metrics"].get("parts", ())
        ),
        key=lambda p: -p[3],
    )[:TOP]
    shown = [
        {"what": what, "text": s["text"], "age": s["age"] + (now - s["at"]), "since": s["first"]}
        for what, s in stalls.items()
        if _stall_current(s, by_rank, cfg.stall_report, now)
    ]
    state = "starting" if not snapshot["ready"] else "running"
    if ended:
        state = ended
    store = next((w["metrics"].get("store") for w in workers if w["metrics"].get("store")), "")
    return {
        "time": time.time(),
        "state": state,
        "failure": snapshot["failure"]
        or next((n["reason"] for n in nodes if n["reason"] and n["state"] == "failed"), ""),
        "failovers": list(snapshot.get("failovers", ())),
        "membership": list(snapshot.get("membership", ()))[-20:],
        "uptime": snapshot["uptime"],
        "num_worker": cfg.num_worker,
        "num_server": cfg.num_server,
        "store": store,
        "scheduler": f"{cfg.root_uri}:{cfg.root_port}",
        "nodes": nodes,
        "keys": [[k, b, r, t] for k, (b, r, t) in top],
        "nkeys": max((w["metrics"].get("nkeys", 0) for w in workers), default=0),
        "parts": [list(p) for p in parts],
        "stalls": shown,
        "stalls_total": stalls_seen,
        "bytes": sum(w["metrics"].get("bp", 0) + w["metrics"].get("bl", 0) for w in workers),
        "rounds": min((w["metrics"].get("pushes", 0) for w in workers), default=0),
        "metrics": cfg.metrics,
        "ssp": _staleness_view(workers, servers) if store == "dist_ssp" else None,
    }


def _staleness_view(workers: list, servers: list) -> dict:
    """``dist_ssp``: each worker's clock (its pushes of its most pushed key), how far it is
    ahead of the slowest, and the servers' count of reads by how many of the reader's rounds
    they were behind."""
    clocks = {w["rank"]: w["metrics"].get("clock", 0) for w in workers if w["state"] == "running"}
    slowest = min(clocks.values(), default=0)
    reads: list = []
    for s in servers:
        for lag, count in enumerate(s["metrics"].get("stale", ())):
            if lag >= len(reads):
                reads.append(0)
            reads[lag] += count
    return {
        "clocks": [[r, c, c - slowest] for r, c in sorted(clocks.items())],
        "reads": reads,
    }


def _stall_current(stall: dict, by_rank: dict, every: float, now: float) -> bool:
    """A stall shows until a worker that waited on it completes a call, or until it has gone
    unreported for longer than the servers' report period."""
    for rank, calls in stall["calls"].items():
        m = by_rank.get(rank)
        if m and _calls(m) > calls:
            return False
    return not every or now - stall["at"] < 1.5 * every + 5


def _calls(m: dict) -> int:
    return sum(m.get("calls", {}).values())


# ---------------------------------------------------------------- Prometheus


class _Collector:
    """Turns the latest view into metric families each time /metrics is read."""

    def __init__(self, status: StatusServer):
        self.status = status

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        view = self.status.view
        if view is None:
            return
        node_labels = ["role", "rank", "host", "pid"]

        def gauge(name, doc, labels=()):
            return GaugeMetricFamily(f"kvstore_{name}", doc, labels=list(labels))

        def counter(name, doc, labels=()):
            return CounterMetricFamily(f"kvstore_{name}", doc, labels=list(labels))

        up = gauge("job_running", "1 while the job runs, 0 once it has finished or failed")
        up.add_metric([], 1.0 if view["state"] in ("starting", "running") else 0.0)
        yield up
        size = gauge("job_nodes", "nodes the job was started with", ["role"])
        size.add_metric(["worker"], view["num_worker"])
        size.add_metric(["server"], view["num_server"])
        yield size
        uptime = gauge("job_uptime_seconds", "seconds since the scheduler started")
        uptime.add_metric([], view["uptime"])
        yield uptime
        rounds = counter("job_rounds", "push calls completed by every worker (sync rounds)")
        rounds.add_metric([], view["rounds"])
        yield rounds
        stalls = counter("stalls", "rounds reported as stalled by the servers")
        stalls.add_metric([], view["stalls_total"])
        yield stalls
        current = gauge("stalls_current", "rounds stalled now")
        current.add_metric([], len(view["stalls"]))
        yield current

        node_up = gauge("node_up", "1 while a node runs, 0 finished, -1 failed", node_labels)
        age = gauge("heartbeat_age_seconds", "seconds since the node was last heard", node_labels)
        rss = gauge("process_resident_memory_bytes", "the node process's RSS", node_labels)
        cpu = counter("process_cpu_seconds", "the node process's CPU time", node_labels)
        families = {
            "bp": counter("bytes_pushed", "bytes a worker pushed", ["rank"]),
            "bl": counter("bytes_pulled", "bytes a worker pulled", ["rank"]),
            "pushes": counter("pushes", "push and pushpull calls of a worker", ["rank"]),
            "pulls": counter("pulls", "pull and pushpull calls of a worker", ["rank"]),
            "rounds": counter("key_rounds", "key rounds a worker pushed, summed", ["rank"]),
        }
        calls = counter("calls", "public calls of a worker by kind", ["rank", "call"])
        latency = HistogramMetricFamily(
            "kvstore_call_seconds",
            "latency of a worker's calls (a pushpull's includes its round)",
            labels=["rank", "call"],
        )
        requests = counter("server_requests", "requests a server answered", ["rank", "kind"])
        bytes_in = counter("server_bytes_received", "bytes pushed to a server", ["rank"])
        bytes_out = counter("server_bytes_sent", "bytes a server sent in replies", ["rank"])
        for n in view["nodes"]:
            labels = [n["role"], str(n["rank"]), n["host"], str(n["pid"])]
            state = {"failed": -1.0, "finished": 0.0}.get(n["state"], 1.0)
            node_up.add_metric(labels, state)
            age.add_metric(labels, n["heartbeat_age"])
            m = n["metrics"]
            if not m:
                continue
            rss.add_metric(labels, m["rss"])
            cpu.add_metric(labels, m["cpu"])
            rank = str(n["rank"])
            if n["role"] == "worker":
                for field, family in families.items():
                    family.add_metric([rank], m[field])
                for kind, count in m["calls"].items():
                    calls.add_metric([rank, kind], count)
                for kind, hist in m["hist"].items():
                    buckets, total = [], 0
                    for bound, count in zip([*BUCKETS, float("inf")], hist[:-1], strict=True):
                        total += count
                        buckets.append((_bound(bound), total))
                    latency.add_metric([rank, kind], buckets, hist[-1])
            else:
                for kind, count in m["req"].items():
                    requests.add_metric([rank, kind], count)
                bytes_in.add_metric([rank], m["bin"])
                bytes_out.add_metric([rank], m["bout"])
        yield from (node_up, age, rss, cpu, *families.values(), calls, latency)
        yield from (requests, bytes_in, bytes_out)
        if view.get("ssp"):
            yield from _staleness_metrics(view["ssp"], gauge, HistogramMetricFamily)

        key_bytes = counter("key_bytes", f"bytes pushed and pulled, top {TOP} keys", ["key"])
        key_rounds = counter("key_pushes", f"pushes of a key by a worker, top {TOP}", ["key"])
        key_latency = gauge("key_last_latency_seconds", "a key's last call latency", ["key"])
        for key, nbytes, rounds, last in view["keys"]:
            key_bytes.add_metric([str(key)], nbytes)
            key_rounds.add_metric([str(key)], rounds)
            key_latency.add_metric([str(key)], last)
        yield from (key_bytes, key_rounds, key_latency)
        part_bytes = counter(
            "server_part_bytes",
            f"bytes of a key part at its server, top {TOP}",
            ["rank", "key", "part"],
        )
        for rank, key, part, nbytes, _ in view["parts"]:
            part_bytes.add_metric([str(rank), str(key), str(part)], nbytes)
        yield part_bytes


def _staleness_metrics(ssp: dict, gauge, histogram):
    clock = gauge("worker_clock", "dist_ssp: a worker's pushes of its most pushed key", ["rank"])
    ahead = gauge("worker_ahead_rounds", "dist_ssp: a worker's clock less the slowest's", ["rank"])
    for rank, c, lead in ssp["clocks"]:
        clock.add_metric([str(rank)], c)
        ahead.add_metric([str(rank)], lead)
    reads = histogram(
        "kvstore_staleness_rounds",
        "dist_ssp reads (servers' answers) by how many of the reader's rounds they lacked",
    )
    buckets, total = [], 0
    for lag, count in enumerate(ssp["reads"]):
        total += count
        if lag < STALE_MAX:  # the last slot counts every read further behind: +Inf only
            buckets.append((repr(float(lag)), total))
    buckets.append(("+Inf", total))
    weighted = sum(lag * count for lag, count in enumerate(ssp["reads"]))
    reads.add_metric([], buckets, weighted)
    yield from (clock, ahead, reads)


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


# ---------------------------------------------------------------- the page


def render_page(view: dict | None, cfg) -> str:
    if view is None:
        main = "<main><p>The scheduler is starting.</p></main>"
        title = "kvstore job"
    else:
        main = _main(view, cfg)
        title = f"kvstore job: {view['state']}"
    return _PAGE.format(title=html.escape(title), main=main)


def _main(v: dict, cfg) -> str:
    e = html.escape
    rate_bytes, rate_rounds = _rates(v["history"])
    state = v["state"]
    head = (
        f'<header><h1>kvstore job <span class="state {e(state)}" id="job-state">{e(state)}</span>'
        f"</h1><p>{v['num_worker']} workers, {v['num_server']} servers"
        f"{', ' + e(v['store']) if v['store'] else ''}; scheduler at {e(v['scheduler'])}; "
        f"up {_duration(v['uptime'])}</p>"
        f'<dl class="figures"><div><dt>rounds/s</dt><dd id="rounds-rate">{rate_rounds:.1f}</dd>'
        f'</div><div><dt>bytes/s</dt><dd id="bytes-rate">{_bytes(rate_bytes)}/s</dd></div>'
        f"<div><dt>rounds</dt><dd>{v['rounds']}</dd></div>"
        f"<div><dt>bytes moved</dt><dd>{_bytes(v['bytes'])}</dd></div>"
        f"<div><dt>stalls</dt><dd>{len(v['stalls'])} now, {v['stalls_total']} seen</dd></div>"
        "</dl></header>"
    )
    if v["failure"]:
        head += f'<p class="failure" id="failure">{e(v["failure"])}</p>'
    for m in v.get("membership", ()):
        what = "joined" if m["why"] == "joined" else f"left ({m['why']})"
        head += f'<p class="membership">epoch {m["epoch"]}: worker slot {m["worker"]} {e(what)}</p>'
    for f in v.get("failovers", ()):
        head += (
            f'<p class="failover">epoch {f["epoch"]}: server {f["server"]} failed over to its '
            f"replicas: {e(f['why'])}</p>"
        )
    if not v["metrics"]:
        head += "<p>KVSTORE_METRICS=0: the nodes send no counters.</p>"
    plot = f"<section><h2>Throughput, last 5 minutes</h2>{_plot(v['history'])}</section>"
    rows = []
    for n in v["nodes"]:
        m = n["metrics"]
        doing = n["current"]
        if doing and n["current_for"] >= 0.5:
            doing += f" ({n['current_for']:.1f}s)"
        moved = m.get("bp", 0) + m.get("bl", 0) if n["role"] == "worker" else m.get("bin", 0)
        calls = m.get("pushes", 0) if n["role"] == "worker" else sum(m.get("req", {}).values())
        rank = n["rank"] if n["rank"] >= 0 else "?"
        title = f' title="{e(n["reason"])}"' if n["reason"] else ""
        where = e(n["host"]) + (f":{n['port']}" if n["port"] else "")
        late = "late" if n["heartbeat_age"] > 2 * cfg.heartbeat_interval + 0.5 else ""
        rows.append(
            f'<tr class="node" data-role="{e(n["role"])}" data-rank="{rank}" '
            f'data-state="{e(n["state"])}"><td class="role">{e(n["role"])}</td>'
            f'<td class="rank">{rank}</td><td>{where}</td><td>{n["pid"]}</td>'
            f'<td class="state {e(n["state"])}"{title}>{e(n["state"])}</td>'
            f'<td class="call">{e(doing) or "&ndash;"}</td>'
            f'<td class="{late}">'
            f"{n['heartbeat_age']:.1f}s ago</td><td>{calls}</td><td>{_bytes(moved)}</td>"
            f"<td>{_bytes(m.get('rss', 0))}</td><td>{m.get('cpu', 0):.1f}s</td></tr>"
        )
    nodes = (
        '<section><h2>Nodes</h2><table id="nodes"><thead><tr><th>role</th><th>rank</th>'
        "<th>address</th><th>pid</th><th>state</th><th>current call</th><th>last heartbeat</th>"
        "<th>calls</th><th>bytes</th><th>RSS</th><th>CPU</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table></section>"
    )
    failed = [n for n in v["nodes"] if n["reason"]]
    if failed:
        nodes += (
            '<ul class="reasons">'
            + "".join(f"<li>{e(n['role'])} {n['rank']}: {e(n['reason'])}</li>" for n in failed)
            + "</ul>"
        )
    key_rows = "".join(
        f"<tr><td>{e(str(k))}</td><td>{_bytes(b)}</td><td>{r}</td><td>{_ms(t)}</td></tr>"
        for k, b, r, t in v["keys"]
    )
    shown = ""
    if v["nkeys"] > len(v["keys"]):
        shown = f" (top {len(v['keys'])} of {v['nkeys']} by bytes)"
    keys = (
        f'<section><h2>Keys{shown}</h2><table id="keys"><thead><tr><th>key</th><th>bytes</th>'
        "<th>pushes (per worker)</th><th>last latency</th></tr></thead><tbody>"
        + (key_rows or '<tr><td colspan="4">no traffic yet</td></tr>')
        + "</tbody></table></section>"
    )
    if v["parts"]:
        keys += (
            "<section><h2>Server parts</h2><table><thead><tr><th>server</th><th>key</th>"
            "<th>part</th><th>bytes</th><th>requests</th></tr></thead><tbody>"
            + "".join(
                f"<tr><td>{s}</td><td>{e(str(k))}</td><td>{p}</td><td>{_bytes(b)}</td>"
                f"<td>{c}</td></tr>"
                for s, k, p, b, c in v["parts"]
            )
            + "</tbody></table></section>"
        )
    stalls = "".join(
        f'<li class="stall"><b>{e(s["what"])}</b>, waiting {s["age"]:.0f}s: {e(s["text"])}</li>'
        for s in v["stalls"]
    )
    stalls = stalls or "<li>none</li>"
    stall_html = f'<section><h2>Stalls</h2><ul id="stalls">{stalls}</ul></section>'
    if v.get("ssp"):
        stall_html += _staleness_html(v["ssp"])
    updated = time.strftime("%H:%M:%S", time.localtime(v["time"]))
    foot = (
        f'<footer>updated <span id="updated">{updated}</span> <span id="conn"></span> &middot; '
        '<a href="metrics">/metrics</a> &middot; <a href="status.json">/status.json</a></footer>'
    )
    return f"<main>{head}{plot}{nodes}{stall_html}{keys}{foot}</main>"


def _staleness_html(ssp: dict) -> str:
    rows = "".join(
        f"<tr><td>{r}</td><td>{c}</td><td>{ahead}</td></tr>" for r, c, ahead in ssp["clocks"]
    )
    total = sum(ssp["reads"]) or 1
    reads = ", ".join(
        f"{lag}: {count} ({100 * count / total:.0f}%)"
        for lag, count in enumerate(ssp["reads"])
        if count
    )
    return (
        '<section><h2>Staleness (dist_ssp)</h2><table id="clocks"><thead><tr><th>worker</th>'
        "<th>clock</th><th>ahead of the slowest</th></tr></thead><tbody>"
        + (rows or '<tr><td colspan="3">no worker running</td></tr>')
        + "</tbody></table><p>reads by rounds behind the reader: "
        + (reads or "none yet")
        + "</p></section>"
    )


def _rates(history: list) -> tuple[float, float]:
    """Bytes/s and rounds/s over the last 5 seconds of samples."""
    if len(history) < 2:
        return 0.0, 0.0
    end = history[-1]
    start = next((h for h in history if end[0] - h[0] <= 5.0), history[0])
    if start is end:
        start = history[-2]
    span = end[0] - start[0] or 1.0
    return (end[1] - start[1]) / span, (end[2] - start[2]) / span


def _plot(history: list) -> str:
    """Bytes/s over time as an inline SVG line (and rounds/s, scaled to its own maximum)."""
    width, height, pad = 720, 160, 36
    rates = []  # each over the 5 s before it: counters arrive once a heartbeat, not smoothly
    first = 0
    for b in history[1:]:
        while history[first][0] < b[0] - 5.0:
            first += 1
        a = history[first] if history[first] is not b else history[first - 1]
        span = (b[0] - a[0]) or 1.0
        rates.append((b[0], (b[1] - a[1]) / span, (b[2] - a[2]) / span))
    frame = (
        f'<svg id="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="throughput">'
        f'<rect x="{pad}" y="8" width="{width - pad - 8}" height="{height - pad}" '
        'fill="#fafafa" stroke="#ccc"/>'
    )
    if len(rates) < 2:
        return frame + f'<text x="{pad + 10}" y="40" fill="#666">collecting...</text></svg>'
    t0, t1 = rates[0][0], rates[-1][0]
    top_bytes = max(r[1] for r in rates) or 1.0
    top_rounds = max(r[2] for r in rates) or 1.0
    span = (t1 - t0) or 1.0

    def line(values, top, color, name, dash=""):
        points = " ".join(
            f"{pad + (t - t0) / span * (width - pad - 8):.1f},"
            f"{8 + (height - pad) * (1 - value / top):.1f}"
            for t, value in values
        )
        return (
            f'<polyline class="{name}" fill="none" stroke="{color}" stroke-width="1.5" '
            f'stroke-dasharray="{dash}" points="{points}"/>'
        )

    return (
        frame
        + line([(r[0], r[1]) for r in rates], top_bytes, "#1f77b4", "bytes")
        + line([(r[0], r[2]) for r in rates], top_rounds, "#d62728", "rounds", "4 3")
        + f'<text x="{pad + 4}" y="20" font-size="10">'
        + f"{_bytes(top_bytes)}/s</text>"
        + f'<text x="{pad - 4}" y="{height - pad + 8}" text-anchor="end" font-size="10">0</text>'
        + f'<text x="{pad}" y="{height - 8}" font-size="10">-{_duration(t1 - t0)}</text>'
        + f'<text x="{width - 8}" y="{height - 8}" text-anchor="end" font-size="10">now</text>'
        + f'<text x="{pad + 8}" y="{height - 8 - 12}" font-size="10" fill="#1f77b4">bytes/s</text>'
        + f'<text x="{pad + 60}" y="{height - 8 - 12}" font-size="10" fill="#d62728">'
        f"rounds/s (max {top_rounds:.1f})</text></svg>"
    )


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.4em; margin: 0 0 .2em; }} h2 {{ font-size: 1.1em; margin: 1.2em 0 .4em; }}
table {{ border-collapse: collapse; }} th, td {{ padding: 2px 10px; text-align: left; }}
thead th {{ border-bottom: 1px solid #999; }} tbody tr:nth-child(odd) {{ background: #f4f4f4; }}
.state {{ font-weight: bold; }} .running, .finished {{ color: #2a7a2a; }}
.joined, .registered, .starting {{ color: #b07000; }} .failed {{ color: #c0392b; }}
.late {{ color: #c0392b; font-weight: bold; }}
.figures {{ display: flex; gap: 2em; margin: .5em 0; }} .figures dt {{ color: #666; }}
.figures dd {{ margin: 0; font-size: 1.3em; }}
.failure {{ background: #fdecea; border: 1px solid #c0392b; padding: .5em; }}
.stall {{ background: #fff6e0; margin: .3em 0; padding: .3em; }}
footer {{ margin-top: 1.5em; color: #666; font-size: .9em; }}
</style></head>
<body>
{main}
<script>
// Refresh the content every 2 s from the same URL (a token, if any, is in a cookie).
setInterval(async function () {{
  try {{
    const reply = await fetch(location.href, {{cache: "no-store"}});
    if (!reply.ok) throw new Error(reply.status);
    const page = new DOMParser().parseFromString(await reply.text(), "text/html");
    document.querySelector("main").replaceWith(page.querySelector("main"));
    document.title = page.title;
  }} catch (err) {{
    const conn = document.getElementById("conn");
    if (conn) conn.textContent = "(the scheduler does not answer: the job has ended?)";
  }}
}}, 2000);
</script>
</body></html>
"""
