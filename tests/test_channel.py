"""The same-host channel (kvstore.channel): framing against a model, real Unix sockets, and a
stranger at a real server's channel."""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import channel

from .cluster import poll_until

sizes = st.one_of(
    st.integers(0, 64),
    st.integers(channel.CHUNK - 40, channel.CHUNK + 40),
    st.integers(0, 3 * channel.CHUNK),
)


def _frames(draw_sizes, seed: int) -> list[bytes]:
    return [bytes((seed + i + j) % 251 for j in range(n)) for i, n in enumerate(draw_sizes)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(sizes, min_size=1, max_size=5), min_size=1, max_size=4))
def test_messages_come_out_as_they_went_in(messages):
    """Any run of messages, each cut into datagrams of at most CHUNK bytes, reassembles into
    the same frames, one message per last datagram."""
    assembler = channel.Assembler()
    for seed, shape in enumerate(messages):
        frames = _frames(shape, seed)
        grams = channel.datagrams(frames)
        assert all(sum(memoryview(b).nbytes for b in g) <= channel.CHUNK for g in grams)
        out = [assembler.feed(b"".join(g)) for g in grams]
        assert out[:-1] == [None] * (len(grams) - 1)
        assert [bytes(f) for f in out[-1]] == frames


def test_a_malformed_datagram_is_refused():
    def first(frames):
        return b"".join(channel.datagrams(frames)[0])

    with pytest.raises(ValueError, match="no header"):
        channel.Assembler().feed(b"\x01")
    good = first([b"abc", b"de"])
    with pytest.raises(ValueError, match="do not add up"):  # body 16: frames 8 + 8 padded
        channel.Assembler().feed(good[:12] + struct.pack("<QQ", 3, 9) + good[28:])
    with pytest.raises(ValueError, match="announced"):
        channel.Assembler().feed(good + b"x")
    with pytest.raises(ValueError, match="KVSTORE_MAX_MESSAGE"):
        channel.Assembler(limit=100).feed(first([bytes(101), b""]))
    with pytest.raises(ValueError, match="frames and"):
        channel.Assembler(limit=100).feed(first([bytes(300)]))
    with pytest.raises(ValueError, match="frames and"):
        channel.Assembler().feed(struct.pack("<QI", 0, channel.MAX_FRAMES + 1))
    with pytest.raises(ValueError, match="not \\[rank, secret\\]"):
        channel.parse_hello(b"\x93\x01\x02\x03")


def test_a_header_longer_than_a_datagram():
    frames = [bytes([i % 7]) for i in range(channel.CHUNK // 8 + 10)]
    grams = channel.datagrams(frames)
    assert len(grams) == 3  # the header alone fills more than one
    assembler = channel.Assembler()
    assert [assembler.feed(b"".join(g)) for g in grams[:2]] == [None, None]
    assert [bytes(f) for f in assembler.feed(b"".join(grams[2]))] == frames


def _pair(limit: int = 2**32):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    return channel.Channel(a, limit), channel.Channel(b, limit)


def test_a_reader_that_lags_gets_everything_in_order():
    """Sends never wait: what the socket does not take is queued (copied), written by
    flush, and read in order; with QUEUE_MESSAGES waiting a bounded send is refused."""
    writer, reader = _pair()
    big = [bytes([i % 256]) * 50_000 for i in range(40)]  # far more than a socket holds
    for i, payload in enumerate(big):
        assert writer.send([b"head %d" % i, payload])
    assert writer.backlog
    got = []
    for _ in range(1000):
        writer.flush()
        got += reader.receive()
        if len(got) == len(big) and not writer.backlog:
            break
    assert [bytes(f[0]) for f in got] == [b"head %d" % i for i in range(40)]
    assert [bytes(f[1]) for f in got] == big
    sent = [writer.send([bytes(1000)]) for _ in range(channel.QUEUE_MESSAGES + 400)]
    assert all(sent[:200]) and not all(sent)  # the socket took some, the queue 1000
    assert not writer.send([bytes(10)])
    writer.close()
    reader.close()


def test_a_workers_queue_goes_out_while_it_does_something_else():
    """A worker's channel writes what the socket did not take from a thread (as ZeroMQ's
    I/O thread would), so a push goes out while its caller computes; frames arrive whole,
    in order and 8-byte aligned."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    writer, reader = channel.Channel(a, background=True), channel.Channel(b)
    payloads = [bytes([i]) * (100_000 + i) for i in range(30)]
    taken = [writer.send([b"%d" % i, b"x" * (i % 9), p]) for i, p in enumerate(payloads)]
    assert writer.backlog  # nobody reads yet: the thread waits for room
    last = taken[-1]
    assert isinstance(last, channel.Queued) and not last.done
    last.wait(0.05)  # (a tracker's wait: no error when not done)
    assert not last.done
    got = []
    assert poll_until(lambda: got.extend(reader.receive()) or len(got) == 30, 20)
    assert [bytes(f[2]) for f in got] == payloads
    assert [bytes(f[1]) for f in got] == [b"x" * (i % 9) for i in range(30)]
    for frames in got:
        for frame in frames:
            assert np.frombuffer(frame, np.uint8).ctypes.data % 8 == 0
    assert poll_until(lambda: not writer.backlog, 5) and all(t is True or t.done for t in taken)
    writer.send([bytes(300_000)])  # more than the socket holds: the thread writes the rest
    reader.close()  # the peer is gone: the thread's write fails, and the next send says so
    assert poll_until(lambda: writer.broken, 5)
    with pytest.raises(BrokenPipeError):
        writer.send([b"x"])
    writer.close()


def test_the_end_of_a_connection_is_read_as_closed():
    writer, reader = _pair()
    writer.send([b"last"])
    writer.close()
    assert [bytes(f[0]) for f in reader.receive()] == [b"last"]
    assert reader.closed
    with pytest.raises(OSError):  # EPIPE: the peer is gone
        reader.send([b"x" * 10])
    reader.close()


def test_connect_refuses_an_address_that_is_not_a_channel():
    with pytest.raises(OSError, match="not a channel address"):
        channel.connect("/tmp/x", 0, "s", 1)


def _listening_channels(pid: int) -> list[str]:
    """The abstract addresses a process listens at, as any local user sees them."""
    names = []
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            listening = len(parts) >= 8 and int(parts[3], 16) & 0x10000  # __SO_ACCEPTCON
            if listening and parts[-1].startswith(f"@kvs-channel-{pid}-"):
                names.append(parts[-1])
    return names


def test_a_stranger_at_a_servers_channel_is_closed_and_the_job_goes_on(cluster):
    """Anyone on the host can find the address; without the secret its hello gave a proved
    worker, a connection is closed at its first datagram, and the workers' sums stay
    exact."""
    c = cluster(1, 2, KVSTORE_BIGARRAY_BOUND=1000)
    workers = c.start_workers("random_rounds.py", [5, 60])
    server = c.procs["server0"].pid
    assert poll_until(lambda: _listening_channels(server), 30), c.dump()
    address = _listening_channels(server)[0]
    for rank, secret in ((0, "0" * 32), (7, "x"), ("bad", "")):
        with pytest.raises(OSError):
            channel.connect(address, rank, secret, 10)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as raw:  # no [rank, secret]
        raw.settimeout(10)
        raw.connect("\0" + address[1:])
        raw.send(b"\xc1not msgpack")
        assert raw.recv(100) == b""
    assert c.wait(workers, 90) == [0, 0], c.dump()
    for i in range(2):
        out = c.output(f"worker{i}")
        assert "talks by channel with 1 servers" in out and "pulled values exact" in out, out
    assert "wrong secret; closed" in c.output("server0"), c.dump()


def test_a_connection_that_never_proves_itself_is_closed_after_10_s(cluster):
    c = cluster(1, 1)
    (worker,) = c.start_workers("idle.py", [14])
    c.wait_for_output("worker0", "ready", 30)
    (address,) = _listening_channels(c.procs["server0"].pid)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as silent:
        silent.settimeout(30)
        silent.connect("\0" + address[1:])
        opened = time.monotonic()
        assert silent.recv(100) == b""  # the server's tick: 10 to 10.1 s after the accept
        took = time.monotonic() - opened
    assert 9.5 < took < 13 and c.procs["server0"].poll() is None, (took, c.dump())
    assert c.wait([worker], 30) == [0], c.dump()
