"""One task of an mpi, slurm, sge or yarn job: find its role from its index, then run it.

The index comes from ``OMPI_COMM_WORLD_RANK`` (Open MPI), ``PMI_RANK`` (MPICH),
``SLURM_PROCID`` (Slurm) or ``SGE_TASK_ID`` (Grid Engine, from 1); the first
``--num-servers`` indices are servers, the rest workers. Under YARN the application master
sets ``DMLC_ROLE`` and ``DMLC_TASK_ID`` itself. Output lines are prefixed with the role.

    python -m kvstore.launch.child --num-servers 2 -- python train.py --kv-store dist_sync
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from .spec import SECRETS, role_overrides

_INDEX_VARS = (
    ("OMPI_COMM_WORLD_RANK", 0),
    ("PMI_RANK", 0),
    ("SLURM_PROCID", 0),
    ("SGE_TASK_ID", 1),
)


def task_role(env, num_servers: int) -> tuple[str, int]:
    if env.get("DMLC_ROLE") in ("server", "worker") and env.get("DMLC_TASK_ID", "").isdigit():
        return env["DMLC_ROLE"], int(env["DMLC_TASK_ID"])
    for name, base in _INDEX_VARS:
        if env.get(name, "").isdigit():
            index = int(env[name]) - base
            if index < num_servers:
                return "server", index
            return "worker", index - num_servers
    raise ValueError(
        "cannot tell this task's index: none of "
        f"{', '.join(n for n, _ in _INDEX_VARS)} is set (start it through launch.py)"
    )


def worker_ranks(env, rank: int) -> dict:
    """torchrun's ``RANK`` and ``WORLD_SIZE`` for a worker task; ``LOCAL_RANK`` and
    ``LOCAL_SIZE`` only when every task runs on one host (elsewhere the tasks of a host mix
    servers and workers, and ``kvstore.torch.init`` finds them from the host names)."""
    out = {"RANK": str(rank)}
    workers = env.get("DMLC_NUM_WORKER", "")
    if workers.isdigit():
        out["WORLD_SIZE"] = workers
    one_host = (
        any(
            env.get(local, "") == env.get(world, "") != ""
            for local, world in (
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"),
                ("MPI_LOCALNRANKS", "PMI_SIZE"),
            )
        )
        or env.get("SLURM_NNODES") == "1"
    )
    if one_host and workers.isdigit():
        out.update(LOCAL_RANK=str(rank), LOCAL_SIZE=workers)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.launch.child")
    parser.add_argument("--num-servers", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        role, rank = task_role(os.environ, args.num_servers)
    except ValueError as exc:
        print(f"kvstore.launch.child: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ, DMLC_ROLE=role, KVSTORE_RANK=str(rank))
    for name in SECRETS:  # under YARN the secret comes as DMLC_<name> (see launch.yarn)
        if "DMLC_" + name in env:
            env.setdefault(name, env.pop("DMLC_" + name))
    env.update(role_overrides(os.environ, role))
    if role == "worker":
        env.update(worker_ranks(os.environ, rank))
    argv = [sys.executable, "-m", "kvstore.server"] if role == "server" else command
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    for raw in proc.stdout:
        sys.stdout.write(f"[{role} {rank}] {raw.decode(errors='replace')}")
        sys.stdout.flush()
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
