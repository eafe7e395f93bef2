"""``--launcher mpi``: one ``mpirun`` starts every server and worker.

Open MPI and MPICH are both supported (``mpirun --version`` tells which). Each task runs
:mod:`kvstore.launch.child`, which takes its role from its MPI rank: the first
``--num-servers`` ranks are servers, the rest workers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from .hostfile import place
from .job import Proc
from .spec import SECRETS, JobSpec


def flavour(mpirun: str = "mpirun") -> str:
    """``openmpi`` or ``mpich``, from the output of ``mpirun --version``."""
    path = shutil.which(mpirun)
    if path is None:
        raise ValueError(
            "the mpi launcher needs mpirun on PATH (Open MPI or MPICH): "
            "install openmpi-bin or mpich"
        )
    text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    out = text.stdout + text.stderr
    if "Open MPI" in out or "OpenRTE" in out:
        return "openmpi"
    if "HYDRA" in out or "MPICH" in out or "Intel" in out:
        return "mpich"
    raise ValueError(f"cannot tell which MPI {path} is (neither Open MPI nor MPICH): {out[:200]}")


def command(spec: JobSpec, kind: str, hostfile: str | None, as_root: bool) -> list[str]:
    """The exact ``mpirun`` command line for ``spec``."""
    argv = ["mpirun", "-n", str(spec.num_procs)]
    if kind == "openmpi":
        if as_root:
            argv += ["--allow-run-as-root"]
        argv += ["--oversubscribe"]
        if hostfile:
            argv += ["--hostfile", hostfile]
        for name, value in sorted(spec.env.items()):  # a secret: from the environment only
            argv += ["-x", name if name in SECRETS else f"{name}={value}"]
    else:
        if hostfile:
            argv += ["-f", hostfile]
        for name, value in sorted(spec.env.items()):
            argv += ["-genvlist", name] if name in SECRETS else ["-genv", name, str(value)]
    return argv + spec.child_command()


def write_hostfile(spec: JobSpec, kind: str) -> str | None:
    if not spec.hosts:
        return None
    counts: dict = {}
    for host in place(spec.hosts, spec.num_procs):
        counts[host.name] = counts.get(host.name, 0) + 1
    lines = [
        f"{name} slots={n}" if kind == "openmpi" else f"{name}:{n}" for name, n in counts.items()
    ]
    fd, path = tempfile.mkstemp(prefix="kvstore-hosts-", text=True)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def processes(spec: JobSpec) -> list[Proc]:
    kind = flavour()
    argv = command(spec, kind, write_hostfile(spec, kind), os.geteuid() == 0)
    argv[0] = shutil.which("mpirun")
    return [Proc("mpirun", argv, {**os.environ, **spec.env}, "mpirun", prefixed=True)]
