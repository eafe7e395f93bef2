"""A slow but healthy peer never fails a job: a barrier or a join that waits is reported to
the workers waiting in it (a ``stall`` from the scheduler, naming who is missing and what it
does), and each report restarts their deadline; a dead peer still fails it (heartbeats)."""

from __future__ import annotations

import pytest

from kvstore.protocol import Message, decode, encode

from .cluster import poll_until
from .test_failures import RawNode, _register


@pytest.mark.timeout(90)
@pytest.mark.parametrize("call", ["barrier", "join"])
def test_a_rank_busy_longer_than_the_timeout_is_waited_for(cluster, call):
    """Rank 0 writes a 'checkpoint' for 12s before its barrier (join); the other rank waits in
    it with KVSTORE_TIMEOUT=5: both return, none blames the scheduler."""
    c = cluster(1, 2, KVSTORE_TIMEOUT=5, KVSTORE_HEARTBEAT_TIMEOUT=3)
    outs = c.run_workers("slow_peer.py", [call, 12], timeout=60)
    assert "OK 0" in outs[0] or "OK 0" in outs[1], outs
    waited = next(o for o in outs if "OK 1" in o)
    assert float(waited.split("OK 1 after ")[1].split("s")[0]) >= 5, outs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["barrier", "join"])
def test_the_scheduler_tells_a_waiting_worker_whom_it_waits_for(cluster, call):
    """Two hand-made workers: rank 1 waits in barrier (join), rank 0 does nothing (and sends
    heartbeats). With KVSTORE_TIMEOUT=3, rank 1 hears why every second from the first one;
    the scheduler logs it every KVSTORE_STALL_REPORT=2s."""
    c = cluster(1, 2, KVSTORE_TIMEOUT=3, KVSTORE_STALL_REPORT=2, KVSTORE_HEARTBEAT_TIMEOUT=60)
    address = "tcp://{}:{}".format(c.env["DMLC_PS_ROOT_URI"], c.env["DMLC_PS_ROOT_PORT"])
    idle = RawNode(address, secret=c.env["KVSTORE_SECRET"])
    waiting = RawNode(address, secret=c.env["KVSTORE_SECRET"])
    try:
        idle.sock.send_multipart(_register(num_worker=2, pid=1))  # rank 0: the lower pid
        waiting.sock.send_multipart(_register(num_worker=2, pid=2))
        books = [_next(node, "book") for node in (idle, waiting)]
        assert [b.body["rank"] for b in books] == [0, 1]
        body = {"group": "worker"} if call == "barrier" else {}
        waiting.sock.send_multipart(encode(Message(call, 5, "raw", body)))
        stalls = []
        while len(stalls) < 3:
            idle.sock.send_multipart(encode(Message("heartbeat", 1, "raw", {})))
            stalls.append(_next(waiting, "stall", skip=("heartbeat",)))
        what = "barrier(worker)" if call == "barrier" else "join()"
        text = stalls[0].body["message"]
        assert text.startswith(f"stall: {what} has waited 1s for worker 0: worker 0 is in no "), (
            text
        )
        assert "call the scheduler knows of, last heartbeat" in text, text
        assert "has waited 3s" in stalls[2].body["message"], stalls[2].body

        def logged():
            return f"stall: {what} has waited" in c.output("scheduler")

        assert poll_until(logged, 10), c.output("scheduler")
        if call == "barrier":  # and the barrier still completes
            idle.sock.send_multipart(encode(Message("barrier", 6, "raw", body)))
            assert _next(waiting, "barrier_done", skip=("stall",)).id == 5
            assert _next(idle, "barrier_done", skip=("heartbeat",)).id == 6
    finally:
        idle.close()
        waiting.close()


def _next(node: RawNode, kind: str, skip=(), timeout: float = 10.0) -> Message:
    """The next message of ``kind`` the scheduler sends ``node``, skipping ``skip``."""
    while True:
        assert node.sock.poll(timeout * 1000), f"no {kind} within {timeout}s"
        msg = decode(node.sock.recv_multipart())
        if msg.kind == kind:
            return msg
        assert msg.kind in skip, msg
