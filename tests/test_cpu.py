"""Roles run under SCHED_BATCH (kvstore.cpu), unless KVSTORE_SCHED_BATCH=0."""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "SCHED_BATCH") or sys.platform != "linux", reason="Linux's SCHED_BATCH"
)


def _policy(pid: int) -> int:
    return os.sched_getscheduler(pid)  # the process's main thread (its tid is its pid)


@pytest.mark.parametrize("flag", ["1", "0"])
def test_every_role_runs_under_sched_batch_unless_turned_off(cluster, flag):
    c = cluster(2, 2, KVSTORE_SCHED_BATCH=flag, PS_VERBOSE="1")
    want = os.SCHED_BATCH if flag == "1" else os.SCHED_OTHER
    workers = c.start_workers("policy.py", [1])
    # once a worker has done a round, every role is past its start: read them while they run
    c.wait_for_output("worker0", "policy caller=", 60)
    c.wait_for_output("worker1", "policy caller=", 60)
    roles = {n: _policy(c.procs[n].pid) for n in ("scheduler", "server0", "server1")}
    assert all(p == want for p in roles.values()), roles
    assert c.wait(workers, 60) == [0, 0], c.dump()
    said = "CPU policy: SCHED_BATCH (KVSTORE_SCHED_BATCH=0 keeps the default)"
    for role in ("scheduler", "server0", "worker0"):  # PS_VERBOSE=1 says so
        assert (said in c.output(role)) == (flag == "1"), c.output(role)
    name = "batch" if flag == "1" else "other"
    for i in range(2):  # the caller's thread and those started after; not those before
        out = c.output(f"worker{i}")
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
