"""Same-host fast path: big key parts pass between a worker and a server through shared
memory; ZeroMQ carries only the small control message.

"Same host" is proved, not guessed: at start-up a worker makes a small probe segment holding a
random nonce and names it in its ``hello``; a server answers ``shm: true`` only if it opened
that very file and read that nonce (:func:`prove`). Containers and pods on one node share the
kernel's boot id but not ``/dev/shm``; they fail the probe and use TCP.

A worker makes one segment per big key part it pushes to such a server. The segment holds a
header of two counters, then the push region (the worker writes its gradient there), then
the pull region (the server writes the value it answers with there)::

    [written: u64][consumed: u64][pad to 64 B][push: nbytes][pull: nbytes]

- push: the worker copies the gradient in, bumps ``written`` and sends the push with an empty
  array (of the key's dtype) and ``{"shm": [[index, name, written]]}``; the server checks the
  counter and the dtype and sums straight from the region (a read-only view, never kept past
  the round: a lone push is copied before it becomes the stored value). The worker writes
  the push region again only once the server has answered that push, i.e. after its round
  was applied (a ZeroMQ message, so the server's reads happen before the worker's next write
  on any CPU, weakly ordered ones included); a push of a part whose previous push is still
  unanswered goes through TCP instead. (``dist_ssp`` answers a push before its round
  completes: the server copies such a push out of the segment on arrival.) (The
  ``consumed`` slot is unused.)
- pull: the server copies the stored value into the pull region before it answers with an
  empty array and ``{"shm": [index, ...]}``; the worker reads it on receipt, and has one
  pulling request per key in flight, so the region is never written while it reads.

A row-sparse key's rows use one segment per key and server the same way; its push entry
adds the segment's size (``[index, name, written, nbytes]``: the rows pushed vary), the rows
fill the front of the push region, and a reply's rows the front of the pull region
(``shm: [[index, rows]]``). A push bigger than the segment makes a new one, a quarter
bigger; the server closes the key's old one when the new name arrives.

Segments are allocated in full when made (``posix_fallocate``): a ``/dev/shm`` too small for
one (Docker's default is 64 MB) is an ``OSError`` then, and that part goes through TCP,
instead of a SIGBUS at the first write into a sparse file.

The file in ``/dev/shm`` is created with mode 0600 and removed by the worker as soon as the
server has mapped it (its first answer), so nothing is left behind even if a process dies;
the mappings live on until both close them.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

import numpy as np

HEADER = 64
SHM_DIR = "/dev/shm"
_NAME = re.compile(r"kvs-[0-9a-f]{16}-w(\d+)-\d+")


def host_id() -> str:
    """This boot's id: two processes with different ids certainly share no memory (equal ids
    prove nothing: containers on one node share it), so a server tries the probe only then."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def available() -> bool:
    return os.path.isdir(SHM_DIR)


class Segment:
    """One key part's push and pull regions, shared by a worker and a server."""

    def __init__(self, name: str, nbytes: int, create: bool):
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            size = HEADER + 2 * nbytes
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)  # all pages now, or ENOSPC now
                except OSError:
                    os.unlink(path)
                    raise
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"shared segment {name}: wrong size, expected {size} bytes")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name, self.nbytes, self.path = name, nbytes, path
        self.counters = np.ndarray((2,), np.uint64, self._map, 0)
        self.push = np.ndarray((nbytes,), np.uint8, self._map, HEADER)
        self.pull = np.ndarray((nbytes,), np.uint8, self._map, HEADER + nbytes)
        self.linked = True  # a server that opened it removes the name too, if still there

    def unlink(self) -> None:
        """Remove the name (the mappings stay): once both sides have it mapped."""
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        self.counters = self.push = self.pull = None
        try:
            self._map.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass


class WorkerSegments:
    """A worker's segments, by (server, key, part)."""

    def __init__(self, rank: int):
        self.prefix = f"kvs-{secrets.token_hex(8)}-w{rank}"
        self.segments: dict = {}
        self._count = 0

    def get(self, where: tuple, nbytes: int) -> Segment:
        segment = self.segments.get(where)
        if segment is None:
            self._count += 1
            segment = Segment(f"{self.prefix}-{self._count}", nbytes, create=True)
            self.segments[where] = segment
        return segment

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()


PROBE_BYTES = 64


def make_probe(segments: WorkerSegments) -> tuple[Segment, str]:
    """A small segment holding a random nonce, for :func:`prove`; ``(segment, nonce hex)``."""
    nonce = secrets.token_bytes(16)
    segment = segments.get((None, "probe"), PROBE_BYTES)  # no key is None
    segment.push[: len(nonce)] = np.frombuffer(nonce, np.uint8)
    return segment, nonce.hex()


def prove(name: str, rank: int, nonce: str) -> bool:
    """Whether this process sees worker ``rank``'s probe segment ``name`` holding ``nonce``:
    then it shares that worker's memory. Any failure is a plain no."""
    try:
        segment = open_for(name, rank, PROBE_BYTES)
    except (OSError, ValueError):
        return False
    try:
        seen = bytes(segment.push[:16]).hex()
    finally:
        segment.linked = False  # the worker removes its own probe
        segment.close()
    return isinstance(nonce, str) and seen == nonce


def open_for(name: str, rank: int, nbytes: int) -> Segment:
    """A server opens a worker's segment: only one of that worker's names, of the right size."""
    match = _NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None or int(match[1]) != rank:
        raise ValueError(f"shared segment name {name!r:.80} is not worker {rank}'s")
    return Segment(name, nbytes, create=False)
