"""``launch.py --launcher slurm`` through a real Slurm: slurmctld, slurmd and munged started on
this machine (one node, CPUs=2) from a minimal slurm.conf in a temporary directory, a job
allocated with ``salloc --no-shell``, the launcher run inside it (``SLURM_JOB_ID``) as a user
does in ``salloc``. A job that succeeds, a failing worker, Ctrl-C. Skips, saying why, where
Slurm cannot run (not root, the packages missing: scripts/test.sh installs them as root)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .cluster import ROOT, free_port, poll_until

pytestmark = pytest.mark.slow

DAEMONS = ("munged", "slurmctld", "slurmd")
SCRIPT = """\
import os, sys, time
import numpy as np
import kvstore
kv = kvstore.create("dist_sync")
kv.init(0, np.zeros(3, np.float32))
out = np.empty(3, np.float32)
rounds = int(sys.argv[1])
print(f"pid {os.getpid()} rank {kv.rank} in slurm job {os.environ['SLURM_JOB_ID']}", flush=True)
for step in range(rounds):
    if kv.rank == int(sys.argv[2]) and step == 3:
        print("giving up", flush=True)
        sys.exit(7)
    kv.pushpull(0, np.ones(3, np.float32), out=out)
    time.sleep(0.05)
print(f"rank {kv.rank} done: {out[0]:g}", flush=True)
"""


def _why_not() -> str:
    if os.geteuid() != 0:
        return "a private Slurm needs root (slurmd runs jobs as their users); CI runs as root"
    missing = [d for d in (*DAEMONS, "srun", "salloc", "sinfo") if shutil.which(d) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing): scripts/test.sh installs "
            "Debian's slurm-wlm and munge when run as root"
        )
    return ""


class PrivateSlurm:
    """munged, slurmctld and slurmd in the foreground, on private ports, torn down by PID."""

    def __init__(self, tmp: Path):
        self.tmp, self.procs = tmp, {}
        self.node = socket.gethostname().split(".")[0]
        (tmp / "state").mkdir()
        (tmp / "spool").mkdir()
        munge = tmp / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = munge / "socket"
        self.conf = tmp / "slurm.conf"
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=kvstoretest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.socket}",
                    f"StateSaveLocation={tmp / 'state'}",
                    f"SlurmdSpoolDir={tmp / 'spool'}",
                    f"SlurmctldPidFile={tmp / 'slurmctld.pid'}",
                    f"SlurmdPidFile={tmp / 'slurmd.pid'}",
                    "ProctrackType=proctrack/linuxproc",  # no cgroups in a container
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/builtin",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "MpiDefault=none",
                    "MailProg=/bin/true",
                    "ReturnToService=2",
                    "KillWait=5",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN",
                    "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
                    "OverSubscribe=YES",
                    "",
                ]
            )
        )
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._start(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={self.socket}",
                f"--pid-file={munge / 'pid'}",
                f"--seed-file={munge / 'seed'}",
                f"--log-file={munge / 'log'}",
            ],
        )
        if not poll_until(self.socket.exists, 10):
            return
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._start("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(self.conf)])

    def _start(self, name: str, argv: list[str]) -> None:
        with open(self.tmp / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def idle(self) -> bool:
        done = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env, timeout=10
        )
        return done.stdout.strip() == "idle"

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{(self.tmp / f'{name}.log').read_text(errors='replace')[-1500:]}"
            for name in self.procs
        )

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _why_not()
    if why:
        pytest.skip(why)
    cluster = PrivateSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        if not poll_until(cluster.idle, 30, interval=0.5):
            pytest.skip(f"slurmctld/slurmd did not come up in this container:\n{cluster.logs()}")
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def allocation(slurm):
    """An allocation of 3 tasks (overcommitted on the node's 2 CPUs), as salloc gives one;
    the environment a shell inside it has."""
    done = subprocess.run(
        ["salloc", "--no-shell", "--ntasks=3", "--overcommit", "--immediate=20"],
        capture_output=True,
        text=True,
        env=slurm.env,
        timeout=60,
    )
    found = re.search(r"Granted job allocation (\d+)", done.stderr)
    assert found, done.stderr + slurm.logs()
    job = found[1]
    env = dict(slurm.env, SLURM_JOB_ID=job, SLURM_JOBID=job, PYTHONPATH=str(ROOT))
    env.update({"SLURM_NTASKS": "3", "SLURM_NPROCS": "3", "SLURM_OVERCOMMIT": "1"})
    env.update({"KVSTORE_HEARTBEAT_INTERVAL": "0.2", "KVSTORE_START_TIMEOUT": "40"})
    yield env
    subprocess.run(["scancel", job], env=slurm.env, timeout=30, capture_output=True)


def launch(env, tmp_path, rounds: int, failing_rank: int = -1) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(ROOT / "launch.py"), "-n", "2", "-s", "1", "--launcher"]
    argv += ["slurm", "--timeout", "120", sys.executable, str(script), str(rounds)]
    argv += [str(failing_rank)]
    return subprocess.Popen(
        argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_job_runs_through_srun(allocation, tmp_path):
    proc = launch(allocation, tmp_path, rounds=10)
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out
    job = allocation["SLURM_JOB_ID"]
    for rank in (0, 1):
        assert re.search(rf"rank {rank} in slurm job {job}\b", out), out
        assert f"rank {rank} done: 2" in out, out


def test_a_failing_worker_ends_the_job_with_its_status(allocation, tmp_path):
    proc = launch(allocation, tmp_path, rounds=1000, failing_rank=1)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode != 0, out
    assert "giving up" in out, out
    assert time.monotonic() - t0 < 60, out  # srun --kill-on-bad-exit, not a deadline
    pids = [int(p) for p in re.findall(r"pid (\d+) rank", out)]
    assert len(pids) == 2 and poll_until(lambda: not any(_alive(p) for p in pids), 20), out


def test_ctrl_c_stops_every_task(allocation, tmp_path):
    proc = launch(allocation, tmp_path, rounds=100000)
    seen, pids = [], []
    deadline = time.monotonic() + 90
    while len(pids) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        pids += [int(p) for p in re.findall(r"pid (\d+) rank", line)]
    assert len(pids) == 2, "".join(seen)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    out = "".join(seen) + rest
    assert proc.returncode == 130 and "interrupted; stopping every process" in out, out
    assert poll_until(lambda: not any(_alive(p) for p in pids), 30), out
