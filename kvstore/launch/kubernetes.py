"""``--launcher kubernetes``: the manifests of a job, as Kubeflow's MXJob ran MXNet jobs.

One Secret (the job's ``KVSTORE_SECRET``), then for each process a headless Service and a
Job of one pod: ``<job>-scheduler-0``, ``<job>-server-<i>``, ``<job>-worker-<i>``. Every
container gets MXJob's environment (``DMLC_PS_ROOT_URI=<job>-scheduler-0``, a DNS name,
``DMLC_PS_ROOT_PORT``, ``DMLC_ROLE``, ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``; workers also
``DMLC_WORKER_ID``; ``MX_CONFIG``), plus ``DMLC_NODE_HOST`` from the pod's own address and
the secret from the Secret (never in a command line). The scheduler and the servers run
``python -m kvstore.scheduler`` / ``kvstore.server`` from the same image as the workers, whose
command is the user's. Exit codes tell Kubernetes what to retry: 1-127 are permanent (bad
configuration, refused authentication: the Job fails at once), 128 and above transient (a
peer lost, a signal: the pod is retried up to ``backoffLimit``).

    launch.py -n 2 -s 1 --launcher kubernetes --image me/train:1 \
        python train.py --kv-store dist_sync
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess

from .spec import SECRETS, JobSpec, role_overrides

SCHEDULER_PORT = 9091
SERVER_PORT = 9092
PERMANENT_EXIT_CODES = list(range(1, 128))
# Settings of the launching host that mean nothing inside a pod.
_HOST_ONLY = {"DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NODE_HOST", "DMLC_INTERFACE"}


def job_name(name: str) -> str:
    """A DNS-1035 label short enough for ``<job>-scheduler-0`` and ``<job>-worker-<i>``."""
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", name):
        raise ValueError(
            f"--job-name {name!r}: lower-case letters, digits and '-', starting with a letter, "
            "at most 40 characters (it prefixes every pod's DNS name)"
        )
    return name


def replicas(spec: JobSpec) -> list[tuple[str, int]]:
    return [("scheduler", 0)] + spec.roles()


def mx_config(name: str, spec: JobSpec, role: str, index: int) -> str:
    """MXJob's ``MX_CONFIG``: the cluster (role -> ["host:port"]) and this task."""
    cluster = {
        "scheduler": [f"{name}-scheduler-0:{SCHEDULER_PORT}"],
        "server": [f"{name}-server-{i}:{SERVER_PORT}" for i in range(spec.num_servers)],
        "worker": [f"{name}-worker-{i}:{SERVER_PORT}" for i in range(spec.num_workers)],
    }
    return json.dumps(
        {"cluster": cluster, "labels": {}, "task": {"type": role, "index": index}},
        separators=(",", ":"),
    )


def manifests(
    spec: JobSpec,
    image: str,
    name: str,
    namespace: str | None = None,
    python: str = "python",
    backoff_limit: int = 3,
) -> list[dict]:
    """Every object of the job, in the order to apply them."""
    if not image:
        raise ValueError("the kubernetes launcher needs --image (the container image to run)")
    name = job_name(name)
    meta_ns = {"namespace": namespace} if namespace else {}
    labels = {"app.kubernetes.io/name": "kvstore", "kvstore/job": name}
    secret = spec.env.get("KVSTORE_SECRET", "")
    objects: list[dict] = []
    if secret:
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": f"{name}-secret", "labels": labels, **meta_ns},
                "type": "Opaque",
                "data": {"KVSTORE_SECRET": base64.b64encode(secret.encode()).decode()},
            }
        )
    shared = {
        k: v
        for k, v in spec.env.items()
        if k not in SECRETS
        and k not in _HOST_ONLY
        and k not in ("KVSTORE_ROLE_ENV", "KVSTORE_SECRET_FILE")
    }
    shared.update(
        {
            "DMLC_PS_ROOT_URI": f"{name}-scheduler-0",
            "DMLC_PS_ROOT_PORT": str(SCHEDULER_PORT),
            "DMLC_NUM_SERVER": str(spec.num_servers),
            "DMLC_NUM_WORKER": str(spec.num_workers),
        }
    )
    for role, index in replicas(spec):
        pod = f"{name}-{role}-{index}"
        pod_labels = {**labels, "kvstore/role": role, "kvstore/replica": pod}
        env = {**shared, "DMLC_ROLE": role, "MX_CONFIG": mx_config(name, spec, role, index)}
        env.update(role_overrides(spec.env, role))
        port = SCHEDULER_PORT if role == "scheduler" else SERVER_PORT
        if role == "worker":
            env["DMLC_WORKER_ID"] = str(index)
            env["KVSTORE_RANK"] = str(index)
            # torchrun's names; every pod is a host of its own
            env.update(
                RANK=str(index), WORLD_SIZE=str(spec.num_workers), LOCAL_RANK="0", LOCAL_SIZE="1"
            )
            command = list(spec.command)
        elif role == "server":
            env["KVSTORE_RANK"] = str(index)
            env["KVSTORE_SERVER_PORT"] = str(SERVER_PORT)
            command = [python, "-m", "kvstore.server"]
        else:
            command = [python, "-m", "kvstore.scheduler"]
        env_list = [{"name": k, "value": v} for k, v in sorted(env.items())]
        env_list.append(
            {"name": "DMLC_NODE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        )
        if secret:
            env_list.append(
                {
                    "name": "KVSTORE_SECRET",
                    "valueFrom": {
                        "secretKeyRef": {"name": f"{name}-secret", "key": "KVSTORE_SECRET"}
                    },
                }
            )
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": pod, "labels": pod_labels, **meta_ns},
                "spec": {
                    "clusterIP": "None",
                    # the name resolves as soon as the pod has an address, not when it is ready
                    "publishNotReadyAddresses": True,
                    "selector": {"kvstore/replica": pod},
                    "ports": [{"name": "kvstore", "port": port, "targetPort": port}],
                },
            }
        )
        objects.append(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": pod, "labels": pod_labels, **meta_ns},
                "spec": {
                    "backoffLimit": backoff_limit,
                    "podFailurePolicy": {
                        "rules": [
                            {
                                "action": "FailJob",
                                "onExitCodes": {
                                    "containerName": "kvstore",
                                    "operator": "In",
                                    "values": PERMANENT_EXIT_CODES,
                                },
                            }
                        ]
                    },
                    "template": {
                        "metadata": {"labels": pod_labels},
                        "spec": {
                            "restartPolicy": "Never",
                            "containers": [
                                {
                                    "name": "kvstore",
                                    "image": image,
                                    "command": command,
                                    "env": env_list,
                                    "ports": [{"name": "kvstore", "containerPort": port}],
                                }
                            ],
                        },
                    },
                },
            }
        )
    return objects


def to_yaml(objects: list[dict]) -> str:
    """The objects as one YAML stream. JSON is YAML: one JSON document per ``---`` keeps it
    exact without a YAML library."""
    return "".join(f"---\n{json.dumps(obj, indent=2)}\n" for obj in objects)


def apply(text: str) -> int:
    """``kubectl apply -f -`` with the manifests on stdin (the secret never in argv)."""
    if shutil.which("kubectl") is None:
        raise ValueError(
            "--apply needs kubectl on PATH; without --apply the manifests go to stdout"
        )
    return subprocess.run(["kubectl", "apply", "-f", "-"], input=text.encode()).returncode
