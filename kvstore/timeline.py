"""A Chrome trace-event file per worker (``KVSTORE_TIMELINE=path``), merged by the launcher.

Each worker writes ``<path>.worker<rank>``: a JSON array of complete events (``"ph": "X"``),
one per public call (push, pull, pushpull, barrier, join) and one per wait for replies inside
it, with the keys and bytes in ``args``. Timestamps are the wall clock in microseconds, so the
workers of one host line up. Events are written as they end (buffered), so a worker that is
killed leaves a file cut short; :func:`merge` reads such a file too. The launcher merges the
files into ``path``, which opens in Perfetto (ui.perfetto.dev) or ``chrome://tracing``.

With the timeline off nothing here runs: the call wrappers of :mod:`kvstore.metrics` test one
attribute for ``None``.

>>> merge("trace.json")  # doctest: +SKIP
(120, 2)
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
import time

SUFFIX = ".worker"
log = logging.getLogger("kvstore.timeline")


class Tracer:
    """The trace-event file of one worker; opened at the first event, once the rank is known."""

    def __init__(self, path: str, role: str):
        self.path, self.role = path, role
        self.rank = -1
        self._file = None
        self._broken = False  # the file could not be written: the job goes on without it
        self._lock = threading.Lock()  # kvstore.torch calls the store from its own thread

    def span(self, name: str, start: float, end: float, args: dict) -> None:
        """One complete event from ``start`` to ``end`` (``time.time()`` seconds)."""
        event = {
            "name": name,
            "cat": "kvstore",
            "ph": "X",
            "ts": round(start * 1e6, 1),
            "dur": round((end - start) * 1e6, 1),
            "pid": self.rank,
            "tid": threading.get_native_id(),
            "args": args,
        }
        line = json.dumps(event, default=str) + ",\n"
        with self._lock:
            if self._file is None and not self._open():
                return
            try:
                self._file.write(line)
            except OSError as exc:
                self._give_up(exc)

    def _open(self) -> bool:
        if self._broken or self.rank < 0:  # before the book the rank, so the file, is unknown
            return False
        name = f"{self.path}{SUFFIX}{self.rank}"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(name)), exist_ok=True)
            self._file = open(name, "w")  # noqa: SIM115 (open until close())
            self._file.write("[\n")
        except OSError as exc:
            self._give_up(exc)
            return False
        return True

    def _give_up(self, exc: OSError) -> None:
        log.error("KVSTORE_TIMELINE=%s: %s; this worker writes no timeline", self.path, exc)
        self._broken = True
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def close(self) -> None:
        """End the array with the process's name, so the file is valid JSON by itself."""
        with self._lock:
            if self._file is None:
                return
            meta = {
                "name": "process_name",
                "ph": "M",
                "pid": self.rank,
                "args": {"name": f"{self.role} {self.rank}"},
            }
            try:
                self._file.write(json.dumps(meta) + "\n]\n")
                self._file.close()
            except OSError as exc:
                self._give_up(exc)
            self._file = None


def now() -> float:
    return time.time()


def read_events(path: str) -> list[dict]:
    """The events of one worker's file, also when the worker died before closing it."""
    with open(path) as f:
        text = f.read().strip()
    if not text:
        return []
    if not text.endswith("]"):
        text = text.rstrip().rstrip(",") + "\n]"
    events = json.loads(text)
    return [e for e in events if isinstance(e, dict)]


def merge(path: str, remove: bool = True) -> tuple[int, int]:
    """Merge every ``<path>.worker<rank>`` into ``path`` (a trace-event JSON object); return
    (events, files). The per-worker files are removed once merged when ``remove``."""
    files = sorted(glob.glob(glob.escape(path) + SUFFIX + "*"))
    events: list[dict] = []
    ranks = set()
    for name in files:
        try:
            part = read_events(name)
        except (OSError, ValueError):
            continue
        events.extend(part)
        ranks.update(e.get("pid") for e in part)
    for rank in sorted(r for r in ranks if isinstance(r, int)):
        if not any(e.get("ph") == "M" and e.get("pid") == rank for e in events):
            events.append(
                {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"worker {rank}"}}
            )
    if not files:
        return 0, 0
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
    if remove:
        for name in files:
            os.unlink(name)
    return len(events), len(files)
