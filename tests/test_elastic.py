"""Elastic workers (``launch.py -n MIN:MAX``, KVSTORE_MIN_WORKERS): a worker can leave (killed,
failed or finished) and another take its slot, while the others train on without a restart.

- The round machine: a slot left mid-round completes the open round with the pushes made; a
  newcomer's pushes start at each key's next round (hypothesis, against a plain model).
- The scheduler: the start waits for MIN, a silent worker leaves (a new epoch, not the end),
  a newcomer waits for a free slot and takes it, and a worker given up on is fenced.
- The real thing, through the launcher: a worker killed half way is started again in its
  slot; the survivors never restart, every round's value is a count of workers, and the
  newcomer's pushes count within a round.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvstore.config import Config
from kvstore.membership import Broadcast, Exit, Membership, Send
from kvstore.protocol import Message
from kvstore.rounds import Apply, Reply, Rounds

from .cluster import ROOT, started_pids


@settings(max_examples=300, deadline=None)
@given(
    W=st.integers(2, 5),
    events=st.lists(
        st.tuples(st.sampled_from(["push", "leave", "arrive", "enter"]), st.integers(0, 4))
    ),
    reproducible=st.booleans(),
)
def test_rounds_complete_with_the_pushes_of_the_workers_present(W, events, reproducible):
    """Every push is 1, so a round's sum counts its pushes. Against a plain model of the rule:
    a worker's n-th push goes to its next round; a newcomer is in the rounds from its first
    push on, which goes to the open round, unless that round was open when it came (then
    to the next), or from its ``enter`` (the open round without it, the next with it); a
    round completes once it holds a push and every worker present (but newcomers yet to
    push or enter) has pushed it. Pushes, leaves, arrivals and entries in any order."""
    r = Rounds(W, 0, reproducible=reproducible)
    r.add_key("k")
    present, fresh = set(range(W)), set()
    nxt, counts, done, model = [0] * W, {}, 0, []
    applied = []
    for kind, who in events:
        rank = who % W
        if kind == "push" and rank in present:
            if rank in fresh:
                fresh.discard(rank)
                nxt[rank] = max(nxt[rank], done)
            counts[nxt[rank]] = counts.get(nxt[rank], 0) + 1
            nxt[rank] += 1
            grad = np.ones(1, np.float32)
            grad.flags.writeable = False
            actions = r.push(object(), rank, [("k", grad)], True, 0.0)
        elif kind == "leave" and rank in present and len(present) > 1:
            present.discard(rank)
            fresh.discard(rank)
            actions = r.leave(rank, 0.0)
        elif kind == "arrive" and rank not in present:
            present.add(rank)
            fresh.add(rank)
            nxt[rank] = max(nxt[rank], done + (1 if counts.get(done) else 0))
            r.arrive(rank)
            actions = []
        elif kind == "enter" and rank in fresh:  # kvstore.elastic's reset: in from now on
            fresh.discard(rank)
            nxt[rank] = max(nxt[rank], done + (1 if counts.get(done) else 0))
            actions = r.enter(rank, 0.0)
        else:
            continue
        applied += [float(a.value[0]) for a in actions if isinstance(a, Apply)]
        while counts.get(done) and all(nxt[q] > done for q in present - fresh):
            model.append(float(counts[done]))
            done += 1
    assert applied == model


# ---- elastic rounds: a newcomer absent, entering, a slot taken again (review findings)


def _push(r, rank, value, key="k", req=None):
    req = req if req is not None else object()
    return r.push(req, rank, [(key, np.full(1, value, np.float64))], True, 0.0)


def _sums(actions):
    return [float(a.value[0]) for a in actions if isinstance(a, Apply)]


def test_regression_a_newcomer_joined_while_absent_has_one_leaf():
    """W=4; slots 2 and 3 are newcomers (absent). Newcomer 3 calls join() before ever pushing
    'k': the round-open code places its zero (joined), and _close_absent places it again
    (absent), leaving a stale zero leaf in the tree. Once everyone joined and the next epoch
    starts, newcomer 2's push consumes that stale leaf as 3's, and 3's first push is lost."""
    r = Rounds(4, 0)
    r.add_key("k")
    for s in (2, 3):
        r.leave(s, 0.0)
        r.arrive(s)
    r.joined(3, 0.0)
    got = _push(r, 0, 1.0) + _push(r, 1, 2.0)
    assert _sums(got) == [3.0]
    for s in (0, 1, 2):  # everyone out of data: the next epoch
        r.joined(s, 0.0)
    got = _push(r, 0, 1.0) + _push(r, 2, 4.0) + _push(r, 3, 8.0) + _push(r, 1, 2.0)
    # 0, 1, 2 and 3 all pushed round 1 (2 and 3 their first pushes, both in the open round)
    assert _sums(got) == [15.0]


def test_a_newcomer_in_a_key_s_rounds_stays_in_them_after_a_take_over():
    """Replication: newcomer 1 (a plain script: it never enters) pushed 'k' with the others
    on the primary, so it is in its rounds. The backup (same membership events) takes the
    part over: the newcomer is in its rounds there too (not absent again, which would let a
    round complete without it and leave it a step behind for good)."""
    primary, backup = Rounds(3, 0), Rounds(3, 0)
    primary.add_key("k")
    for r in (primary, backup):
        r.leave(1, 0.0)
        r.arrive(1)
    got = _push(primary, 1, 2.0) + _push(primary, 0, 1.0) + _push(primary, 2, 4.0)
    assert _sums(got) == [7.0]  # on the primary the newcomer is in round 0
    backup.add_key("k", None, 1)  # take_over after the primary died
    got = _push(backup, 0, 1.0) + _push(backup, 2, 4.0) + _push(backup, 1, 2.0)
    assert _sums(got) == [7.0]


def test_a_key_made_after_a_newcomer_came_has_it_in_round_0():
    """A plain elastic script: every worker present (newcomer 1 included) inits a new key
    and pushes it; round 0 completes with the survivors alone when their pushes come first
    must wait for the newcomer: every worker present is in a new key's rounds."""
    r = Rounds(3, 0)
    r.leave(1, 0.0)
    r.arrive(1)
    r.add_key("new")
    got = _push(r, 0, 1.0, "new") + _push(r, 2, 4.0, "new") + _push(r, 1, 2.0, "new")
    assert _sums(got) == [7.0]


def test_regression_a_group_key_slot_taken_again_counts_its_queued_push_once():
    """Pre-existing: group key of ranks 0-3; workers 3 then 2 push rounds 0 and 1 (round 1
    queued) and worker 2 leaves; a newcomer takes slot 2, an outsider of the group's key.
    Round 1 opens with 3's queued push: the outsider's zero goes in for slot 2, then the old
    worker's queued push of slot 2 goes in again, waits for a sibling already consumed."""
    r = Rounds(4, 0)
    r.add_key("g", members=[0, 1, 2, 3])
    _push(r, 3, 8.0, "g"), _push(r, 3, 8.0, "g")
    _push(r, 2, 4.0, "g"), _push(r, 2, 4.0, "g")
    r.leave(2, 0.0)
    r.arrive(2)
    got = _push(r, 0, 1.0, "g") + _push(r, 1, 2.0, "g")
    got += _push(r, 0, 1.0, "g") + _push(r, 1, 2.0, "g")
    assert _sums(got) == [15.0, 15.0]


@settings(max_examples=400, deadline=None)
@given(W=st.integers(2, 5), reproducible=st.booleans(), data=st.data())
def test_elastic_rounds_against_a_model(W, reproducible, data):
    """Every event drawn among those that apply (push, pull, leave, arrive, enter, a key
    made later), every push a distinct power of two (a sum names its pushes): each key's
    sums equal a plain model's, and each push and pull is answered once its rounds are."""
    r = Rounds(W, 0, reproducible=reproducible)
    keys = ["a"]
    r.add_key("a")
    present, newcomers = set(range(W)), set()
    M = {"a": dict(nxt=[0] * W, rounds={}, done=0, fresh=set(), model=[])}
    applied = {"a": []}
    waiting = {}  # request -> (key, round)
    serial = 0
    for _ in range(data.draw(st.integers(0, 40))):
        kinds = ["push", "pull"]
        if len(present) > 1:
            kinds.append("leave")
        if len(present) < W:
            kinds.append("arrive")
        if newcomers:
            kinds.append("enter")
        if "b" not in keys:
            kinds.append("add_b")
        kind = data.draw(st.sampled_from(kinds))
        if kind == "push":
            rank = data.draw(st.sampled_from(sorted(present)))
            key = data.draw(st.sampled_from(keys))
            m = M[key]
            if rank in m["fresh"]:
                m["fresh"].discard(rank)
                m["nxt"][rank] = max(m["nxt"][rank], m["done"])
            n = m["nxt"][rank]
            m["nxt"][rank] += 1
            value = 2.0 ** (serial % 50)
            serial += 1
            m["rounds"].setdefault(n, []).append(value)
            req = ("push", serial)
            waiting[req] = (key, n)
            grad = np.full(1, value, np.float64)
            grad.flags.writeable = False
            actions = r.push(req, rank, [(key, grad)], True, 0.0)
        elif kind == "pull":
            rank = data.draw(st.sampled_from(sorted(present)))
            key = data.draw(st.sampled_from(keys))
            serial += 1
            req = ("pull", serial)
            waiting[req] = (key, M[key]["nxt"][rank] - 1)  # every round it pushed
            actions = r.pull(req, rank, [key])
        elif kind == "leave":
            rank = data.draw(st.sampled_from(sorted(present)))
            present.discard(rank)
            newcomers.discard(rank)
            for m in M.values():
                m["fresh"].discard(rank)
            actions = r.leave(rank, 0.0)
        elif kind == "arrive":
            rank = data.draw(st.sampled_from(sorted(set(range(W)) - present)))
            present.add(rank)
            newcomers.add(rank)
            for m in M.values():
                m["fresh"].add(rank)
                d = m["done"]
                m["nxt"][rank] = max(m["nxt"][rank], d + (1 if m["rounds"].get(d) else 0))
            r.arrive(rank)
            actions = []
        elif kind == "enter":
            rank = data.draw(st.sampled_from(sorted(newcomers)))
            newcomers.discard(rank)
            for m in M.values():
                if rank in m["fresh"]:
                    m["fresh"].discard(rank)
                    d = m["done"]
                    m["nxt"][rank] = max(m["nxt"][rank], d + (1 if m["rounds"].get(d) else 0))
            actions = r.enter(rank, 0.0)
        else:  # a key made now: every worker present is in its rounds
            keys.append("b")
            r.add_key("b")
            M["b"] = dict(nxt=[0] * W, rounds={}, done=0, fresh=set(), model=[])
            applied["b"] = []
            actions = []
        for a in actions:
            if isinstance(a, Apply):
                applied[a.key].append(float(a.value[0]))
        for m in M.values():
            while m["rounds"].get(m["done"]) and all(
                m["nxt"][q] > m["done"] for q in present - m["fresh"]
            ):
                m["model"].append(float(sum(sorted(m["rounds"][m["done"]]))))
                m["done"] += 1
        for a in actions:
            if isinstance(a, Reply):
                key, n = waiting.pop(a.request)
                assert M[key]["done"] > n, (a.request, key, n)
        for req, (key, n) in waiting.items():
            assert M[key]["done"] <= n, ("not answered", req, key, n)
        for key in keys:
            assert applied[key] == M[key]["model"], key


def test_a_root_that_dies_between_the_length_and_the_payload_rounds(monkeypatch):
    """broadcast(): the root pushed the length, then died before it pushed the payload: the
    payload round completes with its zero leaf: every other worker raises
    HostsUpdatedInterrupt (and resets again), never unpickles zeros."""
    import pickle
    import zlib

    from kvstore import elastic

    data = pickle.dumps({"epoch": 3, "batch": 7}, protocol=pickle.HIGHEST_PROTOCOL)

    def group_sum(kv, gen, name, rows):  # what the servers sum: root's head, no payload
        if name == "object.head":
            rows[:] = (len(data), zlib.crc32(data))

    monkeypatch.setattr(elastic, "_group_sum", group_sum)
    gen = elastic.Generation(1, (0, 1), 1)  # this worker is rank 1, the root rank 0
    with pytest.raises(elastic.HostsUpdatedInterrupt):
        elastic.broadcast(None, gen, None)


def test_a_group_key_taken_over_leaves_out_a_newcomer_as_its_primary_did():
    """Replication + a generation's group key (kvstore.elastic's 'check'): slot 2 died and a
    newcomer took it; on the primary the newcomer is an outsider of the old generation's
    keys (arrive), so the survivors' check round completes. A backup that takes the key
    over knows its members' arrivals too: slot 2's holder came later, so it is out of the
    group there as well (else the round waits for a newcomer waiting in the rendezvous)."""
    primary, backup = Rounds(3, 0), Rounds(3, 0)
    primary.add_key("check", members=[0, 1, 2], arrivals=[0, 0, 0])
    for r in (primary, backup):
        r.leave(2, 0.0)
        r.arrive(2, 2)
    assert _sums(_push(primary, 0, 1.0, "check") + _push(primary, 1, 2.0, "check")) == [3.0]
    backup.add_key("check", [0, 1, 2], 1, [0, 0, 0])  # take_over after the primary died
    assert _sums(_push(backup, 0, 1.0, "check") + _push(backup, 1, 2.0, "check")) == [3.0]


def test_a_generation_s_key_made_after_a_slot_changed_hands_leaves_the_newcomer_out():
    """kvstore.elastic: slots 0-2 agree on a generation (the rendezvous round of the members
    key). Worker 2 dies during the generation's first step and a newcomer takes slot 2
    before the survivors' first commit(), whose 'check' group key (members: the
    generation's slots, with the arrivals of their workers) is made only then: slot 2's
    holder came after, so it is out of the group (it waits in the next rendezvous round)."""
    r = Rounds(3, 0)
    r.add_key("members")
    got = []
    for rank in (0, 1, 2):  # the rendezvous: generation (slots 0, 1, 2)
        got += _push(r, rank, 1.0, "members")
    assert _sums(got) == [3.0]
    r.leave(2, 0.0)  # worker 2 dies in the first step
    r.arrive(2, 2)  # a newcomer takes slot 2 (membership epoch 2) ...
    newcomer = ("newcomer's rendezvous", 2)
    r.push(newcomer, 2, [("members", np.ones(1))], True, 0.0)  # ... and waits there
    r.add_key("check", members=[0, 1, 2], arrivals=[0, 0, 0])  # the survivors' first commit
    got = _push(r, 0, 0.0, "check") + _push(r, 1, 0.0, "check")
    assert _sums(got) == [0.0], "the survivors' check round waits for the newcomer: deadlock"


def make_cfg(**kw) -> Config:
    kw.setdefault("insecure", True)
    return Config("scheduler", "127.0.0.1", 9091, 1, 3, "127.0.0.1", **kw)


def register(role, pid, hint=-1):
    body = {
        "role": role,
        "host": "h",
        "port": 10 if role == "server" else 0,
        "pid": pid,
        "num_server": 1,
        "num_worker": 3,
        "rank_hint": hint,
        "cred": "c",
    }
    return Message("register", 0, role, body)


def test_scheduler_starts_with_min_lets_workers_leave_and_join_and_fences_the_gone():
    m = Membership(make_cfg(min_workers=2, heartbeat_timeout=3.0), 0.0)
    m.receive(b"s", register("server", 1), 0.0)
    m.receive(b"a", register("worker", 2, 0), 0.0)
    assert m.tick(0.5) == [] and not m.ready  # one worker: fewer than MIN
    m.receive(b"b", register("worker", 3, 1), 0.6)
    assert not m.tick(1.0) and not m.ready  # MIN came: a moment for the third
    books = [a for a in m.tick(2.1) if isinstance(a, Send) and a.message.kind == "book"]
    assert m.ready and len(books) == 3
    assert all(b.message.body["present"] == [0, 1] for b in books)
    for who in (b"s", b"a"):
        m.receive(who, Message("heartbeat", 0, "x"), 4.0)
    actions = m.tick(4.5)  # worker 1 silent since 0.6 s
    assert not any(isinstance(a, Exit) for a in actions)
    change = next(a.message.body for a in actions if isinstance(a, Broadcast))
    assert change["left"] == 1 and change["present"] == [0] and change["epoch"] == 1
    fenced = m.receive(b"b", Message("heartbeat", 0, "worker"), 5.0)  # it was only frozen
    assert [a.message.kind for a in fenced] == ["fenced"]
    actions = m.receive(b"c", register("worker", 4, 1), 5.0)  # a replacement for slot 1
    book = next(a.message for a in actions if isinstance(a, Send))
    assert book.kind == "book" and book.body["rank"] == 1 and book.body["epoch"] == 2
    assert book.body["present"] == [0, 1]
    told = [a.message for a in actions if isinstance(a, Broadcast)]
    assert {t.body["joined"] for t in told} == {1} and any("cred" in t.body for t in told)
    m.receive(b"d", register("worker", 5, 2), 5.1)  # slot 2: free too
    actions = m.receive(b"e", register("worker", 6, -1), 5.2)  # no slot left: it waits
    assert not any(isinstance(a, Send) for a in actions)
    assert m.receive(b"e", Message("heartbeat", 0, "worker"), 5.3) == []
    actions = m.receive(b"a", Message("finalize", 7, "worker"), 6.0)  # worker 0 is done
    book = next(a.message for a in actions if isinstance(a, Send) and a.identity == b"e")
    assert book.kind == "book" and book.body["rank"] == 0  # the waiting one takes slot 0


def _started_with_three(min_workers: int) -> Membership:
    """A scheduler's membership of an elastic job (``-n MIN:3``, one server) started with
    workers a, b and c in slots 0, 1 and 2 (pids 2, 3, 4; the server's pid 1)."""
    m = Membership(make_cfg(min_workers=min_workers, heartbeat_timeout=3.0), 0.0)
    m.receive(b"s", register("server", 1), 0.0)
    for who, pid, slot in ((b"a", 2, 0), (b"b", 3, 1), (b"c", 4, 2)):
        m.receive(who, register("worker", pid, slot), 0.0)
    m.tick(0.1)
    m.tick(1.2)  # (the start's grace for the others)
    assert m.ready
    return m


@pytest.mark.parametrize("how", ["finished", "died"])
def test_workers_that_finished_count_toward_min_and_dead_ones_do_not(how):
    """-n 2:3: workers 0 and 1 leave while worker 2 trains on. Finished (their data ran out),
    they did their part: the job goes on with one worker. Died, it is one worker short of
    MIN, and fails once no newcomer came within the start-up timeout (60 s)."""
    m = _started_with_three(min_workers=2)
    if how == "finished":
        for i, who in enumerate((b"a", b"b")):
            m.receive(who, Message("finalize", 7 + i, "worker"), 2.0)
    actions = []
    for t in range(2, 80):  # the server and worker 2 beat; workers 0 and 1 are silent
        for who in (b"s", b"c"):
            m.receive(who, Message("heartbeat", 0, "x"), float(t))
        actions += m.tick(t + 0.5)
    assert m._present() == [2], m._present()
    exits = [a for a in actions if isinstance(a, Exit)]
    if how == "finished":
        assert not exits and not m.failure, (exits, m.failure)
    else:
        assert exits and m.failure.startswith("only 1 worker(s) left, fewer than the 2"), m.failure


def test_a_slot_that_finished_twice_counts_once_toward_min():
    """-n 3:3: worker 0 finishes, a newcomer takes its slot and finishes too, then worker 2
    dies. One worker trains on, and slot 0 finished: two of the three MIN, not three (the
    slot is not counted once per holder). No newcomer comes: the job fails, saying why."""
    m = _started_with_three(min_workers=3)
    m.receive(b"a", Message("finalize", 7, "worker"), 2.0)
    actions = m.receive(b"d", register("worker", 5, 0), 2.1)  # slot 0 again
    assert next(a for a in actions if isinstance(a, Send)).message.body["rank"] == 0
    m.receive(b"d", Message("finalize", 8, "worker"), 2.2)
    actions = []
    for t in range(3, 80):  # worker 2 is silent from now on: it died
        for who in (b"s", b"b"):
            m.receive(who, Message("heartbeat", 0, "x"), float(t))
        actions += m.tick(t + 0.5)
    assert m._present() == [1], m._present()
    assert any(isinstance(a, Exit) for a in actions)
    assert m.failure.startswith("only 1 worker(s) left and 1 finished, fewer than the 3")


def test_the_last_worker_dying_after_the_others_finished_is_said_as_such():
    """-n 2:3 under a launcher that starts no replacement: workers 0 and 1 finish, then
    worker 2 dies. After the start-up timeout the job fails saying no worker is left
    training, not that it is short of the MIN the finished ones make up."""
    m = _started_with_three(min_workers=2)
    for i, who in enumerate((b"a", b"b")):
        m.receive(who, Message("finalize", 7 + i, "worker"), 2.0)
    actions = []
    for t in range(2, 80):  # worker 2 is silent from now on
        m.receive(b"s", Message("heartbeat", 0, "x"), float(t))
        actions += m.tick(t + 0.5)
    assert any(isinstance(a, Exit) for a in actions) and m._present() == []
    assert m.failure.startswith("no worker left training (2 finished, the last failed), and no")


def test_a_stall_waiting_for_a_newcomer_says_so_and_how_to_avoid_it():
    m = Membership(make_cfg(min_workers=2, heartbeat_timeout=3.0), 0.0)
    m.receive(b"s", register("server", 1), 0.0)
    m.receive(b"a", register("worker", 2, 0), 0.0)
    m.receive(b"b", register("worker", 3, 1), 0.0)
    m.tick(1.1)
    m.tick(2.5)  # started with slots 0 and 1
    m.receive(b"c", register("worker", 4, 2), 2.6)  # slot 2, taken mid-job: epoch 1
    body = {"key": "'w'", "round": 7, "age": 2.0, "missing": [2, 1], "silent": [-1.0, 1.0]}
    body |= {"present": [0], "waiting": [0]}
    actions = m.receive(b"s", Message("stalled", 1, "server", body), 2.7)
    (text,) = {a.message.body["message"] for a in actions if isinstance(a, Send)}
    assert "worker 2, a newcomer (epoch 1) never pushed it" in text, text
    assert "worker 1 silent on this key" in text, text  # not a newcomer
    assert "known limits): kvstore.elastic's reset avoids it" in text, text


def test_a_deadlock_with_a_newcomer_says_it_came_mid_job():
    """(From a two-host user trial.) A replacement that ran a fixed-size script from its
    start reached a round the others, waiting in their epoch barrier for it, never push: the
    deadlock now says the worker came mid-job and what an elastic script does instead."""
    m = Membership(make_cfg(min_workers=2, heartbeat_timeout=3.0), 0.0)
    m.receive(b"s", register("server", 1), 0.0)
    m.receive(b"a", register("worker", 2, 0), 0.0)
    m.receive(b"b", register("worker", 3, 1), 0.0)
    m.tick(1.1)
    m.tick(2.5)
    m.receive(b"c", register("worker", 4, 2), 2.6)  # slot 2, taken mid-job: epoch 1
    for who in (b"a", b"b"):
        m.receive(who, Message("barrier", 7, "x", {"group": "worker"}), 2.7)
    body = {"key": "'w'", "round": 7, "age": 1.0, "missing": [0, 1], "silent": [1.0, 1.0]}
    body |= {"present": [2], "waiting": [2]}
    m.receive(b"s", Message("stalled", 1, "server", body), 2.8)
    assert m.failure.startswith("deadlock: dist_sync round 7"), m.failure
    assert m.failure.endswith(
        "; worker(s) [2] came mid-job (epoch 1) and started the script over: an elastic "
        "job's script goes on from the others' state (kvstore.elastic; README, Elastic workers)"
    ), m.failure


def _launch_elastic(
    tmp_path,
    kill_after: str,
    launcher=("-s", "1"),
    script="elastic_counter.py",
    args=("50", "0.05"),
    server_too=False,
    server_first=False,
    **env,
) -> str:
    """Launch an elastic job (-n 2:3) of ``script`` (in tests/workers, or a path) with ``args``;
    kill worker 1 once ``kill_after`` is printed (and
    with ``server_too`` server 1 when the newcomer starts, so that it registers while the
    servers fail over; with ``server_first`` server 1 first, and worker 1 once the servers
    failed over, so that its newcomer comes after the failover)."""
    env = dict(os.environ, KVSTORE_HEARTBEAT_TIMEOUT="2", PYTHONPATH=str(ROOT), **env)
    script = ROOT / "tests" / "workers" / script
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "-n", "2:3", *launcher]
        + [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    killed = False
    try:
        for line in proc.stdout:  # bounded: the launcher's own deadline below ends it
            seen.append(line)
            if not killed and kill_after in line and server_first != "killed":
                victim = "server 1" if server_first else "worker 1"
                os.kill(started_pids("".join(seen))[victim], 9)
                killed, server_first = not server_first, "killed" if server_first else False
            if server_first == "killed" and "failover to epoch" in line:
                os.kill(started_pids("".join(seen))["worker 1"], 9)
                killed, server_first = True, False
            if server_too and killed and line.startswith("launch: started worker 1 "):
                server_too = False
                os.kill(started_pids("".join(seen))["server 1"], 9)
        assert proc.wait(timeout=90) == 0, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return "".join(seen)


def test_a_worker_killed_is_replaced_and_the_others_never_restart(tmp_path):
    out = _launch_elastic(tmp_path, "[worker 0] step 10 ")
    assert "worker 1 on localhost was killed by SIGKILL; the others go on" in out, out
    assert "[worker 1] late: slot 1" in out, out  # the replacement took slot 1
    for rank in (0, 2):  # survivors: every step once, in order, no second start
        steps = [int(s) for s in re.findall(rf"\[worker {rank}\] step (\d+) ", out)]
        assert steps == list(range(50)), (rank, steps)
    values = re.findall(r"step \d+ value (\S+) workers (\d+)", out)
    assert all(float(v) in (1, 2, 3) for v, _ in values), values
    # the newcomer's pushes count: rounds of 3 after the kill
    after = out.split("[worker 1] late")[1]
    assert re.search(r"\[worker 0\] step \d+ value 3 workers 3", after), out


def test_row_sparse_keys_in_an_elastic_job(tmp_path):
    """A row-sparse key (rows on both servers), every row pushed and pulled each step: a
    worker killed and replaced; every row's value counts 1 to 3 pushes, the survivors'
    steps go on, and the newcomer's pushes count."""
    out = _launch_elastic(
        tmp_path, "[worker 0] step 10 ", ("-s", "2"), args=("40", "0.05", "64", "rows")
    )
    assert "[worker 1] late: slot 1" in out, out
    for rank in (0, 2):
        steps = [int(s) for s in re.findall(rf"\[worker {rank}\] step (\d+) ", out)]
        assert steps == list(range(40)), (rank, steps)
    found = re.findall(r"min (\S+) max (\S+)", out)
    assert all(1 <= float(lo) <= float(hi) <= 3 for lo, hi in found), found
    after = out.split("[worker 1] late")[1]
    assert re.search(r"\[worker 0\] step \d+ value 3 .* min 3 max 3", after), out


def test_a_kvstore_script_s_elastic_state_goes_on_without_rolling_back(tmp_path):
    """kvstore.elastic for KVStore users (an int-keyed store with the servers' SGD): a worker
    killed half way is replaced; at the next commit every worker resets at the same step and
    agrees on ranks and size; the survivors never go back; the newcomer starts from rank 0's
    commit; every round takes its pushes' count off the weight."""
    out = _launch_elastic(
        tmp_path, "[worker 0] step 0.10 ", script="elastic_state.py", args=("2", "20", "0.05")
    )
    assert "[worker 1] late: slot 1" in out, out
    for rank in (0, 2):  # survivors: every batch once, in order
        steps = re.findall(rf"\[worker {rank}\] step (\d+)\.(\d+) ", out)
        assert [(int(e), int(b)) for e, b in steps] == [
            (e, b) for e in range(2) for b in range(20)
        ], (rank, steps)
        assert out.count(f"[worker {rank}] start ") >= 2, out  # a reset (or two)
    starts = re.findall(r"\[worker (\d)\] start (\d+)\.(\d+) rank (\d) size (\d)", out)
    late = [s for s in starts if s[0] == "1"][-1]  # the newcomer's (re)start
    last = next(s for s in reversed(starts) if s[0] == "0" and s[4] == "3")
    assert late[1:3] == last[1:3] and late[4] == "3", (late, last)  # rank 0's commit
    assert sorted(s[3] for s in starts if s[1:3] == last[1:3] and s[4] == "3") == ["0", "1", "2"]
    ws = [float(w) for w in re.findall(r"\[worker 0\] step \S+ w (\S+) ", out)]
    assert all(0 < a - b <= 3 for a, b in zip([0.0] + ws[:-1], ws, strict=True)), ws  # SGD


def test_a_newcomer_registering_while_the_servers_fail_over(tmp_path):
    """Replicas and elastic workers together: worker 1 is killed, and server 1 when the
    launcher starts the newcomer, so the newcomer registers and arrives while server 0 takes
    over server 1's parts of the key. The job ends 0; every element of every round counts
    1 to 3 pushes; once things settle, every part of the key holds all three workers'."""
    out = _launch_elastic(
        tmp_path,
        "[worker 0] step 10 ",
        launcher=("-s", "2", "--replicas", "2"),
        args=("80", "0.05", "4096"),
        server_too=True,
        KVSTORE_BIGARRAY_BOUND="1000",
    )
    assert "server 1 on localhost was killed by SIGKILL; its replicas go on" in out, out
    assert "failover to epoch" in out and "[worker 1] late: slot 1" in out, out
    pattern = r"\[worker (\d)\] step \d+ value \S+ workers (\d) .* min (\S+) max (\S+)"
    rows = re.findall(pattern, out)
    assert all(1 <= float(lo) <= float(hi) <= 3 for _, _, lo, hi in rows), rows
    for rank in "02":  # the survivors: all three in both parts, step after step
        mine = "".join("3" if r[1:] == ("3", "3", "3") else "." for r in rows if r[0] == rank)
        assert "33333" in mine, (rank, mine)


def test_a_newcomer_after_a_failover_sends_to_the_replicas(tmp_path):
    """Server 1 is killed and failed over; then worker 1 is killed, and its newcomer's book
    names the dead server. It used to send its hello to the dead server and wait there for
    KVSTORE_TIMEOUT (600 s), then fail; every newcomer after it did the same. Now it sends to
    server 0, which answers for both, and joins the rounds: of a dense key cut into parts
    on both servers and of a row-sparse key."""
    for args in (("60", "0.05", "4096"), ("60", "0.05", "64", "rows")):
        out = _launch_elastic(
            tmp_path,
            "[worker 0] step 10 ",
            launcher=("-s", "2", "--replicas", "2"),
            args=args,
            server_first=True,
            KVSTORE_BIGARRAY_BOUND="1000",
            KVSTORE_TIMEOUT="60",
        )
        assert "failover to epoch" in out and "[worker 1] late: slot 1" in out, out
        after = out.split("[worker 1] late")[1]
        assert re.search(r"\[worker 1\] step \d+ value 3 workers 3 .* min 3 max 3", after), out


def test_a_worker_killed_as_the_others_finish_ends_the_job_with_them(tmp_path):
    """Worker 1 is killed two steps before the end; its replacement (slow to start, as a
    PyTorch script is) comes after the others finished and the scheduler ended the job: the
    launcher stops it ``--finish-grace`` (here 4 s; 30 s by default) later and starts nobody
    again, and the job ends 0 (it used to start replacements for ever, each waiting 65 s for
    a scheduler that was gone)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys, time\n"
        "import numpy as np\n"
        "mark = f'started.{os.environ[\"KVSTORE_RANK\"]}'\n"
        "if os.path.exists(mark):\n"
        "    time.sleep(3)  # a replacement: slow to start\n"
        "open(mark, 'w').close()\n"
        "import kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init('w', np.zeros(1, np.float32))\n"
        "out = np.zeros(1, np.float32)\n"
        "for step in range(20):\n"
        "    kv.pushpull('w', np.ones(1, np.float32), out=out)\n"
        "    print('step', step, flush=True)\n"
        "    time.sleep(0.05)\n"
    )
    out = _launch_elastic(
        tmp_path,
        "[worker 0] step 18",
        launcher=("-s", "1", "--finish-grace", "4"),
        script=script,
        args=(),
    )
    stopped = "the job has finished (every worker in it finished): stopping worker 1, still "
    assert stopped + "running 4s later" in out, out
    assert "stopping worker 0" not in out and "stopping worker 2" not in out, out
    assert out.count("launch: started worker 1 ") == 2, out


def _run_elastic(tmp_path, script, workers: str, options=()) -> tuple[int, str]:
    """Run ``script`` in an elastic job (``-n workers``, one server, the launcher's
    ``options``) to its end (a 100 s deadline): its exit status and all it printed."""
    env = dict(os.environ, KVSTORE_HEARTBEAT_TIMEOUT="2", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "-n", workers, "-s", "1", "--timeout", "100"]
        + [*options, sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_last_worker_failing_after_the_others_finished_ends_the_job_at_once(tmp_path):
    """-n 2:3: workers 0 and 1 finish their 5 steps; worker 2 trains on and raises at its
    20th. A newcomer in its slot would have nobody to take the model from: the launcher ends
    the job at once with worker 2's status (it used to wait out the scheduler's 60 s start-up
    timeout, then end 129 saying the job was short of workers)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os, time\n"
        "import numpy as np\n"
        "import kvstore\n"
        "slot = int(os.environ['KVSTORE_RANK'])\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init('w', np.zeros(1, np.float32))\n"
        "out = np.zeros(1, np.float32)\n"
        "for step in range(5 if slot < 2 else 40):\n"
        "    kv.pushpull('w', np.ones(1, np.float32), out=out)\n"
        "    time.sleep(0.05)\n"
        "    if slot == 2 and step == 20:\n"
        "        raise RuntimeError('boom in the last worker')\n"
        "kv.close()\n"
    )
    t0 = time.monotonic()
    code, out = _run_elastic(tmp_path, script, "2:3")
    assert code == 1, out
    assert time.monotonic() - t0 < 30, out
    said = (
        "launch: worker 2 on localhost exited with status 1 (last output: 'RuntimeError: boom in "
        "the last worker'); the other workers have finished, so no new one takes its slot: "
        "stopping the job"
    )
    assert said in out, out
    assert out.count("launch: started worker 2 ") == 1 and "fewer than" not in out, out


def test_a_worker_that_always_fails_is_set_aside_and_the_job_says_so(tmp_path):
    """An elastic job's worker in slot 1 fails at once every time it starts: it is started
    again twice, then its slot is set aside; the others finish their steps, and the job
    ends with the failing worker's status and a line that says why."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, time\n"
        "import numpy as np\n"
        "import kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init('w', np.zeros(1, np.float32))\n"
        "if kv._rank == 1:\n"
        "    sys.exit(3)\n"
        "out = np.zeros(1, np.float32)\n"
        "for step in range(60):\n"
        "    kv.pushpull('w', np.ones(1, np.float32), out=out)\n"
        "    time.sleep(0.1)\n"
        "print('finished', kv.num_workers, flush=True)\n"
    )
    code, out = _run_elastic(tmp_path, script, "1:2")
    assert code == 3, out
    assert out.count("launch: started worker 1 ") == 3, out
    assert "its slot is set aside" in out and "set aside)" in out, out
    assert "[worker 0] finished 1" in out, out


@pytest.mark.parametrize("alike", [True, False])
def test_every_worker_failing_the_same_way_ends_the_job_at_once(tmp_path, alike):
    """Every worker of an elastic job raises the same error (a bug in the script): the job
    ends when the last of them fails, each started once (three tracebacks; it was nine:
    each slot was started again twice and set aside). Errors that differ (each names its
    process) keep the slots' three tries."""
    script = tmp_path / "train.py"
    said = "'the same bug'" if alike else "f'process {os.getpid()} has its own bug'"
    script.write_text(
        "import os\n"
        "import numpy as np\n"
        "import kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init('w', np.zeros(1, np.float32))\n"
        f"raise ValueError({said})\n"
    )
    code, out = _run_elastic(tmp_path, script, "2:3")
    assert code == 1, out
    if alike:
        assert out.count("Traceback") == 3 and out.count("launch: started worker") == 3, out
        assert (
            'every worker failed the same way ("ValueError: the same bug"), so would its '
            "replacement: stopping the job"
        ) in out, out
    else:
        assert out.count("Traceback") == 9, out
        assert "every worker slot is set aside: stopping the job" in out, out


def test_soak_short_form(tmp_path):
    """scripts/elastic_soak.py's short form: 6 random changes (joins, graceful leaves, kill
    -9) one or two seconds apart, W between 2 and 6, three keys pushed in turn by blocking
    pushpulls: no hang, every round's sum exactly the pushes of its members, no survivor
    restarted, every newcomer in its first round."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "elastic_soak.py"), "--changes", "6", "--keys", "3"]
        + ["--every", "1,2", "--hang", "20"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "6 changes in" in out and " 0 problem(s)" in out, out


def test_over_ssh_a_worker_killed_is_replaced(sshd, tmp_path):
    """The same through the ssh launcher (a private sshd on 127.0.0.1 and 127.0.0.2): the
    worker's ssh is killed, its remote process ends with it, and a new one takes the slot."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    options = ["-s", "1", "--launcher", "ssh", "-H", str(hosts), *sshd.ssh_options()]
    out = _launch_elastic(tmp_path, "[worker 0] step 10 ", options)
    assert "worker 1 on 127.0.0." in out and "the others go on" in out, out
    assert "[worker 1] late: slot 1" in out, out
    for rank in (0, 2):
        steps = [int(s) for s in re.findall(rf"\[worker {rank}\] step (\d+) ", out)]
        assert steps == list(range(50)), (rank, steps)


def test_host_discovery_script_gains_and_loses_a_host(sshd, tmp_path):
    """horovodrun's --host-discovery-script through the private sshd: the script prints the
    lines of a file the test rewrites. 127.0.0.1 alone (one slot), then 127.0.0.2 with two
    more (the launcher starts workers 1 and 2 there; they join), then 127.0.0.2 gone (the
    launcher stops them; worker 0 trains on alone and the job ends 0)."""
    listed = tmp_path / "hosts.txt"
    listed.write_text("127.0.0.1:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listed}\n")
    script.chmod(0o755)
    env = dict(os.environ, KVSTORE_HEARTBEAT_TIMEOUT="2", PYTHONPATH=str(ROOT))
    counter = ROOT / "tests" / "workers" / "elastic_counter.py"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "-n", "1:3", "-s", "1"]
        + ["--host-discovery-script", str(script), *sshd.ssh_options()]
        + [sys.executable, str(counter), "300", "0.05"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    stage = 0
    try:
        for line in proc.stdout:  # bounded: the job ends by itself (300 steps)
            seen.append(line)
            if stage == 0 and "[worker 0] step 5 " in line:
                listed.write_text("127.0.0.1:1\n127.0.0.2:2\n")
                stage = 1
            elif stage == 1 and re.search(r"\[worker 0\] step \d+ value 3 ", line):
                listed.write_text("127.0.0.1:1\n")
                stage = 2
        assert proc.wait(timeout=120) == 0, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = "".join(seen)
    assert stage == 2, out
    assert "started worker 1 on 127.0.0.2" in out and "started worker 2 on 127.0.0.2" in out
    assert "host 127.0.0.2 left: stopping worker 1" in out, out
    assert re.search(r"\[worker 0\] step 29\d value 1 workers 1", out), out
    steps = [int(s) for s in re.findall(r"\[worker 0\] step (\d+) ", out)]
    assert steps == list(range(300)), steps


def test_host_discovery_leaves_a_finished_workers_slot_empty(sshd, tmp_path):
    """With --host-discovery-script, worker 0 finishes (closes its store, exits 0) while
    worker 1 trains on: the launcher's next looks at the hosts start nobody in slot 0. It
    used to start a new worker 0 there, which joined mid-job, or came after the job ended,
    was stopped, and made the job fail ("every worker's last process failed", status 255)."""
    listed = tmp_path / "hosts.txt"
    listed.write_text("127.0.0.1:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {listed}\n")
    discover.chmod(0o755)
    script = tmp_path / "train.py"
    script.write_text(
        "import time\n"
        "import numpy as np\n"
        "import kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init('w', np.zeros(1, np.float32))\n"
        "out = np.zeros(1, np.float32)\n"
        "for step in range(5 if kv._rank == 0 else 100):  # worker 1: 5 s, two looks or more\n"
        "    kv.pushpull('w', np.ones(1, np.float32), out=out)\n"
        "    time.sleep(0.05)\n"
        "kv.close()\n"
        "print('finished', flush=True)\n"
    )
    options = ["--host-discovery-script", str(discover), *sshd.ssh_options()]
    code, out = _run_elastic(tmp_path, script, "1:2", options)
    assert code == 0, out
    # (not "late" in out: two workers that register over a second apart make one late)
    assert out.count("started worker 0 ") == 1, out
    assert "[worker 0] finished" in out and "[worker 1] finished" in out, out


def test_a_worker_of_another_store_type_is_refused_at_once(tmp_path):
    """Two workers, one creating dist_sync and one dist_async: the one that registers second
    is refused by the scheduler with what to do, instead of rounds that follow two rules."""
    from .cluster import Cluster

    code = "import sys, kvstore\nkv = kvstore.create(sys.argv[1])\nprint('created')\n"
    script = tmp_path / "make.py"
    script.write_text(code)
    cluster = Cluster(1, 2, tmp_path, KVSTORE_START_TIMEOUT=5)
    try:
        procs = [
            cluster._spawn(
                f"worker{i}",
                [sys.executable, str(script), kind],
                "worker",
                dict(cluster.env, KVSTORE_RANK=str(i)),
            )
            for i, kind in enumerate(["dist_sync", "dist_async"])
        ]
        codes = cluster.wait(procs, 60)
        said = cluster.output("worker0") + cluster.output("worker1")
        assert all(codes), said
        assert "must create the same store type" in said, said
        assert "creates kvstore.create('dist_" in said, said
    finally:
        cluster.stop()


def test_a_newcomer_cannot_replace_the_jobs_optimizer():
    """set_optimizer from a worker that joined a running elastic job carries ``keep``: the
    same spec keeps the servers' state, another is refused (a fixed job's worker may still
    replace it, as in MXNet)."""
    from types import SimpleNamespace

    from kvstore import optimizer as opt
    from kvstore.server import Server

    s = object.__new__(Server)
    s.optimizer_spec, s.updater, s.chains, s.rank, s.name = None, None, None, 0, "server 0"
    s.sent = []
    s._send = lambda identity, msg, keys=None, track=True: s.sent.append(msg)
    s.cfg = SimpleNamespace(verbose=0)
    s._optimizer_calls, s._optimizer_count = [], {}
    sgd = opt.create("sgd", learning_rate=0.1, momentum=0.9).spec()
    adam = opt.create("adam", learning_rate=0.01).spec()
    s._on_optimizer(b"worker-0", 0, Message("optimizer", 1, "w", {"spec": sgd}))
    kept = s.updater
    s._on_optimizer(b"worker-1", 1, Message("optimizer", 2, "w", {"spec": sgd, "keep": True}))
    assert s.updater is kept
    try:
        s._on_optimizer(b"worker-1", 1, Message("optimizer", 3, "w", {"spec": adam, "keep": True}))
    except ValueError as exc:
        assert "every worker must set the same" in str(exc)
    else:
        raise AssertionError("a newcomer replaced the job's optimizer")
    assert s.updater is kept
    s._on_optimizer(b"worker-0", 0, Message("optimizer", 4, "w", {"spec": adam}))
    assert s.updater is not kept
    replaced = s.updater
    # worker 2's first call is the job's first: sgd, not adam (each worker's n-th call
    # must set what the others' n-th set); its calls that match change nothing, and the
    # old sgd does not come back
    try:
        s._on_optimizer(b"worker-2", 2, Message("optimizer", 5, "w", {"spec": adam}))
    except ValueError as exc:
        assert "in the same call (set_optimizer number 1 of each)" in str(exc), exc
    else:
        raise AssertionError("another worker's different first optimizer was taken")
    s._on_optimizer(b"worker-2", 2, Message("optimizer", 6, "w", {"spec": sgd}))  # call 1
    assert s.updater is replaced
    s._on_optimizer(b"worker-2", 2, Message("optimizer", 7, "w", {"spec": adam}))  # call 2
    assert s.updater is replaced


def test_regression_a_newcomer_mid_round_in_arrival_order():
    """Found by a helper's run of the property test: W=3, arrival order; worker 1 pushes,
    slot 2 leaves and is taken again while the round is open, worker 0 pushes: the round
    completes (the newcomer's first push goes to the next round)."""
    r = Rounds(3, 0, reproducible=False)
    r.add_key("k")
    r.push(object(), 1, [("k", np.ones(1, np.float32))], True, 0.0)
    r.leave(2, 0.0)
    r.arrive(2)
    actions = r.push(object(), 0, [("k", np.ones(1, np.float32))], True, 0.0)
    assert [float(a.value[0]) for a in actions if isinstance(a, Apply)] == [2.0]


# ---- a newcomer mid-step in a loop of blocking pushpulls over keys on several servers


def _cluster_run(W, S, K, steps, free, changes, reproducible, tell, choose, pattern="blocking"):
    """A simulated elastic job of W slots, key k on server k % S, slots ``free`` unheld at the
    start. ``changes`` (``("arrive" | "kill", slot)``) happen in order, each when ``choose``
    says, before the others pass their second step; each is a membership epoch, which each
    server hears at its own moment (a request naming a later epoch, ``mepoch``, waits until
    the server has). A killed worker's messages in flight are lost. Every worker runs
    ``for step: for key: pushpull(key)`` (``pattern`` "blocking": one key at a time) or
    sends every key then waits for all ("async"), pushing [1, 2**slot] (a round's sum is
    [its pushes, the set of their slots]), until every worker made ``steps`` steps after the
    last change. ``tell``: the servers' replies name the newcomers seen in a completed round
    and the workers' pushes pass that on (Rounds.expect). ``choose(n)`` picks one of n
    enabled events. Returns (finished, sums, answered): finished is False when nothing can
    move (a deadlock); answered[key] counts the pushes replied."""
    servers = [Rounds(W, 0, reproducible=reproducible) for _ in range(S)]
    for s, r in enumerate(servers):
        for k in range(s, K, S):
            r.add_key(k)
        for slot in free:
            r.leave(slot, 0.0)
    heard, deferred, inbox = [0] * S, [[] for _ in range(S)], [[] for _ in range(S)]
    notices, pending = [], list(changes)  # the epochs so far; the changes to come
    holder = {}  # slot -> its holder's number (a dead holder's replies are dropped)

    def worker(slot, mepoch):
        holder[slot] = holder.get(slot, 0) + 1
        return dict(step=0, key=0, waiting=0, mepoch=mepoch, entered={}, holder=holder[slot])

    workers = {slot: worker(slot, 0) for slot in range(W) if slot not in free}
    replies = {slot: [] for slot in range(W)}
    sums, answered = {k: [] for k in range(K)}, {k: 0 for k in range(K)}

    def carry_out(s, actions):
        for a in actions:
            if isinstance(a, Apply):
                sums[a.key].append(a.value.copy())
            elif isinstance(a, Reply):
                slot, number, key = a.request
                answered[key] += 1
                replies[slot].append((number, dict(servers[s].entered) if tell else {}))

    def handle(s, msg):
        slot, number, key, entered, mepoch = msg
        if mepoch > heard[s]:
            deferred[s].append(msg)
            return
        if tell and entered:
            servers[s].expect([list(e) for e in entered.items()], [key])
        grad = np.array([1.0, 2.0**slot])
        grad.flags.writeable = False
        carry_out(s, servers[s].push((slot, number, key), slot, [(key, grad)], True, 0.0))

    def send(slot, w, key):
        inbox[key % S].append((slot, w["holder"], key, dict(w["entered"]), w["mepoch"]))
        w["waiting"] += 1

    target = None
    while True:
        if not pending and min(heard) == len(notices):
            target = target or {slot: w["step"] + steps for slot, w in workers.items()}
            if all(w["step"] >= target.get(slot, steps) for slot, w in workers.items()):
                return True, sums, answered
        events = []
        for slot, w in workers.items():
            if not w["waiting"] and (w["step"] < 2 or not pending):
                events.append(("send", slot))
            if replies[slot]:
                events.append(("reply", slot))
        events += [("deliver", s) for s in range(S) if inbox[s]]
        events += [("change", None)] if pending else []
        events += [("hear", s) for s in range(S) if heard[s] < len(notices)]
        if not events:
            return False, sums, answered
        kind, who = events[choose(len(events))]
        if kind == "send":
            w = workers[who]
            for key in [w["key"]] if pattern == "blocking" else range(K):
                send(who, w, key)
        elif kind == "deliver":
            handle(who, inbox[who].pop(0))
        elif kind == "reply":
            number, entered = replies[who].pop(0)
            w = workers.get(who)
            if w is None or w["holder"] != number:
                continue  # a dead holder's
            for slot, epoch in entered.items():
                if slot != who and w["entered"].get(slot, -1) < epoch:
                    w["entered"][slot] = epoch
                    w["mepoch"] = max(w["mepoch"], epoch)
            w["waiting"] -= 1
            if w["waiting"] == 0:
                w["key"] = (w["key"] + 1) % K if pattern == "blocking" else 0
                w["step"] += w["key"] == 0
        elif kind == "change":  # the scheduler's: a slot taken (its worker starts) or lost
            what, slot = pending.pop(0)
            notices.append((what, slot))
            if what == "arrive":
                workers[slot] = worker(slot, len(notices))
            else:  # killed: it and its messages in flight are gone
                del workers[slot]
                for q in inbox + deferred:
                    q[:] = [m for m in q if m[0] != slot]
                replies[slot] = []
        else:  # a server hears the next epoch, then acts on what waited for it
            what, slot = notices[heard[who]]
            heard[who] += 1
            if what == "arrive":
                servers[who].arrive(slot, heard[who])
            else:
                carry_out(who, servers[who].leave(slot, 0.0))
            waiting, deferred[who] = deferred[who], []
            for msg in waiting:
                handle(who, msg)


_CHANGES = {
    "one newcomer": ((2,), [("arrive", 2)]),
    "two newcomers": ((1, 2), [("arrive", 1), ("arrive", 2)]),
    "a newcomer killed and replaced": ((2,), [("arrive", 2), ("kill", 2), ("arrive", 2)]),
    "a worker killed, a newcomer in its slot": ((), [("kill", 0), ("arrive", 0)]),
}


@settings(max_examples=400, deadline=None)
@given(
    S=st.integers(2, 3),
    K=st.integers(2, 4),
    changes=st.sampled_from(sorted(_CHANGES)),
    pattern=st.sampled_from(["blocking", "async"]),
    reproducible=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_a_newcomer_mid_step_never_deadlocks_a_job(S, K, changes, pattern, reproducible, seed):
    """W=3, keys on S servers, every worker a loop of blocking pushpulls (Gluon's) or of
    pushpull_async then a wait (Horovod's), newcomers arriving and workers killed at any
    moment (each server hearing of it at its own): every worker finishes its steps, and
    every round's sum holds each of its slots' pushes once. Without the servers telling the
    workers who entered (``tell``) this finds the deadlock the soak found in about half the
    orders of a blocking loop (test below)."""
    free, events = _CHANGES[changes]
    # a known limit (README): two newcomers, or one replaced, each pushing every key before
    # a wait can land a round apart in opposite directions on two keys and wait for each
    # other (about 2% of orders, with or without Rounds.expect)
    assume(
        pattern == "blocking"
        or changes in ("one newcomer", "a worker killed, a newcomer in its slot")
    )
    rng = random.Random(seed)  # the order of events (a draw per event is too much data)
    done, sums, answered = _cluster_run(
        3, S, K, 3, free, events, reproducible, True, rng.randrange, pattern
    )
    assert done, "deadlock"
    for key, values in sums.items():
        for v in values:  # no slot twice in a round
            assert bin(int(v[1])).count("1") == v[0], (key, v)
        # every answered push is in an applied round (a pushpull is answered once its round
        # is); a killed worker's pushes may be in rounds without an answer
        assert sum(v[0] for v in values) >= answered[key], (key, [list(v) for v in values])
        if "kill" not in changes:
            assert sum(v[0] for v in values) == answered[key], (key, [list(v) for v in values])


def test_without_telling_a_newcomer_mid_step_can_deadlock():
    """The check above can fail: the same simulated job, newcomers' first pushes placed by
    each server alone (the rule before Rounds.expect), deadlocks in about a third of the
    orders of events; and without the arrival epoch kept with a first push, a newcomer killed
    and replaced before its first round completed made its successor awaited on keys it never
    pushed (a review finding)."""
    free, events = _CHANGES["one newcomer"]
    deadlocks = 0
    for seed in range(300):
        rng = random.Random(seed)
        done, _, _ = _cluster_run(3, 2, 2, 3, free, events, False, False, rng.randrange)
        deadlocks += not done
    assert deadlocks > 30, deadlocks


def test_regression_a_slot_s_next_holder_is_not_taken_for_its_predecessor():
    """Newcomer N (slot 2, epoch 1) pushes key A into the open round, is killed, and N' takes
    the slot (epoch 3) before that round completes: the round's completion must not say that
    slot 2 entered (N' pushed nothing), else the others would wait for N' in key B's round."""
    one = np.ones(1)
    r = Rounds(3, 0)
    r.add_key("A")
    r.leave(2, 0.0)
    r.arrive(2, 1)
    r.push("N", 2, [("A", one)], True, 0.0)
    r.push("0", 0, [("A", one)], True, 0.0)
    r.leave(2, 0.0)
    r.arrive(2, 3)
    assert _sums(r.push("1", 1, [("A", one)], True, 0.0)) == [3.0]
    assert r.entered == {}


def test_optimizer_calls_of_a_slot_s_next_holder_and_of_mxnet_s_two_steps():
    """Review findings: a newcomer in a reused slot inherited its predecessor's call count,
    so the survivors' next change was refused; and a newcomer's first call must be able to
    match an earlier call of the job (MXNet sets the spec, then multi-precision: two calls),
    then go on from there. A newcomer never installs a spec of its own."""
    from types import SimpleNamespace

    from kvstore import optimizer as opt
    from kvstore.server import Server

    s = object.__new__(Server)
    s.optimizer_spec, s.updater, s.chains, s.rank, s.name = None, None, None, 0, "server 0"
    s.sent, s._optimizer_calls, s._optimizer_count = [], [], {}
    s._send = lambda identity, msg, keys=None, track=True: s.sent.append(msg)
    s.cfg = SimpleNamespace(verbose=0)
    s.num_workers, s.members_epoch, s.gate, s._proved, s._shm_of = 2, 0, None, {}, {}
    s._lost, s._deferred, s._listener = set(), [], None
    s.rounds = SimpleNamespace(leave=lambda *a: [], arrive=lambda *a: None)
    s._execute = lambda actions: None
    plain = opt.create("sgd", learning_rate=0.1).spec()
    mixed = opt.create("sgd", learning_rate=0.1, multi_precision=True).spec()
    later = opt.create("sgd", learning_rate=0.05).spec()

    def call(rank, spec, keep=False):
        body = {"spec": spec, "keep": True} if keep else {"spec": spec}
        s._on_optimizer(f"worker-{rank}".encode(), rank, Message("optimizer", 1, "w", body))

    for rank in (0, 1):  # MXNet's two steps, on every worker
        call(rank, plain)
        call(rank, mixed)
    assert s.optimizer_spec == mixed
    s._on_members(Message("members", 0, "s", {"epoch": 1, "left": 1, "present": [0]}))
    s._on_members(Message("members", 0, "s", {"epoch": 2, "joined": 1, "present": [0, 1]}))
    call(1, plain, keep=True)  # the newcomer's first step matches the job's first call
    call(1, mixed)
    assert s.optimizer_spec == mixed
    call(0, later)  # the survivors change it: not refused for the slot's old count
    call(1, later)
    assert s.optimizer_spec == later
    with pytest.raises(ValueError, match="every worker must set the same"):
        s._on_members(Message("members", 0, "s", {"epoch": 3, "joined": 1, "present": [0, 1]}))
        call(1, opt.create("adam").spec(), keep=True)
    assert s.optimizer_spec == later
