"""``--launcher yarn``: submit servers and workers as YARN containers, as dmlc-tracker does.

It needs the Hadoop client (``hadoop`` on PATH, ``HADOOP_HOME``) and dmlc's YARN application
jar (``DMLC_YARN_JAR``); each is checked first, and a missing one is a clear error. The
application master starts the tasks with ``DMLC_ROLE`` and ``DMLC_TASK_ID`` set, which
:mod:`kvstore.launch.child` reads.
"""

from __future__ import annotations

import os
import shutil

from .job import Proc
from .spec import JobSpec


def command(spec: JobSpec, jar: str) -> list[str]:
    argv = [
        "hadoop",
        "jar",
        jar,
        "org.apache.hadoop.yarn.dmlc.Client",
        "-jobname",
        "kvstore",
        "-tempdir",
        "/tmp",
        "-queue",
        "default",
    ]
    for name, value in sorted(spec.env.items()):
        argv += ["-env", f"{name}={value}"]
    return argv + spec.child_command()


def processes(spec: JobSpec) -> list[Proc]:
    missing = []
    if shutil.which("hadoop") is None:
        missing.append("the Hadoop client (`hadoop` on PATH)")
    if not os.environ.get("HADOOP_HOME"):
        missing.append("HADOOP_HOME")
    jar = os.environ.get("DMLC_YARN_JAR", "")
    if not os.path.isfile(jar):
        missing.append("dmlc's YARN application jar (DMLC_YARN_JAR=/path/to/dmlc-yarn.jar)")
    if missing:
        raise ValueError("the yarn launcher needs " + ", ".join(missing) + "; none found here")
    env = {
        **os.environ,
        **spec.env,
        "DMLC_NUM_SERVER": str(spec.num_servers),
        "DMLC_NUM_WORKER": str(spec.num_workers),
    }
    return [Proc("yarn", command(spec, jar), env, "yarn", prefixed=True)]
