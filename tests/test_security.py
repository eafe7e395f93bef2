"""Authentication by default: only the job's own processes register, connect to a server, or
have a message acted on; each worker acts only as its own rank."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import auth
from kvstore import worker as worker_module
from kvstore.config import Config
from kvstore.protocol import Message, decode, encode
from kvstore.worker import DistStore

from .cluster import base_env


def _register(role="worker"):
    body = {"role": role, "host": "127.0.0.1", "port": 0, "num_server": 1, "num_worker": 2}
    return encode(Message("register", 1, "rogue", {**body, "pid": 1, "cred": "x" * 64}))


def _server_port(c) -> int:
    c.wait_for_output("server0", "ready for", 30)
    return int(re.search(r"server 0 \(127\.0\.0\.1:(\d+)\)", c.output("server0"))[1])


def test_rogue_without_the_key_is_refused_by_scheduler_and_server(cluster):
    c = cluster(1, 2, PS_VERBOSE=1)
    workers = c.start_workers("loop.py", [400])
    port = _server_port(c)
    for i in range(2):  # connected: a rogue cannot take a worker's routing identity first
        c.wait_for_output(f"worker{i}", "round 0", 60)
    ctx = zmq.Context()
    try:
        rogues = []
        for kind in ("no key", "curve with a random key"):
            for where in (c.env["DMLC_PS_ROOT_PORT"], port):
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                sock.identity = b"worker-0" if where != port or kind != "no key" else b"rogue"
                if kind.startswith("curve"):
                    public, secret = zmq.curve_keypair()
                    sock.curve_publickey, sock.curve_secretkey = public, secret
                    sock.curve_serverkey = zmq.curve_keypair()[0]
                sock.connect(f"tcp://127.0.0.1:{where}")
                rogues.append(sock)
                big = [np.full(100, 1e6, np.float32), np.full(2000, 1e6, np.float32)]
                sock.send_multipart(_register())
                sock.send_multipart(
                    encode(Message("push", 5, "worker-0", {"keys": [["w", 0], ["b", 0]]}, big))
                )
        # The scheduler and an encrypted server answer nothing; a server's data connection
        # (no mechanism by default) answers each request with a refusal
        answers = [decode(s.recv_multipart()) for s in rogues if s.poll(1500)]
        assert [(a.kind, "refused" in a.body["message"]) for a in answers] in (
            [],
            [("error", True)],
            [("error", True)] * 2,
        ), answers
        assert c.wait(workers, 60) == [0, 0], c.dump()  # loop.py checks every sum exactly
    finally:
        for s in rogues:
            s.close()
        ctx.term()
    # the address, or "?" when the rogue was gone before its address could be read (a race
    # on a loaded machine: the monitor reads it from the socket after the fact)
    for name in ("scheduler", "server0"):
        assert re.search(r"refused a connection from (127\.0\.0\.1|\?)", c.output(name)), c.output(
            name
        )
    for i in range(2):
        assert "done" in c.output(f"worker{i}")


def test_a_worker_cannot_act_as_another_rank(cluster):
    c = cluster(1, 3)
    outs = c.run_workers("impostor.py")
    lines = [line for line in outs[1].splitlines() if ": refused (" in line]
    assert len(lines) == 5 and "ACCEPTED" not in outs[1], outs[1]
    assert "push from worker-2 refused: this connection has not proved" in lines[0], lines
    # rank 0's identity: ignored while rank 0 is connected, refused once it has left
    assert "(no connection)" in lines[1] or "worker-0 refused: this connection" in lines[1], lines
    assert "push from worker-2 refused: this connection has not proved" in lines[4], lines
    assert "unknown peer b'worker-00'" in lines[2] and "unknown peer" in lines[3], lines
    assert all("after: [3.0, 3.0, 3.0, 3.0]" in o for o in outs[:2]), outs


def test_gate_decisions_without_sockets():
    keys = auth.JobKeys.from_secret(b"s" * 32)
    allowed = {("CURVE", zmq.utils.z85.decode(keys.node_public)): ("node", None)}
    base = [b"1.0", b"1", b"kvstore", b"127.0.0.1", b""]
    node = zmq.utils.z85.decode(keys.node_public)
    assert auth.decide([*base, b"CURVE", node], allowed)[0] == b"200"
    assert auth.decide([*base, b"CURVE", b"x" * 32], allowed)[0] == b"400"
    assert auth.decide([*base, b"NULL"], allowed)[0] == b"400"  # the scheduler: CURVE only
    assert auth.decide([*base, b"PLAIN", b"worker-0", b"tok"], allowed)[0] == b"400"
    assert auth.decide([b"1.0", b"1", b"other", b"", b"", b"CURVE", node], allowed)[0] == b"400"
    assert auth.decide([b"garbage"], allowed)[0] == b"400"
    servers = {("NULL",): ("conn", None)}  # a server's gate, default mode
    assert auth.decide([*base, b"NULL"], servers, 7) == (b"200", "OK", "conn-7")
    assert auth.decide([*base, b"NULL", b"extra"], servers, 7)[0] == b"400"
    assert auth.decide([*base, b"PLAIN", b"worker-0", b"tok"], servers)[0] == b"400"
    assert auth.decide([b"1.0", b"1", b"other", b"", b"", b"NULL"], servers)[0] == b"400"


_frames = st.lists(st.binary(max_size=12), max_size=9)


@settings(max_examples=300, deadline=None)
@given(
    request=st.one_of(
        _frames,
        st.tuples(
            st.sampled_from([b"1.0", b"2.0"]),
            st.binary(max_size=4),
            st.sampled_from([b"kvstore", b"other"]),
            st.binary(max_size=8),
            st.binary(max_size=8),
            st.sampled_from([b"NULL", b"CURVE", b"PLAIN", b"GSSAPI"]),
            _frames,
        ).map(lambda t: [*t[:6], *t[6]]),
    ),
    null_allowed=st.booleans(),
    serial=st.integers(0, 2**40),
)
def test_gate_decision_properties(request, null_allowed, serial):
    """The reference model: 200 exactly for this job's domain with a known CURVE key, or a
    bare NULL handshake where NULL is allowed, which is named by its serial alone."""
    key = b"k" * 32
    allowed = {("CURVE", key): ("node", None)}
    if null_allowed:
        allowed[("NULL",)] = ("conn", None)
    status, reason, user = auth.decide(request, allowed, serial)
    well_formed = len(request) >= 6 and request[0] == b"1.0" and request[2] == b"kvstore"
    creds = request[6:]
    curve_ok = well_formed and request[5] == b"CURVE" and creds == [key]
    null_ok = well_formed and request[5] == b"NULL" and not creds and null_allowed
    assert status == (b"200" if curve_ok or null_ok else b"400"), (request, reason)
    assert user == ("node" if curve_ok else f"conn-{serial}" if null_ok else "")
    assert reason and isinstance(reason, str)


@settings(max_examples=200, deadline=None)
@given(
    token=st.text(min_size=1, max_size=70),
    challenge=st.text(alphabet="0123456789abcdef", min_size=32, max_size=32),
    rank=st.integers(0, 10**6),
    other=st.integers(0, 10**6),
    given=st.one_of(st.none(), st.integers(), st.text(max_size=70)),
)
def test_a_proof_fits_one_token_one_challenge_one_rank(token, challenge, rank, other, given):
    good = auth.proof(token, challenge, rank)
    assert len(good) == 64 and (len(token) < 16 or token not in good)
    assert auth.check_proof(token, challenge, rank, good) == ""
    assert auth.check_proof(token, None, rank, good)  # no hello on this connection
    assert auth.check_proof(token + "x", challenge, rank, good)
    assert auth.check_proof(token, challenge[::-1] + "0", rank, good)
    if other != rank:
        assert auth.check_proof(token, challenge, other, good)
    if given != good:
        assert auth.check_proof(token, challenge, rank, given)


def test_different_secrets_derive_different_keys():
    a, b = auth.JobKeys.from_secret(b"a" * 32), auth.JobKeys.from_secret(b"b" * 32)
    assert a.scheduler_public != b.scheduler_public and a.node_public != b.node_public
    assert zmq.curve_public(a.node_secret) == a.node_public


def test_a_process_with_another_secret_is_told_at_once(cluster):
    c = cluster(1, 1)
    env = dict(c.env, DMLC_ROLE="worker", KVSTORE_SECRET="another-job-" + "x" * 20)
    code = (
        "import kvstore\ntry:\n    kvstore.create('dist_sync')\n"
        "except kvstore.KVStoreError as e:\n    print(e)"
    )
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert "refused this process's key" in done.stdout and "KVSTORE_SECRET" in done.stdout, done
    assert time.monotonic() - t0 < 15  # not the start-up deadline
    assert "refused a connection from" in c.output("scheduler")


def test_no_secret_is_a_clear_error():
    env = {k: v for k, v in base_env(1, 1).items() if k != "KVSTORE_SECRET"}
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.server"],
        env=dict(env, DMLC_ROLE="server"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "no job secret" in done.stderr, done.stderr


@pytest.mark.parametrize("mode", [{"KVSTORE_ENCRYPT": "1"}, {"KVSTORE_INSECURE": "1"}])
def test_encrypted_and_insecure_jobs_compute_the_same_sums(cluster, mode):
    c = cluster(2, 2, KVSTORE_BIGARRAY_BOUND=2000, **mode)
    outs = c.run_workers("rounds.py", ["dist_sync", 3, "sgd", "int"])
    assert all("OK after 3 rounds" in o for o in outs), outs
    if "KVSTORE_INSECURE" in mode:  # said loudly, by every process
        assert "KVSTORE_INSECURE=1" in c.output("scheduler") + c.output("server0")


def test_the_secret_is_not_in_a_configs_repr():
    """A Config that reaches a log or a traceback (``%r``, an exception's locals) must not
    carry the job's secret."""
    from kvstore.config import Config

    env = dict(base_env(1, 1), DMLC_ROLE="worker")
    cfg = Config.from_env(env)
    assert cfg.secret == env["KVSTORE_SECRET"].encode()
    for text in (repr(cfg), str(cfg), f"{cfg!r}"):
        assert env["KVSTORE_SECRET"] not in text and "secret=" not in text, text


class Relay:
    """A TCP forwarder on 127.0.0.1 in front of ``upstream``, keeping every byte its clients
    send: what a sniffer on the path sees."""

    def __init__(self, upstream: tuple):
        self.upstream = upstream
        self.sent = bytearray()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.open += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src, dst, keep):
        try:
            while data := src.recv(65536):
                if keep:
                    with self.lock:
                        self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        for s in self.open:
            s.close()


def _worker_through(c, relay_port: int, monkeypatch) -> DistStore:
    """This test process as the job's one worker, reaching its server through a relay."""
    real_wait = worker_module.Control.wait

    def wait(self, *args, **kw):
        msg = real_wait(self, *args, **kw)
        if msg.kind == "book":
            msg.body["servers"] = [["127.0.0.1", relay_port]]
        return msg

    monkeypatch.setattr(worker_module.Control, "wait", wait)
    return DistStore("dist_sync", Config.from_env(dict(c.env, DMLC_ROLE="worker")))


def _dealer(ctx, port: int, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.identity = identity
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _ask(sock, kind: str, body: dict, patience: float = 2.0):
    sock.send_multipart(encode(Message(kind, 7, "x", body)))
    return decode(sock.recv_multipart()) if sock.poll(patience * 1000) else None


@pytest.mark.timeout(120)
def test_the_token_never_crosses_the_wire_and_a_sniffed_proof_is_worth_nothing(
    cluster, monkeypatch
):
    c = cluster(1, 1, KVSTORE_SHM="0", PS_VERBOSE=1)
    c.wait_for_output("scheduler", "registered server at", 30)  # ready once we register
    port = int(re.search(r"registered server at 127\.0\.0\.1:(\d+)", c.output("scheduler"))[1])
    relay = Relay(("127.0.0.1", port))
    kv = _worker_through(c, relay.port, monkeypatch)
    ctx = zmq.Context()
    try:
        kv.init("w", np.zeros(4, np.float32))
        kv.push("w", np.ones(4, np.float32))
        out = np.empty(4, np.float32)
        kv.pull("w", out=out)
        assert (out == 1).all()
        token = kv._cred.public
        with relay.lock:
            wire = bytes(relay.sent)
        # What a sniffer saw: the proof, never the token (with PLAIN it was in every handshake)
        assert token.encode() not in wire
        assert b"auth" in wire and b"worker-0" in wire and bytes.fromhex(token) not in wire
        sniffed = re.search(rb"proof\xd9\x40([0-9a-f]{64})", wire)[1].decode()

        # The worker's own connection goes; a fresh one takes its identity and replays
        kv._sockets[0].close(linger=0)
        replay = _dealer(ctx, port, b"worker-0")
        deadline = time.monotonic() + 30
        while (hello := _ask(replay, "hello", {"host": ""})) is None:  # the identity frees
            assert time.monotonic() < deadline, "the server never answered the replayer"
            replay.close()
            replay = _dealer(ctx, port, b"worker-0")
        assert isinstance(hello.body.get("challenge"), str) and len(hello.body["challenge"]) == 32
        refused = _ask(replay, "auth", {"proof": sniffed})
        assert refused.kind == "error" and "wrong proof for worker-0" in refused.body["message"]
        pull = _ask(replay, "pull", {"keys": [["w", 0]]})
        assert pull.kind == "error" and "has not proved worker-0" in pull.body["message"]
        # the proof that the token gives for this connection's own challenge is accepted
        ok = _ask(replay, "hello", {"host": ""})
        proof = auth.proof(token, ok.body["challenge"], 0)
        assert _ask(replay, "auth", {"proof": proof}).kind == "ack"
        assert _ask(replay, "pull", {"keys": [["w", 0]]}).kind == "data"
        replay.close()

        # a connection that skips auth, under a free identity: refused, nothing acted on
        skipper = _dealer(ctx, port, b"worker-0")
        deadline = time.monotonic() + 30
        while (got := _ask(skipper, "pull", {"keys": [["w", 0]]})) is None:
            assert time.monotonic() < deadline, "the server never answered"
            skipper.close()
            skipper = _dealer(ctx, port, b"worker-0")
        assert got.kind == "error" and "has not proved worker-0" in got.body["message"]
        skipper.close()
        assert "wrong proof for worker-0" in c.output("server0")
    finally:
        ctx.term()
        kv._shutdown(finalize=True)
        relay.close()


@pytest.mark.timeout(180)
def test_broadcast_object_unpickles_the_roots_bytes_alone(cluster):
    """A non-root that pushes into broadcast_object's summed keys what would turn the root's
    pickle into its own changes nothing: the servers count its pushes to the root's keys as
    zeros, and every worker gets exactly the root's object."""
    pytest.importorskip("torch")
    c = cluster(1, 3)
    outs = c.run_workers("torch_object_garbage.py", timeout=150)
    assert not any("PWNED" in o for o in outs), outs
    for r, out in enumerate(outs):
        assert f"rank {r} got {{'from': 0, 'list': [0, 0, 0], 'pad': '{'.' * 100}'}}" in out, outs


def test_a_handshake_lost_once_is_retried_not_taken_for_a_refused_key(tmp_path):
    """A connection to the scheduler's port that fails mid-handshake (here a listener that
    echoes it, as a connection that met itself does: a port of the ephemeral range nobody
    listens on yet can connect to itself) is retried, and the job comes up;
    only handshakes failing again and again mean a refused key. (CI once saw both servers
    of a job exit with "refused this process's key" at start-up.)"""
    env = base_env(1, 1)
    port = int(env["DMLC_PS_ROOT_PORT"])
    lure = socket.socket()
    lure.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lure.bind(("127.0.0.1", port))
    lure.listen(1)
    lure.settimeout(30)
    procs = []

    def start(role, argv, log):
        with open(tmp_path / log, "wb") as out:
            procs.append(
                subprocess.Popen(argv, env=dict(env, DMLC_ROLE=role), stdout=out, stderr=out)
            )
        return procs[-1]

    code = (
        "import numpy as np, kvstore\nkv = kvstore.create('dist_sync')\n"
        "kv.init('k', np.zeros(3, np.float32))\nkv.push('k', np.ones(3, np.float32))\n"
        "out = np.zeros(3, np.float32)\nkv.pull('k', out=out)\nprint('pulled', out.tolist())"
    )
    try:
        start("server", [sys.executable, "-m", "kvstore.server"], "server.log")
        conn, _ = lure.accept()  # the server's first try meets "itself": what it sends
        conn.settimeout(0.5)  # comes back (its greeting, then its CURVE HELLO), then closed
        try:
            while data := conn.recv(4096):
                conn.sendall(data)
        except OSError:
            pass
        conn.close()
        lure.close()
        start("scheduler", [sys.executable, "-m", "kvstore.scheduler"], "scheduler.log")
        worker = start("worker", [sys.executable, "-c", code], "worker.log")
        worker.wait(60)
        said = (tmp_path / "worker.log").read_text() + (tmp_path / "server.log").read_text()
        assert worker.returncode == 0 and "pulled [1.0, 1.0, 1.0]" in said, said
        assert "refused" not in said, said
    finally:
        lure.close()
        for proc in procs:  # by PID
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
