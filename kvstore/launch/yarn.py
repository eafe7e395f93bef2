"""``--launcher yarn``: submit servers and workers as YARN containers, as dmlc-tracker does.

It needs the Hadoop client (``hadoop`` on PATH, ``HADOOP_HOME``) and dmlc's YARN application
jar (``DMLC_YARN_JAR``); each is checked first, and a missing one is a clear error. The
application master starts the tasks with ``DMLC_ROLE`` and ``DMLC_TASK_ID`` set, which
:mod:`kvstore.launch.child` reads.

The job secret never goes on a command line. dmlc's ``Client`` copies every ``-env NAME=VALUE``
into the application master's own command line (``ps`` on its node shows it), so the secret
travels in the environment of the ``hadoop`` process instead, as ``DMLC_KVSTORE_SECRET``: the
Client copies the ``DMLC_*`` variables of its environment into the application master's
container environment, and the master copies its ``DMLC_*`` variables into every task's
container environment. What a container sees: ``DMLC_KVSTORE_SECRET`` in its environment,
which :mod:`kvstore.launch.child` renames to ``KVSTORE_SECRET`` before it starts the server or
the worker. YARN keeps a container's environment in the NodeManager's launch script, and
dmlc's master logs the task environment into its own container log: both are readable by the
job's user and the cluster's administrators, not by other users. For a secret that appears
nowhere, set ``KVSTORE_SECRET_FILE`` to a file on a shared file system that only you can read.
"""

from __future__ import annotations

import os
import shutil

from .job import Proc
from .spec import SECRETS, JobSpec

# The prefix dmlc's YARN Client and ApplicationMaster copy from their environment into the
# containers' environments.
CARRIED = "DMLC_"


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
        if name not in SECRETS:  # a secret: in the environment only (see environment())
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
    return [Proc("yarn", command(spec, jar), environment(spec, os.environ), "yarn", prefixed=True)]


def environment(spec: JobSpec, base) -> dict:
    """The environment of the ``hadoop`` process: each secret under a ``DMLC_`` name, which
    dmlc's Client and ApplicationMaster carry into every container (see the module's text)."""
    env = {
        **base,
        **spec.env,
        "DMLC_NUM_SERVER": str(spec.num_servers),
        "DMLC_NUM_WORKER": str(spec.num_workers),
    }
    for name in SECRETS & spec.env.keys():
        env[CARRIED + name] = spec.env[name]
    return env
