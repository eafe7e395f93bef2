"""What every launcher needs to know about a job, and the environment of each process."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from .hostfile import Host

# Never written on a command line (where `ps` shows it): passed in the environment, or on
# ssh's stdin.
SECRETS = frozenset({"KVSTORE_SECRET"})

# MXNet's --env-server / --env-worker, for launchers whose tasks find their role themselves
# (mpi, slurm, sge, yarn): {"server": {...}, "worker": {...}}, applied by kvstore.launch.child.
ROLE_ENV = "KVSTORE_ROLE_ENV"


def role_overrides(env, role: str) -> dict:
    """The variables ``--env-server``/``--env-worker`` set for ``role`` (from ``env``)."""
    raw = env.get(ROLE_ENV, "")
    if not raw:
        return {}
    try:
        table = json.loads(raw)
        return {str(k): str(v) for k, v in (table.get(role) or {}).items()}
    except (ValueError, AttributeError):
        raise ValueError(f"{ROLE_ENV}={raw!r}: expected JSON {{'server': {{...}}}}") from None


@dataclass
class JobSpec:
    num_workers: int
    num_servers: int
    command: list[str]
    root_uri: str
    port: int
    hosts: list[Host] | None = None
    env: dict = field(default_factory=dict)  # DMLC_* plus the user's --env
    cwd: str = field(default_factory=os.getcwd)
    python: str = sys.executable
    ssh_port: int | None = None
    ssh_options: list[str] = field(default_factory=list)
    sync_dst_dir: str | None = None
    launcher: str = "local"
    colocate: bool = False  # server i on the i-th host, workers round-robin over the hosts

    @property
    def num_procs(self) -> int:
        return self.num_servers + self.num_workers

    def roles(self):
        """(role, rank) of every server and worker process, servers first."""
        return [("server", i) for i in range(self.num_servers)] + [
            ("worker", i) for i in range(self.num_workers)
        ]

    def role_env(self, role: str, rank: int) -> dict:
        env = {**self.env, "DMLC_ROLE": role, "KVSTORE_RANK": str(rank)}
        env.update(role_overrides(self.env, role))
        if role == "worker":
            env.update(self.worker_ranks(rank))
        return env

    def worker_ranks(self, rank: int) -> dict:
        """torchrun's names for a worker (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``LOCAL_SIZE``): its rank among the workers on its host follows the placement."""
        if self.hosts:
            from .hostfile import place

            where = place(self.hosts, self.num_procs)[self.num_servers :]
            mine = where[rank].name
            local = [r for r, h in enumerate(where) if h.name == mine]
        else:
            local = list(range(self.num_workers))
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.num_workers),
            "LOCAL_RANK": str(local.index(rank)),
            "LOCAL_SIZE": str(len(local)),
        }

    def role_command(self, role: str) -> list[str]:
        return [self.python, "-m", "kvstore.server"] if role == "server" else self.command

    def child_command(self) -> list[str]:
        """For launchers that start N identical tasks (mpi, slurm, sge, yarn): each task finds
        its role from its index (see :mod:`kvstore.launch.child`)."""
        return [
            self.python,
            "-m",
            "kvstore.launch.child",
            "--num-servers",
            str(self.num_servers),
            "--",
            *self.command,
        ]
