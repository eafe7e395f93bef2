"""Counters a node keeps about its own traffic, sent to the scheduler with its heartbeats.

A worker counts each public call (push, pull, pushpull, barrier, join) as it returns: bytes
pushed and pulled, calls, key rounds, the call's latency (a histogram with fixed buckets), and
per key its bytes, rounds and last latency. A server counts the requests it is sent, the
bytes in and out, and per key part the bytes. Counting is a few additions per call, in the
calling thread; nothing is sent per call. Bytes are the values' sizes, whatever carried
them (a frame, shared memory) and however compressed. The link thread
(:mod:`kvstore.control`) takes a
:meth:`NodeMetrics.snapshot` for every heartbeat: only the top :data:`TOP` keys and parts by
bytes travel, so a model of 10,000 keys keeps heartbeats small. The scheduler checks what it
receives with :func:`clean` and serves it (:mod:`kvstore.status`).

The hooks are decorators on the store's and the server's methods::

    @metrics.observed("pushpull")
    def _pushpull(self, items): ...

With ``KVSTORE_METRICS=0`` and no ``KVSTORE_TIMELINE`` a wrapped call costs one attribute
test more than the bare method.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import os
import time

from . import timeline

# Upper bounds (seconds) of the call-latency histogram's buckets; the last bucket is +Inf.
BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
STALE_MAX = 64  # dist_ssp staleness histogram: reads n rounds behind, n < this; the last: more
TOP = 20  # keys (and server parts) by bytes that each heartbeat carries
_PUSHES = ("push", "pushpull")
_PULLS = ("pull", "pushpull")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class NodeMetrics:
    """One process's counters. Written by the node's own threads, read by the link thread
    (snapshots copy each container in one C-level call, so they never see one changing)."""

    def __init__(self, role: str):
        self.role = role
        self.store = ""  # the store type (dist_sync, ...), known at the first call
        self.current = ""  # the public call in progress, and since when (perf_counter)
        self.since = 0.0
        self.calls: dict[str, int] = {}
        self.pushes = self.pulls = self.rounds = 0
        self.bytes_pushed = self.bytes_pulled = 0
        self.hist: dict[str, list] = {}  # call -> [count per bucket..., +Inf count, sum]
        self.keys: dict = {}  # key -> [bytes, rounds, last latency]
        self.clock = 0  # dist_ssp: this worker's pushes of its most pushed key
        # a server's
        self.requests: dict[str, int] = {}
        self.bytes_in = self.bytes_out = 0
        self.parts: dict = {}  # (key, part) -> [bytes, requests]
        self.staleness: list = []  # dist_ssp: reads answered n rounds behind the reader, per n

    # ---- a worker's calls
    def done(self, kind: str, items, seconds: float) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        hist = self.hist.get(kind)
        if hist is None:
            hist = self.hist[kind] = [0] * (len(BUCKETS) + 2)
        hist[bisect.bisect_left(BUCKETS, seconds)] += 1
        hist[-1] += seconds
        if items is None:
            return
        push, pull = kind in _PUSHES, kind in _PULLS
        pushed = pulled = 0
        keys = self.keys
        for item in items:
            size = item.values[0].nbytes if push else 0
            got = item.outs[0].nbytes if pull else 0
            pushed += size
            pulled += got
            rec = keys.get(item.key)
            if rec is None:
                rec = keys[item.key] = [0, 0, 0.0]
            rec[0] += size + got
            rec[1] += push
            rec[2] = seconds
        if push:
            self.pushes += 1
            self.rounds += len(items)
            self.bytes_pushed += pushed
        if pull:
            self.pulls += 1
            self.bytes_pulled += pulled

    # ---- a server's requests
    def request(self, kind: str, msg, stored: dict) -> None:
        """Count a push/pull request by the size of the values it names (the logical bytes,
        whatever the transport: a frame, shared memory, or compressed)."""
        self.requests[kind] = self.requests.get(kind, 0) + 1
        push, pull = kind in _PUSHES, kind in _PULLS
        parts = self.parts
        for wire in msg.body.get("keys") or ():
            try:
                key = (wire[0], wire[1])
                value = stored.get(key)
            except (TypeError, IndexError):
                return  # the handler refuses it with a clear error
            if value is None:
                continue  # never initialised: refused, not counted
            size = value.nbytes
            self.bytes_in += size if push else 0
            self.bytes_out += size if pull else 0
            rec = parts.get(key)
            if rec is None:
                rec = parts[key] = [0, 0]
            rec[0] += size * (push + pull)
            rec[1] += 1

    def stale(self, lag: int) -> None:
        """A ``dist_ssp`` read answered ``lag`` of the reader's rounds before they completed."""
        lag = min(lag, STALE_MAX)
        counts = self.staleness
        if len(counts) <= lag:
            counts.extend([0] * (lag + 1 - len(counts)))
        counts[lag] += 1

    # ---- the heartbeat's view
    def snapshot(self) -> dict:
        keys = list(self.keys.items())
        parts = list(self.parts.items())
        top_keys = heapq.nlargest(TOP, keys, key=_first)
        top_parts = heapq.nlargest(TOP, parts, key=_first)
        return {
            "store": self.store,
            "cur": self.current,
            "for": time.perf_counter() - self.since if self.current else 0.0,
            "calls": dict(self.calls),
            "pushes": self.pushes,
            "pulls": self.pulls,
            "rounds": self.rounds,
            "bp": self.bytes_pushed,
            "bl": self.bytes_pulled,
            "hist": {kind: list(counts) for kind, counts in list(self.hist.items())},
            "keys": [[_wire_key(k), r[0], r[1], r[2]] for k, r in top_keys],
            "nkeys": len(keys),
            "req": dict(self.requests),
            "bin": self.bytes_in,
            "bout": self.bytes_out,
            "parts": [[_wire_key(k[0]), k[1], r[0], r[1]] for k, r in top_parts],
            "nparts": len(parts),
            "clock": self.clock,
            "stale": list(self.staleness),
            "rss": resident_bytes(),
            "cpu": time.process_time(),
        }


def _first(entry):
    return entry[1][0]


def _wire_key(key):
    return key if type(key) is int else str(key)[:80]


def resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the hooks
def observed(kind: str):
    """Count a store method as the public call ``kind`` and trace it on the timeline. The
    method's first argument, for push/pull/pushpull, is its list of items."""
    data = kind in _PUSHES or kind in _PULLS

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            control = self._control
            m, tracer = control.metrics, control.tracer
            if m is None and tracer is None:
                return method(self, *args, **kwargs)
            t0 = time.perf_counter()
            wall = timeline.now() if tracer is not None else 0.0
            outer = ""
            if m is not None:
                outer, m.current = m.current, m.current or kind
                if not outer:
                    m.since = t0
            ok = False
            try:
                result = method(self, *args, **kwargs)
                ok = True
                return result
            finally:
                seconds = time.perf_counter() - t0
                items = args[0] if data and args else None
                if m is not None:
                    m.current = outer
                    if ok:
                        m.store = self.type
                        m.done(kind, items, seconds)
                if tracer is not None:
                    tracer.span(kind, wall, wall + seconds, _span_args(kind, items, ok))

        return call

    return wrap


def traced(kind: str):
    """Trace a method on the timeline only (the store's wait for replies)."""

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            tracer = self._control.tracer
            if tracer is None:
                return method(self, *args, **kwargs)
            wall = timeline.now()
            try:
                return method(self, *args, **kwargs)
            finally:
                what = args[0] if args else kind
                tracer.span(kind, wall, timeline.now(), {"in": str(what)})

        return call

    return wrap


def served(method):
    """Count a server handler's request (``handler(self, identity, rank, msg)``)."""

    @functools.wraps(method)
    def call(self, identity, rank, msg):
        m = self.control.metrics
        if m is not None:
            m.request(msg.kind, msg, self.stored)
        return method(self, identity, rank, msg)

    return call


def _span_args(kind: str, items, ok: bool) -> dict:
    args: dict = {} if ok else {"error": True}
    if items is None:
        return args
    push, pull = kind in _PUSHES, kind in _PULLS
    nbytes = 0
    for item in items:
        nbytes += (item.values[0].nbytes if push else 0) + (item.outs[0].nbytes if pull else 0)
    if len(items) == 1:
        args["key"] = _wire_key(items[0].key)
    else:
        args["keys"] = [_wire_key(item.key) for item in items[:16]]
        args["nkeys"] = len(items)
    args["bytes"] = nbytes
    return args


# ---- the scheduler's check of what a node sent
_NUMBERS = ("for", "pushes", "pulls", "rounds", "bp", "bl", "nkeys", "bin", "bout", "nparts")
_NUMBERS += ("rss", "cpu", "clock")


def clean(raw) -> dict:
    """A node's heartbeat metrics, checked field by field; ``ValueError`` if malformed."""
    if not isinstance(raw, dict):
        raise ValueError("metrics: expected a map")
    out: dict = {name: _number(raw.get(name, 0), name) for name in _NUMBERS}
    out["store"] = _text(raw.get("store", ""), 32)
    out["cur"] = _text(raw.get("cur", ""), 32)
    out["calls"] = _counts(raw.get("calls", {}), "calls")
    out["req"] = _counts(raw.get("req", {}), "req")
    hist = raw.get("hist", {})
    if not isinstance(hist, dict) or len(hist) > 16:
        raise ValueError("metrics: bad hist")
    out["hist"] = {}
    for kind, counts in hist.items():
        if not isinstance(counts, list) or len(counts) != len(BUCKETS) + 2:
            raise ValueError("metrics: bad histogram")
        out["hist"][_text(kind, 32)] = [_number(c, "hist") for c in counts]
    stale = raw.get("stale", [])
    if not isinstance(stale, list) or len(stale) > STALE_MAX + 1:
        raise ValueError("metrics: bad stale")
    out["stale"] = [_number(c, "stale") for c in stale]
    out["keys"] = [
        [_key(k), _number(b, "key"), _number(r, "key"), _number(t, "key")]
        for k, b, r, t in _rows(raw.get("keys", []), 4)
    ]
    out["parts"] = [
        [_key(k), int(_number(p, "part")), _number(b, "part"), _number(n, "part")]
        for k, p, b, n in _rows(raw.get("parts", []), 4)
    ]
    return out


def _rows(rows, width: int) -> list:
    if not isinstance(rows, list) or len(rows) > TOP:
        raise ValueError("metrics: bad rows")
    for row in rows:
        if not isinstance(row, list) or len(row) != width:
            raise ValueError("metrics: bad row")
    return rows


def _number(value, what: str):
    if type(value) not in (int, float) or value != value or value < 0:
        raise ValueError(f"metrics: bad {what}")
    return value


def _text(value, limit: int) -> str:
    if not isinstance(value, str):
        raise ValueError("metrics: expected a string")
    return value[:limit]


def _key(value):
    if type(value) is int:
        return value
    return _text(value, 80)


def _counts(value, what: str) -> dict:
    if not isinstance(value, dict) or len(value) > 16:
        raise ValueError(f"metrics: bad {what}")
    return {_text(k, 32): _number(v, what) for k, v in value.items()}
