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
header ``<body bytes, frame count, frame sizes...>`` (64-bit, 32-bit, 64-bit each,
little-endian) and the frames, each part padded to 8 bytes, cut into datagrams of at most
:data:`CHUNK` bytes (the kernel caps a datagram near the socket's send buffer).
:func:`datagrams` and :class:`Assembler` do that without I/O.

A reader that stops reading is flow control, as with ZeroMQ's queues: a send never blocks;
what does not fit is copied and queued (a :class:`Queued`, a tracker a worker's push waits
for), and written when the socket is writable (by the server's poll loop; by a worker's
drain thread, which runs only while its queue is not empty). A queue holds 1000 messages at
most, ZeroMQ's high-water mark: beyond it a server drops its replies, and a worker's call
fails ("is it alive?"), as with a full ZeroMQ queue. The end of a connection (a peer that
died or closed) is read as an empty datagram; the scheduler still decides what a lost peer
means.
"""

from __future__ import annotations

import collections
import os
import secrets
import select
import socket
import struct
import threading

import msgpack

CHUNK = 1 << 16  # bytes per datagram
MAX_FRAMES = 1 << 20  # frames in one message, at most (far more than any has)
QUEUE_MESSAGES = 1000  # a server's queue to one worker, beyond which replies drop (ZMQ's HWM)
_HEAD = struct.Struct("<QI")
_ZEROS = bytes(8)


def _pad(n: int) -> int:
    return -n % 8


def datagrams(frames: list) -> list[list]:
    """A message's frames as datagrams: each a list of buffers of at most :data:`CHUNK`
    bytes in all (the frames are not copied: slices of them). The message is one stream:
    ``<body bytes, count, sizes...>``, then each frame, every part starting 8-byte aligned
    (the arrays in them keep the alignment separate ZeroMQ frames give), cut every
    :data:`CHUNK` bytes."""
    views = [memoryview(f) for f in frames]
    views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
    if len(views) > MAX_FRAMES:
        raise ValueError(f"a message of {len(views)} frames: at most {MAX_FRAMES}")
    sizes = [v.nbytes for v in views]
    body = sum(n + _pad(n) for n in sizes)
    head = _HEAD.pack(body, len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)
    parts = [memoryview(head + bytes(_pad(len(head))))]
    for view in views:
        parts.append(view)
        if _pad(view.nbytes):
            parts.append(memoryview(_ZEROS[: _pad(view.nbytes)]))
    out, current, room = [], [], CHUNK
    for view in parts:
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
        """The message ``data`` completes (its frames, each 8-byte aligned when ``data`` is),
        or None. A malformed datagram raises ``ValueError``."""
        if not self._parts:  # a message's first datagram: at least its fixed header
            if len(data) < _HEAD.size:
                raise ValueError(f"a channel datagram of {len(data)} bytes: no header")
            body, count = _HEAD.unpack_from(data)
            if count > MAX_FRAMES or body > (self.limit + 8) * max(count, 1):
                raise ValueError(f"a channel message of {count} frames and {body} bytes")
            head = _HEAD.size + 8 * count
            self._count, self._total = count, head + _pad(head) + body
        self._parts.append(data)
        self._have += len(data)
        if self._have < self._total:
            return None
        count, total, have = self._count, self._total, self._have
        whole = data if len(self._parts) == 1 else b"".join(self._parts)
        self._parts, self._have = [], 0
        if have > total:
            raise ValueError(f"a channel message of {have} bytes, announced {total}")
        sizes = struct.unpack_from(f"<{count}Q", whole, _HEAD.size)
        at = _HEAD.size + 8 * count
        at += _pad(at)
        if sum(n + _pad(n) for n in sizes) != total - at:
            raise ValueError("a channel header's frame sizes do not add up to its total")
        if sizes and max(sizes) > self.limit:
            raise ValueError(
                f"a channel frame of {max(sizes)} bytes: more than {self.limit} "
                "(KVSTORE_MAX_MESSAGE)"
            )
        frames, view = [], memoryview(whole)
        for size in sizes:
            frames.append(view[at : at + size])
            at += size + _pad(size)
        return frames


class Queued:
    """A message left in a channel's queue, as a ZeroMQ tracker: :attr:`done` once written
    (or the channel closed or broke: then it is lost, as with a dead ZeroMQ peer). A
    worker's push waits for it, so a reader that stops reading slows the writer down and
    the writer's wait loop hears the scheduler meanwhile, as a zero-copy ZeroMQ send's."""

    __slots__ = ("_chan", "_seq")

    def __init__(self, chan: Channel, seq: int):
        self._chan, self._seq = chan, seq

    @property
    def done(self) -> bool:
        chan = self._chan
        return chan.written >= self._seq or chan.closed or bool(chan.broken)

    def wait(self, timeout: float) -> None:
        """Until done or ``timeout`` seconds (no error either way)."""
        with self._chan.progress:
            self._chan.progress.wait_for(lambda: self.done, timeout)


class Channel:
    """One end of a connection: :meth:`send` a message's frames, :meth:`receive` messages.

    What the socket does not take at once is copied and queued; a server writes the queue
    from its poll loop (:meth:`flush` when writable), a worker (``background``) from a
    thread that starts when the queue does, so that its messages go out while its caller
    does something else, as ZeroMQ's I/O thread sends."""

    def __init__(self, sock: socket.socket, limit: int = 2**32, background: bool = False):
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.closed = False
        self.background = background
        self._in = Assembler(limit)
        self._lock = threading.Lock()  # the queue, between a worker and its drain thread
        self._out: collections.deque = collections.deque()  # (datagram copy, ends a message)
        self._messages = 0  # messages with a datagram in the queue
        self.queued = self.written = 0  # messages ever queued, and of those written
        self.progress = threading.Condition(self._lock)  # notified as the queue drains
        self._draining = False
        self.broken = ""  # why the drain thread could not write (the peer is gone)
        self.rank = -1  # a server's: the worker it proved to be (-1: not yet)
        self.identity = b""
        self.epoch = 0  # a server's: the membership epoch it was proved in

    @property
    def backlog(self) -> bool:
        """Datagrams queued to write when the socket is writable (:meth:`flush`)."""
        return bool(self._out)

    def send(self, frames: list) -> bool | Queued:
        """Write a message without waiting: True, or what does not fit now is copied and
        queued (a :class:`Queued`, done once written). False (nothing queued) when
        :data:`QUEUE_MESSAGES` wait already (ZeroMQ's high-water mark: a reader that does not
        read, or a frozen one). ``OSError`` when the peer is gone (found by this write or by
        the drain thread's)."""
        grams = datagrams(frames)
        with self._lock:
            if self.broken:
                raise BrokenPipeError(self.broken)
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
            if self._messages >= QUEUE_MESSAGES:
                return False
            last = len(grams) - 1
            self._out.extend((b"".join(grams[k]), k == last) for k in range(i, len(grams)))
            self._messages += 1
            self.queued += 1
            if self.background and not self._draining:
                self._draining = True
                threading.Thread(target=self._drain, name="kvstore-channel", daemon=True).start()
            return Queued(self, self.queued)

    def flush(self) -> None:
        """Write queued datagrams while the socket takes them."""
        with self._lock:
            while self._out:
                data, last = self._out[0]
                try:
                    self.sock.send(data)
                except BlockingIOError:
                    return
                self._written(last)

    def _written(self, last: bool) -> None:
        self._out.popleft()
        if last:
            self._messages -= 1
            self.written += 1
            self.progress.notify_all()

    def _drain(self) -> None:
        """A worker's queue, written as the socket takes it (a thread; ends when it is
        empty or the channel closed: the main thread learns of a lost peer by reading)."""
        while True:
            with self._lock:
                if not self._out or self.closed:
                    self._draining = False
                    self.progress.notify_all()
                    return
                data, last = self._out[0]
            try:
                select.select([], [self.sock], [], 1.0)
                self.sock.send(data)
            except BlockingIOError:
                continue
            except (OSError, ValueError) as exc:  # closed, or the peer is gone
                with self._lock:
                    self._draining = False
                    if not self.closed:  # the next send raises it
                        self.broken = str(exc) or type(exc).__name__
                    self.progress.notify_all()
                return
            with self._lock:
                self._written(last)

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

    def accept(self, limit: int = 2**32) -> tuple[list[Channel], str]:
        """The connections waiting, and why the next could not be accepted ("": none
        waits); a connection not accepted leaves its worker on ZeroMQ."""
        channels = []
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return channels, ""
            except OSError as exc:  # (EMFILE and the like)
                return channels, str(exc)
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
    return Channel(sock, background=True)


def parse_hello(data) -> tuple[int, str]:
    """A connection's first datagram: ``(rank, secret)``; ``ValueError`` if it is not one."""
    try:
        rank, secret = msgpack.unpackb(bytes(data))
    except Exception:
        raise ValueError("a channel's first datagram is not [rank, secret]") from None
    if type(rank) is not int or not isinstance(secret, str):
        raise ValueError("a channel's first datagram is not [rank, secret]")
    return rank, secret
