"""Start a real cluster (scheduler, servers, workers) as subprocesses on 127.0.0.1."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def can_build_c() -> bool:
    """Whether ``pip install`` here can build kvstore's optional C module: a C compiler and
    Python's headers (gcc without python3-dev builds nothing, and the install goes on)."""
    import shutil
    import sysconfig

    cc = (sysconfig.get_config_var("CC") or "").split()
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    return bool(cc) and shutil.which(cc[0]) is not None and headers.exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(num_server: int, num_worker: int, port: int | None = None, **extra) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": str(port or free_port()),
            "DMLC_NUM_SERVER": str(num_server),
            "DMLC_NUM_WORKER": str(num_worker),
            "DMLC_NODE_HOST": "127.0.0.1",
            "PYTHONPATH": str(ROOT),
            "KVSTORE_HEARTBEAT_INTERVAL": "0.2",
            "KVSTORE_HEARTBEAT_TIMEOUT": "3",  # quick to notice a death, patient with a busy CI
            "KVSTORE_START_TIMEOUT": "30",
            "KVSTORE_TIMEOUT": "60",
            "KVSTORE_ROUND_TIMEOUT": "30",
            "KVSTORE_SECRET": secrets.token_hex(32),
        }
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def started_pids(out: str) -> dict:
    """{'scheduler': pid, 'server 0': pid, ...} from the launcher's 'started' lines (a slot
    started again: its latest pid)."""
    pids = {}
    for line in out.splitlines():
        if line.startswith("launch: started ") and " (pid " in line:
            name = line[len("launch: started ") :].split(" on ")[0]
            pids[name] = int(line.rsplit("(pid ", 1)[1].rstrip(")"))
    return pids


def poll_until(condition, timeout: float, interval: float = 0.05) -> bool:
    """Check ``condition()`` every ``interval`` until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            return False
        pause.wait(interval)
    return True


def shm_left(before: set) -> set:
    """The ``kvs-`` names in /dev/shm that are not in ``before`` and that no live process
    maps or holds open: what a job left behind. A job running beside this one (tests run
    side by side with -n) holds its segments for as long as it runs: not counted."""
    from kvstore import shm

    new = {n for n in os.listdir(shm.SHM_DIR) if n.startswith("kvs-")} - before
    if not new:
        return new
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                held.update(
                    line.split("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line
                )
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target[len("/dev/shm/") :].split()[0])
        except OSError:  # it ended meanwhile
            continue
    return new - held


class Cluster:
    """Scheduler + servers now; workers run a snippet of Python via :meth:`run_workers`.

    Every process is stopped (by PID) in :meth:`stop`, whatever happened.
    """

    def __init__(self, num_server: int, num_worker: int, tmp: Path, **env):
        self.num_server, self.num_worker, self.tmp = num_server, num_worker, Path(tmp)
        self.env = base_env(num_server, num_worker, **env)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self._spawn("scheduler", [sys.executable, "-m", "kvstore.scheduler"], "scheduler")
        for i in range(num_server):
            self._spawn(f"server{i}", [sys.executable, "-m", "kvstore.server"], "server")

    def _spawn(self, name: str, argv: list, role: str, env=None) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        self.logs[name] = log
        proc_env = dict(env or self.env, DMLC_ROLE=role)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv, env=proc_env, stdout=out, stderr=subprocess.STDOUT, cwd=self.tmp
            )
        self.procs[name] = proc
        return proc

    def start_workers(self, script: str, args=(), env=None, count=None) -> list:
        """Start ``count`` (default: all) workers running ``tests/workers/<script>``."""
        path = ROOT / "tests" / "workers" / script
        # rank i for worker i, as launch.py does (without a hint ranks follow the pids, which
        # wrap around: then worker0 is not rank 0)
        return [
            self._spawn(
                f"worker{i}",
                [sys.executable, str(path), *map(str, args)],
                "worker",
                dict(env or self.env, KVSTORE_RANK=str(i)),
            )
            for i in range(count or self.num_worker)
        ]

    def run_workers(self, script: str, args=(), timeout: float = 60, env=None) -> list[str]:
        """Run a worker script in every worker; return their outputs, or fail with the logs."""
        workers = self.start_workers(script, args, env)
        codes = self.wait(workers, timeout)
        outputs = [self.output(f"worker{i}") for i in range(self.num_worker)]
        if any(codes):
            raise AssertionError(f"workers exited {codes}\n{self.dump()}")
        return outputs

    def wait(self, procs, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"process {proc.args} still running after {timeout}s\n{self.dump()}"
                ) from None
        return codes

    def wait_for_output(self, name: str, text: str, timeout: float) -> None:
        def printed():
            return text in self.output(name) or self.procs[name].poll() is not None

        if not poll_until(printed, timeout) or text not in self.output(name):
            raise AssertionError(f"{name} never printed {text!r}\n{self.dump()}")

    def output(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def dump(self) -> str:
        return "\n".join(f"--- {n}\n{self.output(n)[-3000:]}" for n in self.logs)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
