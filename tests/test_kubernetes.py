"""``launch.py --launcher kubernetes``: manifests checked against the Kubernetes schema offline
(kubernetes-validate bundles it), MXJob's environment contract, and that environment run
locally: the same script as every role, the scheduler reached by a host name."""

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from kvstore.config import Config, _node_host, bind_host
from kvstore.errors import ConfigError
from kvstore.launch import kubernetes as k8s

from .cluster import free_port, poll_until

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).parent / "data" / "mxjob_script.py"
K8S_VERSION = "1.30.0"  # podFailurePolicy is GA from 1.31, beta (on by default) from 1.26


def render(*extra: str, env=None) -> list[dict]:
    argv = [sys.executable, str(ROOT / "launch.py"), "-n", "2", "-s", "2"]
    argv += ["--launcher", "kubernetes", "--image", "registry.example/train:1", *extra]
    argv += ["python", "train.py", "--kv-store", "dist_sync"]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, env=env, check=True
    ).stdout
    return [json.loads(doc) for doc in out.split("---\n") if doc.strip()]


def env_of(obj: dict) -> dict:
    container = obj["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.fixture(scope="module")
def objects():
    return render("--job-name", "mnist", "--env-worker", "OMP_NUM_THREADS:3")


def test_manifests_valid_against_the_schema(objects):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for version in (K8S_VERSION, "1.33.0"):
        for obj in objects:
            kv.validate(obj, version, strict=True)  # raises on any error or unknown field
    kinds = [o["kind"] for o in objects]
    assert kinds.count("Secret") == 1 and kinds.count("Service") == 5 and kinds.count("Job") == 5


def test_mxjob_environment_contract(objects):
    jobs = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Job"}
    assert sorted(jobs) == sorted(
        [
            "mnist-scheduler-0",
            "mnist-server-0",
            "mnist-server-1",
            "mnist-worker-0",
            "mnist-worker-1",
        ]
    )
    for name, job in jobs.items():
        env = env_of(job)
        role = name.split("-")[1]
        assert env["DMLC_PS_ROOT_URI"] == "mnist-scheduler-0"  # a DNS name, never an address
        assert env["DMLC_PS_ROOT_PORT"] == str(k8s.SCHEDULER_PORT)
        assert env["DMLC_ROLE"] == role
        assert env["DMLC_NUM_SERVER"] == "2" and env["DMLC_NUM_WORKER"] == "2"
        config = json.loads(env["MX_CONFIG"])
        assert config["task"] == {"type": role, "index": int(name[-1])}
        assert config["cluster"]["scheduler"] == [f"mnist-scheduler-0:{k8s.SCHEDULER_PORT}"]
        assert env["KVSTORE_SECRET"] == {
            "secretKeyRef": {"name": "mnist-secret", "key": "KVSTORE_SECRET"}
        }
        assert env["DMLC_NODE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert ("DMLC_WORKER_ID" in env) == (role == "worker")
        assert (env.get("OMP_NUM_THREADS") == "3") == (role == "worker")  # --env-worker
        spec = job["spec"]
        assert spec["template"]["spec"]["restartPolicy"] == "Never"
        rule = spec["podFailurePolicy"]["rules"][0]
        assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == list(range(1, 128))
        command = spec["template"]["spec"]["containers"][0]["command"]
        if role == "worker":
            assert command == ["python", "train.py", "--kv-store", "dist_sync"]
            assert env["DMLC_WORKER_ID"] == name[-1]
        else:
            assert command == ["python", "-m", f"kvstore.{role}"]
    services = [o for o in objects if o["kind"] == "Service"]
    assert all(s["spec"]["clusterIP"] == "None" for s in services)  # headless: the pod's IP


def test_secret_never_in_a_command_or_plain_env(objects):
    secret = next(o for o in objects if o["kind"] == "Secret")["data"]["KVSTORE_SECRET"]
    text = json.dumps([o for o in objects if o["kind"] != "Secret"])
    assert secret not in text
    import base64

    assert base64.b64decode(secret).decode() not in text


def test_bad_job_name_and_missing_image():
    argv = [sys.executable, str(ROOT / "launch.py"), "-n", "1", "--launcher", "kubernetes"]
    bad = subprocess.run(
        [*argv, "--image", "x", "--job-name", "Bad_Name", "python", "t.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--job-name 'Bad_Name'" in bad.stderr
    none = subprocess.run([*argv, "python", "t.py"], capture_output=True, text=True, timeout=60)
    assert none.returncode == 2 and "needs --image" in none.stderr


def _hosts_line(name: str) -> str:
    return f"127.0.0.1 {name}  # kvstore test_kubernetes\n"


def _run_mxjob(
    tmp_path, name: str, delay: float, only_mx_config: bool = False
) -> tuple[list[int], str]:
    """Start every role of the rendered manifests as local processes (the same script for
    all), with MXJob's environment (no DMLC_NODE_HOST); ``name`` (the scheduler's DNS name)
    appears in /etc/hosts after ``delay`` seconds, as a headless service's record does.
    ``only_mx_config``: every DMLC_* variable removed, MX_CONFIG alone says it all."""
    objects = render("--job-name", name)
    secret = "k8s-simulation-" + uuid.uuid4().hex
    port = free_port()
    procs, logs = [], []
    for job in (o for o in objects if o["kind"] == "Job"):
        env = {k: v for k, v in env_of(job).items() if isinstance(v, str)}
        if only_mx_config:
            config = json.loads(env["MX_CONFIG"])
            config["cluster"]["scheduler"] = [f"{name}-scheduler-0:{port}"]
            env = {k: v for k, v in env.items() if not k.startswith("DMLC_")}
            env["MX_CONFIG"] = json.dumps(config)
        env.update(
            {
                **({} if only_mx_config else {"DMLC_PS_ROOT_PORT": str(port)}),
                "KVSTORE_SECRET": secret,
                "KVSTORE_SERVER_PORT": "0",  # every "pod" shares this host's ports
                "KVSTORE_START_TIMEOUT": "40",
                "PYTHONPATH": str(ROOT),
                "PATH": os.environ["PATH"],
            }
        )
        log = tmp_path / f"{job['metadata']['name']}.log"
        logs.append(log)
        with open(log, "wb") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPT)], env=env, stdout=out, stderr=subprocess.STDOUT
                )
            )
    added = threading.Event()

    def publish():
        with open("/etc/hosts", "a") as hosts:
            hosts.write(_hosts_line(f"{name}-scheduler-0"))
        added.set()

    timer = threading.Timer(delay, publish)
    timer.start()
    try:
        poll_until(lambda: all(p.poll() is not None for p in procs), 90)
        codes = [p.poll() for p in procs]
    finally:
        timer.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if added.is_set():
            with open("/etc/hosts") as f:
                kept = [ln for ln in f if ln != _hosts_line(f"{name}-scheduler-0")]
            with open("/etc/hosts", "w") as f:
                f.writelines(kept)
    return codes, "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in logs)


needs_hosts = pytest.mark.skipif(
    not os.access("/etc/hosts", os.W_OK),
    reason="simulating a DNS name needs a writable /etc/hosts (run as root, as CI does)",
)


@needs_hosts
@pytest.mark.slow
def test_mxjob_environment_runs_locally(tmp_path):
    name = "kvsim" + uuid.uuid4().hex[:8]
    codes, logs = _run_mxjob(tmp_path, name, delay=0.0)
    assert codes == [0] * 5, logs
    assert logs.count(" OK") == 2, logs


@needs_hosts
@pytest.mark.slow
def test_mxjob_scheduler_name_resolves_late(tmp_path):
    name = "kvsim" + uuid.uuid4().hex[:8]
    codes, logs = _run_mxjob(tmp_path, name, delay=4.0)
    assert codes == [0] * 5, logs


@needs_hosts
@pytest.mark.slow
def test_mxjob_with_only_mx_config(tmp_path):
    name = "kvsim" + uuid.uuid4().hex[:8]
    codes, logs = _run_mxjob(tmp_path, name, delay=1.0, only_mx_config=True)
    assert codes == [0] * 5, logs
    assert logs.count(" OK") == 2, logs


MX_CONFIG = {
    "cluster": {
        "scheduler": ["job-scheduler-0:9091"],
        "server": ["job-server-0:9091", "job-server-1:9091"],
        "worker": ["job-worker-0:9091", "job-worker-1:9091", "job-worker-2:9091"],
    },
    "task": {"type": "worker", "index": 2},
}


def mx_env(config=None, **extra) -> dict:
    env = {"KVSTORE_SECRET": "s" * 32, "MX_CONFIG": json.dumps(config or MX_CONFIG)}
    return {**env, **extra}


def test_mx_config_fills_every_missing_dmlc_variable():
    cfg = Config.from_env(mx_env())
    assert (cfg.role, cfg.root_uri, cfg.root_port) == ("worker", "job-scheduler-0", 9091)
    assert (cfg.num_server, cfg.num_worker, cfg.rank_hint) == (2, 3, 2)
    server = dict(MX_CONFIG, task={"type": "server", "index": 1})
    assert Config.from_env(mx_env(server)).role == "server"
    assert Config.from_env(mx_env(server)).rank_hint == 1


def test_dmlc_variables_win_over_mx_config():
    cfg = Config.from_env(
        mx_env(DMLC_PS_ROOT_URI="10.0.0.5", DMLC_PS_ROOT_PORT="7000", DMLC_NUM_WORKER="4")
    )
    assert (cfg.root_uri, cfg.root_port, cfg.num_worker, cfg.num_server) == ("10.0.0.5", 7000, 4, 2)


def test_rank_hint_order():
    assert Config.from_env(mx_env(DMLC_WORKER_ID="1")).rank_hint == 1
    assert Config.from_env(mx_env(DMLC_WORKER_ID="1", KVSTORE_RANK="0")).rank_hint == 0
    server = dict(MX_CONFIG, task={"type": "server", "index": 0})
    assert Config.from_env(mx_env(server, DMLC_WORKER_ID="1")).rank_hint == 0  # workers' only
    plain = {
        "KVSTORE_SECRET": "s" * 32,
        "DMLC_ROLE": "worker",
        "DMLC_PS_ROOT_URI": "127.0.0.1",
        "DMLC_PS_ROOT_PORT": "9000",
        "DMLC_NUM_SERVER": "1",
        "DMLC_NUM_WORKER": "2",
    }
    assert Config.from_env(plain).rank_hint == -1
    assert Config.from_env(dict(plain, DMLC_WORKER_ID="1")).rank_hint == 1


@pytest.mark.parametrize(
    "raw, match",
    [
        ("{not json", "MX_CONFIG is not valid JSON"),
        ('{"cluster": {}, "task": {"type": "chief"}}', "expected Kubeflow MXJob's JSON"),
        (json.dumps(dict(MX_CONFIG, cluster={"scheduler": ["nohostport"]})), "'host:port'"),
        (json.dumps(dict(MX_CONFIG, task={"type": "worker", "index": "x"})), "task.index"),
    ],
)
def test_bad_mx_config_is_a_configuration_error(raw, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_env({"KVSTORE_SECRET": "s" * 32, "MX_CONFIG": raw})


def test_node_host_when_the_scheduler_does_not_resolve_yet():
    host = _node_host({}, "kvstore-nowhere.invalid")
    assert host != "127.0.0.1" or not _has_route(), host
    assert _node_host({"DMLC_NODE_HOST": "10.1.2.3"}, "x.invalid") == "10.1.2.3"
    assert _node_host({}, "127.0.0.1") == "127.0.0.1"  # a local job stays on loopback


def _has_route() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
        return True
    except OSError:
        return False


def test_listen_on_every_interface_for_a_name():
    assert bind_host("job-scheduler-0") == "*"  # may not resolve yet
    assert bind_host("203.0.113.9") == "*"  # not this machine's (a NAT's)
    assert bind_host("127.0.0.1") == "127.0.0.1" and bind_host("localhost") == "127.0.0.1"
