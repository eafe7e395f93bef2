"""Scripts written the way Horovod and MXNet users write them, run through launch.py: no
close(), an exception in one rank, a slow rank, a deadlock, a rank that leaves early. Each
checks what the user reads."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time

from .cluster import ROOT

SCRIPT = ROOT / "tests" / "scripts" / "no_close.py"


def run(num_workers, *args, env=None, timeout=90):
    """Launch a job; return (exit status, output, {first line containing text: time seen})."""
    argv = [sys.executable, str(ROOT / "launch.py"), "-n", str(num_workers), "-s", "1"]
    argv += ["--launcher", "local", sys.executable, str(SCRIPT), *map(str, args)]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put((time.monotonic(), x)) for x in proc.stdout]).start()
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    end = time.monotonic()
    seen = []
    while True:
        try:
            seen.append(lines.get(timeout=5))
        except queue.Empty:
            break
    return proc.returncode, "".join(line for _, line in seen), seen, end


def test_a_script_that_never_closes_its_store_succeeds():
    code, out, _, _ = run(2)
    assert code == 0, out
    assert "rank 0 trained: w[0] = 2" in out and "rank 1 trained: w[0] = 2" in out, out
    assert "heartbeat" not in out and "Traceback" not in out, out


def test_a_crash_is_named_once_with_its_exception_and_ends_the_job_at_once():
    code, out, seen, end = run(3, "--crash-rank", 1, "--rounds", 200)
    assert code == 1, out
    assert out.count("[worker 1] RuntimeError: boom at step 100") == 1, out
    # the survivors say who failed and why, not push counts; no second traceback at exit
    for rank in (0, 2):  # told by the scheduler, or by a server that heard it first
        # a KVStoreError that says a peer was lost (exit 129: kvstore/errors.py)
        said = rf"\[worker {rank}\] kvstore.errors.PeerLostError: pushpull: (server 0 \(.*\): )?"
        assert re.search(said + r"worker 1 \(127.0.0.1 pid \d+\) failed: it raised", out), out
    assert "failed: it raised RuntimeError: boom at step 100" in out
    for noise in ("same number of times", "close: close:", "Exception ignored", "heartbeat"):
        assert noise not in out, (noise, out)
    launch_lines = [line for _, line in seen if line.startswith("launch: ") and "exited" in line]
    assert launch_lines[0].startswith("launch: worker 1 on localhost exited with status 1"), out
    crashed = next(t for t, line in seen if "RuntimeError: boom" in line)
    assert end - crashed < 10, end - crashed  # the launcher's 1 s window, not a timeout


def test_a_rank_interrupted_is_named_as_interrupted_not_as_finished():
    """(From a user trial.) Ctrl-C in one rank's terminal: its KeyboardInterrupt closed the
    store as if the rank had finished, so the others were told it finished after some
    pushes and to look for uneven data (join()), and the job ended 1. Now the others say it
    was interrupted, and the job ends as the interrupted rank did (130, as a shell says)."""
    code, out, seen, end = run(3, "--interrupt-rank", 1, "--rounds", 200)
    assert code == 130, out
    for rank in (0, 2):
        said = rf"\[worker {rank}\] kvstore.errors.PeerLostError: pushpull: (server 0 \(.*\): )?"
        said += r"worker 1 \(127.0.0.1 pid \d+\) failed: it was interrupted \(KeyboardInterrupt"
        assert re.search(said, out), out
    for noise in ("same number of times", "join()", "Exception ignored", "heartbeat"):
        assert noise not in out, (noise, out)
    ends = [line for _, line in seen if re.match(r"launch: \S+ \d on localhost (was|exited)", line)]
    assert ends[0].startswith("launch: worker 1 on localhost was killed by SIGINT"), out


def test_sys_exit_0_in_a_with_block_is_a_finish(tmp_path):
    """(Review finding.) ``sys.exit()`` inside ``with kvstore.create(...) as kv:`` is a
    finish, not a failure: every rank exits 0 and no one is told of a failure."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        "import numpy as np\n"
        "import kvstore\n"
        "with kvstore.create('dist_sync') as kv:\n"
        "    kv.init('w', np.zeros(2, np.float32))\n"
        "    kv.pushpull('w', np.ones(2, np.float32))\n"
        "    print('rank', kv.rank, 'done', flush=True)\n"
        "    sys.exit(0)\n"
    )
    argv = [sys.executable, str(ROOT / "launch.py"), "-n", "2", "-s", "1", "--timeout", "60"]
    done = subprocess.run(
        [*argv, sys.executable, str(script)], capture_output=True, text=True, timeout=90
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "rank 0 done" in out and "rank 1 done" in out and "failed" not in out, out


def test_a_slow_rank_is_reported_not_killed():
    env = {"KVSTORE_STALL_REPORT": "1", "KVSTORE_TIMEOUT": "3"}  # the old deadline: 3s
    code, out, _, _ = run(2, "--slow-rank", 1, "--slow-seconds", 4, env=env)
    assert code == 0, out
    assert "rank 0 trained" in out and "rank 1 trained" in out, out
    report = next(
        line for line in out.splitlines() if line.startswith("[scheduler]") and "stall:" in line
    )
    for part in (
        "dist_sync round 10 of key 'w' on server 0",
        "for worker(s) [1] (pushed by [0])",
        "worker 1 silent on this key for",
        "is in no call the scheduler knows of, last heartbeat",
        "no deadline: set KVSTORE_ROUND_TIMEOUT",
    ):
        assert part in report, (part, report)
    assert "[worker 0]" in out and "pushpull: stall:" in out  # the waiting worker hears it


def test_a_certain_deadlock_fails_at_once_naming_both_sides():
    t0 = time.monotonic()
    code, out, _, _ = run(2, "--barrier-rank", 1)
    assert code == 1, out
    assert time.monotonic() - t0 < 30, out
    text = "waits for worker(s) [1] to push, but they wait in barrier() for worker(s) [0]"
    assert "[worker 0] kvstore.errors.KVStoreError: pushpull: server 0" in out and text in out
    assert "[worker 1] kvstore.errors.KVStoreError: barrier: deadlock:" in out, out
    assert "node failed" not in out, out  # one cause, not a cascade


def test_a_barrier_fails_at_once_when_a_member_has_left():
    env = {"KVSTORE_TIMEOUT": "60"}
    t0 = time.monotonic()
    code, out, _, _ = run(2, "--stop-rank", 0, "--barrier-after-stop", env=env)
    assert code == 1, out
    assert time.monotonic() - t0 < 30, out
    assert "barrier(worker): worker 0 (127.0.0.1 pid" in out, out
    assert "finished (closed its store) without reaching this barrier" in out, out


def test_a_round_deadline_the_user_set_fails_the_round_naming_the_silent_rank():
    env = {"KVSTORE_ROUND_TIMEOUT": "2", "KVSTORE_STALL_REPORT": "0"}
    code, out, _, _ = run(2, "--slow-rank", 1, "--slow-seconds", 20, env=env, timeout=60)
    assert code == 1, out
    assert "timed out after 2s (KVSTORE_ROUND_TIMEOUT): worker rank(s) [1] did not push it" in out


def test_uneven_partitions_join_and_end_with_the_same_model():
    argv = [sys.executable, str(ROOT / "launch.py"), "-n", "2", "-s", "1", "--launcher", "local"]
    argv += [sys.executable, str(ROOT / "examples" / "train_mlp.py"), "--kv-store", "dist_sync"]
    argv += ["--uneven", "--epochs", "3"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = {int(r): int(n) for r, n in re.findall(r"rank (\d): .* after (\d+) steps", done.stdout)}
    accuracy = set(re.findall(r"test accuracy ([\d.]+)", done.stdout))
    assert steps[1] < steps[0], done.stdout  # rank 1 ran out of data first, and joined
    assert len(accuracy) == 1 and float(accuracy.pop()) > 0.85, done.stdout  # one model
