"""Same-host channel: a worker's messages to a server on its own host, and the replies, over
one Unix ``SOCK_SEQPACKET`` connection instead of ZeroMQ over TCP.

Why: with 4 processes on 2 cores, a ZeroMQ message wakes 3 threads (the sender's I/O
thread, the receiver's, then the receiver), and a round trip 6; the channel wakes only the
reader. The arrays of a same-host part are in shared segments already (:mod:`kvstore.shm`),
so the channel carries the small messages that name them: what ZeroMQ cost was the wake-ups.

Setting up, after a worker's ``hello`` proved that the server shares its memory
(:func:`kvstore.shm.prove`): the server's reply names its listening address (abstract, so
nothing is left in the file system) and a one-time secret. The secret is good only once this
connection has proved its token too (``auth``, :mod:`kvstore.auth`), or at once in an
encrypted or insecure job. The worker connects, sends ``[rank, secret]`` and waits for the
server's ``ok``; from then on every message of the worker to that server, and back, goes by
the channel. Any failure on the way (another network namespace, no room) leaves the worker on
ZeroMQ, as before: the channel is a shortcut, never a requirement.

Messages keep ZeroMQ's frames (:func:`kvstore.protocol.encode_frames`). A message is a
header ``<frame bytes, frame count, frame sizes...>`` (64-bit, 32-bit, 64-bit each,
little-endian) and the frames' bytes back to back, cut into datagrams of at most
:data:`CHUNK` bytes (the kernel caps a datagram near the socket's send buffer).
:func:`datagrams` and :class:`Assembler` do that without I/O.

A reader that stops reading is flow control, as with ZeroMQ's queues: a send never waits;
what does not fit is copied and queued, and written when the socket is writable (each side's
poll loop). A server's queue to one worker is bounded (64 MiB, 10,000 datagrams): beyond it the
replies are dropped, as a full ZeroMQ queue drops them (a message is always taken when none
waits before it). A worker's is not: it holds the worker's own calls, which wait for their
replies. The end of a
connection (a peer that died or closed) is read as an empty datagram; the scheduler still
decides what a lost peer means.
"""

from __future__ import annotations

import collections
import os
import secrets
import socket
import struct

import msgpack

CHUNK = 1 << 16  # bytes per datagram
MAX_FRAMES = 1 << 20  # frames in one message, at most (far more than any has)
# a server's queue to one worker, beyond which its replies drop: bytes, datagrams
QUEUE_BYTES, QUEUE_DATAGRAMS = 1 << 26, 10_000
_HEAD = struct.Struct("<QI")


def datagrams(frames: list) -> list[list]:
    """A message's frames as datagrams: each a list of buffers of at most :data:`CHUNK`
    bytes in all (the frames are not copied: slices of them). The message is one stream,
    ``<total, count, sizes...>`` then the frames, cut every :data:`CHUNK` bytes."""
    views = [memoryview(f) for f in frames]
    views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
    if len(views) > MAX_FRAMES:
        raise ValueError(f"a message of {len(views)} frames: at most {MAX_FRAMES}")
    sizes = [v.nbytes for v in views]
    head = _HEAD.pack(sum(sizes), len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)
    out, current, room = [], [], CHUNK
    for view in (memoryview(head), *views):
        while view.nbytes:
            if not room:
                out.append(current)
                current, room = [], CHUNK
            piece, view = view[:room], view[room:]
            current.append(piece)
            room -= piece.nbytes
    out.append(current)
    return out


class Assembler:
    """Datagrams in, complete messages (lists of frame buffers) out."""

    def __init__(self, limit: int = 2**32):
        self.limit = limit  # bytes in one frame, at most (KVSTORE_MAX_MESSAGE)
        self._parts: list = []
        self._have = 0
        self._total = 0  # the message's bytes, its header's included
        self._count = 0

    def feed(self, data: bytes) -> list | None:
        """The message ``data`` completes (its frames), or None. A malformed datagram
        raises ``ValueError``."""
        if not self._parts:  # a message's first datagram: at least its fixed header
            if len(data) < _HEAD.size:
                raise ValueError(f"a channel datagram of {len(data)} bytes: no header")
            total, count = _HEAD.unpack_from(data)
            if count > MAX_FRAMES or total > self.limit * max(count, 1):
                raise ValueError(f"a channel message of {count} frames and {total} bytes")
            self._count, self._total = count, _HEAD.size + 8 * count + total
        self._parts.append(data)
        self._have += len(data)
        if self._have < self._total:
            return None
        count, total, have = self._count, self._total, self._have
        whole = data if len(self._parts) == 1 else b"".join(self._parts)
        self._parts, self._have = [], 0
        if have > total:
            raise ValueError(f"a channel message of {have} bytes, announced {total}")
        start = _HEAD.size + 8 * count
        sizes = struct.unpack_from(f"<{count}Q", whole, _HEAD.size)
        if sum(sizes) != total - start:
            raise ValueError("a channel header's frame sizes do not add up to its total")
        if sizes and max(sizes) > self.limit:
            raise ValueError(
                f"a channel frame of {max(sizes)} bytes: more than {self.limit} "
                "(KVSTORE_MAX_MESSAGE)"
            )
        frames, at, view = [], start, memoryview(whole)
        for size in sizes:
            frames.append(view[at : at + size])
            at += size
        return frames


class Channel:
    """One end of a connection: :meth:`send` a message's frames, :meth:`receive` messages."""

    def __init__(self, sock: socket.socket, limit: int = 2**32):
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.closed = False
        self._in = Assembler(limit)
        self._out: collections.deque = collections.deque()  # copied datagrams not yet written
        self._queued = 0
        self.rank = -1  # a server's: the worker it proved to be (-1: not yet)
        self.identity = b""

    @property
    def backlog(self) -> bool:
        """Datagrams queued to write when the socket is writable (:meth:`flush`)."""
        return bool(self._out)

    def send(self, frames: list, bounded: bool = True) -> bool:
        """Write a message without waiting; what does not fit now is copied and queued. False
        (nothing queued) when ``bounded`` and the queue would hold over :data:`QUEUE_BYTES`
        or holds :data:`QUEUE_DATAGRAMS` already (a server's replies to a worker that does
        not read them; a message is always taken when nothing waits before it).
        ``OSError`` when the peer is gone."""
        grams = datagrams(frames)
        i = 0
        if not self._out:
            try:
                while i < len(grams):
                    self.sock.sendmsg(grams[i])
                    i += 1
            except BlockingIOError:
                pass
        if i == len(grams):
            return True
        rest = [b"".join(g) for g in grams[i:]]
        size = sum(map(len, rest))
        if bounded and self._out:
            if self._queued + size > QUEUE_BYTES or len(self._out) >= QUEUE_DATAGRAMS:
                return False
        self._out.extend(rest)
        self._queued += size
        return True

    def flush(self) -> None:
        """Write queued datagrams while the socket takes them."""
        while self._out:
            try:
                self.sock.send(self._out[0])
            except BlockingIOError:
                return
            self._queued -= len(self._out.popleft())

    def receive(self, limit: int = 64) -> list:
        """The complete messages readable now (at most ``limit`` datagrams read). At the end
        of the connection :attr:`closed` is set. ``ValueError`` for a malformed datagram."""
        messages = []
        for _ in range(limit):
            try:
                data = self.sock.recv(CHUNK)
            except BlockingIOError:
                break
            except ConnectionResetError:
                data = b""
            if not data:
                self.closed = True
                break
            frames = self._in.feed(data)
            if frames is not None:
                messages.append(frames)
        return messages

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class Listener:
    """A server's listening socket: an abstract address (Linux), random, nothing on disk."""

    def __init__(self):
        self.address = f"\0kvs-channel-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.sock.bind(self.address)
            self.sock.listen(64)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()

    def accept(self, limit: int = 2**32) -> list[Channel]:
        channels = []
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return channels
            except OSError:  # (EMFILE and the like: that worker stays on ZeroMQ)
                return channels
            channels.append(Channel(conn, limit))

    def close(self) -> None:
        self.sock.close()


def wire_address(address: str) -> str:
    """The address as the hello reply names it (``@`` for the abstract namespace's NUL)."""
    return "@" + address[1:] if address.startswith("\0") else address


def connect(address: str, rank: int, secret: str, timeout: float) -> Channel:
    """A worker's end: connect to a server's channel and prove ``rank`` with the secret from
    its hello reply; the server's ``ok`` arrives within ``timeout`` seconds or ``OSError``
    (a ``TimeoutError``)."""
    if not isinstance(address, str) or not address.startswith("@kvs-channel-"):
        raise OSError(f"not a channel address: {address!r:.80}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(timeout)
        sock.connect("\0" + address[1:])
        sock.send(msgpack.packb([rank, secret]))
        answer = sock.recv(CHUNK)
        if answer != b"ok":
            raise OSError(f"the server refused the channel: {answer[:200]!r}")
    except BaseException:
        sock.close()
        raise
    return Channel(sock)


def parse_hello(data) -> tuple[int, str]:
    """A connection's first datagram: ``(rank, secret)``; ``ValueError`` if it is not one."""
    try:
        rank, secret = msgpack.unpackb(bytes(data))
    except Exception:
        raise ValueError("a channel's first datagram is not [rank, secret]") from None
    if type(rank) is not int or not isinstance(secret, str):
        raise ValueError("a channel's first datagram is not [rank, secret]")
    return rank, secret
