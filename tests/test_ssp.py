"""dist_ssp's contract on the round machine, against a plain model; no processes, no sockets.

Hypothesis writes W <= 8 workers' programs (every worker pushes the keys of each step, with
pulls anywhere, as a training loop does; some run out of data and ``join``, counting as
zeros) and an interleaving in which any worker may run ahead. Each worker follows the
client's rule (``DistStore._bound``): it pushes a key again only once its last push of it was
answered, and it waits for its pulls. Checked:

- every reply of a pull or pushpull at clock ``c`` (the reader's pushes of the key) is the
  model's value after ``d`` complete rounds with ``c - s <= d <= c``: it holds every worker's
  pushes of clocks up to ``c - s - 1`` and no round the reader has not pushed;
- when a push that takes its worker to clock ``c`` is answered, ``c - s`` rounds are complete:
  no worker is ever more than ``s`` answered clocks ahead of the slowest;
- nobody deadlocks: every program runs to its end;
- ``s = 0`` gives the same actions, in the same order, as ``dist_sync`` for the same events.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore
from kvstore.config import staleness_of
from kvstore.errors import ConfigError
from kvstore.rounds import Apply, Fail, Reply, Rounds

SIZES = {"a": 2, "b": 3}


class Model:
    """The server as the rounds direct it, and the sequential model to check it against."""

    def __init__(self, workers: int, staleness: int | None, updater: bool, reproducible=True):
        self.W, self.s, self.updater = workers, staleness, updater
        self.rounds = Rounds(workers, round_timeout=0, reproducible=reproducible)
        for key in SIZES:
            self.rounds.add_key(key)
        self.stored = {k: np.arange(n, dtype=np.float64) + 1 for k, n in SIZES.items()}
        self.init = {k: v.copy() for k, v in self.stored.items()}
        self.applied = dict.fromkeys(SIZES, 0)  # rounds applied so far, as a reply sees them
        self.pushes = {k: [[] for _ in range(workers)] for k in SIZES}
        self.requests: dict = {}  # id -> (rank, kind, {key: clock})
        self.outcomes: dict = {}  # id -> ("reply", {key: (value, rounds done)}) or ("fail", text)
        self.events: list = []  # what the rounds were fed, for a replay
        self.actions: list = []  # what they said, as comparable tuples
        self.ids = 0

    def expected(self, key, done: int) -> np.ndarray:
        value = self.init[key].copy()
        for i in range(done):
            total = sum(p[i] for p in self.pushes[key] if len(p) > i)  # joined: zeros
            value = 0.5 * value + total if self.updater else total
        return value

    def _run(self, actions: list) -> None:
        for action in actions:
            if isinstance(action, Apply):
                old = self.stored[action.key]
                new = 0.5 * old + action.value if self.updater else np.array(action.value)
                self.stored[action.key] = new
                self.applied[action.key] += 1
                self.actions.append(("apply", action.key, tuple(action.value)))
            elif isinstance(action, Reply):
                rank, kind, clocks = self.requests[action.request]
                if kind == "push":  # the bound: the pusher is at most s ahead of the rounds
                    for key, clock in clocks.items():
                        done = self.applied[key]
                        assert clock - done <= (self.s or 0), (rank, key, clock, done)
                seen = {k: (self.stored[k].copy(), self.applied[k]) for k in clocks}
                self.outcomes[action.request] = ("reply", seen)
                self.actions.append(("reply", action.request))
            else:
                assert isinstance(action, Fail)
                self.outcomes[action.request] = ("fail", action.text)
                self.actions.append(("fail", action.request))

    def push(self, rank: int, kind: str, keys: list, grads: dict) -> int:
        self.ids += 1
        for key in keys:
            self.pushes[key][rank].append(grads[key])
        clocks = {k: len(self.pushes[k][rank]) for k in keys}
        self.requests[self.ids] = (rank, kind, clocks)
        items = [(k, grads[k]) for k in keys]
        self.events.append(("push", self.ids, rank, items))
        self._run(self.rounds.push(self.ids, rank, items, True, 0.0, self.s))
        return self.ids

    def pull(self, rank: int, keys: list) -> int:
        self.ids += 1
        self.requests[self.ids] = (rank, "pull", {k: len(self.pushes[k][rank]) for k in keys})
        self.events.append(("pull", self.ids, rank, keys))
        self._run(self.rounds.pull(self.ids, rank, keys, self.s))
        return self.ids


@st.composite
def programs(draw):
    workers = draw(st.integers(1, 8))
    staleness = draw(st.sampled_from([0, 1, 2, 4]))
    steps = draw(
        st.lists(
            st.lists(st.sampled_from(sorted(SIZES)), min_size=1, max_size=2, unique=True),
            min_size=1,
            max_size=8,
        )
    )
    return workers, staleness, steps


def _grad(data, key: str) -> np.ndarray:
    values = st.lists(st.integers(-4, 4), min_size=SIZES[key], max_size=SIZES[key])
    return np.array(data.draw(values), dtype=np.float64)


@settings(max_examples=300, deadline=None)
@given(programs(), st.booleans(), st.booleans(), st.data())
def test_every_read_is_within_the_bound_and_nobody_runs_further_ahead(
    scn, updater, reproducible, data
):
    workers, s, steps = scn
    m = Model(workers, s, updater, reproducible)
    ops = []
    for _ in range(workers):
        mine = []
        length = len(steps)
        if data.draw(st.booleans(), label="runs out of data"):  # then joins: zeros from now on
            length = data.draw(st.integers(0, len(steps)), label="steps before join")
        for keys in steps[:length]:
            if data.draw(st.booleans(), label="pull first"):
                mine.append(
                    ("pull", sorted(data.draw(st.sets(st.sampled_from(sorted(SIZES)), min_size=1))))
                )
            mine.append((data.draw(st.sampled_from(["push", "pushpull"])), keys))
        if length < len(steps):
            mine.append(("join", []))
        ops.append(mine)
    pc = [0] * workers
    blocking: list = [None] * workers  # the pull or pushpull a worker waits for
    unacked: list = [{} for _ in range(workers)]  # key -> its last push's request
    for _ in range(10_000):

        def runnable(r):
            if pc[r] >= len(ops[r]):
                return False
            if blocking[r] is not None and blocking[r] not in m.outcomes:
                return False
            kind, keys = ops[r][pc[r]]
            if kind == "join":  # join waits until every request of this worker is answered
                keys = list(unacked[r])
            return kind == "pull" or all(
                unacked[r].get(k) is None or unacked[r][k] in m.outcomes for k in keys
            )

        ready = [r for r in range(workers) if runnable(r)]
        if not ready:
            break
        r = data.draw(st.sampled_from(ready), label="next worker")
        kind, keys = ops[r][pc[r]]
        pc[r] += 1
        if kind == "pull":
            blocking[r] = m.pull(r, keys)
            continue
        if kind == "join":
            m.events.append(("join", None, r, None))
            m._run(m.rounds.joined(r, 0.0))
            continue
        q = m.push(r, kind, keys, {k: _grad(data, k) for k in keys})
        for k in keys:
            unacked[r][k] = q
        if kind == "pushpull":
            blocking[r] = q
    assert pc == [len(o) for o in ops], f"deadlock: programs stopped at {pc}"
    assert len(m.outcomes) == m.ids, "a request was never answered"
    for q, (what, result) in m.outcomes.items():
        assert what == "reply", result
        rank, kind, clocks = m.requests[q]
        if kind == "push":
            continue
        for key, (value, done) in result.items():
            c = clocks[key]
            assert c - s <= done <= c, (kind, rank, key, c, done)
            np.testing.assert_array_equal(value, m.expected(key, done))
    if s == 0:  # the same events through dist_sync's rules say the same
        sync = Model(workers, None, updater, reproducible)
        for kind, q, rank, payload in m.events:
            if kind == "join":
                sync._run(sync.rounds.joined(rank, 0.0))
            elif kind == "push":
                sync.requests[q] = m.requests[q]
                sync._run(sync.rounds.push(q, rank, payload, True, 0.0))
            else:
                sync.requests[q] = m.requests[q]
                sync._run(sync.rounds.pull(q, rank, payload))
        assert sync.actions == m.actions


def test_a_worker_s_rounds_ahead_is_answered_and_one_more_waits():
    r = Rounds(num_workers=2, round_timeout=0)
    r.add_key("w")
    one = np.ones(1)
    for n in range(2):  # worker 0 runs 2 rounds ahead of worker 1: answered at once
        assert [type(a) for a in r.push(("p", n), 0, [("w", one)], True, 0.0, 2)] == [Reply]
    assert r.push(("p", 2), 0, [("w", one)], True, 0.0, 2) == []  # a third waits
    assert [type(a) for a in r.pull("read", 0, ["w"], 2)] == []  # clock 3 needs round 0
    got = r.push("slow", 1, [("w", one)], True, 0.0, 2)
    assert [type(a).__name__ for a in got] == ["Reply", "Apply", "Reply", "Reply"]
    assert {a.request for a in got if isinstance(a, Reply)} == {("p", 2), "read", "slow"}


def test_workers_must_agree_on_the_bound():
    r = Rounds(num_workers=2, round_timeout=0)
    r.add_key("w")
    r.push("a", 0, [("w", np.ones(1))], True, 0.0, 2)
    (fail,) = r.push("b", 1, [("w", np.ones(1))], True, 0.0, 1)
    assert isinstance(fail, Fail)
    assert "dist_ssp with staleness 1" in fail.text and "staleness 2" in fail.text
    (fail,) = r.pull("c", 1, ["w"], None)
    assert isinstance(fail, Fail) and "dist_sync" in fail.text
    (fail,) = r.push("d", 1, [("w", np.ones(1))], False, 0.0, -1)  # unbounded: async
    assert isinstance(fail, Fail) and "staleness inf" in fail.text


def test_a_push_answered_early_into_a_round_that_can_never_complete_fails_the_flush():
    """Worker 0 pushes 3 times, worker 1 twice and closes: round 2 can never complete. Its
    push was answered (s=1), so the client's flush at close is where it hears of it."""
    r = Rounds(num_workers=2, round_timeout=0)
    r.add_key("w")
    one = np.ones(1)
    for n in range(3):  # each of worker 0's pushes is answered (the third one round early)
        assert Reply(("a", n)) in r.push(("a", n), 0, [("w", one)], True, 0.0, 1)
        if n < 2:
            r.push(("b", n), 1, [("w", one)], True, 0.0, 1)
    assert r.pull("read", 0, ["w"], 1) == [Reply("read")]  # clock 3, rounds 0..1 done
    assert r.finished(1) == []  # nobody waits on round 2 yet
    (fail,) = r.pull("flush", 0, ["w"], 1, flush=True)
    assert isinstance(fail, Fail) and "can never complete" in fail.text


def test_a_stall_names_the_clocks_of_a_held_back_worker():
    r = Rounds(num_workers=3, round_timeout=0)
    r.add_key("w")
    for n in range(3):
        r.push(n, 0, [("w", np.ones(1))], True, 0.0, 1)
    r.push("one", 1, [("w", np.ones(1))], True, 0.0, 1)
    (stall,) = r.stalled(now=5.0, after=1.0)
    assert stall.staleness == 1 and stall.clocks == [3, 1, 0]
    assert stall.missing == [2] and 2 in stall.waiting  # worker 0's third push waits


# ---- real processes


@pytest.mark.parametrize("staleness,slow", [(0, -1), (2, 1)])
def test_counters_read_within_the_bound_with_random_delays(cluster, staleness, slow):
    c = cluster(2, 3, KVSTORE_BIGARRAY_BOUND=1000)
    outs = c.run_workers("ssp_counter.py", [staleness, 30, 7, slow], timeout=120)
    stale = 0
    for o in outs:
        assert " OK " in o, outs
        stale += int(o.split(" reads checked, ")[1].split()[0])
    if staleness == 0:
        assert stale == 0, outs  # s = 0 is dist_sync: every read holds every round
    else:
        assert stale > 0, outs  # the fast workers did read ahead of the slow one


def test_the_bound_setting():
    assert staleness_of(None, "KVSTORE_STALENESS") == 1
    assert staleness_of("3", "KVSTORE_STALENESS") == 3
    assert staleness_of("inf", "KVSTORE_STALENESS") == float("inf")
    assert staleness_of(0, "staleness") == 0
    for bad in ("-1", "1.5", "two", 2.5):
        with pytest.raises(ConfigError, match="expected a number of rounds"):
            staleness_of(bad, "KVSTORE_STALENESS")
    with pytest.raises(ValueError, match="for 'dist_ssp' only"):
        kvstore.create("dist_sync", staleness=2)


def test_a_push_that_can_never_be_applied_is_an_error_at_close(cluster):
    c = cluster(1, 2)
    workers = c.start_workers("ssp_short.py")
    c.wait(workers, 60)
    assert "CLOSE: ok" in c.output("worker1"), c.dump()
    out = c.output("worker0")
    assert "pulled [-4.0, -4.0, -4.0]" in out, c.dump()  # rounds 0 and 1 of 2 workers' ones
    assert "CLOSE: " in out and "can never complete" in out.split("CLOSE: ")[1], c.dump()
