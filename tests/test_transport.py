"""The zero-copy send helper: trackers follow the protocol's frame map, sends never block."""

import gc

import numpy as np
import pytest
import zmq

from kvstore import transport
from kvstore.protocol import Message, decode, encode_frames

from .cluster import poll_until


def test_frame_map_names_the_array_each_frame_carries():
    arrays = [np.ones(4), np.ones(100_000), np.ones(3), np.ones(20_000, np.float32)]
    frames, carried = encode_frames(
        Message("data", 1, "s", {"keys": [[i, 0] for i in range(4)]}, arrays)
    )
    assert carried == {1: 1, 2: 3}  # frame 0 packs the small arrays 0 and 2 after the header
    for frame, index in carried.items():
        assert frames[frame].obj is arrays[index]


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.setsockopt(zmq.SNDHWM, 2)  # an inproc queue holds both ends' marks
    b.setsockopt(zmq.RCVHWM, 2)
    a.bind("inproc://transport-test")
    b.connect("inproc://transport-test")
    yield a, b
    a.close(linger=0)
    b.close(linger=0)
    ctx.term()


def test_a_small_array_before_a_big_one_ties_the_tracker_to_the_big_one(pair):
    """The old server tied frame i to key i-1: with a packed small array first, the big
    array's tracker went to the small key, and an update could change it mid-send."""
    a, b = pair
    small, big = np.ones(4, np.float32), np.arange(100_000, dtype=np.float32)
    sent = transport.send(a, Message("data", 1, "s", {"keys": [["s", 0], ["b", 0]]}, [small, big]))
    assert [s.array for s in sent] == [1]
    assert transport.pending(sent) == sent  # unread by the peer: ZeroMQ still holds it
    frames = b.recv_multipart(copy=False)
    np.testing.assert_array_equal(decode(frames).arrays[1], big)
    del frames
    gc.collect()
    assert poll_until(lambda: not transport.pending(sent), 5)


def test_a_full_peer_queue_raises_again_instead_of_blocking(pair):
    a, _ = pair
    msg = Message("ack", 1, "s")
    with pytest.raises(zmq.Again):
        for _ in range(100):
            transport.send(a, msg)


def test_monitor_event_reads_what_zmq_utils_monitor_reads():
    """transport.monitor_event parses the monitor frames as pyzmq's own parser does (which
    kvstore no longer imports: it brings asyncio into every process)."""
    from zmq.utils.monitor import parse_monitor_message

    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        port = server.bind_to_random_port("tcp://127.0.0.1")
        monitor = server.get_monitor_socket(zmq.EVENT_ACCEPTED)
        client.connect(f"tcp://127.0.0.1:{port}")
        assert monitor.poll(5000)
        frames = monitor.recv_multipart(copy=True)
        pyzmq = parse_monitor_message(frames)
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://monitor-copy")
        b.connect("inproc://monitor-copy")
        a.send_multipart(frames)
        event, value = transport.monitor_event(b)
        assert (event, value) == (pyzmq["event"], pyzmq["value"]) and event == zmq.EVENT_ACCEPTED
        a.send_multipart([b"\0", b""])
        with pytest.raises(ValueError, match="not a ZeroMQ monitor event"):
            transport.monitor_event(b)
        for s in (a, b, monitor):
            s.close(linger=0)
    finally:
        server.close(linger=0)
        client.close(linger=0)
        ctx.term()
