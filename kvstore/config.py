"""Every environment variable the runtime reads, read once and validated here.

ps-lite's names (``DMLC_*``, ``PS_VERBOSE``) keep existing launch scripts working; our own
settings use the ``KVSTORE_`` prefix. A bad value is a :class:`~kvstore.errors.ConfigError`
(a ``ValueError``; a process ending with it exits 2) naming the variable.

Kubeflow's MXJob gives every container ``MX_CONFIG`` (JSON: ``{"cluster": {"scheduler":
["host:port"], "server": [...], "worker": [...]}, "task": {"type": "worker", "index": 0}}``);
any ``DMLC_*`` variable missing is filled from it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import os
import socket
import struct
import sys
from dataclasses import dataclass, field

from .errors import ConfigError

ROLES = ("scheduler", "server", "worker")


@dataclass(frozen=True)
class Config:
    role: str
    root_uri: str
    root_port: int
    num_server: int
    num_worker: int
    node_host: str
    verbose: int = 0
    start_timeout: float = 60.0
    request_timeout: float = 600.0
    round_timeout: float = 0.0  # 0: a slow round is reported (stall_report), never failed
    reproducible: bool = True  # KVSTORE_REPRODUCIBLE=0: servers sum in arrival order
    replicas: int = 1  # KVSTORE_REPLICAS: copies of every dense key part, on distinct servers
    min_workers: int = 0  # KVSTORE_MIN_WORKERS: elastic (num_worker slots, at least this many)
    staleness: float = 1  # KVSTORE_STALENESS: dist_ssp's bound in rounds; inf: as dist_async
    stall_report: float = 60.0  # seconds between reports of a round that waits
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    bigarray_bound: int = 1_000_000
    piece_bytes: int = 4 << 20  # KVSTORE_PIECE_BYTES: big keys travel in pieces of about this
    server_port: int = 0
    rank_hint: int = -1
    # the job's secret; empty only with insecure. Out of the repr: a Config that reaches a log
    # or a traceback must not carry it
    secret: bytes = field(default=b"", repr=False)
    insecure: bool = False  # KVSTORE_INSECURE=1: no authentication, no encryption
    encrypt: bool = False  # KVSTORE_ENCRYPT=1: CURVE on the data connections too
    shm: bool = True  # KVSTORE_SHM=0: big parts go through TCP even to a server on this host
    # KVSTORE_CHANNEL=0: same-host messages go by ZeroMQ over TCP, not by a Unix socket
    channel: bool = True
    # KVSTORE_SCHED_BATCH=0: the roles keep the default CPU policy, not SCHED_BATCH (cpu.py)
    sched_batch: bool = True
    max_message: int = 2**32  # bytes in one frame a server accepts (ZMQ_MAXMSGSIZE)
    metrics: bool = True  # KVSTORE_METRICS=0: no counters in the heartbeats
    status_port: int = -1  # KVSTORE_STATUS_PORT: the status page's port; -1 any free one, 0 off
    status_addr: str = "127.0.0.1"  # KVSTORE_STATUS_ADDR: elsewhere only with the secret
    status_linger: float = 0.0  # KVSTORE_STATUS_LINGER: seconds the page stays after a failure
    timeline: str = ""  # KVSTORE_TIMELINE: each worker writes <path>.worker<rank> (trace events)

    @property
    def scheduler_address(self) -> str:
        return f"tcp://{self.root_uri}:{self.root_port}"

    @classmethod
    def from_env(cls, env=None) -> Config:
        env = os.environ if env is None else env
        env = with_mx_config(env)
        role = env.get("DMLC_ROLE", "")
        if role not in ROLES:
            raise ConfigError(
                f"DMLC_ROLE must be one of {ROLES}, got {role!r}: start distributed "
                "jobs with launch.py, or set DMLC_ROLE and the DMLC_* variables"
            )
        root_uri = _require(env, "DMLC_PS_ROOT_URI")
        interval = _number(env, "KVSTORE_HEARTBEAT_INTERVAL", 1.0, float, low=0.01)
        cfg = cls(
            role=role,
            root_uri=root_uri,
            root_port=_number(env, "DMLC_PS_ROOT_PORT", None, int, low=1, high=65535),
            num_server=_number(env, "DMLC_NUM_SERVER", None, int, low=1),
            num_worker=_number(env, "DMLC_NUM_WORKER", None, int, low=1),
            node_host=_node_host(env, root_uri),
            verbose=_number(env, "PS_VERBOSE", 0, int, low=0, high=2),
            start_timeout=_number(env, "KVSTORE_START_TIMEOUT", 60.0, float, low=0.1),
            request_timeout=_number(env, "KVSTORE_TIMEOUT", 600.0, float, low=0.1),
            round_timeout=_number(env, "KVSTORE_ROUND_TIMEOUT", 0.0, float, low=0.0),
            reproducible=_flag(env, "KVSTORE_REPRODUCIBLE", default=True),
            replicas=_number(env, "KVSTORE_REPLICAS", 1, int, low=1),
            min_workers=_number(env, "KVSTORE_MIN_WORKERS", 0, int, low=0),
            staleness=staleness_of(env.get("KVSTORE_STALENESS"), "KVSTORE_STALENESS"),
            stall_report=_number(env, "KVSTORE_STALL_REPORT", 60.0, float, low=0.0),
            heartbeat_interval=interval,
            heartbeat_timeout=_number(
                env, "KVSTORE_HEARTBEAT_TIMEOUT", 5 * interval, float, low=2 * interval
            ),
            bigarray_bound=_number(
                env,
                "KVSTORE_BIGARRAY_BOUND",
                env.get("MXNET_KVSTORE_BIGARRAY_BOUND", 1_000_000),
                int,
                low=1,
            ),
            piece_bytes=_number(env, "KVSTORE_PIECE_BYTES", 4 << 20, int, low=0),
            server_port=_number(env, "KVSTORE_SERVER_PORT", 0, int, low=0, high=65535),
            rank_hint=_rank_hint(env, role),
            secret=_secret(env),
            insecure=_flag(env, "KVSTORE_INSECURE"),
            encrypt=_flag(env, "KVSTORE_ENCRYPT"),
            shm=_flag(env, "KVSTORE_SHM", default=True),
            channel=_flag(env, "KVSTORE_CHANNEL", default=True),
            sched_batch=sched_batch_of(env),
            max_message=_number(env, "KVSTORE_MAX_MESSAGE", 2**32, int, low=1024),
            metrics=_flag(env, "KVSTORE_METRICS", default=True),
            status_port=_number(env, "KVSTORE_STATUS_PORT", -1, int, low=-1, high=65535),
            status_addr=env.get("KVSTORE_STATUS_ADDR", "") or "127.0.0.1",
            status_linger=_number(env, "KVSTORE_STATUS_LINGER", 0.0, float, low=0.0),
            timeline=env.get("KVSTORE_TIMELINE", ""),
        )
        if not cfg.secret and not cfg.insecure:
            raise ConfigError(
                "no job secret: every process of a job needs the same KVSTORE_SECRET (or "
                "KVSTORE_SECRET_FILE, a file only its owner can read). launch.py makes one; "
                "by hand: export KVSTORE_SECRET=$(python -c 'import secrets; "
                "print(secrets.token_hex(32))'). KVSTORE_INSECURE=1 runs without "
                "authentication (anyone who reaches a port can join the job)"
            )
        if cfg.min_workers > cfg.num_worker:
            raise ConfigError(
                f"KVSTORE_MIN_WORKERS={cfg.min_workers} is more than the {cfg.num_worker} worker "
                "slots (DMLC_NUM_WORKER): launch.py -n MIN:MAX sets both"
            )
        if cfg.replicas > 2:
            raise ConfigError(
                f"KVSTORE_REPLICAS={cfg.replicas}: at most 2 for now (a backup that missed the "
                "last forward of a dead primary is not yet brought back in step)"
            )
        if cfg.replicas > cfg.num_server:
            raise ConfigError(
                f"KVSTORE_REPLICAS={cfg.replicas} needs at least that many servers; the job has "
                f"{cfg.num_server} (DMLC_NUM_SERVER): start more servers or lower it"
            )
        if cfg.insecure and cfg.encrypt:
            raise ConfigError("KVSTORE_ENCRYPT=1 needs authentication: unset KVSTORE_INSECURE")
        return cfg


def with_mx_config(env) -> dict:
    """``env`` with every ``DMLC_*`` variable it lacks filled from Kubeflow MXJob's
    ``MX_CONFIG``: the role from ``task.type``, the scheduler's host and port from
    ``cluster.scheduler[0]``, the counts from the lengths of ``cluster.server`` and
    ``cluster.worker``. Variables already set win.

    >>> with_mx_config({"MX_CONFIG": '{"cluster": {"scheduler": ["s-0:9091"], '
    ...     '"server": ["a:1"], "worker": ["b:1", "c:1"]}, "task": {"type": "worker", '
    ...     '"index": 1}}'})["DMLC_NUM_WORKER"]
    '2'
    """
    raw = env.get("MX_CONFIG", "")
    if not raw:
        return env
    config = _mx_config(raw)
    cluster, task = config["cluster"], config["task"]
    found = {"DMLC_ROLE": str(task["type"])}
    if cluster.get("scheduler"):
        host, _, port = str(cluster["scheduler"][0]).rpartition(":")
        if not host or not port:
            raise ConfigError(
                f"MX_CONFIG: cluster.scheduler[0]={cluster['scheduler'][0]!r}: expected 'host:port'"
            )
        found.update({"DMLC_PS_ROOT_URI": host.strip("[]"), "DMLC_PS_ROOT_PORT": port})
    for role, name in (("server", "DMLC_NUM_SERVER"), ("worker", "DMLC_NUM_WORKER")):
        if role in cluster:
            found[name] = str(len(cluster[role]))
    merged = dict(env)
    for name, value in found.items():
        if not merged.get(name):
            merged[name] = value
    return merged


def _mx_config(raw: str) -> dict:
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"MX_CONFIG is not valid JSON: {exc}") from None
    ok = (
        isinstance(config, dict)
        and isinstance(config.get("cluster"), dict)
        and isinstance(config.get("task"), dict)
        and all(isinstance(v, list) for v in config["cluster"].values())
        and config["task"].get("type") in ROLES
    )
    if not ok:
        raise ConfigError(
            'MX_CONFIG: expected Kubeflow MXJob\'s JSON, {"cluster": {"scheduler": '
            '["host:port"], "server": [...], "worker": [...]}, "task": '
            f'{{"type": one of {ROLES}, "index": 0}}}}; got {raw[:200]!r}'
        )
    return config


def _rank_hint(env, role: str) -> int:
    """KVSTORE_RANK, else DMLC_WORKER_ID (a worker's), else MX_CONFIG's task.index; -1: none."""
    if env.get("KVSTORE_RANK", "") != "":
        return _number(env, "KVSTORE_RANK", -1, int, low=-1)
    if role == "worker" and env.get("DMLC_WORKER_ID", "") != "":
        return _number(env, "DMLC_WORKER_ID", -1, int, low=0)
    if env.get("MX_CONFIG"):
        index = _mx_config(env["MX_CONFIG"])["task"].get("index", -1)
        if not isinstance(index, int) or isinstance(index, bool) or index < -1:
            raise ConfigError(f"MX_CONFIG: task.index={index!r} is not a rank (an int >= 0)")
        return index
    return -1


def _flag(env, name: str, default: bool = False) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name}={env[name]!r}: expected 1 or 0")


def sched_batch_of(env) -> bool:
    """``KVSTORE_SCHED_BATCH`` (default on): whether a role runs under ``SCHED_BATCH``
    (kvstore/cpu.py); also read by the benchmarks' bare processes, which have no Config."""
    return _flag(env, "KVSTORE_SCHED_BATCH", default=True)


def _secret(env) -> bytes:
    """The job secret: KVSTORE_SECRET, else the contents of KVSTORE_SECRET_FILE."""
    value = env.get("KVSTORE_SECRET", "")
    path = env.get("KVSTORE_SECRET_FILE", "")
    if not value and path:
        try:
            mode = os.stat(path).st_mode
            if mode & 0o077:
                raise ConfigError(
                    f"KVSTORE_SECRET_FILE={path!r} can be read by other users "
                    f"(mode {mode & 0o777:o}): chmod 600 it"
                )
            with open(path) as f:
                value = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"KVSTORE_SECRET_FILE={path!r}: {exc.strerror}") from None
    if value and len(value) < 16:
        raise ConfigError("KVSTORE_SECRET is too short: use at least 16 characters (32 hex bytes)")
    return value.encode()


def _require(env, name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise ConfigError(f"{name} is not set: the launcher sets it (see launch.py -h)")
    return value


def staleness_of(raw, where: str) -> float:
    """``dist_ssp``'s bound: a count of rounds (an int >= 0), or ``inf`` for no bound (the
    store then behaves as ``dist_async``). Unset: 1."""
    if raw is None or raw == "":
        return 1
    if isinstance(raw, str) and raw.strip().lower() in ("inf", "infinite", "infinity"):
        return float("inf")
    if isinstance(raw, float) and raw == float("inf"):
        return raw
    try:
        value = -1 if isinstance(raw, bool) else int(raw)
    except (TypeError, ValueError, OverflowError):
        value = -1
    if value < 0 or value >= 2**31 or (isinstance(raw, float) and raw != value):
        raise ConfigError(
            f"{where}={raw!r}: expected a number of rounds (an int >= 0) or 'inf' "
            "(no bound: dist_async)"
        )
    return value


def _number(env, name, default, kind, low=None, high=None):
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"{name} is not set: the launcher sets it (see launch.py -h)")
        raw = default
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
    if (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(f"{name}={raw!r} is out of range [{low}, {high}]")
    return value


def _node_host(env, root_uri: str) -> str:
    """The address this node announces: DMLC_NODE_HOST, else DMLC_INTERFACE's, else the
    address this machine uses to reach the scheduler. When the scheduler's name does not
    resolve yet (a Kubernetes headless service's record appears only once its pod is ready),
    this machine's own address (a pod's hostname resolves to its IP), never 127.0.0.1."""
    if env.get("DMLC_NODE_HOST"):
        return env["DMLC_NODE_HOST"]
    if env.get("DMLC_INTERFACE"):
        return interface_address(env["DMLC_INTERFACE"])
    routed = _route_source(root_uri)
    if routed:
        return routed
    try:
        own = socket.gethostbyname(socket.gethostname())
    except OSError:
        own = ""
    if own and not own.startswith("127."):
        return own
    # the hostname maps to loopback (a container's /etc/hosts): the default route's address
    routed = _route_source("192.0.2.1")  # TEST-NET-1: only the route is looked up
    if routed or own:
        return routed or own
    raise ConfigError(
        f"DMLC_PS_ROOT_URI={root_uri!r} does not resolve yet and this host's name "
        f"{socket.gethostname()!r} does not either: set DMLC_NODE_HOST (the address "
        "the other nodes reach this one at) or DMLC_INTERFACE"
    )


def _route_source(host: str) -> str:
    """The local address of the route to ``host``, or "" (a name that does not resolve)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # UDP connect sends nothing; it only picks a route
            return probe.getsockname()[0]
    except OSError:
        return ""


def is_local_address(host: str) -> bool:
    """Whether ``host`` is an IP literal of this machine (one a socket can bind to)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return False  # a name
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False


def bind_host(host: str) -> str:
    """Where to listen for an address a node is reached at: that address when it is an IP
    literal of this machine (a job on one machine stays on loopback), else every interface
    (``*``): a DNS name may not resolve yet (Kubernetes), or resolve to an address of a NAT.
    """
    if host == "localhost":
        return "127.0.0.1"
    return host if is_local_address(host) else "*"


def interface_address(name: str) -> str:
    """IPv4 address of a network interface (Linux), or a ValueError naming DMLC_INTERFACE."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError as exc:
        raise ConfigError(
            f"DMLC_INTERFACE={name!r}: no IPv4 address on that interface "
            f"({exc.strerror}); see `ip addr` for the names"
        ) from None


def warn_if_insecure(cfg: Config, log: logging.Logger) -> None:
    if cfg.insecure:
        log.warning(
            "KVSTORE_INSECURE=1: no authentication and no encryption; any process that "
            "reaches this job's ports can join it, read and change its values"
        )


def setup_logging(verbose: int, prefix: str) -> None:
    """Make the ``kvstore`` logger's records visible in this process, without taking over.

    The library itself only adds a ``NullHandler`` (``kvstore/__init__.py``); this is called
    by the entry points (scheduler, server) and by ``kvstore.create`` in a worker. Records
    always propagate to the root logger, so a user's ``logging`` configuration sees them all.
    While the root logger has no handler (nobody configured logging), a fallback handler
    writes them to stderr with the node's role in every line; it goes quiet by itself as soon
    as the application configures logging, so no line is printed twice. The level is set only
    when ``PS_VERBOSE`` asks for more (1: INFO, 2: DEBUG); else the application's applies
    (WARNING by default).

    >>> setup_logging(0, "worker")  # doctest: +SKIP
    """
    logger = logging.getLogger("kvstore")
    logger.propagate = True
    if verbose:
        logger.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    if any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        return
    handler = _FallbackHandler()
    handler.setFormatter(logging.Formatter(f"[%(asctime)s {prefix}] %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)


class _FallbackHandler(logging.StreamHandler):
    """stderr, but only while the root logger has no handler of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the application configured logging: the record reaches it by propagation
        self.stream = sys.stderr  # looked up each time, as logging.lastResort does
        super().emit(record)
