"""The round state machine against a sequential model of dist_sync and dist_async.

No processes and no sockets: hypothesis writes the workers' programs (a common sequence of
push steps, as a training loop makes, with pulls anywhere, some workers running out of data
and joining or closing early) and an interleaving, including workers several rounds ahead.
A harness plays the server (it applies what :class:`Rounds` says and answers requests), and
every value a pull returns is compared with the model's.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.rounds import Apply, Fail, Reply, Rounds

SIZES = {"a": 1, "b": 3, "c": 17}


class Harness:
    """Plays the server: executes actions, keeps every request's outcome, checks buffers."""

    def __init__(self, num_workers: int, sync: bool, updater: bool, data, reproducible=True):
        self.W, self.sync, self.updater, self.data = num_workers, sync, updater, data
        self.rounds = Rounds(num_workers, round_timeout=1e9, reproducible=reproducible)
        self.init = {k: np.arange(n, dtype=np.float64) + 1 for k, n in SIZES.items()}
        self.stored = {k: v.copy() for k, v in self.init.items()}
        self.shadow = {k: v.copy() for k, v in self.init.items()}
        for key in SIZES:
            self.rounds.add_key(key)
        self.pushes = {k: [[] for _ in range(num_workers)] for k in SIZES}  # model: per round
        self.arrivals = {k: [] for k in SIZES}  # model for async: pushes in arrival order
        self.pending: dict = {}  # request -> (rank, kind, {key: rounds needed})
        self.outcomes: dict = {}
        self.sent_grads: list = []  # (array, copy): a pushed array is never written to
        self.now = 0.0
        self.ids = 0

    # ---- the model
    def expected(self, key, rounds_needed):
        if not self.sync:
            value = self.init[key].copy()
            for grad in self.arrivals[key][:rounds_needed]:
                value = 0.5 * value + grad if self.updater else value + grad
            return value
        value = self.init[key].copy()
        for i in range(rounds_needed):
            total = sum(p[i] for p in self.pushes[key] if len(p) > i)
            value = 0.5 * value + total if self.updater else total
        return value

    # ---- events
    def _run(self, actions):
        for action in actions:
            for key in SIZES:  # nobody wrote into a stored value behind the server's back
                np.testing.assert_array_equal(self.stored[key], self.shadow[key])
            if isinstance(action, Apply):
                old = self.stored[action.key]
                if self.updater:
                    new = 0.5 * old + action.value
                elif action.accumulate:
                    new = old + action.value
                else:
                    new = action.value  # the round's sum becomes the value, uncopied
                self.stored[action.key] = new
                self.shadow[action.key] = np.array(new)
                if self.data.draw(st.booleans(), label="old value no longer sent"):
                    self.rounds.give_back(action.key, old)
            elif isinstance(action, Reply):
                rank, kind, needed = self.pending.pop(action.request)
                values = {k: np.array(self.stored[k]) for k in needed}
                self.outcomes[action.request] = ("reply", rank, kind, needed, values)
            else:
                assert isinstance(action, Fail)
                rank, kind, needed = self.pending.pop(action.request)
                self.outcomes[action.request] = ("fail", rank, kind, needed, action.text)

    def push(self, rank, keys, kind, counts):
        self.ids += 1
        self.now += 0.001
        grads = []
        for key in keys:
            grad = np.array(
                self.data.draw(
                    st.lists(st.integers(-4, 4), min_size=SIZES[key], max_size=SIZES[key])
                ),
                dtype=np.float64,
            )
            self.sent_grads.append((grad, grad.copy()))
            self.pushes[key][rank].append(grad)
            self.arrivals[key].append(grad)
            counts[key] += 1
            grads.append((key, grad))
        needed = {k: counts[k] if self.sync else len(self.arrivals[k]) for k in keys}
        self.pending[self.ids] = (rank, kind, needed)
        self._run(self.rounds.push(self.ids, rank, grads, self.sync, self.now))
        return self.ids

    def pull(self, rank, keys, counts):
        self.ids += 1
        needed = {k: counts[k] if self.sync else len(self.arrivals[k]) for k in keys}
        self.pending[self.ids] = (rank, "pull", needed)
        self._run(self.rounds.pull(self.ids, rank, list(keys)))
        return self.ids

    def check(self, early: set):
        for request, outcome in self.outcomes.items():
            what, rank, kind, needed, result = outcome
            if what == "fail":
                assert early, f"request {request} of rank {rank} failed: {result}"
                assert "finished" in result, result
                continue
            if kind == "push":
                continue
            for key, rounds_needed in needed.items():
                np.testing.assert_array_equal(
                    result[key],
                    self.expected(key, rounds_needed),
                    err_msg=f"{kind} of {key!r} by rank {rank} after {rounds_needed} rounds",
                )
        for grad, copy in self.sent_grads:
            np.testing.assert_array_equal(grad, copy)


@st.composite
def scenario(draw):
    W = draw(st.integers(1, 4))
    sync = draw(st.booleans())
    steps = draw(
        st.lists(
            st.lists(st.sampled_from(sorted(SIZES)), min_size=1, max_size=3, unique=True),
            min_size=1,
            max_size=6,
        )
    )
    ends = [draw(st.sampled_from(["all", "join", "close"] if sync else ["all"])) for _ in range(W)]
    lengths = [len(steps) if e == "all" else draw(st.integers(0, len(steps))) for e in ends]
    return W, sync, steps, ends, lengths


@settings(max_examples=300, deadline=None)
@given(scenario(), st.booleans(), st.booleans(), st.data())
def test_every_pull_equals_the_sequential_model(scn, updater, reproducible, data):
    """Either summation order (the pairwise tree, or arrival order): the pushes are small
    integers, so every order gives the model's sums exactly."""
    W, sync, steps, ends, lengths = scn
    h = Harness(W, sync, updater, data, reproducible)
    programs = []
    for rank in range(W):
        ops = []
        for keys in steps[: lengths[rank]]:
            if data.draw(st.booleans(), label="pull first"):
                ops.append(("pull", data.draw(st.sets(st.sampled_from(sorted(SIZES)), min_size=1))))
            ops.append((data.draw(st.sampled_from(["push", "pushpull"])), keys))
        ops.append((ends[rank] if ends[rank] != "all" else "close", None))
        programs.append(ops)
    counts = [dict.fromkeys(SIZES, 0) for _ in range(W)]
    outstanding = [set() for _ in range(W)]  # requests not yet answered
    blocking = [None] * W  # the pull/pushpull a worker waits on
    crashed = [False] * W
    pc = [0] * W
    early = {r for r in range(W) if ends[r] == "close" and lengths[r] < len(steps)}
    for _ in range(10_000):
        for r in range(W):
            outstanding[r] = {q for q in outstanding[r] if q not in h.outcomes}
            if blocking[r] is not None and blocking[r] in h.outcomes:
                crashed[r] = h.outcomes[blocking[r]][0] == "fail"
                blocking[r] = None

        def runnable(r):
            if crashed[r] or blocking[r] is not None or pc[r] >= len(programs[r]):
                return False
            op = programs[r][pc[r]][0]
            return op not in ("join", "close") or not outstanding[r]  # both wait for acks

        ready = [r for r in range(W) if runnable(r)]
        if not ready:
            break
        r = data.draw(st.sampled_from(ready), label="next worker")
        op, keys = programs[r][pc[r]]
        pc[r] += 1
        if op == "pull":
            q = h.pull(r, sorted(keys), counts[r])
            blocking[r] = q
        elif op in ("push", "pushpull"):
            q = h.push(r, keys, op, counts[r])
            outstanding[r].add(q)
            if op == "pushpull":
                blocking[r] = q
        elif op == "join":
            h._run(h.rounds.joined(r, h.now))
        else:
            h._run(h.rounds.finished(r))
    # Nothing is left waiting: every request was answered or failed with a reason.
    assert not h.pending, f"requests never answered: {h.pending}"
    h.check(early)
    if not early:
        assert all(pc[r] == len(programs[r]) for r in range(W)), "a worker never finished"


def test_worker_three_rounds_ahead_pulls_its_own_pushes():
    """Bug 1 of the round rework: the pull waited only for the round of the first push."""
    r = Rounds(num_workers=3, round_timeout=60)
    r.add_key("3")
    for n in range(3):
        assert r.push(("p", n), 0, [("3", np.array([-1.0]))], True, now=n) == []
    assert r.pull("pull", 0, ["3"]) == []  # waits for all three rounds, not the first
    acts = []
    for n in range(3):
        acts += r.push(("q", n), 1, [("3", np.array([-2.0]))], True, now=3 + n)
        acts += r.push(("s", n), 2, [("3", np.array([-3.0]))], True, now=3 + n)
    applies = [a for a in acts if isinstance(a, Apply)]
    assert [float(a.value[0]) for a in applies] == [-6.0, -6.0, -6.0]
    replies = [a.request for a in acts if isinstance(a, Reply)]
    assert replies.index("pull") > replies.index(("p", 2))  # after the third round, not before


def test_finished_worker_fails_only_the_rounds_it_skipped():
    r = Rounds(num_workers=2, round_timeout=60)
    r.add_key("k")
    r.push("a0", 0, [("k", np.ones(1))], True, 0)
    acts = r.push("b0", 1, [("k", np.ones(1))], True, 0)
    assert [type(a) for a in acts] == [Apply, Reply, Reply]
    assert r.finished(1) == []  # nobody waits on a round worker 1 skipped yet
    acts = r.push("a1", 0, [("k", np.ones(1))], True, 1)
    assert len(acts) == 1 and isinstance(acts[0], Fail) and "worker 1 finished" in acts[0].text
    assert isinstance(r.pull("p", 0, ["k"])[0], Fail)


def test_join_counts_as_zeros_until_everyone_joined():
    r = Rounds(num_workers=3, round_timeout=60)
    r.add_key("k")
    assert r.joined(2, 0) == []
    acts = r.push("a", 0, [("k", np.full(2, 1.0))], True, 0)
    acts += r.push("b", 1, [("k", np.full(2, 2.0))], True, 0)
    assert [a.value.tolist() for a in acts if isinstance(a, Apply)] == [[3.0, 3.0]]
    assert r.joined(0, 1) == [] and r.joined(1, 1) == []
    assert not r.joined_ranks  # all joined: the next epoch starts even
    r.push("c", 0, [("k", np.ones(2))], True, 2)
    assert r.push("d", 2, [("k", np.ones(2))], True, 2) == []  # worker 1 counts again


def test_round_deadline_fails_the_round_and_names_the_missing_rank():
    r = Rounds(num_workers=2, round_timeout=10)
    r.add_key("k")
    r.push("a", 0, [("k", np.ones(1))], True, now=0)
    assert r.tick(5) == []
    (fail,) = r.tick(11)
    assert fail.request == "a" and "worker rank(s) [1] did not push it" in fail.text
    (late,) = r.push("b", 1, [("k", np.ones(1))], True, now=12)
    assert isinstance(late, Fail)


def test_async_applies_each_push_on_arrival():
    r = Rounds(num_workers=2, round_timeout=10)
    r.add_key("k")
    acts = r.push("a", 0, [("k", np.ones(1))], False, 0)
    assert isinstance(acts[0], Apply) and acts[0].accumulate and isinstance(acts[1], Reply)
    assert r.pull("p", 1, ["k"]) == [Reply("p")]


@pytest.mark.parametrize("reproducible", [True, False])
@pytest.mark.parametrize("spare_dtype", [np.float64, np.float32])
def test_a_given_back_buffer_is_reused_only_when_it_fits(spare_dtype, reproducible):
    r = Rounds(num_workers=2, round_timeout=10, reproducible=reproducible)
    r.add_key("k")
    spare = np.zeros(4, spare_dtype)
    r.give_back("k", spare)
    r.push("a", 0, [("k", np.ones(4))], True, 0)
    (apply, *_) = r.push("b", 1, [("k", np.ones(4))], True, 0)
    assert (apply.value is spare) == (spare_dtype == np.float64)
    np.testing.assert_array_equal(apply.value, 2.0)
