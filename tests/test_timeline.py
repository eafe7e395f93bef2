"""Timeline: KVSTORE_TIMELINE through launch.py gives one merged trace-event file with one
span per pushpull of every worker; a worker's file cut short by its death still merges."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvstore import timeline

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import numpy as np, kvstore
kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(1024, np.float32))
kv.init("b", np.zeros(16, np.float32))
grad = np.ones(1024, np.float32)
for step in range({steps}):
    kv.pushpull("w", grad)
    kv.push("b", np.ones(16, np.float32))
kv.barrier()
"""


def test_merged_timeline_through_the_launcher(tmp_path):
    steps, workers = 12, 2
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(steps=steps))
    trace = tmp_path / "out" / "trace.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVSTORE_TIMELINE=str(trace))
    env.pop("KVSTORE_SECRET", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "-n", str(workers), "-s", "1"]
        + [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"timeline: {trace}" in done.stdout
    assert "status: http://127.0.0.1:" in done.stdout
    data = json.loads(trace.read_text())
    events = data["traceEvents"]
    assert not list(trace.parent.glob("trace.json.worker*"))  # merged, then removed
    for rank in range(workers):
        mine = [e for e in events if e["pid"] == rank]
        spans = [e for e in mine if e["ph"] == "X"]
        for e in spans:
            assert {"name", "ts", "dur", "tid", "args"} <= set(e) and e["dur"] >= 0
        pushpulls = [e for e in spans if e["name"] == "pushpull"]
        assert len(pushpulls) == steps
        assert all(e["args"] == {"key": "w", "bytes": 2 * 4096} for e in pushpulls)
        pushes = [e for e in spans if e["name"] == "push"]
        assert len(pushes) == steps and pushes[0]["args"]["bytes"] == 64
        assert any(e["name"] == "barrier" for e in spans)
        waits = [e for e in spans if e["name"] == "wait"]
        assert len(waits) >= steps
        names = [e for e in mine if e["ph"] == "M" and e["name"] == "process_name"]
        assert names[0]["args"]["name"] == f"worker {rank}"


def test_a_file_cut_short_still_merges(tmp_path):
    path = str(tmp_path / "t.json")
    whole = timeline.Tracer(path, "worker")
    whole.rank = 0
    whole.span("pushpull", 1.0, 1.5, {"key": 1, "bytes": 8})
    whole.close()
    assert json.loads(Path(path + ".worker0").read_text())[0]["dur"] == 500000.0
    cut = timeline.Tracer(path, "worker")
    cut.rank = 1
    cut.span("pushpull", 2.0, 2.25, {"key": 1, "bytes": 8})
    cut._file.flush()  # the worker dies here: no closing bracket
    assert timeline.merge(path) == (4, 2)
    events = json.loads(Path(path).read_text())["traceEvents"]
    assert sorted(e["pid"] for e in events if e["ph"] == "X") == [0, 1]
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"worker 0", "worker 1"}


def test_an_unwritable_timeline_never_fails_the_job(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    tracer = timeline.Tracer(str(blocker / "t.json"), "worker")  # a directory under a file
    tracer.rank = 0
    tracer.span("pushpull", 1.0, 2.0, {})
    tracer.span("pushpull", 2.0, 3.0, {})
    tracer.close()
    assert timeline.merge(str(blocker / "t.json")) == (0, 0)
