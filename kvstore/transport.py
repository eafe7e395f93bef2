"""Sending a message without copying its arrays, and knowing when ZeroMQ is done with them.

Workers and servers send through :func:`send`. Each array of at least :data:`COPY_BELOW`
bytes goes out as its own frame straight from the array's memory; :func:`send` returns a
:class:`Sent` per such array: the index of the array in the message and the ZeroMQ tracker
that reports when its memory is no longer read. The protocol's frame map ties trackers to
arrays, never their positions. Whoever changes an array
that a send still reads must write elsewhere instead (a server) or wait (a worker reusing the
caller's buffer).

Sends never block: when the peer's queue is full, ``zmq.Again`` is raised and nothing was
sent.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import zmq

from .protocol import Message, encode_frames

# Below this a copy is cheaper than tracking a zero-copy frame, and needs no tracker.
COPY_BELOW = zmq.COPY_THRESHOLD


@dataclass(frozen=True)
class Sent:
    array: int  # index of the array in the message (-1: a channel's message)
    tracker: zmq.MessageTracker  # or a kvstore.channel.Queued: the same done and wait

    @property
    def done(self) -> bool:
        return self.tracker.done


_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)  # plain ints: enum flag arithmetic costs per call
_LAST = NOBLOCK = int(zmq.NOBLOCK)


def send(
    sock: zmq.Socket, msg: Message, route: bytes | None = None, track: bool = True
) -> list[Sent]:
    """Send ``msg`` (to ``route`` on a ROUTER socket) without blocking or copying big arrays.
    ``track=False`` for arrays nobody writes again (fresh copies): no trackers, which cost a
    notification per frame; ZeroMQ keeps them alive until sent."""
    frames, carried = encode_frames(msg)
    last = len(frames) - 1
    if route is not None:
        sock.send(route, _MORE)
    sent = []
    for i, frame in enumerate(frames):
        flags = _MORE if i < last else _LAST
        index = carried.get(i)
        if index is None or memoryview(frame).nbytes < COPY_BELOW:
            sock.send(frame, flags)
            continue
        if not track:
            sock.send(frame, flags, copy=False)
            continue
        tracker = sock.send(frame, flags, copy=False, track=True)
        sent.append(Sent(index, tracker))
    return sent


def recv(sock: zmq.Socket, flags: int = 0) -> list:
    """The next message's frames as ``zmq.Frame`` s (not copied): ``recv_multipart`` without
    its per-frame socket-option call (pyzmq makes an enum each time: half its cost)."""
    frames = [sock.recv(flags, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(flags, copy=False))
    return frames


def monitor_event(monitor: zmq.Socket) -> tuple[int, int]:
    """``(event, value)`` of the next event on a ``get_monitor_socket()`` socket: the frame
    ``zmq_socket_monitor`` writes (16-bit event, 32-bit value), parsed here rather than with
    ``zmq.utils.monitor``, whose import brings asyncio (7 MiB in every process)."""
    frames = monitor.recv_multipart()
    if len(frames) != 2 or len(frames[0]) != 6:
        raise ValueError(f"not a ZeroMQ monitor event: {frames!r:.80}")
    event, value = struct.unpack("=hi", frames[0])
    return event, value


def pending(sent: list[Sent]) -> list[Sent]:
    """The sends in ``sent`` whose memory ZeroMQ still reads."""
    return [s for s in sent if not s.tracker.done]
