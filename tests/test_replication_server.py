"""The replicated server's rules at the level of one process, without sockets: a hand-made
``Server`` (as ``tests/test_sparse_server.py`` makes one) whose forwards are captured, and the
scheduler's state machine. Each test is a scenario a review found broken (join after a
failover, a forwarded sum reused while in flight, a forward that arrives before its
failover notice, a broadcast key taken over; for row-sparse keys: a failed round or load, a
deferred forward's arrays, loads in order and re-sent, a newcomer's request ids), and a
property test drives a row-sparse primary and its backup through any interleaving.
"""

import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    s.primary, s.backup, s.backup_updaters, s._home_specs = Primary(), Backup(), {}, {}
    s._targets = {rank: [b for b in s.chains[rank] if b != rank]}
    s._peer_ready = {b: True for b in s._targets[rank]}
    s._backlog, s._pusher, s._deferred, s._unsent = {}, None, [], set()
    s._lost, s._last_failure, s._peer_lost = set(), "", ""
    s._listener = None  # no same-host channels (kvstore.channel)
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
    s2._handle_peer(b"server-1", [None], s1.forwards[0][0])
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


@pytest.mark.parametrize("knew", [True, False])
@pytest.mark.parametrize("order", ["arrival first", "init first"])
def test_a_key_made_after_a_newcomer_came_is_taken_over_with_it_alike(knew, order):
    """(From review.) A key made after a newcomer came has it in its rounds from the start
    (``Rounds.arrive`` changed only the keys there were) when its worker knew of it (the
    init's ``mepoch``); else the newcomer is out until its first push, as if it came after.
    Each server may handle the members notice and the init in either order: the primary and
    the copy it took over decide alike either way."""
    from kvstore.compression import PullCodes

    p, b = replicated_server(2, rank=0), replicated_server(2, rank=1)
    p.pull_codes = b.pull_codes = PullCodes()
    K, key = ["k", 0], ("k", 0)
    body = {"keys": [K], "home": 0, **({"mepoch": 3} if knew else {})}

    def arrive(s):  # slot 1's worker leaves, a newcomer takes the slot at epoch 3
        _members(s, 2, left=1)
        _members(s, 3, joined=1)

    for s in (p, b):
        if order == "arrival first" or knew:  # (a server holds an init until it knows mepoch)
            arrive(s)
            call(s, 0, "init", body, [np.zeros(4, np.float32)])
        else:
            call(s, 0, "init", body, [np.zeros(4, np.float32)])
            arrive(s)
    call(p, 0, "push", {"keys": [K]}, [np.ones(4, np.float32)], msg_id=10)
    waits = p.rounds.keys[key].done == 0
    assert waits == knew, "the primary decides by what the initialising worker knew"
    assert deliver(p, b) == []
    _failover(b, 4, [0])
    again = {"keys": [K], "epoch": 4, "resend": True}
    call(b, 0, "push", again, [np.ones(4, np.float32)], msg_id=10)
    if waits:
        assert b.rounds.keys[key].done == 0, "the copy closed the round without the newcomer"
    else:  # the primary's round 0 went without it: the copy counted it and goes on alike
        assert b.rounds.keys[key].done == 1
        call(b, 0, "push", {"keys": [K], "epoch": 4}, [np.ones(4, np.float32)], msg_id=11)
        assert b.rounds.keys[key].done == 2, "the copy waits for the newcomer"


def test_a_backup_changes_optimizer_where_its_primary_did_among_the_rounds():
    """A changed optimizer (MXNet changes a schedule by calling set_optimizer again) reaches
    each server from every worker. A backup installed it for its copies on a worker's call,
    which may come before the forward of a round its primary applied with the old one: that
    round was applied with another learning rate there, and after a failover the values
    were not the primary's. The primary now forwards the change in its place."""
    from kvstore.optimizer import SGD

    p, b = _dense_pair()
    K, key = ["k", 0], ("k", 0)

    def set_optimizer(s, lr, at):
        _set_optimizer(s, SGD(learning_rate=lr, momentum=0.9), at)

    for s in (p, b):
        set_optimizer(s, 0.1, 50)
    assert deliver(p, b) == []
    for rank in range(2):  # round 0, with lr 0.1; its forward is still on the way...
        call(p, rank, "push", {"keys": [K]}, [np.full(4, 1.0 + rank, np.float32)], 60 + rank)
    for s in (b, p):  # ...when the workers' next set_optimizer reaches the backup
        set_optimizer(s, 0.5, 70)
    for rank in range(2):  # round 1, with lr 0.5
        call(p, rank, "push", {"keys": [K]}, [np.full(4, 3.0 - rank, np.float32)], 80 + rank)
    assert deliver(p, b) == []
    assert p.stored[key].tobytes() == b.stored[key].tobytes(), (p.stored[key], b.stored[key])
    acked = {m.id for _, m in p.sent if m.kind == "ack"}
    assert not acked & {70, 71}, "set_optimizer answered before the backup holds it"
    for ready in p.primary.ack(1, p.primary.sent[1]):  # the backup acknowledges
        p._reply(ready)
    assert {m.id for _, m in p.sent if m.kind == "ack"} >= {70, 71}
    _failover(b, 1, [0])  # the taken-over copy goes on with the primary's optimizer state
    for s in (p, b):
        for rank in range(2):
            call(s, rank, "push", {"keys": [K], "epoch": 1}, [np.ones(4, np.float32)], 90 + rank)
    assert p.stored[key].tobytes() == b.stored[key].tobytes(), (p.stored[key], b.stored[key])


@pytest.mark.parametrize("lost", ["the forward", "the workers' calls"])
def test_a_key_taken_over_updates_with_the_optimizer_set_last(lost):
    """The primary dies after a second set_optimizer: either before it forwarded the change
    (the backup heard the workers' calls only), or the backup heard only the forward so far.
    Either way the taken-over copy updates the next rounds with the optimizer set last."""
    from kvstore.optimizer import SGD

    p, b = _dense_pair()
    K, key = ["k", 0], ("k", 0)

    def set_optimizer(s, lr, at):
        _set_optimizer(s, SGD(learning_rate=lr), at)

    for s in (p, b):
        set_optimizer(s, 0.1, 50)
    assert deliver(p, b) == []
    set_optimizer(p, 0.5, 70)
    if lost == "the forward":
        p.forwards.clear()
        set_optimizer(b, 0.5, 70)
    else:
        assert deliver(p, b) == []
    _failover(b, 1, [0])
    for rank in range(2):
        call(b, rank, "push", {"keys": [K], "epoch": 1}, [np.ones(4, np.float32)], 90 + rank)
    assert b.stored[key].tolist() == [0.0] * 4, "not updated with lr 0.5 (1 - 0.5 * 2)"


@pytest.mark.parametrize("backup_fails", [True, False])
def test_a_state_load_that_fails_part_way_must_fail_alike_on_the_backup(backup_fails):
    """(From review.) Past its checks a load can still fail part way (memory): the primary
    forwards it with why, and the backup, loading the same, must fail alike, or it refuses
    the forward (and is no replica any more), never holding other states than its primary."""
    from kvstore.compression import PullCodes
    from kvstore.optimizer import SGD
    from kvstore.sparse import dump_states

    p, b = rows_server(2, 0), rows_server(2, 1)
    for s in (p, b):
        s.pull_codes, s._optimizer_calls, s._optimizer_count = PullCodes(), [], {}
        rows_init(s, "e", 0)
        _set_optimizer(s, SGD(learning_rate=0.1, momentum=0.9), 50)
    for rank in range(2):
        body = {"keys": [["e", 0]], "sync": True}
        rows_call(p, rank, "sparse_push", body, row_set([1, 2], 1.0 + rank), 60 + rank)
    assert deliver(p, b) == []
    saved = dump_states(p.updater, p._tables_of(0))

    def out_of_memory(*_):
        raise MemoryError("no room")

    for s in (p, b) if backup_fails else (p,):
        s.rows.tables[("e", 0)].restore_bookkeeping = out_of_memory
    body = {"name": "set_states", "home": 0}
    msg = Message("command", 900, "worker-0", body, [np.frombuffer(saved, np.uint8)])
    with pytest.raises(RuntimeError, match="failed part way"):
        p._on_command(b"worker-0", 0, msg)
    ((forward, _),) = p.forwards
    assert forward.body["failed"] == "MemoryError: no room"
    refused = deliver(p, b)
    assert bool(refused) != backup_fails, refused


def test_load_optimizer_states_is_forwarded_in_order_and_never_loaded_twice():
    """load_optimizer_states reached every replica on its own, so a backup could load the
    states on the other side of a round than its primary. It now goes to the acting server,
    which forwards it in its place and answers once the backups hold it; a copy refuses it;
    re-sent after a failover to a backup that holds it, it is answered, not loaded again
    (that would undo the rounds applied since)."""
    from kvstore.optimizer import SGD
    from kvstore.sparse import dump_states

    p, b = _dense_pair()
    K, key = ["k", 0], ("k", 0)
    for s in (p, b):
        _set_optimizer(s, SGD(learning_rate=0.1, momentum=0.9), 50)
    assert deliver(p, b) == []

    def round_(s, n, epoch=0):
        for rank in range(2):
            body = {"keys": [K], "epoch": epoch} if epoch else {"keys": [K]}
            grad = np.full(4, n + rank + 1.0, np.float32)
            call(s, rank, "push", body, [grad], msg_id=100 * n + rank + 1)

    def set_states(s, blob, resend=False):
        body = {"name": "set_states", "home": 0, **({"resend": True} if resend else {})}
        msg = Message("command", 900, "worker-0", body, [np.frombuffer(blob, np.uint8)])
        s._on_command(b"worker-0", 0, msg)

    round_(p, 1)
    saved = dump_states(p.updater, p._tables_of(0))  # a checkpoint's states
    round_(p, 2)
    assert deliver(p, b) == []
    with pytest.raises(ValueError, match="loaded by their primary"):
        set_states(b, saved)  # a copy's states come from its primary
    set_states(p, saved)
    assert 900 not in {m.id for _, m in p.sent}, "answered before the backup holds it"
    round_(p, 3)  # (after the load, on both)
    assert deliver(p, b) == []
    for ready in p.primary.ack(1, p.primary.sent[1]):
        p._reply(ready)
    assert 900 in {m.id for _, m in p.sent if m.kind == "ack"}
    assert p.stored[key].tobytes() == b.stored[key].tobytes(), (p.stored[key], b.stored[key])
    held = dump_states(b.backup_updaters[0], b._tables_of(0))
    assert held == dump_states(p.updater, p._tables_of(0))
    _failover(b, 1, [0])  # the primary died before its answer reached worker 0
    set_states(b, saved, resend=True)
    assert 900 in {m.id for _, m in b.sent if m.kind == "ack"}
    assert dump_states(b.backup_updaters[0], b._tables_of(0)) == held, "loaded twice"


def _dense_pair():
    """A primary (server 0) and its backup, W=2, holding dense key k of home 0 (ones)."""
    from kvstore.compression import PullCodes

    p, b = replicated_server(2, rank=0), replicated_server(2, rank=1)
    for s in (p, b):
        s.pull_codes, s._optimizer_calls, s._optimizer_count = PullCodes(), [], {}
        call(s, 0, "init", {"keys": [["k", 0]], "home": 0}, [np.ones(4, np.float32)])
    return p, b


def _set_optimizer(s, optimizer, at: int, W: int = 2) -> None:
    """Every worker's ``set_optimizer(optimizer)`` as server ``s`` handles it (ids ``at``...)."""
    spec = optimizer.spec()
    for rank in range(W):
        msg = Message("optimizer", at + rank, f"worker-{rank}", {"spec": spec})
        s._on_optimizer(f"worker-{rank}".encode(), rank, msg)


def _members(s, epoch, left=None, joined=None):
    """The scheduler's ``members`` notice of an elastic job, as a server handles it."""
    s.members_epoch = getattr(s, "members_epoch", 0)
    s._proved, s._optimizer_count = {}, {}
    body = {"epoch": epoch, "present": [0, 1], "why": "test"}
    body.update({"left": left} if left is not None else {"joined": joined})
    s._on_members(Message("members", 0, "scheduler", body))


@pytest.mark.parametrize("newcomer_pushed", [False, True])
def test_a_key_taken_over_keeps_a_newcomer_out_of_its_rounds_until_its_first_push(
    newcomer_pushed,
):
    """Elastic workers and replicas. A newcomer is out of a key's rounds until its first push
    of the key (``Rounds.arrive``, on the primary's active keys). A backup's copy is passive:
    taken over, it counted the newcomer in, so the next round waited for a push the newcomer
    was not making (in a blocking loop it waits on a key of another server: a deadlock). A
    newcomer whose push of the key is in a forwarded round is in, and must be waited for."""
    from kvstore.compression import PullCodes
    from kvstore.protocol import request_ids

    p, b = replicated_server(2, rank=0), replicated_server(2, rank=1)
    p.pull_codes = b.pull_codes = PullCodes()
    K, key = ["k", 0], ("k", 0)
    for s in (p, b):
        call(s, 0, "init", {"keys": [K], "home": 0}, [np.zeros(4, np.float32)])
    old, new = request_ids(0), request_ids(3)  # slot 1: its first holder, then epoch 3's
    call(p, 0, "push", {"keys": [K]}, [np.ones(4, np.float32)], msg_id=10)
    call(p, 1, "push", {"keys": [K]}, [np.ones(4, np.float32)], msg_id=next(old))
    for s in (p, b):  # slot 1's worker dies; a newcomer takes the slot
        _members(s, 2, left=1)
        _members(s, 3, joined=1)
    if newcomer_pushed:  # (first: the round then waits for worker 0's push too)
        call(p, 1, "push", {"keys": [K]}, [np.full(4, 5.0, np.float32)], msg_id=next(new))
    call(p, 0, "push", {"keys": [K]}, [np.full(4, 2.0, np.float32)], msg_id=11)
    assert p.rounds.keys[key].done == 2
    assert p.stored[key].tolist() == [7.0 if newcomer_pushed else 2.0] * 4
    for msg, arrays in p.forwards:
        b._on_replica(b"server-0", 0, Message(msg.kind, msg.id, msg.sender, msg.body, arrays))
    _failover(b, 4, [0])
    call(b, 0, "push", {"keys": [K], "epoch": 4}, [np.full(4, 3.0, np.float32)], msg_id=12)
    if not newcomer_pushed:
        assert b.rounds.keys[key].done == 3, (
            "the taken-over key waits for a newcomer that has not pushed it"
        )
        assert b.stored[key].tolist() == [3.0] * 4
        return
    assert b.rounds.keys[key].done == 2, "the newcomer's rounds of the key were lost"
    call(b, 1, "push", {"keys": [K], "epoch": 4}, [np.full(4, 4.0, np.float32)], next(new))
    assert b.rounds.keys[key].done == 3
    assert b.stored[key].tolist() == [7.0] * 4


# ---------------------------------------------------------------- row-sparse keys

ROWS = (100_000, 4)


def rows_server(W, rank, chains=((0, 1), (1, 0))):
    from kvstore.compression import PullCodes

    s = replicated_server(W, rank, chains)
    s.pull_codes, s._owned, s._segments = PullCodes(), {}, {}
    s.cfg.num_server = 1  # every id is every part's (hash sharding over one server)
    return s


def rows_call(s, rank, kind, body, arrays, msg_id):
    handler = {
        "sparse_init": s._on_sparse_init,
        "sparse_push": s._on_sparse_push,
        "sparse_load": s._on_sparse_load,
    }[kind]
    handler(f"worker-{rank}".encode(), rank, Message(kind, msg_id, f"worker-{rank}", body, arrays))


def row_set(ids, value):
    ids = np.array(ids, np.int64)
    return [ids, np.full((ids.size, ROWS[1]), value, np.float32)]


def rows_init(s, key, home, init=None):
    from kvstore.sparse import zeros

    meta = [ROWS[0], ROWS[1], "<f4", init or zeros()]
    body = {"keys": [[key, home]], "meta": [meta], "home": home}
    rows_call(s, 0, "sparse_init", body, row_set([], 0), 1)


def deliver(primary, backup, peer=0) -> list:
    """The primary's captured forwards, handled by the backup: the refusals (the errors its
    replication link answers with, ``_handle_peer``)."""
    refused = []
    for msg, arrays in primary.forwards:
        try:
            backup._on_replica(
                f"server-{peer}".encode(),
                peer,
                Message(msg.kind, msg.id, msg.sender, msg.body, arrays),
            )
        except Exception as exc:
            refused.append(str(exc))
    primary.forwards.clear()
    return refused


def table_state(s, key) -> tuple:
    t = s.rows.tables[key]
    return t.step, t.ids.tolist(), t.block[t.slots].tobytes(), t.changed[t.slots].tolist()


def test_a_row_round_the_primary_could_not_apply_must_fail_alike_on_the_backup():
    """A round that raises part way (a MemoryError, the 2**31-row limit) has already moved
    the table's step, evicted and written rows on the primary. A backup that only counted it
    stayed a step behind for good, and evicted other rows. Now the backup applies the same
    pushes: failing the same way keeps it in step; applying them where the primary could not
    makes it refuse (it is no replica any more)."""
    from kvstore.sparse import zeros

    spec = {**zeros(), "evict_after": 4}
    key = ("e", 0)
    for fails_on_backup_too in (True, False):
        p, b = rows_server(2, 0), rows_server(2, 1)
        for s in (p, b):
            rows_init(s, "e", 0, spec)
        ids = iter(range(100, 200))

        def round_(rows0, rows1, p=p, b=b, ids=ids):
            for rank, r in enumerate((rows0, rows1)):
                body = {"keys": [list(key)], "sync": True}
                rows_call(p, rank, "sparse_push", body, row_set(r, 1.0 + rank), next(ids))
            return deliver(p, b)

        assert round_([1], [2]) == []
        broken = [s.rows.tables[key] for s in ((p, b) if fails_on_backup_too else (p,))]
        for t in broken:
            t._create = lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room"))
        errors = round_([5], [6])
        for t in broken:
            del t._create
        if not fails_on_backup_too:
            assert errors and "cannot follow its primary" in errors[0], errors
            continue
        assert errors == [], errors
        for i in range(8):  # evictions, every other round, at the same steps
            assert round_([10 + i], []) == []
            assert table_state(b, key) == table_state(p, key), i


def test_a_deferred_forward_keeps_its_arrays():
    """S=3, R=2: server 0 dies; server 1 forwards a round of its own part, stamped with the
    new epoch, to server 2 before server 2 processed the failover. The forward waited with
    its header frame only: replayed, it had no arrays, server 2 refused it, was dropped as a
    replica and failed over, and the job lost home 2's chain."""
    from kvstore.protocol import encode_frames

    chains = ((0, 1), (1, 2), (2, 0))
    s1, s2 = rows_server(2, 1, chains), rows_server(2, 2, chains)
    key = ["e", 1]
    for s in (s1, s2):
        rows_init(s, "e", 1)
    _failover(s1, 1, [0])
    s1._peer_ready = {2: True}
    ids = np.arange(3000, dtype=np.int64)  # rows over 16 KiB: a frame of their own
    for rank in range(2):
        body = {"keys": [key], "sync": True, "epoch": 1}
        rows_call(s1, rank, "sparse_push", body, [ids, np.ones((3000, 4), np.float32)], 50 + rank)
    msg, arrays = s1.forwards[0]
    frames, _ = encode_frames(Message(msg.kind, msg.id, msg.sender, msg.body, arrays))
    assert len(frames) > 1
    s2.sent.clear()
    s2._handle(b"server-1", frames)  # before its failover notice: deferred
    assert not s2.sent
    _failover(s2, 1, [0])  # the notice: the forward is handled now
    assert [m.kind for _, m in s2.sent] == ["ack"], [m.body for _, m in s2.sent]
    assert table_state(s2, ("e", 1)) == table_state(s1, ("e", 1))


def test_load_rows_is_forwarded_in_order_and_never_applied_twice():
    """load_rows went to each replica on its own, so a backup could load before a round
    its primary applied first. Now the primary forwards it in its place. After a failover a
    re-sent load the backup holds is answered, not loaded again (that would undo the rounds
    since), and a re-sent push older than a held load is still applied (a load does not
    count as holding the rank's earlier pushes)."""
    W, key = 2, ("e", 0)
    p, b = rows_server(W, 0), rows_server(W, 1)
    for s in (p, b):
        rows_init(s, "e", 0)
    sync = {"keys": [list(key)], "sync": True}
    rows_call(p, 0, "sparse_push", sync, row_set([5, 6], 1.0), 10)  # round 0 waits for 1
    rows_call(p, 0, "sparse_load", {"keys": [list(key)]}, row_set([5, 9], 7.0), 11)
    rows_call(p, 1, "sparse_push", sync, row_set([5], 2.0), 20)  # round 0 applied: 5 -> 3
    assert deliver(p, b) == []
    assert table_state(b, key) == table_state(p, key)
    read = b.rows.tables[key].read
    assert read(np.array([5, 6, 9]))[:, 0].tolist() == [3.0, 1.0, 7.0]
    # the primary dies before answering the load: worker 0 re-sends it to the backup
    _failover(b, 1, [0])
    again = {"keys": [list(key)], "resend": True, "epoch": 1}
    b.sent.clear()
    rows_call(b, 0, "sparse_load", again, row_set([5, 9], 7.0), 11)
    assert read(np.array([5]))[:, 0].tolist() == [3.0], "the re-sent load undid round 0"
    assert [m.kind for _, m in b.sent] == ["ack"]

    # another primary died holding round 0 open (push 10) after forwarding a load (id 11)
    p, b = rows_server(W, 0), rows_server(W, 1)
    for s in (p, b):
        rows_init(s, "e", 0)
    rows_call(p, 0, "sparse_push", sync, row_set([5], 1.0), 10)
    rows_call(p, 0, "sparse_load", {"keys": [list(key)]}, row_set([9], 7.0), 11)
    assert deliver(p, b) == []
    _failover(b, 1, [0])
    rows_call(b, 0, "sparse_push", {**sync, "resend": True, "epoch": 1}, row_set([5], 1.0), 10)
    rows_call(b, 1, "sparse_push", {**sync, "epoch": 1}, row_set([5], 2.0), 20)
    assert b.rows.tables[key].read(np.array([5]))[:, 0].tolist() == [3.0]
    assert b.rows.rounds_done[key] == 1


def test_a_newcomer_s_resent_push_and_load_are_not_taken_for_its_predecessor_s():
    """A slot's newcomer numbered its requests from 1 again, while a backup keeps, per slot,
    the latest request id of the pushes and loads it holds: a newcomer's push or load lost
    with a dead primary and re-sent was "already held" (an id below its predecessor's), so
    answered and never applied. Its ids now start past any its predecessors could use."""
    from kvstore.protocol import request_ids

    W, key = 2, ("e", 0)
    p, b = rows_server(W, 0), rows_server(W, 1)
    for s in (p, b):
        rows_init(s, "e", 0)
    first, newcomer = request_ids(0), request_ids(3)  # slot 1's holders: the first, epoch 3's
    for _ in range(500):  # the first holder's ids run on
        old = next(first)
    sync = {"keys": [list(key)], "sync": True}
    rows_call(p, 0, "sparse_push", sync, row_set([1], 1.0), 100)
    rows_call(p, 1, "sparse_push", sync, row_set([1], 2.0), old)
    rows_call(p, 1, "sparse_load", {"keys": [list(key)]}, row_set([9], 5.0), next(first))
    assert deliver(p, b) == []
    # the newcomer: a push of round 1, then a load; the primary applies both and dies
    pushed, loaded = next(newcomer), next(newcomer)
    rows_call(p, 0, "sparse_push", sync, row_set([1], 1.0), 101)
    rows_call(p, 1, "sparse_push", sync, row_set([1], 4.0), pushed)
    p.forwards.clear()  # lost with the primary
    _failover(b, 1, [0])
    again = {**sync, "resend": True, "epoch": 1}
    rows_call(b, 0, "sparse_push", again, row_set([1], 1.0), 101)
    rows_call(b, 1, "sparse_push", again, row_set([1], 4.0), pushed)
    assert b.rows.rounds_done[key] == 2, "the newcomer's re-sent push was taken as held"
    assert b.rows.tables[key].read(np.array([1]))[:, 0].tolist() == [5.0]
    load = {"keys": [list(key)], "resend": True, "epoch": 1}
    rows_call(b, 1, "sparse_load", load, row_set([9], 7.0), loaded)
    assert b.rows.tables[key].read(np.array([9]))[:, 0].tolist() == [7.0]


def test_a_load_the_primary_could_not_finish_must_fail_alike_on_the_backup():
    """load_rows moves the table's step, then creates rows: one that raises part way (a
    MemoryError) left the primary's step moved and forwarded nothing, so the backup's step
    (and its evictions, save_rows' steps) differed. Now the load is forwarded with why it
    failed; the backup must fail alike, or refuses (it is no replica any more)."""
    import pytest

    key = ("e", 0)
    for fails_on_backup_too in (True, False):
        p, b = rows_server(2, 0), rows_server(2, 1)
        for s in (p, b):
            rows_init(s, "e", 0)
        broken = [s.rows.tables[key] for s in ((p, b) if fails_on_backup_too else (p,))]
        for t in broken:
            t._create = lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room"))
        body = {"keys": [list(key)], "step": 50}
        with pytest.raises(RuntimeError, match="load_rows failed: MemoryError: no room"):
            rows_call(p, 0, "sparse_load", body, row_set([5, 6], 7.0), 10)
        errors = deliver(p, b)
        if fails_on_backup_too:
            assert errors == [], errors
            assert table_state(b, key) == table_state(p, key)
            assert p.rows.tables[key].step == 50
        else:
            assert errors and "cannot follow its primary's load" in errors[0], errors


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_a_row_sparse_backup_holds_its_primary_s_bits_under_any_interleaving(data):
    """Pushes (rounds ahead of each other, repeated and empty row sets, sync or async), loads
    (with a step) and the forwards' deliveries in any order, with or without an optimizer
    (changed by hand on the way, its states saved and loaded back), admission and eviction:
    once the forwards are delivered, the backup's table is its primary's, bit for bit (rows,
    steps, changed stamps, optimizer state, update counts)."""
    from kvstore import optimizer as opt
    from kvstore.sparse import RowTable, dump_states, zeros

    W = data.draw(st.integers(2, 3), label="W")
    spec = {**zeros(), **data.draw(st.sampled_from([{}, {"admit_after": 2}, {"evict_after": 3}]))}
    optimizer = data.draw(st.sampled_from([None, "sgd", "adam"]), label="optimizer")
    sync = data.draw(st.booleans(), label="sync")
    p, b = rows_server(W, 0), rows_server(W, 1)
    key = ("e", 0)
    for s in (p, b):
        rows_init(s, "e", 0, spec)
        s._optimizer_calls, s._optimizer_count = [], {}
    ids = iter(range(1, 10**6))
    specs = {
        "sgd": [opt.SGD(learning_rate=lr, momentum=0.9).spec() for lr in (0.1, 0.05)],
        "adam": [opt.Adam(learning_rate=lr).spec() for lr in (0.01, 0.02)],
    }.get(optimizer, [])

    def set_optimizer(spec):  # every worker, to both servers (either may hear them first)
        for s in (b, p) if data.draw(st.booleans()) else (p, b):
            for rank in range(W):
                msg = Message("optimizer", next(ids), f"worker-{rank}", {"spec": spec})
                s._on_optimizer(f"worker-{rank}".encode(), rank, msg)

    if optimizer:
        set_optimizer(specs[0])
    saved = None
    pushes = [0] * W
    row_ids = st.lists(st.integers(0, 40), max_size=6).map(lambda x: sorted(set(x)))
    events = ["push", "push", "push", "load", "deliver"]
    events += ["optimizer", "save", "restore", "refused"] if optimizer else []
    for _ in range(data.draw(st.integers(1, 25), label="steps")):
        what = data.draw(st.sampled_from(events))
        rank = data.draw(st.integers(0, W - 1))
        if what == "optimizer":  # changed by hand (the same spec again: the state is kept)
            set_optimizer(data.draw(st.sampled_from(specs)))
            continue
        if what == "save":  # a checkpoint's optimizer states...
            saved = dump_states(p.updater, p._tables_of(0))
            continue
        if what == "restore":  # ...loaded (load_optimizer_states): to the primary only
            if saved is not None:
                body = {"name": "set_states", "home": 0}
                msg = Message("command", next(ids), "worker-0", body, [np.frombuffer(saved, "u1")])
                p._on_command(b"worker-0", 0, msg)
            continue
        if what == "refused":  # a file that names a key this job lacks changes nothing
            other = RowTable(4, np.float32)
            other.assign(np.array([3]), np.ones((1, 4), np.float32))
            bad = dump_states(p.updater, {**p._tables_of(0), ("zz", 0): other})
            before = dump_states(p.updater, p._tables_of(0))
            body = {"name": "set_states", "home": 0}
            msg = Message("command", next(ids), "worker-0", body, [np.frombuffer(bad, "u1")])
            with pytest.raises(ValueError, match="not initialised"):
                p._on_command(b"worker-0", 0, msg)
            assert dump_states(p.updater, p._tables_of(0)) == before, "a refused load changed"
            continue
        if what == "push":
            rows = data.draw(row_ids)
            value = data.draw(st.sampled_from([-0.0, 0.1, 0.7, 1e-8, 3.3, -2.9]))
            body = {"keys": [list(key)], "sync": sync}
            rows_call(p, rank, "sparse_push", body, row_set(rows, value), next(ids))
            pushes[rank] += 1
        elif what == "load":
            step = data.draw(st.sampled_from([None, 0, 5, 20]))
            body = {"keys": [list(key)], **({} if step is None else {"step": step})}
            rows_call(p, rank, "sparse_load", body, row_set(data.draw(row_ids), 0.5), next(ids))
        else:
            assert deliver(p, b) == []
    if sync:  # every rank's rounds complete
        for rank in range(W):
            while pushes[rank] < max(pushes):
                body = {"keys": [list(key)], "sync": True}
                rows_call(p, rank, "sparse_push", body, row_set([], 0), next(ids))
                pushes[rank] += 1
    assert deliver(p, b) == []
    assert table_state(b, key) == table_state(p, key)
    tp, tb = p.rows.tables[key], b.rows.tables[key]
    assert [s[tp.slots].tobytes() for s in tp.states] == [s[tb.slots].tobytes() for s in tb.states]
    assert tp.cand_ids.tolist() == tb.cand_ids.tolist()
    if optimizer:
        assert p.updater.counts == b.backup_updaters[0].counts
