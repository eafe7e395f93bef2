"""The replicated server's rules at the level of one process, without sockets: a hand-made
``Server`` (as ``tests/test_sparse_server.py`` makes one) whose forwards are captured, and the
scheduler's state machine. Each test is a scenario a review found broken (join after a
failover, a forwarded sum reused while in flight, a forward that arrives before its
failover notice, a broadcast key taken over).
"""

import time
from types import SimpleNamespace

import numpy as np

from kvstore.membership import Broadcast, Membership, Send
from kvstore.protocol import Message
from kvstore.replication import Backup, Primary
from kvstore.rounds import Rounds
from kvstore.server import Server, _show

from .test_membership import make_cfg, register


def _job():
    cfg = make_cfg(3, 2, heartbeat_timeout=3.0, replicas=2)
    m = Membership(cfg, 0.0)
    for s in range(3):
        m.receive(
            f"s{s}".encode(),
            register("server", port=10 + s, hint=s, num_server=3, num_worker=2),
            0.0,
        )
    for w in range(2):
        m.receive(
            f"w{w}".encode(), register("worker", pid=5 + w, hint=w, num_server=3, num_worker=2), 0.0
        )
    for who in (b"s1", b"s2", b"w0", b"w1"):
        m.receive(who, Message("heartbeat", 0, "x"), 2.5)
    actions = m.tick(3.5)  # server 0 silent: failed over
    assert any(isinstance(a, Broadcast) and a.message.kind == "failover" for a in actions)
    return m


def test_join_after_a_failover_completes():
    m = _job()
    out = []
    for w in (b"w0", b"w1"):
        acts = m.receive(w, Message("join", 7, "worker"), 4.0)
        out += acts
        told = [a for a in acts if isinstance(a, Broadcast) and a.message.kind == "worker_joined"]
        rank = told[0].message.body["rank"]
        for s in m.identities(roles=("server",)):  # every LIVE server acks
            out += m.receive(s, Message("joined_ack", 0, "server", {"rank": rank}), 4.0)
    done = [a for a in out if isinstance(a, Send) and a.message.kind == "join_done"]
    assert len(done) == 2, "join() never completes after a failover (join_acks counts dead servers)"


# ---------------------------------------------------------------- a hand-made replicated server


def replicated_server(W, rank=0, chains=((0, 1), (1, 0))):
    s = object.__new__(Server)
    s.cfg = SimpleNamespace(num_server=len(chains), verbose=0, shm=False)
    s.num_workers, s.rank, s.name = W, rank, f"server {rank}"
    s.stored, s.sending, s._shm_of, s._roots = {}, {}, {}, {}
    s.rounds = Rounds(W, 0, describe=_show)
    from kvstore.sparse import SparseKeys

    s.rows = SparseKeys()
    s.updater = s.optimizer_spec = None
    s.chains = [list(c) for c in chains]
    s.epoch, s.dead = 0, set()
    s.primary, s.backup, s.backup_updaters = Primary(), Backup(), {}
    s._targets = {rank: [b for b in s.chains[rank] if b != rank]}
    s._peer_ready = {b: True for b in s._targets[rank]}
    s._backlog, s._pusher, s._deferred, s._unsent = {}, None, [], set()
    s._lost, s._last_failure, s._peer_lost = set(), "", ""
    s.control = SimpleNamespace(metrics=None, send=lambda *a: None)
    s.gate = None
    s.sent, s.forwards = [], []
    s._send = lambda identity, msg, keys=None, track=True: s.sent.append((identity, msg))
    # a zero-copy send: the message keeps the very arrays until the I/O thread sends them
    s._send_peer = lambda backup, msg, keys=None: s.forwards.append(
        (msg, [a.copy() for a in msg.arrays])
    )
    return s


def call(s, rank, kind, body, arrays=(), msg_id=None):
    msg = Message(
        kind, msg_id or (len(s.sent) + 1000 * rank + 1), f"worker-{rank}", body, list(arrays)
    )
    {"init": s._on_init, "push": s._on_push, "pull": s._on_pull}[kind](
        f"worker-{rank}".encode(), rank, msg
    )


def test_a_forwarded_sum_is_not_reused_while_in_flight():
    """No optimizer (sums assigned), W=3, R=2. Workers 0 and 2 push key k twice (push returns
    before its answer); worker 1 joins: one _execute applies rounds 0 and 1. Round 0's sum is
    forwarded zero-copy, but Apply 1 gives it back as a spare (the forward is not yet tracked),
    and the next round sums into it while the forward still reads it."""
    W, pushers = 5, (0, 2, 3, 4)
    s = replicated_server(W)
    K = ["k", 0]
    call(s, 0, "init", {"keys": [K]}, [np.zeros(4, np.float32)])
    for n in range(2):
        for r in pushers:
            call(s, r, "push", {"keys": [K]}, [np.full(4, 10.0 * n + r + 1, np.float32)])
    s._execute(s.rounds.joined(1, time.monotonic()))
    assert len(s.forwards) == 1
    msg, at_send = s.forwards[0]
    assert len(msg.arrays) == 2
    # the next round (worker 1 stays joined)
    for r in pushers:
        call(s, r, "push", {"keys": [K]}, [np.full(4, 100.0 + r, np.float32)])
    for live, sent in zip(msg.arrays, at_send, strict=True):
        assert np.array_equal(live, sent), (
            f"a forward's array was overwritten while in flight: sent {sent}, now {live}"
        )


def _failover(s, epoch, dead):
    s._peers, s.gate = {}, None
    s._connect_peers = lambda: None
    s._on_failover(
        Message("failover", 0, "scheduler", {"epoch": epoch, "dead": dead, "reason": "test"})
    )


def test_r3_a_forward_before_the_failover_notice_is_not_refused():
    """R=3, S=3. Server 0 dies; server 1 hears the failover first, takes over home 0 and
    forwards a round to server 2, which has not processed its failover yet (sockets are
    polled before the control pipe): it refuses ('server 1 does not answer for server 0's
    parts'), and the primary then drops server 2 for good, telling nobody."""
    chains = ((0, 1, 2), (1, 2, 0), (2, 0, 1))
    s1 = replicated_server(1, rank=1, chains=chains)
    s2 = replicated_server(1, rank=2, chains=chains)
    K = ["k", 0]
    for s in (s1, s2):
        call(s, 0, "init", {"keys": [K], "home": 0}, [np.zeros(4, np.float32)])
    _failover(s1, 1, [0])
    s1._peer_ready = {2: True}
    call(s1, 0, "push", {"keys": [K], "epoch": 1}, [np.ones(4, np.float32)])
    assert s1.forwards, "server 1 forwards home 0's round to server 2"
    s2.gate = None
    s2._handle_peer(b"server-1", None, s1.forwards[0][0])
    kinds = [m.kind for _, m in s2.sent]
    assert "error" not in kinds, [m.body for _, m in s2.sent]


def test_a_root_only_key_taken_over_keeps_its_root():
    """kvstore.torch's broadcast keys ('kvt.root<r>.'): only rank r's bytes count. A backup
    copy skips the _roots registration in _on_init, and _on_failover's add_key does not add
    it: after a failover the new acting server sums every rank's push."""
    s = replicated_server(2, rank=1)
    K = ["kvt.root0.w", 0]
    call(s, 0, "init", {"keys": [K], "home": 0}, [np.zeros(4, np.float32)])
    _failover(s, 1, [0])
    call(s, 0, "push", {"keys": [K], "epoch": 1}, [np.ones(4, np.float32)])
    call(s, 1, "push", {"keys": [K], "epoch": 1}, [np.full(4, 5.0, np.float32)])
    assert np.array_equal(s.stored[("kvt.root0.w", 0)], np.ones(4, np.float32)), s.stored
