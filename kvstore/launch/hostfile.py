"""Hostfiles and placement.

Accepted lines (comments after ``#`` and blank lines are ignored)::

    node1                 # a host
    node2:2222            # a host and its ssh port
    node3 slots=4         # Open MPI style: up to 4 processes here
    node4:2222 slots=2

Processes are placed round-robin over the hosts, each host taking up to its slots (one when
none is given) per pass; past the total, placement wraps around (oversubscription).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Host:
    name: str
    port: int | None = None
    slots: int = 1


def parse_hostfile(path: str) -> list[Host]:
    """The hosts of a hostfile, or a ValueError naming the file and line."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"hostfile {path!r}: {exc.strerror}") from None
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        name, port, slots = fields[0], None, 1
        if ":" in name and not name.startswith("["):
            name, _, port_text = name.rpartition(":")
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise ValueError(f"{path}:{number}: bad port in {raw.strip()!r}")
            port = int(port_text)
        for extra in fields[1:]:
            key, _, value = extra.partition("=")
            if key in ("slots", "max_slots", "max-slots") and value.isdigit() and int(value) > 0:
                slots = int(value) if key == "slots" else slots
            else:
                raise ValueError(
                    f"{path}:{number}: cannot read {extra!r} in {raw.strip()!r} "
                    "(expected 'host', 'host:port' or 'host slots=N')"
                )
        hosts.append(Host(name, port, slots))
    if not hosts:
        raise ValueError(f"hostfile {path!r} lists no hosts")
    return hosts


def discover(script: str, timeout: float = 10.0) -> list[Host]:
    """The hosts a ``--host-discovery-script`` prints now (horovodrun's format: one
    ``host`` or ``host:slots`` a line), or a ValueError that says what went wrong."""
    import subprocess

    try:
        done = subprocess.run(
            [script], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"host discovery script {script!r}: {exc}") from None
    if done.returncode:
        raise ValueError(
            f"host discovery script {script!r} exited with status {done.returncode}: "
            f"{done.stderr.strip()[-200:]}"
        )
    hosts = []
    for raw in done.stdout.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, slots = line.rpartition(":") if ":" in line else (line, "", "1")
        if not name or not slots.isdigit() or int(slots) < 1:
            raise ValueError(
                f"host discovery script {script!r} printed {raw.strip()!r}: expected "
                "'host' or 'host:slots'"
            )
        hosts.append(Host(name, None, int(slots)))
    return hosts


def place(hosts: list[Host], count: int) -> list[Host]:
    """The host of each of ``count`` processes, round-robin with slots respected."""
    order = []
    used = {h: 0 for h in hosts}
    while len(order) < sum(h.slots for h in hosts):
        for host in hosts:
            if used[host] < host.slots:
                used[host] += 1
                order.append(host)
    return [order[i % len(order)] for i in range(count)]
