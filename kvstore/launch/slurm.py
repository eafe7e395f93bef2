"""``--launcher slurm``: ``srun`` starts every server and worker inside an allocation.

Each task runs :mod:`kvstore.launch.child`, which takes its role from ``SLURM_PROCID``.
"""

from __future__ import annotations

import os
import shutil

from .job import Proc
from .spec import JobSpec


def command(spec: JobSpec) -> list[str]:
    argv = ["srun", f"--ntasks={spec.num_procs}", "--kill-on-bad-exit=1", "--export=ALL"]
    if spec.hosts:
        argv += [f"--nodelist={','.join(dict.fromkeys(h.name for h in spec.hosts))}"]
    return argv + spec.child_command()


def processes(spec: JobSpec) -> list[Proc]:
    if shutil.which("srun") is None:
        raise ValueError(
            "the slurm launcher needs srun on PATH; run it on a Slurm login node, "
            "inside an allocation (salloc or sbatch)"
        )
    return [Proc("srun", command(spec), {**os.environ, **spec.env}, "slurm", prefixed=True)]
