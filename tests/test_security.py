"""Authentication by default: only the job's own processes register, connect to a server, or
have a message acted on; each worker acts only as its own rank."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import auth
from kvstore.protocol import Message, decode, encode

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
    for name in ("scheduler", "server0"):
        assert "refused a connection from 127.0.0.1" in c.output(name), c.output(name)
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
