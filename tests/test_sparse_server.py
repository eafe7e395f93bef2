"""A server's row-sparse handlers without sockets: requests in, replies out.

The server is built without its sockets or its scheduler link; each request calls its
handler as the poll loop does (a handler that raises is a refusal: the loop answers it with
the error), and the replies are collected instead of sent."""

from types import SimpleNamespace

import numpy as np
import pytest

from kvstore import optimizer as opt
from kvstore.compression import PullCodes
from kvstore.protocol import Message
from kvstore.replication import Backup
from kvstore.rounds import Rounds
from kvstore.server import Server, _show
from kvstore.sparse import SparseKeys, zeros

SHAPE = (10, 2)


def make_server(num_workers: int, num_server: int = 1, rank: int = 0):
    s = object.__new__(Server)
    s.cfg = SimpleNamespace(num_server=num_server, verbose=0)
    s.num_workers, s.rank, s.name = num_workers, rank, f"server {rank}"
    s.stored, s.sending, s._shm_of, s._roots = {}, {}, {}, {}
    s.pull_codes = PullCodes()
    s.rounds = Rounds(num_workers, 0, describe=_show)
    s.rows, s._owned = SparseKeys(), {}
    s.updater = s.optimizer_spec = None
    s.chains, s.backup, s._unsent = None, Backup(), set()  # no replicas
    s._lost, s._last_failure, s._peer_lost = set(), "", ""
    s.control = SimpleNamespace(metrics=None)
    s.sent = []  # (identity, message) of every reply
    s._send = lambda identity, msg, keys=None, track=True: s.sent.append((identity, msg))
    return s


def request(s, rank: int, kind: str, body: dict, arrays=()):
    """Call the handler of ``kind`` as worker ``rank``; the replies it caused."""
    before = len(s.sent)
    msg = Message(kind, len(s.sent) + 100 * rank, f"worker-{rank}", body, list(arrays))
    handler = {
        "sparse_init": s._on_sparse_init,
        "sparse_push": s._on_sparse_push,
        "sparse_pull": s._on_sparse_pull,
        "sparse_rows": s._on_sparse_pull,
        "sparse_load": s._on_sparse_load,
    }[kind]
    handler(f"worker-{rank}".encode(), rank, msg)
    return s.sent[before:]


def rows(ids, value):
    ids = np.array(ids, np.int64)
    return [ids, np.full((ids.size, SHAPE[1]), value, np.float32)]


def init(s, key="e", part=0):
    meta = [SHAPE[0], SHAPE[1], "<f4", zeros()]
    request(s, 0, "sparse_init", {"keys": [[key, part]], "meta": [meta]}, rows([], 0))


def push(s, rank, ids, value, sync=True, key="e"):
    return request(s, rank, "sparse_push", {"keys": [[key, 0]], "sync": sync}, rows(ids, value))


def table(s, key="e", part=0):
    return s.rows.tables[(key, part)].read(np.arange(SHAPE[0]))


def test_a_push_refused_after_join_adds_no_rows():
    """A push refused by the rounds (a worker that joined) is answered with the error, and
    its rows are not summed into the round it would have joined."""
    s = make_server(2)
    init(s)
    s._execute(s.rounds.joined(1, 0.0))
    (refused,) = push(s, 1, [2], 100.0)
    assert refused[1].kind == "error" and "after join()" in refused[1].body["message"]
    (ack,) = push(s, 0, [1], 1.0)
    assert ack[1].kind == "ack"
    assert table(s)[:3, 0].tolist() == [0.0, 1.0, 0.0]


def test_sync_rounds_keep_their_rows_when_async_pushes_come_between():
    """An async push applied while a sync round is open advances the table's step; the
    round still sums its own pushes."""
    s = make_server(2)
    init(s)
    assert push(s, 0, [1], 1.0) == []  # waits for rank 1
    push(s, 1, [3], 5.0, sync=False)
    replies = push(s, 1, [2], 2.0)
    assert sorted(r[0] for r in replies) == [b"worker-0", b"worker-1"]
    assert table(s)[:4, 0].tolist() == [0.0, 1.0, 2.0, 5.0]


def test_an_optimizer_rows_cannot_use_is_refused_before_the_round():
    """LAMB cannot update rows: each push is refused when it comes, so no round opens that
    would fail when applied (and leave the other workers' pushes unanswered)."""
    s = make_server(2)
    init(s)
    s.updater = opt.Updater(opt.LAMB())
    for rank in (0, 1):
        with pytest.raises(ValueError, match="LAMB's update takes norms"):
            push(s, rank, [1], 1.0)
    assert not s.rounds._open


def test_a_round_that_fails_to_apply_answers_every_waiting_push():
    """An error while applying a round (here memory) fails every request waiting on it,
    with the reason, instead of leaving the others to their timeout."""
    s = make_server(3)
    init(s)
    t = s.rows.tables[("e", 0)]

    def no_memory(*args, **kwargs):
        raise MemoryError("unable to allocate 8.00 GiB")

    t.assign_sums = t.apply = no_memory
    assert push(s, 0, [1], 1.0) == [] and push(s, 2, [2], 1.0) == []
    pull = request(s, 0, "sparse_pull", {"keys": [["e", 0]]}, [np.array([1], np.int64)])
    assert pull == []  # waits for the round rank 0 pushed
    replies = push(s, 1, [3], 1.0)
    assert sorted(r[0] for r in replies) == [b"worker-0", b"worker-0", b"worker-1", b"worker-2"]
    for _, msg in replies:
        assert msg.kind == "error" and "MemoryError: unable to allocate" in msg.body["message"]
        assert "round 0 of row-sparse key 'e' could not be applied" in msg.body["message"]
    del t.assign_sums, t.apply  # the next round applies as usual
    for rank in range(3):
        push(s, rank, [rank], 1.0)
    assert table(s)[:3, 0].tolist() == [1.0, 1.0, 1.0]


def test_malformed_requests_are_refused_and_change_nothing():
    """Every malformed request is refused (the handler raises: the loop answers with the
    error), none is left unanswered, and a refused init creates no key."""
    s = make_server(1, num_server=2, rank=0)
    meta = [SHAPE[0], SHAPE[1], "<f4", zeros()]
    bad_ids = [np.array([20], np.int64), np.ones((1, 2), np.float32)]  # row 20 of 10
    with pytest.raises(ValueError, match=r"in \[0, 10\)"):
        request(
            s,
            0,
            "sparse_init",
            {"keys": [["a", 0], ["b", 0]], "meta": [meta] * 2},
            rows([], 0) + bad_ids,
        )
    assert not s.rows.tables and not s.rounds.keys
    with pytest.raises(ValueError, match="part 1 of key 'a' is not this server's"):
        request(s, 0, "sparse_init", {"keys": [["a", 1]], "meta": [meta]}, rows([], 0))
    with pytest.raises(ValueError, match="appears twice"):
        request(s, 0, "sparse_init", {"keys": [["a", 0]] * 2, "meta": [meta] * 2}, rows([], 0) * 2)
    assert not s.rows.tables and not s.rounds.keys
    init(s, "a")
    init(s, "b")
    for kind, body, arrays in [
        ("sparse_push", {"keys": []}, []),
        ("sparse_pull", {"keys": []}, []),
        ("sparse_rows", {"keys": [], "since": 0}, []),
        ("sparse_rows", {"keys": [["a", 0], ["b", 0]], "since": 0}, []),
    ]:
        with pytest.raises(ValueError, match="one key|no keys"):
            request(s, 0, kind, body, arrays)
    (ok,) = request(s, 0, "sparse_rows", {"keys": [["a", 0]], "since": -1})
    assert ok[1].kind == "ack"


def test_a_dense_round_that_fails_to_apply_answers_every_waiting_request():
    """The same for a dense key: an updater that raises fails every request waiting on the
    round, not only the push that completed it."""
    s = make_server(2)
    s._ranks = {b"worker-0": 0, b"worker-1": 1}
    request_dense = {"init": s._on_init, "push": s._on_push, "pull": s._on_pull}

    def call(rank, kind, body, arrays=()):
        before = len(s.sent)
        msg = Message(kind, len(s.sent) + 100 * rank, f"worker-{rank}", body, list(arrays))
        request_dense[kind](f"worker-{rank}".encode(), rank, msg)
        return s.sent[before:]

    call(0, "init", {"keys": [["w", 0]]}, [np.zeros(3, np.float32)])

    def broken(key, grad, weight):
        raise FloatingPointError("the update overflowed")

    s.updater = broken
    assert call(0, "push", {"keys": [["w", 0]]}, [np.ones(3, np.float32)]) == []
    replies = call(1, "push", {"keys": [["w", 0]]}, [np.ones(3, np.float32)])
    assert sorted(r[0] for r in replies) == [b"worker-0", b"worker-1"]
    for _, msg in replies:
        assert (
            msg.kind == "error"
            and "FloatingPointError: the update overflowed" in (msg.body["message"])
        )


def test_a_pushpull_is_answered_with_a_delta_of_its_rows():
    """A row pushpull's reply after a round without an optimizer: the positions (into its
    ids) of the rows another worker pushed too, with their sums; its other rows are 0 + its
    own, which its worker holds. Through a shared segment too: the delta is in the reply."""
    s = make_server(2)
    init(s)
    s._ranks = {b"worker-0": 0, b"worker-1": 1}
    s._shm_of = {(0, ("e", 0)): SimpleNamespace(pull=np.zeros(256, np.uint8))}
    body = {"keys": [["e", 0]], "sync": True, "pull": True, "shm_pull": [0]}
    assert request(s, 0, "sparse_push", body, rows([1, 4, 7], 1.5)) == []
    replies = dict(request(s, 1, "sparse_push", body, rows([0, 4, 5, 7, 9], -0.5)))
    for worker, at in ((b"worker-0", [1, 2]), (b"worker-1", [1, 3])):
        reply = replies[worker]
        assert reply.kind == "data" and "shm" not in reply.body, reply.body
        ((index, raw),) = reply.body["delta"]
        assert index == 0 and np.frombuffer(raw, "<i4").tolist() == at
        assert reply.arrays[0].tolist() == [[1.0, 1.0], [1.0, 1.0]]  # rows 4 and 7: the sums
    assert table(s)[[0, 1, 4, 5, 7, 9], 0].tolist() == [-0.5, 1.5, 1.0, -0.5, 1.0, -0.5]


def test_an_elastic_newcomers_first_row_push_is_summed():
    """A newcomer that took a slot pushes a key its survivors already pushed rounds of
    without it: its first push joins the round in progress, and its rows are in the sum
    (they were acknowledged and dropped before: review of the rows2 merge)."""
    s = make_server(2)
    init(s)
    s._ranks = {b"worker-0": 0, b"worker-1": 1}
    s._execute(s.rounds.leave(1, 0.0))  # slot 1's worker leaves ...
    s.rounds.arrive(1, 1)  # ... and a newcomer takes the slot (Server._on_members does both)
    for _ in range(3):  # the survivor trains on alone meanwhile
        assert [m.kind for _, m in push(s, 0, [1], 1.0)] == ["ack"]
    a = push(s, 1, [5], 7.0)  # the newcomer's first push of the key: waits for worker 0
    b = push(s, 0, [5], 1.0)  # completes the round with both pushes
    assert [m.kind for _, m in a + b] == ["ack", "ack"]
    assert table(s)[5, 0] == 8.0
    a = push(s, 1, [5], 2.0)  # and the next round as usual
    b = push(s, 0, [6], 1.0)
    assert [m.kind for _, m in a + b] == ["ack", "ack"]
    assert table(s)[[5, 6], 0].tolist() == [2.0, 1.0]


@pytest.mark.parametrize("backup", [False, True])
def test_a_group_s_row_sparse_key_is_made_by_any_member_and_pushed_by_members_only(backup):
    """``init(..., members=)`` of a row-sparse key (Horovod's process sets, an elastic job's
    generation): each member sends the init, the first makes the key and the same init again
    is answered as done; another shape, dtype, init spec or group is refused; a worker outside
    the group may not push it, and a round completes with the members' pushes (a backup's
    passive copy, ``home`` 1 of server 0, checks the same)."""
    from kvstore.sparse import uniform

    s = make_server(3)
    extra = {}
    if backup:  # server 0 holding a copy of server 1's part, server 1 alive
        s.chains, s.dead, s.cfg.num_server = [[0, 1], [1, 0]], set(), 2
        s.primary = None
        extra = {"home": 1}
    part = 1 if backup else 0
    meta = [SHAPE[0], SHAPE[1], "<f4", zeros()]
    body = {"keys": [["g", part]], "meta": [meta], "members": [0, 2], **extra}
    for rank in (0, 2):
        (ack,) = request(s, rank, "sparse_init", body, rows([], 0))
        assert ack[1].kind == "ack"
    assert ("g", part) in s.rows.tables
    for other in (
        [SHAPE[0], SHAPE[1] + 1, "<f4", zeros()],
        [SHAPE[0], SHAPE[1], "<f8", zeros()],
        [SHAPE[0], SHAPE[1], "<f4", uniform(0, 1, seed=3)],
    ):
        with pytest.raises(ValueError, match="already initialised"):
            request(s, 2, "sparse_init", {**body, "meta": [other]}, rows([], 0))
    with pytest.raises(ValueError, match="already initialised"):
        request(s, 0, "sparse_init", {**body, "members": [0, 1, 2]}, rows([], 0))
    with pytest.raises(ValueError, match="already initialised"):  # not a group's: once only
        request(s, 0, "sparse_init", {k: v for k, v in body.items() if k != "members"}, rows([], 0))
    if backup:
        return  # (a passive copy answers no pushes while its primary lives)
    (refused,) = push(s, 1, [3], 1.0, key="g")
    assert refused[1].kind == "error" and "only its members" in refused[1].body["message"]
    assert push(s, 0, [3, 4], 1.0, key="g") == []  # waits for rank 2, not rank 1
    replies = push(s, 2, [4], 2.0, key="g")
    assert sorted(r[1].kind for r in replies) == ["ack", "ack"]
    assert table(s, "g")[[3, 4], 0].tolist() == [1.0, 3.0]
