"""A worker's calls when something goes wrong half-way: a server that cannot see the worker's
/dev/shm, a /dev/shm too small, a push refused by one server of two, an interrupted call, a
dtype that differs between ranks, a server killed under a push loop, optimizer states of
several MiB. Each ends with exact values or a clear error, never silent garbage or a hang."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from .cluster import ROOT, Cluster

WORKERS = ROOT / "tests" / "workers"


def _private_shm(size: str) -> list[str]:
    """A command prefix: run in a mount namespace of its own whose /dev/shm is a fresh tmpfs
    of ``size`` (as in a container: Docker's default is 64 MB)."""
    mount = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]


@pytest.fixture(scope="module")
def namespaces():
    """Skip where a private /dev/shm cannot be mounted (not root, no unshare, no privilege)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a private /dev/shm needs root")
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    probe = subprocess.run(
        [*_private_shm("1m"), "true"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm: {probe.stderr.strip()}")


class _ServersApart(Cluster):
    """A cluster whose servers each see a /dev/shm of their own, as pods on one node do."""

    def _spawn(self, name, argv, role, env=None):
        if role == "server":
            argv = [*_private_shm("64m"), *argv]
        return super()._spawn(name, argv, role, env)


@pytest.mark.timeout(120)
def test_a_server_with_its_own_dev_shm_gets_big_keys_through_tcp(namespaces, tmp_path):
    """Same boot id, another /dev/shm: the server cannot open the worker's segments, so the
    worker must not use them."""
    c = _ServersApart(1, 2, tmp_path)
    try:
        outs = c.run_workers("big_pushpull.py", [1 << 18, 5], timeout=90)
    finally:
        c.stop()
    for rank, out in enumerate(outs):
        assert f"rank {rank} OK: 5 rounds of 1048576 bytes exact" in out, c.dump()
        assert f"rank {rank} shares memory with 0 servers" in out, out
    assert "FileNotFoundError" not in c.output("server0"), c.dump()


def _run(argv: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run a job's command to its end; past ``timeout`` interrupt it (the launcher then stops
    every process it started, by PID), and fail with its output."""
    proc = subprocess.Popen(
        argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        text = f"{argv[-4:]} still running after {timeout}s:\n{out[-4000:]}"
        raise AssertionError(text) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out)


@pytest.mark.timeout(150)
def test_a_dev_shm_too_small_for_a_key_sends_it_through_tcp(namespaces):
    """A 48 MiB key in a 32 MB /dev/shm (a container's): a warning and TCP, not a SIGBUS."""
    job = [
        sys.executable,
        str(ROOT / "launch.py"),
        *("-n", "1", "-s", "1", "--launcher", "local", "--timeout", "90"),
        *(sys.executable, str(WORKERS / "big_pushpull.py"), 12 << 20, 3),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = _run([*_private_shm("32m"), *map(str, job)], env, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "rank 0 OK: 3 rounds of 50331648 bytes exact" in done.stdout, done.stdout[-4000:]
    assert "rank 0 shares memory with 1 servers" in done.stdout, done.stdout[-4000:]
    assert "no room in /dev/shm for key 'w'" in done.stdout, done.stdout[-4000:]
    assert "goes through TCP" in done.stdout, done.stdout[-4000:]


@pytest.mark.timeout(90)
def test_a_push_refused_by_one_server_fails_the_store(cluster):
    """Rank 1's pushpull(["a", "b"]) is refused by the server of "b" (a dtype rank 0 did not
    initialise) after the other server took its part of "a": rank 1's rounds of "a" now
    differ between the two servers. Every later call must raise, never return a value that
    mixes two rounds; both workers end."""
    c = cluster(2, 2, KVSTORE_BIGARRAY_BOUND=1000, KVSTORE_TIMEOUT=20, KVSTORE_ROUND_TIMEOUT=10)
    workers = c.start_workers("half_refused.py", [3, 4])
    c.wait(workers, 60)
    out0, out1 = c.output("worker0"), c.output("worker1")
    assert "rank 1 call 1 raised KVStoreError" in out1, c.dump()
    assert re.search(r"key 'b': got 10 x int32, expected 10 x float32", out1), out1
    for k in (2, 3, 4):
        line = re.search(rf"rank 1 call {k} (.*)", out1)
        assert line and line[1].startswith("raised"), f"call {k}:\n{out1}"
        assert "the store takes no more calls; restart the job" in line[1], out1
    assert "rank 1 done: 4 calls raised" in out1, out1
    assert not re.search(r"call \d+ got", out0 + out1), c.dump()  # no value of mixed rounds
    assert "rank 0 call 1 raised" in out0, c.dump()  # the other worker: an error, no hang


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["pull", "pushpull"])
def test_a_late_reply_of_an_interrupted_call_writes_nothing(cluster, how):
    """An exception raised inside the call (a signal handler, as Ctrl-C) ends it; its reply,
    which comes later, must not overwrite the array the caller has reused since."""
    c = cluster(1, 2)
    outs = c.run_workers("interrupted.py", [how], timeout=60)
    assert f"rank 0 {how} interrupted" in outs[0], outs[0]
    assert "rank 1 pushpull got [2.0]" in outs[1], outs[1]
    assert "rank 0 pulled [2.0]" in outs[0], outs[0]
    assert "rank 0 out holds [-7.0]" in outs[0], outs[0]


@pytest.mark.timeout(90)
def test_a_dtype_pushed_through_shared_memory_is_checked(cluster):
    """int32 pushed into a float32 key through shared memory: refused naming both dtypes (as
    through TCP), never its bits read as float32."""
    c = cluster(1, 2, KVSTORE_TIMEOUT=20, KVSTORE_ROUND_TIMEOUT=10)
    workers = c.start_workers("shm_dtype.py")
    c.wait(workers, 60)
    out0, out1 = c.output("worker0"), c.output("worker1")
    assert "rank 1 raised KVStoreError" in out1, c.dump()
    assert "got int32 through shared memory, expected float32" in out1, out1  # that path
    assert not re.search(r"rank \d got", out0 + out1), c.dump()  # no sum of reinterpreted bits
    assert "rank 0 raised" in out0, c.dump()  # the other worker: an error, no hang


@pytest.mark.timeout(90)
def test_a_server_killed_under_a_push_loop_through_shared_memory(cluster):
    """Push-only through shared memory (nothing read back) while a server is killed: the
    worker ends with PeerLostError naming it within seconds, not after KVSTORE_TIMEOUT."""
    c = cluster(2, 1, KVSTORE_TIMEOUT=60, PS_VERBOSE=1)
    (worker,) = c.start_workers("push_only.py")
    c.wait_for_output("worker0", "push 20", 40)
    c.wait_for_output("server1", "ready for", 5)
    victim = c.output("server1").split("] ")[-1].split(" ready for")[0]  # "server R (host:port)"
    c.procs["server1"].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    (code,) = c.wait([worker], 25)  # KVSTORE_TIMEOUT is 60 s
    took = time.monotonic() - killed
    print(f"the worker ended {took:.1f}s after the kill")
    out = c.output("worker0")
    assert code == 129, c.dump()  # a lost peer: transient
    assert "PeerLostError" in out and victim in out, out
    assert took < 15, out


@pytest.mark.timeout(120)
def test_optimizer_states_of_several_mib_are_saved_and_loaded(cluster):
    """Adam's states of a 4 MiB key (more than a frame copied: sent without copying) are
    saved and loaded with no error on any server, and training goes on as a local store's."""
    c = cluster(2, 1)
    (out,) = c.run_workers("optimizer_states.py", ["states.bin"], timeout=90)
    assert "7 steps equal to the local store's" in out, out
    assert (c.tmp / "states.bin").stat().st_size > 8 << 20  # m and v of 1M float32
    for name in ("server0", "server1"):
        log = c.output(name)
        assert "refused" not in log and "TypeError" not in log, log


def test_loading_optimizer_states_before_set_optimizer_is_refused_and_the_job_goes_on(cluster):
    """Every server refuses it alike (no optimizer yet), so the store is not failed: the
    worker sets the optimizer and trains on (a user's report: the job used to end with
    "the servers' rounds differ")."""
    c = cluster(2, 2)
    outs = c.run_workers("optimizer_misuse.py", ["load-first", str(c.tmp / "states")])
    for out in outs:
        assert "REFUSED" in out and "call set_optimizer first" in out, out
        assert "OK -1.0" in out, out


def test_workers_setting_different_optimizers_are_told_never_left_to_timing(cluster):
    """Each worker sets its own learning rate: without the check the servers kept whichever
    came last, and could differ from each other (a user's report: six runs, four results).
    Now a server refuses the one that differs from the first it got of that call, so at least
    one worker hears it, every time."""
    for _ in range(3):
        c = cluster(2, 2)
        outs = c.run_workers("optimizer_misuse.py", ["different"])
        refused = [o for o in outs if "REFUSED" in o]
        assert refused, outs
        for out in refused:
            assert "every worker must set the same optimizer" in out, out
        c.stop()


def test_an_optimizer_changed_by_every_worker_replaces_the_old_one(cluster):
    """MXNet's way of changing the schedule by hand: every worker sets another optimizer.
    The new one replaces the old for every round after it; the last worker to set it
    changes nothing."""
    c = cluster(2, 2)
    outs = c.run_workers("optimizer_misuse.py", ["changed"])
    assert all("OK -2.0" in o for o in outs), outs
