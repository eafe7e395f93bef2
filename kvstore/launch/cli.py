"""The ``launch.py`` command line (also ``kvstore-launch`` and ``python -m kvstore.launch``)."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import sys

from .. import timeline
from ..config import interface_address
from ..status import page_token
from . import kubernetes, local, mpi, sge, slurm, ssh, yarn
from .hostfile import discover, parse_hostfile
from .job import Proc, Supervisor
from .spec import ROLE_ENV, SECRETS, JobSpec

LAUNCHERS = {
    "local": local,
    "ssh": ssh,
    "mpi": mpi,
    "slurm": slurm,
    "sge": sge,
    "yarn": yarn,
    "kubernetes": kubernetes,
}
# Settings of the launcher's own environment that every process gets, wherever it runs.
_FORWARD_PREFIXES = ("KVSTORE_", "MXNET_KVSTORE_", "PS_VERBOSE")

EXAMPLES = """\
examples:
  launch.py -n 2 -s 2 --launcher local python examples/train_mlp.py --kv-store dist_sync
  launch.py -n 4 -s 2 --launcher ssh -H hosts --sync-dst-dir /tmp/job python train.py
  launch.py -n 4 --launcher mpi -H hosts python train.py --kv-store dist_sync
  launch.py -n 2 -s 1 --launcher kubernetes --image me/train:1 python train.py --kv-store dist_sync

hostfile lines: 'host', 'host:ssh_port', 'host slots=N'; '#' starts a comment.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start a kvstore job: the scheduler on this host, then the servers and "
        "the workers (your command) through the chosen launcher.",
        epilog=EXAMPLES,
    )
    p.add_argument(
        "-n",
        "--num-workers",
        type=_worker_count,
        required=True,
        help="number of worker processes (each runs your command); MIN:MAX for an elastic "
        "job (torchrun's and horovodrun's habit): MAX workers start, the job goes on while at "
        "least MIN are left, and a worker that fails is started again in its slot",
    )
    p.add_argument(
        "-s",
        "--num-servers",
        type=int,
        help="number of server processes (default: the number of workers; with --colocate, "
        "the number of hosts)",
    )
    p.add_argument(
        "--host-discovery-script",
        metavar="SCRIPT",
        help="an elastic job's hosts (horovodrun's option; needs -n MIN:MAX): a script that "
        "prints 'host' or 'host:slots' lines, run every 2s; workers are started over ssh on "
        "hosts that come, in free slots, and stopped on hosts that leave (a host whose "
        "workers fail three times in 60s gets none for 60s)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        metavar="R",
        help="keep every key part on R servers (KVSTORE_REPLICAS; default 1): with R=2 a "
        "server can die and training goes on, without losing an acknowledged update",
    )
    p.add_argument(
        "--colocate",
        action="store_true",
        help="one server on each host of the hostfile, beside that host's workers (BytePS's "
        "layout): each worker then sends only (H-1)/H of its bytes off its host, and the part "
        "for its own host's server goes through shared memory",
    )
    p.add_argument(
        "--launcher",
        "--cluster",  # dmlc-core's tracker name for it
        dest="launcher",
        choices=sorted(LAUNCHERS),
        help="how processes are started (default: local, or ssh when -H is given); "
        "kubernetes writes the job's manifests instead",
    )
    p.add_argument(
        "-H",
        "--hostfile",
        "--host-file",  # dmlc-core's tracker
        help="hosts to run on, one per line: host, host:port or host slots=N "
        "(ssh needs it; mpi, slurm use it when given); as in MXNet's launch.py, without "
        "--launcher, -H means --launcher ssh",
    )
    p.add_argument(
        "--sync-dst-dir",
        metavar="DIR",
        help="copy the working directory to DIR on every host first (ssh; rsync "
        "where present) and run there",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="pass an environment variable to every process (repeatable): NAME=VALUE, "
        "NAME:VALUE (MXNet's form), or NAME alone for this shell's value",
    )
    for role in ("server", "worker"):
        p.add_argument(
            f"--env-{role}",
            action="append",
            default=[],
            metavar="NAME:VALUE",
            help=f"set a variable for the {role} processes only (repeatable; MXNet's "
            "launch.py option): NAME:VALUE or NAME=VALUE, e.g. OMP_NUM_THREADS:3",
        )
    p.add_argument(
        "--p3",
        action="store_true",
        help="MXNet's P3 (priority-based ps-lite van): not supported, an error says so",
    )
    k8s = p.add_argument_group("kubernetes (--launcher kubernetes)")
    k8s.add_argument("--image", help="container image every pod runs (holds kvstore and your code)")
    k8s.add_argument(
        "--job-name", "--jobname", dest="job_name", default="kvstore", help="prefix of every name"
    )
    k8s.add_argument("--namespace", help="namespace of every object (default: kubectl's)")
    k8s.add_argument(
        "--python", default="python", help="python in the image, for the scheduler and servers"
    )
    k8s.add_argument(
        "--apply",
        action="store_true",
        help="kubectl apply the manifests (default: print them to stdout)",
    )
    p.add_argument(
        "--interface", help="network interface whose address nodes announce (sets DMLC_INTERFACE)"
    )
    p.add_argument(
        "--host-ip",
        help="address of this host as the others reach it (default: "
        "found from --interface or the route to the first host)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="port of the scheduler on this host (default: a free one)",
    )
    p.add_argument("--ssh-port", type=int, help="ssh port for hosts that name none")
    p.add_argument(
        "--ssh-option",
        action="append",
        default=[],
        metavar="OPT",
        help="extra ssh argument, e.g. --ssh-option=-i --ssh-option=KEY (repeatable)",
    )
    p.add_argument(
        "--timeout", type=float, help="stop the whole job after this many seconds (default: none)"
    )
    p.add_argument(
        "--finish-grace",
        type=_seconds,
        default=Supervisor.after_job_grace,
        metavar="SECONDS",
        help="an elastic job: once every worker in it has finished, how long a worker still "
        "running (started in a freed slot too late to join) gets to end by itself before it "
        f"is stopped; one that is still saving what it trained needs it (default: "
        f"{Supervisor.after_job_grace:g})",
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the worker command, e.g. python train.py --kv-store dist_sync",
    )
    return p


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _worker_count(text: str):
    """``N``, or ``MIN:MAX`` (an elastic job): an int, or (MIN, MAX)."""
    least, sep, most = text.partition(":")
    try:
        if not sep:
            return int(text)
        least, most = int(least), int(most)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= least <= most:
        raise argparse.ArgumentTypeError(f"MIN:MAX needs 1 <= MIN <= MAX, got {text!r}")
    return (least, most)


def make_spec(args, parser) -> JobSpec:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no worker command given (e.g. python train.py --kv-store dist_sync)")
    if command[0].startswith("-"):
        parser.error(f"unrecognized option {command[0]!r}")
    least = None
    args.num_workers_range = args.num_workers
    if isinstance(args.num_workers, tuple):
        least, args.num_workers = args.num_workers
    num_servers = args.num_workers if args.num_servers is None else args.num_servers
    if args.colocate and args.num_servers is None and args.hostfile:
        num_servers = len({h.name for h in parse_hostfile(args.hostfile)})
    if args.num_workers < 1 or num_servers < 1:
        parser.error("-n/--num-workers and -s/--num-servers must be >= 1")
    if not 0 <= args.port < 65536:
        parser.error(f"--port {args.port} is not a port number")
    launcher = args.launcher or ("ssh" if args.hostfile or args.host_discovery_script else "local")
    hosts = None
    if args.hostfile:
        hosts = parse_hostfile(args.hostfile)
    if args.host_discovery_script:
        if not isinstance(args.num_workers_range, tuple):
            raise ValueError("--host-discovery-script is for an elastic job: give -n MIN:MAX")
        if launcher != "ssh" or args.hostfile:
            raise ValueError("--host-discovery-script starts workers over ssh, without -H")
        hosts = discover(args.host_discovery_script)
        if not hosts:
            raise ValueError(f"{args.host_discovery_script} printed no host to start on")
    elif launcher == "ssh" and not args.hostfile:
        raise ValueError("the ssh launcher needs a hostfile: -H FILE with one host per line")
    env = {"DMLC_NUM_WORKER": str(args.num_workers), "DMLC_NUM_SERVER": str(num_servers)}
    env.update({k: v for k, v in os.environ.items() if k.startswith(_FORWARD_PREFIXES)})
    # Python block-buffers stdout into a pipe: without this, a worker's prints would reach
    # the user only when it exits. A value the user set (here or with --env) wins.
    env["PYTHONUNBUFFERED"] = os.environ.get("PYTHONUNBUFFERED", "1")
    if not env.get("KVSTORE_INSECURE") and not env.get("KVSTORE_SECRET_FILE"):
        # One secret per job: only the processes started here can join it (kvstore.auth).
        env.setdefault("KVSTORE_SECRET", secrets.token_hex(32))
    if args.interface:
        env["DMLC_INTERFACE"] = args.interface
    if least is not None:
        env["KVSTORE_MIN_WORKERS"] = str(least)
    if args.replicas is not None:
        if not 1 <= args.replicas <= num_servers:
            parser.error(f"--replicas {args.replicas}: expected 1 to the number of servers")
        env["KVSTORE_REPLICAS"] = str(args.replicas)
    for item in args.env:
        name, sep, value = _split_env(item)
        if not name.isidentifier():
            parser.error(f"--env {item!r}: expected NAME, NAME=VALUE or NAME:VALUE")
        if not sep:
            if name not in os.environ:
                raise ValueError(f"--env {name}: {name} is not set in this shell")
            value = os.environ[name]
        env[name] = value
    if args.p3:
        parser.error(
            "--p3: MXNet's P3 van (priority-based parameter slicing) is not supported; "
            "kvstore splits big arrays over every server and pipelines pushes by itself"
        )
    role_env = {}
    for role in ("server", "worker"):
        for item in getattr(args, f"env_{role}"):
            name, sep, value = _split_env(item)
            if not name.isidentifier() or not sep:
                parser.error(f"--env-{role} {item!r}: expected NAME:VALUE or NAME=VALUE")
            if name in SECRETS:
                parser.error(f"--env-{role} {name}: the job secret is the same for every process")
            role_env.setdefault(role, {})[name] = value
    if role_env:
        env[ROLE_ENV] = json.dumps(role_env)
    if launcher == "kubernetes":  # the scheduler is a pod: nothing of this host goes in
        env.update({"DMLC_PS_ROOT_URI": "", "DMLC_PS_ROOT_PORT": ""})
        return JobSpec(args.num_workers, num_servers, command, "", 0, hosts, env, launcher=launcher)
    root_uri = scheduler_host(args, launcher, hosts)
    port = args.port or free_port(root_uri)
    env.update({"DMLC_PS_ROOT_URI": root_uri, "DMLC_PS_ROOT_PORT": str(port)})
    return JobSpec(
        args.num_workers,
        num_servers,
        command,
        root_uri,
        port,
        hosts,
        env,
        ssh_port=args.ssh_port,
        ssh_options=args.ssh_option,
        sync_dst_dir=args.sync_dst_dir,
        launcher=launcher,
        colocate=args.colocate,
    )


def _split_env(item: str) -> tuple[str, str, str]:
    """``NAME=VALUE`` or MXNet's ``NAME:VALUE``, split at whichever comes first (a name holds
    neither), so ``A=x:y`` and ``PATH:/a:/b`` keep their values whole; ``NAME`` alone."""
    cut = min((i for i in (item.find("="), item.find(":")) if i >= 0), default=-1)
    if cut < 0:
        return item, "", ""
    return item[:cut], item[cut], item[cut + 1 :]


def scheduler_host(args, launcher, hosts) -> str:
    if args.host_ip:
        return args.host_ip
    if args.interface:
        return interface_address(args.interface)
    if launcher == "local" or not hosts:
        return "127.0.0.1"
    try:
        target = socket.gethostbyname(hosts[0].name)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # picks a route; sends nothing
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sup = Supervisor()
    sup.after_job_grace = args.finish_grace
    try:
        spec = make_spec(args, parser)
        sup.elastic = bool(int(spec.env.get("KVSTORE_MIN_WORKERS") or 0))
        sup.replicated = int(spec.env.get("KVSTORE_REPLICAS") or 1) > 1
        try:  # (a bad value is the processes' to refuse, saying so)
            interval = float(spec.env.get("KVSTORE_HEARTBEAT_INTERVAL") or 1.0)
        except ValueError:
            interval = 1.0
        sup.failure_window = min(Supervisor.failure_window, max(interval, 0.01))
        if args.launcher is None and spec.launcher == "ssh":
            sup.say(
                "-H given without --launcher: starting the processes through ssh "
                "(--launcher local runs them on this machine)"
            )
        backend = LAUNCHERS[spec.launcher]
        if spec.launcher == "kubernetes":
            objects = kubernetes.manifests(
                spec, args.image, args.job_name, args.namespace, args.python
            )
            text = kubernetes.to_yaml(objects)
            if not args.apply:
                sys.stdout.write(text)
                return 0
            return kubernetes.apply(text)
        if args.host_discovery_script:  # servers on the hosts found; workers as they come
            procs = [
                ssh.role_proc(spec, "server", i, spec.hosts[i % len(spec.hosts)])
                for i in range(spec.num_servers)
            ]
            script = args.host_discovery_script
            sup.discovery = (
                lambda: discover(script),
                lambda rank, host: ssh.role_proc(spec, "worker", rank, host),
                spec.num_workers,
            )
        else:
            procs = backend.processes(spec)
        if spec.launcher == "ssh" and spec.sync_dst_dir:
            ssh.sync_dir(spec, sup.say)
    except (ValueError, RuntimeError) as exc:
        print(f"launch.py: error: {exc}", file=sys.stderr)
        return 2
    scheduler_env = {
        **os.environ,
        **spec.env,
        "DMLC_ROLE": "scheduler",
        "DMLC_NODE_HOST": spec.root_uri,
        "KVSTORE_LAUNCHER_PIPE": "1",  # its stdin: EOF when this launcher is gone
    }
    status_url = status_page(scheduler_env)
    try:
        sup.start(
            Proc(
                "scheduler",
                [sys.executable, "-m", "kvstore.scheduler"],
                scheduler_env,
                role="scheduler",
            )
        )
        for proc in procs:
            sup.start(proc)
    except RuntimeError as exc:
        sup.say(str(exc))
        sup.stop()
        return 1
    sup.say(
        f"started the scheduler at {spec.root_uri}:{spec.port}, {spec.num_servers} "
        f"servers and {spec.num_workers} workers via {spec.launcher}"
    )
    if status_url:
        sup.say(f"status: {status_url}")
    exit_status = sup.wait(args.timeout)
    trace = spec.env.get("KVSTORE_TIMELINE", "")
    if trace:
        events, files = timeline.merge(trace)
        if files:
            sup.say(
                f"timeline: {trace} ({events} events from {files} workers; open it in "
                "ui.perfetto.dev or chrome://tracing)"
            )
        else:
            sup.say(f"timeline: no {trace}{timeline.SUFFIX}<rank> files here to merge")
    return exit_status


def status_page(env: dict) -> str:
    """Give the scheduler a free status port unless one is set; the page's URL, or ''."""
    port = env.get("KVSTORE_STATUS_PORT", "")
    if port == "0":
        return ""
    addr = env.get("KVSTORE_STATUS_ADDR", "") or "127.0.0.1"
    if not port or port == "-1":
        port = str(free_port("127.0.0.1" if addr in ("0.0.0.0", "::") else addr))
        env["KVSTORE_STATUS_PORT"] = port
    if addr in ("0.0.0.0", "::"):
        addr = socket.gethostname()
    host = f"[{addr}]" if ":" in addr else addr
    url = f"http://{host}:{port}/"
    if addr not in ("127.0.0.1", "localhost", "::1"):
        secret = env.get("KVSTORE_SECRET", "")
        if secret:  # the page's own token: it opens the page, never the job
            url += f" (from another host: add ?token={page_token(secret.encode())} once)"
        else:
            url += " (from another host: ?token=$(python -m kvstore status-token) once)"
    return url
