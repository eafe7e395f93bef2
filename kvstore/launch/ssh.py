"""``--launcher ssh``: each process through ``ssh host 'cd DIR && env ... CMD'``.

ssh runs in BatchMode (no password prompts) and honours the user's ssh config; ``--ssh-port``
and ``--ssh-option`` are passed through. The remote command watches its stdin: when the
launcher stops (a failure elsewhere, Ctrl-C) it closes that pipe and the remote process is
terminated, so nothing is left running on the hosts.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

from .hostfile import Host, place
from .job import Proc
from .spec import SECRETS, JobSpec

# Run CMD in the background, stop it when ssh's stdin closes, exit with its status. (A
# background job's stdin is /dev/null unless redirected, hence the copy on fd 3.) A status
# 128 + N is signal N's, as a shell reports it: said in one line for a signal that is not a
# stop (SIGKILL, SIGSEGV; not SIGINT or SIGTERM, nor 129: kvstore's lost peer), instead of
# bash's job notice, which repeats the whole command with its settings.
_WATCH = (
    "exec 3<&0; ({cmd}) </dev/null & child=$!; "
    "(cat <&3 >/dev/null; kill -TERM $child 2>/dev/null) >/dev/null 2>&1 & "
    "wait $child 2>/dev/null; s=$?; "
    "if [ $s -gt 130 ] && [ $s -lt 160 ] && [ $s -ne 143 ]; then "
    'echo "killed by SIG$(kill -l $s) (status $s)" >&2; fi; '
    "exit $s"
)


def ssh_argv(spec: JobSpec, host: Host) -> list[str]:
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    port = host.port or spec.ssh_port
    if port:
        argv += ["-p", str(port)]
    return argv + list(spec.ssh_options) + [host.name]


def remote_command(spec: JobSpec, env: dict, argv: list[str]) -> str:
    """The remote shell command. The job secret is not in it (``ps`` on the host would show
    it): it arrives as the first line of ssh's stdin (see :func:`processes`)."""
    workdir = spec.sync_dst_dir or spec.cwd
    public = {k: v for k, v in env.items() if k not in SECRETS}
    exports = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(public.items()))
    cmd = f"cd {shlex.quote(workdir)} && exec env {exports} {shlex.join(argv)}"
    read = "".join(f"IFS= read -r {k} && export {k} && " for k in sorted(SECRETS & set(env)))
    return "bash -c " + shlex.quote(read + _WATCH.format(cmd=cmd))


def processes(spec: JobSpec) -> list[Proc]:
    hosts = place(spec.hosts, spec.num_procs)
    if spec.colocate:  # a server per host, the workers beside them
        distinct = list(dict.fromkeys(spec.hosts))
        servers = [distinct[i % len(distinct)] for i in range(spec.num_servers)]
        hosts = servers + place(spec.hosts, spec.num_workers)
    return [
        role_proc(spec, role, rank, host)
        for (role, rank), host in zip(spec.roles(), hosts, strict=True)
    ]


def role_proc(spec: JobSpec, role: str, rank: int, host) -> Proc:
    """The ssh process that runs ``role`` ``rank`` on ``host``."""
    env = {**spec.role_env(role, rank), "DMLC_NODE_HOST": host.name}
    argv = [*ssh_argv(spec, host), remote_command(spec, env, spec.role_command(role))]
    stdin = "".join(f"{env[k]}\n" for k in sorted(SECRETS & set(env))).encode()
    return Proc(f"{role} {rank}", argv, None, host.name, role=role, stdin=stdin)


def sync_dir(spec: JobSpec, say) -> None:
    """Copy the working directory to ``--sync-dst-dir`` on every host (rsync where present)."""
    for host in dict.fromkeys(spec.hosts):
        ssh = ssh_argv(spec, host)
        target = f"{host.name}:{spec.sync_dst_dir}/"
        if shutil.which("rsync"):
            argv = [
                "rsync",
                "-az",
                "--delete",
                "--exclude",
                ".git",
                "-e",
                shlex.join(ssh[:-1]),
                f"{spec.cwd}/",
                target,
            ]
        else:
            argv = [*ssh, f"mkdir -p {shlex.quote(spec.sync_dst_dir)}"]
            subprocess.run(argv, check=False, capture_output=True)
            argv = [
                "scp",
                "-rq",
                *ssh[1:-1],
                *(f"{spec.cwd}/{f}" for f in os.listdir(spec.cwd)),
                target,
            ]
            argv = [a if a != "-p" else "-P" for a in argv]
        say(f"syncing {spec.cwd} to {target}")
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"cannot sync to {host.name}: {done.stderr.strip()}")
