"""``kvstore`` / ``python -m kvstore``: the version, the cluster settings this shell holds, and
what each role is.

    kvstore --version          # kvstore-ps 0.1.0
    kvstore                    # version, dependencies, DMLC_*/KVSTORE_* found, the roles
    kvstore launch -n 2 ...    # the same as launch.py / kvstore-launch
    kvstore status-token       # the status page's token, from KVSTORE_SECRET(_FILE)
"""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__

DISTRIBUTION = "kvstore-ps"

ROLES = """\
roles (DMLC_ROLE), as in MXNet's ps-lite:
  scheduler  registers every node, assigns ranks, runs barriers and heartbeats
             (python -m kvstore.scheduler; launch.py starts it on its own host)
  server     holds a shard of every key, sums the workers' pushes, applies the optimizer
             (python -m kvstore.server)
  worker     your training script: kvstore.create('dist_sync') joins the job
A script started with DMLC_ROLE=server or scheduler runs that role inside
kvstore.create(...) and exits when the job ends, so one command can serve every role
(Kubernetes MXJob, hand-written launch scripts).
Start a whole job on this machine:  kvstore launch -n 2 -s 2 python train.py --kv-store dist_sync
"""

_SHOWN = (
    "DMLC_ROLE",
    "DMLC_PS_ROOT_URI",
    "DMLC_PS_ROOT_PORT",
    "DMLC_NUM_SERVER",
    "DMLC_NUM_WORKER",
    "DMLC_WORKER_ID",
    "DMLC_NODE_HOST",
    "DMLC_INTERFACE",
    "PS_VERBOSE",
    "MX_CONFIG",
)


def version_line() -> str:
    return f"{DISTRIBUTION} {__version__}"


def describe(env=None) -> str:
    """What ``kvstore`` prints: version, dependencies, the cluster settings and their check."""
    env = os.environ if env is None else env
    lines = [version_line(), f"  import kvstore: {os.path.dirname(os.path.abspath(__file__))}"]
    lines.append(f"  python {sys.version.split()[0]}")
    for module in ("numpy", "zmq", "msgpack", "cupy"):
        try:
            mod = __import__(module)
            lines.append(f"  {module} {getattr(mod, '__version__', '?')}")
        except ImportError:
            lines.append(
                f"  {module}: not installed" + (" (optional: GPUs)" if module == "cupy" else "")
            )
        except Exception as exc:  # a broken CuPy install says why, it does not stop the report
            lines.append(f"  {module}: cannot import ({exc})")
    from .rowsearch import FAST, STALE

    if FAST:
        lines.append("  row-sparse id search: C (kvstore._rowsearch)")
    elif STALE:
        lines.append(
            "  row-sparse id search: NumPy (slower: kvstore._rowsearch is another version's "
            "build: run `pip install -e .` again)"
        )
    else:
        lines.append(
            "  row-sparse id search: NumPy (slower: kvstore._rowsearch was not built, as pip "
            "found no C compiler or Python headers)"
        )
    lines.append("")
    found = {k: v for k, v in env.items() if k in _SHOWN or k.startswith("KVSTORE_")}
    if not found:
        lines.append("cluster settings: none in this environment (a local store needs none;")
        lines.append("  launch.py sets them for a distributed job)")
    else:
        lines.append("cluster settings found:")
        for name in sorted(found):
            value = (
                "<set, hidden>"
                if "SECRET" in name and name != "KVSTORE_SECRET_FILE"
                else found[name]
            )
            lines.append(f"  {name}={value}")
        if env.get("DMLC_ROLE"):
            from .config import Config

            try:
                cfg = Config.from_env(env)
                lines.append(
                    f"  -> valid: {cfg.role}, scheduler {cfg.root_uri}:{cfg.root_port}, "
                    f"{cfg.num_server} servers, {cfg.num_worker} workers"
                    + (", NO AUTHENTICATION" if cfg.insecure else ", authenticated")
                )
            except ValueError as exc:
                lines.append(f"  -> not a valid cluster configuration: {exc}")
    lines.append("")
    lines.append(ROLES)
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        from .launch.cli import main as launch_main

        return launch_main(argv[1:])
    if argv[:1] == ["status-token"]:
        return status_token()
    parser = argparse.ArgumentParser(
        prog="kvstore",
        description="kvstore: a parameter-server key-value store (MXNet's KVStore API). "
        "Without arguments: the version, the cluster settings found, and the roles. "
        "`kvstore launch ...` starts a job (see `kvstore launch -h`); `kvstore status-token` "
        "prints the status page's token.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    parser.parse_args(argv)
    print(describe())
    return 0


def status_token(env=None) -> int:
    """Print the status page's token (never the secret it is derived from)."""
    from .config import ConfigError, _secret
    from .status import page_token

    env = os.environ if env is None else env
    try:
        secret = _secret(env)
    except ConfigError as exc:
        print(f"kvstore status-token: {exc}", file=sys.stderr)
        return 2
    if not secret:
        print(
            "kvstore status-token: no job secret: set KVSTORE_SECRET or KVSTORE_SECRET_FILE "
            "as the job has it (the page of a KVSTORE_INSECURE job answers the loopback only)",
            file=sys.stderr,
        )
        return 2
    print(page_token(secret))
    return 0


if __name__ == "__main__":
    sys.exit(main())
