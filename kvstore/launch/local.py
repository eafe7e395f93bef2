"""``--launcher local``: every process a subprocess of the launcher, on this machine."""

from __future__ import annotations

import os

from .job import Proc
from .spec import JobSpec


def processes(spec: JobSpec) -> list[Proc]:
    return [
        Proc(
            f"{role} {rank}",
            spec.role_command(role),
            {**os.environ, **spec.role_env(role, rank)},
            "localhost",
            role=role,
        )
        for role, rank in spec.roles()
    ]
