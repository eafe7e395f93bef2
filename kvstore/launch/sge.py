"""``--launcher sge``: a ``qsub`` array job of servers and workers, as dmlc-tracker submits.

``qsub -sync y`` waits for the job, so the launcher's exit status is the job's. Each task runs
:mod:`kvstore.launch.child`, which takes its role from ``SGE_TASK_ID``.

The job secret never goes on a command line: ``-v KVSTORE_SECRET`` names it without a value,
and ``qsub`` takes the value from its own environment, where :func:`processes` puts it. What a
task sees: ``KVSTORE_SECRET`` in its environment. Grid Engine keeps a job's environment with
the job (``qstat -j`` lists it as ``env_list`` to whoever may see the job's details): where
other users may, set ``KVSTORE_SECRET_FILE`` to a file on the shared file system that only you
can read instead.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile

from .job import Proc
from .spec import SECRETS, JobSpec


def script(spec: JobSpec) -> str:
    return f"#!/bin/bash\ncd {shlex.quote(spec.cwd)}\nexec {shlex.join(spec.child_command())}\n"


def command(spec: JobSpec, script_path: str, queue: str | None = None) -> list[str]:
    env = ",".join(k if k in SECRETS else f"{k}={v}" for k, v in sorted(spec.env.items()))
    argv = [
        "qsub",
        "-cwd",
        "-sync",
        "y",
        "-t",
        f"1-{spec.num_procs}",
        "-S",
        "/bin/bash",
        "-N",
        "kvstore",
        "-j",
        "y",
        "-v",
        env,
    ]
    if queue:
        argv += ["-q", queue]
    return argv + [script_path]


def processes(spec: JobSpec) -> list[Proc]:
    if shutil.which("qsub") is None:
        raise ValueError("the sge launcher needs qsub on PATH (Sun/Univa/Son of Grid Engine)")
    fd, path = tempfile.mkstemp(prefix="kvstore-sge-", suffix=".sh", text=True)
    with os.fdopen(fd, "w") as f:
        f.write(script(spec))
    return [
        Proc(
            "qsub",
            command(spec, path, os.environ.get("KVSTORE_SGE_QUEUE")),
            {**os.environ, **spec.env},  # the secret's value, which `-v NAME` takes from here
            "sge",
            prefixed=True,
        )
    ]
