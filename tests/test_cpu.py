"""Roles run under SCHED_BATCH (kvstore.cpu), unless KVSTORE_SCHED_BATCH=0."""

from __future__ import annotations

import os
import sys

import pytest

from tests.cluster import poll_until

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or sys.platform != "linux", reason="Linux's SCHED_BATCH"
)


def _policy(pid: int) -> int:
    return os.sched_getscheduler(pid)  # the process's main thread (its tid is its pid)


@pytest.mark.parametrize("flag", ["1", "0"])
def test_every_role_runs_under_sched_batch_unless_turned_off(cluster, flag):
    c = cluster(2, 2, KVSTORE_SCHED_BATCH=flag)
    want = os.SCHED_BATCH if flag == "1" else os.SCHED_OTHER
    pids = [c.procs[n].pid for n in ("scheduler", "server0", "server1")]
    # each takes its policy at start; a role that never does fails here after 30 s
    assert poll_until(lambda: all(_policy(p) == want for p in pids), 30), [_policy(p) for p in pids]
    outs = c.run_workers("policy.py", timeout=60)
    name = "batch" if flag == "1" else "other"
    for out in outs:  # the caller's thread and those started after; not those before
        assert f"policy caller={name} later={name} earlier=other" in out, out


def test_a_thread_under_another_policy_is_left_alone():
    """SCHED_IDLE (as a real-time policy would be) is kept: batch() lowers only SCHED_OTHER."""
    import subprocess

    code = (
        "import os\n"
        "from kvstore.cpu import batch\n"
        "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
        "print(batch(), os.sched_getscheduler(0) == os.SCHED_IDLE)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out
