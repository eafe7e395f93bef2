"""Reproducible sums: a round's sum is the same bits whatever the order its pushes arrive in.

On the round machine (no processes): hypothesis draws W <= 8 workers' float32 or float16
gradients (random normals of mixed scales, so that sums round; float16 ones long enough for
the servers' fast float16 sum, ``kvstore.half``, and large enough to overflow), ranks that
join after fewer rounds, and two interleavings of the same pushes and joins; both must apply
bit-identical sums, equal to a reference that adds in the documented order (a pairwise tree
over ranks) with NumPy. Then a real job, run three times with random delays, must end with
one hash of its weights.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.rounds import Apply, Rounds, pairwise_sum


def tree_sum(leaves: list, lo: int = 0, size: int | None = None):
    """The documented order, written apart from ``rounds.py``: the node over ranks
    ``[lo, lo + size)`` (size a power of two) is its left half plus its right half; a half
    that holds no rank, or only joined ranks (``None``), is left out."""
    if size is None:
        size = 1 << (len(leaves) - 1).bit_length()
    if size == 1:
        return leaves[lo] if lo < len(leaves) else None
    half = size // 2
    left, right = tree_sum(leaves, lo, half), tree_sum(leaves, lo + half, half)
    if left is None or right is None:
        return right if left is None else left
    return left + right


@st.composite
def jobs(draw):
    W = draw(st.integers(1, 8))
    rounds = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    # float16: past kvstore.half's small-array cut (4096), else NumPy's add sums it
    size = draw(st.integers(1, 9) if dtype == np.float32 else st.integers(4096, 4200))
    # a rank's pushes: all rounds, or fewer and then join (at least one rank pushes them all)
    stays = draw(st.integers(0, W - 1))
    counts = [
        rounds if r == stays or not draw(st.booleans()) else draw(st.integers(0, rounds - 1))
        for r in range(W)
    ]
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    grads = [
        [
            (rng.standard_normal(size) * 10.0 ** rng.integers(-4, 5)).astype(dtype)
            for _ in range(counts[r])
        ]
        for r in range(W)
    ]
    for mine in grads:
        for g in mine:
            g.flags.writeable = False  # a push is read-only: nothing may sum into it
    return W, rounds, counts, grads


def interleave(data, W: int, counts: list, rounds: int, label: str) -> list:
    """A random order of every rank's events: its pushes in order, then its join if any."""
    events = [[("push", r, n) for n in range(counts[r])] for r in range(W)]
    for r in range(W):
        if counts[r] < rounds:
            events[r].append(("join", r, None))
    order = []
    while any(events):
        r = data.draw(st.sampled_from([r for r in range(W) if events[r]]), label=label)
        order.append(events[r].pop(0))
    return order


def play(W: int, grads: list, order: list, give_back=None, reproducible: bool = True) -> list:
    """Feed the events to a :class:`Rounds` as a server does; the sums it applies, in order.
    ``give_back()`` says whether to give a replaced value back for later rounds to sum into."""
    r = Rounds(W, round_timeout=0, reproducible=reproducible)
    r.add_key("k")
    applied = []
    stored = np.zeros_like(grads[0][0] if grads[0] else next(g[0] for g in grads if g))
    for i, (kind, rank, n) in enumerate(order):
        if kind == "push":
            actions = r.push(i, rank, [("k", grads[rank][n])], True, now=float(i))
        else:
            actions = r.joined(rank, now=float(i))
        for action in actions:
            if isinstance(action, Apply):
                applied.append(action.value.copy())
                old, stored = stored, action.value
                if give_back is not None and give_back():
                    r.give_back("k", old)  # a later round may sum into it
    return applied


@settings(max_examples=300, deadline=None)
@given(jobs(), st.data())
def test_every_order_applies_the_same_bits_as_the_pairwise_tree(job, data):
    W, rounds, counts, grads = job

    def give_back():
        return data.draw(st.booleans(), label="give back")

    with np.errstate(over="ignore", invalid="ignore"):  # float16 sums may overflow to inf
        first = play(W, grads, interleave(data, W, counts, rounds, "order 1"), give_back)
        second = play(W, grads, interleave(data, W, counts, rounds, "order 2"), give_back)
    assert len(first) == len(second) == rounds
    for n in range(rounds):
        leaves = [grads[r][n] if n < counts[r] else None for r in range(W)]
        with np.errstate(over="ignore", invalid="ignore"):
            expected = tree_sum(leaves)
            assert expected.tobytes() == pairwise_sum(leaves).tobytes()
        assert first[n].tobytes() == expected.tobytes(), (n, first[n], expected)
        assert second[n].tobytes() == expected.tobytes(), (n, second[n], expected)


def test_arrival_order_gives_other_bits_and_the_tree_does_not():
    """Why: float addition is not associative. 1e8 + 1 rounds to 1e8 in float32."""
    grads = [[np.array([x], np.float32)] for x in (1e8, 1.0, -1e8, 1.0)]
    orders = [[("push", r, 0) for r in ranks] for ranks in ([0, 2, 1, 3], [1, 3, 0, 2])]
    arrival = {float(play(4, grads, o, reproducible=False)[0][0]) for o in orders}
    tree = {float(play(4, grads, o)[0][0]) for o in orders}
    assert arrival == {2.0, 0.0}
    assert tree == {0.0}  # (1e8 + 1) + (-1e8 + 1)


def test_a_lone_push_is_applied_uncopied_and_joined_ranks_are_left_out():
    r = Rounds(3, round_timeout=0)
    r.add_key("k")
    r.joined(0, 0.0)
    r.joined(2, 0.0)
    push = np.array([-0.0], np.float32)
    (apply, _) = r.push("a", 1, [("k", push)], True, 0.0)
    assert apply.value is push  # left out, not added as +0.0: -0.0 stays -0.0
    assert np.signbit(apply.value[0])


def test_a_round_holds_at_most_half_the_workers_buffers():
    """Memory: the tree sums each pair of pushes into a buffer, then sums into those."""
    W = 8
    r = Rounds(W, round_timeout=0)
    r.add_key("k")
    made: list = []  # every distinct array applied (kept alive: no id is reused)
    stored = np.zeros(4)
    for n in range(5):
        for rank in (0, 2, 4, 6, 1, 3, 5, 7) if n % 2 else range(W):
            for action in r.push((n, rank), rank, [("k", np.full(4, 1.0))], True, 0.0):
                if isinstance(action, Apply):
                    assert action.value.tolist() == [8.0] * 4
                    if not any(a is action.value for a in made):
                        made.append(action.value)
                    r.give_back("k", stored)
                    stored = action.value
        assert len(r.keys["k"].spares) <= W // 2
    assert len(made) <= W // 2 + 1  # the buffers go round: no new one each round


# ---- real processes


def test_three_runs_with_random_delays_end_with_the_same_weights(cluster):
    """W=4, S=3; rank 3 joins two steps early. With KVSTORE_REPRODUCIBLE=0 the same three
    runs gave three hashes."""
    hashes = []
    for _ in range(3):
        c = cluster(3, 4, KVSTORE_BIGARRAY_BOUND=1000)
        outs = c.run_workers("reproducible.py", [6], timeout=60)
        c.stop()
        mine = {o.split("weights ")[1].split()[0] for o in outs}
        assert len(mine) == 1, outs  # every worker pulled the same bits
        hashes.append(mine.pop())
    assert len(set(hashes)) == 1, hashes
