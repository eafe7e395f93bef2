"""Exit codes that tell a platform what to retry (kvstore/errors.py): permanent errors 1-127
(bad configuration 2, refused authentication 3, a port in use 1), transient ones 129 (a peer
lost, the scheduler gone or never resolved, the start-up deadline). Real processes, scripts
that let the error escape as users' scripts do."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from kvstore import errors
from kvstore.config import Config
from kvstore.control import resolve_scheduler

from .cluster import ROOT, base_env

UNCAUGHT = (
    "import numpy as np, kvstore\n"
    "kv = kvstore.create('dist_sync')\n"
    "kv.init(0, np.zeros(1000, np.float32))\n"
    "print('ready', flush=True)\n"
    "out = np.empty(1000, np.float32)\n"
    "for _ in range(100000):\n"
    "    kv.pushpull(0, np.ones(1000, np.float32), out=out)\n"
)
NOWHERE = "kvstore-nowhere.invalid"  # .invalid never resolves (RFC 2606)


def run(argv, env, timeout=60):
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_the_table():
    assert (errors.EXIT_FAILED, errors.EXIT_CONFIG, errors.EXIT_AUTH) == (1, 2, 3)
    assert errors.EXIT_PEER_LOST >= 128
    assert errors.KVStoreError("x").exit_code == 1
    assert errors.PeerLostError("x").exit_code == 129
    assert errors.AuthError("x").exit_code == 3
    assert errors.ConfigError("x").exit_code == 2 and isinstance(errors.ConfigError(), ValueError)
    assert issubclass(errors.PeerLostError, errors.KVStoreError)
    assert errors.exit_code_of(RuntimeError()) == 1


def test_a_name_that_never_resolves_fails_at_the_deadline_naming_it():
    env = dict(base_env(1, 1, KVSTORE_START_TIMEOUT=10), DMLC_PS_ROOT_URI=NOWHERE)
    cfg = Config.from_env(dict(env, DMLC_ROLE="worker"))
    now, waits = [0.0], []

    def sleep(seconds):
        waits.append(round(seconds, 6))
        now[0] += seconds

    with pytest.raises(errors.PeerLostError, match=f"'{NOWHERE}'.*waited 10.0s") as caught:
        resolve_scheduler(cfg, sleep=sleep, clock=lambda: now[0])
    assert "10 tries (KVSTORE_START_TIMEOUT=10s)" in str(caught.value)  # last at the deadline
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0, 0.9]  # doubling to 2 s, to the end
    local = Config.from_env(dict(env, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_ROLE="worker"))
    assert resolve_scheduler(local, sleep=None) == "127.0.0.1"  # an address: no lookup


@pytest.mark.parametrize("role", ["server", "worker"])
def test_scheduler_never_resolves_exits_129(role):
    env = dict(base_env(1, 1, KVSTORE_START_TIMEOUT=1.5), DMLC_PS_ROOT_URI=NOWHERE, DMLC_ROLE=role)
    argv = (
        [sys.executable, "-c", UNCAUGHT]
        if role == "worker"
        else [sys.executable, "-m", "kvstore.server"]
    )
    t0 = time.monotonic()
    done = run(argv, env)
    assert done.returncode == 129, done.stderr
    assert f"cannot resolve the scheduler's host '{NOWHERE}'" in done.stderr, done.stderr
    assert time.monotonic() - t0 < 20


def test_bad_configuration_exits_2_in_every_role():
    env = base_env(1, 1, KVSTORE_HEARTBEAT_INTERVAL="soon")
    for role, argv in (
        ("scheduler", [sys.executable, "-m", "kvstore.scheduler"]),
        ("server", [sys.executable, "-m", "kvstore.server"]),
        ("worker", [sys.executable, "-c", UNCAUGHT]),
    ):
        done = run(argv, dict(env, DMLC_ROLE=role))
        assert done.returncode == 2, (role, done.stderr)
        assert "KVSTORE_HEARTBEAT_INTERVAL='soon'" in done.stderr, done.stderr


def test_refused_authentication_exits_3(cluster):
    c = cluster(1, 1)
    other = "another-job-" + "x" * 20
    worker = run(
        [sys.executable, "-c", UNCAUGHT], dict(c.env, DMLC_ROLE="worker", KVSTORE_SECRET=other)
    )
    assert worker.returncode == 3, worker.stderr
    assert "AuthError" in worker.stderr and "refused this process's key" in worker.stderr
    server = run(
        [sys.executable, "-m", "kvstore.server"],
        dict(c.env, DMLC_ROLE="server", KVSTORE_SECRET=other),
    )
    assert server.returncode == 3, server.stderr


def test_a_lost_server_ends_every_process_with_129(cluster):
    c = cluster(2, 2, KVSTORE_BIGARRAY_BOUND=100)
    workers = [c._spawn(f"worker{i}", [sys.executable, "-c", UNCAUGHT], "worker") for i in range(2)]
    for i in range(2):
        c.wait_for_output(f"worker{i}", "ready", 30)
    c.procs["server1"].send_signal(signal.SIGKILL)
    assert c.wait(workers, 30) == [129, 129], c.dump()
    for i in range(2):
        out = c.output(f"worker{i}")
        assert "PeerLostError" in out and "server" in out and "failed" in out, out
    assert c.wait([c.procs["scheduler"], c.procs["server0"]], 15) == [129, 129], c.dump()


def test_an_uncaught_error_of_the_users_own_still_exits_1_and_is_reported(cluster):
    c = cluster(1, 2)
    crash = UNCAUGHT.replace("print('ready', flush=True)\n", "raise RuntimeError('boom')\n")
    workers = [c._spawn(f"worker{i}", [sys.executable, "-c", crash], "worker") for i in range(2)]
    assert c.wait(workers, 30) == [1, 1], c.dump()
    assert "raised RuntimeError: boom" in c.output("scheduler"), c.dump()
