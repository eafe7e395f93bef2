"""A peer that dies, a round that never completes, a cluster that never fills: clear errors
within the deadline, never a hang."""

import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from kvstore import auth
from kvstore.protocol import VERSION, Message, decode, encode

from .cluster import ROOT, base_env


def test_clean_shutdown_exits_zero(cluster):
    c = cluster(2, 2)
    c.run_workers("loop.py", [3])
    others = [p for n, p in c.procs.items() if not n.startswith("worker")]
    assert c.wait(others, 20) == [0, 0, 0]


def test_server_dies_mid_training(cluster):
    c = cluster(2, 2, KVSTORE_BIGARRAY_BOUND=1000, PS_VERBOSE=1)
    workers = c.start_workers("loop.py", [100000])
    c.wait_for_output("worker0", "round 20", 30)
    c.wait_for_output("server1", "ready for", 5)
    victim = c.output("server1").split("] ")[-1].split(" ready for")[0]  # "server R (host:port)"
    c.procs["server1"].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    codes = c.wait(workers, 20)
    assert time.monotonic() - t0 < 15
    assert codes == [3, 3], c.dump()
    for i in range(2):
        out = c.output(f"worker{i}")
        assert "KVStoreError" in out and f"{victim} failed" in out, out
    assert c.wait([c.procs["scheduler"]], 10) == [129]  # a peer lost: transient


def test_worker_dies_mid_training(cluster):
    c = cluster(1, 3)
    workers = c.start_workers("loop.py", [100000])
    c.wait_for_output("worker0", "round 20", 30)
    workers[2].send_signal(signal.SIGKILL)
    codes = c.wait(workers[:2], 20)
    assert codes == [3, 3], c.dump()
    for i in range(2):
        assert "worker 2 (127.0.0.1 pid" in c.output(f"worker{i}"), c.dump()
    assert c.wait([c.procs["server0"]], 10) == [129]
    said = [line for line in c.output("server0").splitlines() if "worker 2 (127.0.0.1" in line]
    assert len(said) == 1 and said[0].endswith("; stopping"), said  # once, and what it does


def test_uneven_rounds_fail_at_once_naming_key_and_rank(cluster):
    c = cluster(1, 2, KVSTORE_ROUND_TIMEOUT=60)  # no waiting for the deadline: rank 1 is done
    workers = c.start_workers("loop.py", [10, 1, 5])  # rank 1 stops after 5 rounds
    codes = c.wait(workers, 30)
    assert codes == [3, 0], c.dump()
    out = c.output("worker0")
    assert re.search(r"dist_sync round 5 of key '[wb]' can never complete", out), out
    assert "worker 1 finished (closed its store) after 5 push(es) of it" in out, out
    after = float(out.split("KVStoreError after ")[1].split("s:")[0])
    assert after < 10, out  # at once: KVSTORE_ROUND_TIMEOUT (60s) would be a hang


def test_round_and_barrier_deadlock_fails_both_at_once(cluster):
    """Rank 1 waits in a barrier while rank 0 waits for rank 1's push: a certain deadlock,
    failed at once (no deadline set), each side naming the other."""
    c = cluster(1, 2, KVSTORE_ROUND_TIMEOUT=0)
    workers = c.start_workers("loop.py", [10, 1, 5, "barrier"])
    codes = c.wait(workers, 30)
    assert codes == [3, 3], c.dump()
    text = "waits for worker(s) [1] to push, but they wait in barrier() for worker(s) [0]"
    assert "pushpull: server 0" in c.output("worker0") and text in c.output("worker0")
    assert "barrier: deadlock: dist_sync round 5 of key" in c.output("worker1")
    for i in range(2):
        after = float(c.output(f"worker{i}").split("KVStoreError after ")[1].split("s:")[0])
        assert after < 15, c.dump()


def _worker(env, code, timeout=30):
    return subprocess.run(
        [sys.executable, "-c", code],
        env=dict(env, DMLC_ROLE="worker"),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


CREATE = (
    "import kvstore\ntry:\n    kvstore.create('dist_sync')\n"
    "except kvstore.KVStoreError as e:\n    print('ERR', e)\n"
)


def test_no_scheduler_listening():
    env = base_env(1, 1, KVSTORE_START_TIMEOUT=0.5)
    t0 = time.monotonic()
    out = _worker(env, CREATE).stdout
    assert time.monotonic() - t0 < 15
    assert "ERR" in out and "no answer from the scheduler at tcp://127.0.0.1:" in out, out


def test_counts_never_fill(cluster):
    c = cluster(1, 2, KVSTORE_START_TIMEOUT=4)
    out = _worker(c.env, CREATE).stdout
    # the server too, unless a loaded machine started it late: the workers are the point
    assert re.search(r"only (0 of 1 servers and )?1 of 2 workers registered", out), out
    assert c.wait([c.procs["scheduler"]], 10) == [129]  # the start-up deadline: transient


def test_scheduler_port_in_use():
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as taken:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        env = dict(base_env(1, 1, port=port), DMLC_ROLE="scheduler")
        proc = subprocess.run(
            [sys.executable, "-m", "kvstore.scheduler"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Address already in use" in proc.stderr


def test_bad_environment():
    env = base_env(1, 1, KVSTORE_HEARTBEAT_INTERVAL="soon")
    out = _worker(
        env,
        "import kvstore\ntry:\n    kvstore.create('dist_sync')\n"
        "except ValueError as e:\n    print('ERR', e)\n",
    ).stdout
    assert "KVSTORE_HEARTBEAT_INTERVAL='soon' is not a valid float" in out


class RawNode:
    """A hand-driven DEALER for sending exact frames to a scheduler or server."""

    def __init__(self, address, identity=None, secret=None, token=None):
        """``secret``: talk to the scheduler as a job member (CURVE with the job's keys);
        ``token``: talk to a server as worker 0, proving that credential (kvstore.auth)."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        if secret:
            keys = auth.JobKeys.from_secret(secret.encode())
            self.sock.curve_serverkey = keys.scheduler_public
            self.sock.curve_publickey, self.sock.curve_secretkey = (
                keys.node_public,
                keys.node_secret,
            )
        self.sock.connect(address)
        if token:
            hello = self.ask(encode(Message("hello", 1, "raw", {"host": ""})))
            proof = auth.proof(token, hello.body["challenge"], 0)
            assert self.ask(encode(Message("auth", 2, "raw", {"proof": proof}))).kind == "ack"

    def ask(self, frames, timeout=10.0) -> Message:
        self.sock.send_multipart(frames)
        assert self.sock.poll(timeout * 1000), "no reply"
        return decode(self.sock.recv_multipart())

    def close(self):
        self.sock.close()
        self.ctx.term()


TOKEN = "t" * 64  # the credential this test's hand-made worker registers with


def _register(num_server=1, num_worker=1, role="worker", pid=1):
    return encode(
        Message(
            "register",
            0,
            "raw",
            {
                "role": role,
                "host": "127.0.0.1",
                "port": 0,
                "num_server": num_server,
                "num_worker": num_worker,
                "pid": pid,
                "cred": TOKEN,
            },
        )
    )


def test_scheduler_rejects_bad_registrations(cluster):
    c = cluster(1, 1)
    address = c.env["DMLC_PS_ROOT_URI"], c.env["DMLC_PS_ROOT_PORT"]
    secret = c.env["KVSTORE_SECRET"]
    node = RawNode("tcp://{}:{}".format(*address), secret=secret)
    try:
        reply = node.ask(_register(num_worker=3))
        assert reply.kind == "error" and "belongs to a different job" in reply.body["message"]
        assert node.ask([b"garbage"]).kind == "error"
        reply = node.ask(encode(Message("barrier", 1, "raw", {"group": "worker"})))
        assert "unregistered node" in reply.body["message"]
        node.sock.send_multipart(_register())  # the one worker: accepted, book follows
        assert node.sock.poll(10000)
        assert decode(node.sock.recv_multipart()).kind == "book"
        reply = node.ask(_register(pid=3))  # (the same one again is taken as a retry)
        assert "duplicate registration" in reply.body["message"]
        other = RawNode("tcp://{}:{}".format(*address), secret=secret)
        try:
            reply = other.ask(_register(pid=2))
            assert "too many workers" in reply.body["message"]
        finally:
            other.close()
        assert c.procs["scheduler"].poll() is None  # still serving
    finally:
        node.close()


def test_server_survives_bad_messages(cluster):
    c = cluster(1, 1, KVSTORE_HEARTBEAT_TIMEOUT=60)
    # this test is the job's one worker: register by hand, then talk to the server raw
    sched = RawNode(
        "tcp://{}:{}".format(c.env["DMLC_PS_ROOT_URI"], c.env["DMLC_PS_ROOT_PORT"]),
        secret=c.env["KVSTORE_SECRET"],
    )
    sched.sock.send_multipart(_register())
    assert sched.sock.poll(20000)
    host, port = decode(sched.sock.recv_multipart()).body["servers"][0]
    node = RawNode(f"tcp://{host}:{port}", identity=b"worker-0", token=TOKEN)
    stranger = RawNode(f"tcp://{host}:{port}", identity=b"intruder")
    try:
        assert (
            "unknown peer"
            in stranger.ask(encode(Message("pull", 1, "x", {"keys": []}))).body["message"]
        )
        w = encode(Message("init", 1, "x", {"keys": [["w", 0]]}, [np.arange(4, dtype="f4")]))
        assert node.ask(w).kind == "ack"
        cases = [
            ([b"\xc1garbage"], "not valid msgpack"),
            (
                [encode(Message("ack"))[0].replace(b"\xa1v" + bytes([VERSION]), b"\xa1v\x09")],
                "version 9",
            ),
            (
                encode(Message("push", 1, "x", {"keys": [["w", 0]]}, [np.ones(5000, "f4")]))[:1],
                "truncated",
            ),
            (
                encode(Message("push", 2, "x", {"keys": [["nokey", 0]]}, [np.ones(3, "f4")])),
                "never initialised",
            ),
            (
                encode(Message("push", 3, "x", {"keys": [["w", 0]]}, [np.ones(5, "f4")])),
                "got 5 x float32, expected 4 x float32",
            ),
            (
                encode(Message("push", 4, "x", {"keys": [["w", 0]]}, [np.ones(4, "f8")])),
                "expected 4 x float32",
            ),
            (
                encode(Message("init", 5, "x", {"keys": [["w", 0]]}, [np.ones(4, "f4")])),
                "already initialised",
            ),
            (
                encode(Message("optimizer", 6, "x", {"spec": {"name": "no-such-optimizer"}})),
                "unknown optimizer",
            ),
            (encode(Message("command", 7, "x", {"name": "explode"})), "unknown command"),
            (
                encode(
                    Message(
                        "book", 8, "x", {"rank": 0, "servers": [], "num_server": 1, "num_worker": 1}
                    )
                ),
                "unexpected message kind",
            ),
        ]
        for frames, expected in cases:
            reply = node.ask(frames)
            assert reply.kind == "error" and expected in reply.body["message"], reply.body
        reply = node.ask(encode(Message("pull", 9, "x", {"keys": [["w", 0]]})))
        assert reply.kind == "data"
        np.testing.assert_array_equal(reply.arrays[0], np.arange(4, dtype=np.float32))
        assert c.procs["server0"].poll() is None
    finally:
        for raw in (node, stranger, sched):
            raw.close()


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_worker_rejects_before_sending(cluster, bad):
    c = cluster(1, 1)
    c.run_workers("reject.py", [bad])
