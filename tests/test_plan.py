"""The worker's plan and collector, without processes: properties against a plain model."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.compression import Compression
from kvstore.plan import SHM_FROM, Collector, Planner, ReplyError

DTYPES = [np.dtype(t) for t in ("f4", "f8", "i4", "f2")]


@st.composite
def calls(draw):
    num_server = draw(st.integers(1, 4))
    bound = draw(st.sampled_from([4, 50, 10**6]))
    count = draw(st.integers(1, 6))
    keys = draw(st.lists(st.integers(0, 50), min_size=count, max_size=count, unique=True))
    sizes = [draw(st.sampled_from([1, 3, 17, 64, 20000])) for _ in keys]
    dtypes = [draw(st.sampled_from(DTYPES)) for _ in keys]
    shm = draw(st.frozensets(st.integers(0, num_server - 1)))
    piece = draw(st.sampled_from([0, 0, 100, 4096, 65536]))
    return num_server, bound, keys, sizes, dtypes, shm, piece


def _planner(num_server, bound, keys, sizes, dtypes, shm, piece):
    planner = Planner(num_server, bound, shm, piece)
    for key, size, dtype in zip(keys, sizes, dtypes, strict=True):
        planner.add_key(key, size, dtype)
    return planner


def _values(keys, sizes, seed):
    rng = np.random.default_rng(seed)
    # pushed as float64: the plan casts to each key's dtype
    return [rng.standard_normal(size) * 10 for size in sizes]


@settings(max_examples=150, deadline=None)
@given(calls(), st.integers(0, 2**32 - 1), st.sampled_from(["push", "pushpull"]))
def test_a_push_plan_sends_every_element_once_cast_to_the_stored_dtype(call, seed, kind):
    num_server, bound, keys, sizes, dtypes, shm, piece = call
    planner = _planner(*call)
    values = _values(keys, sizes, seed)
    got = {key: np.full(size, np.nan) for key, size in zip(keys, sizes, strict=True)}
    seen = {key: np.zeros(size, int) for key, size in zip(keys, sizes, strict=True)}
    messages = list(planner.push(kind, keys, values, sync=True))
    if not piece:
        assert len({m.server for m in messages}) == len(messages)  # one message per server
    for m in messages:
        if piece and len(m.arrays) > 1:  # several slices only when they fit one piece
            assert sum(a.nbytes for a in m.arrays) <= piece
        assert m.kind == kind and m.body == {"sync": True} and not m.residuals
        assert len(set(m.keys)) == len(m.keys) == len(m.arrays)
        for index, ((key, part), array) in enumerate(zip(m.keys, m.arrays, strict=True)):
            server, _, lo, hi = next(p for p in planner.layout[key] if p[1] == part)
            assert server == m.server and array.dtype == planner.dtypes[key]
            got[key][lo:hi] = array
            seen[key][lo:hi] += 1
            big = array.nbytes >= SHM_FROM and m.server in shm
            assert (index in m.shared) == big
    for key, value, dtype in zip(keys, values, dtypes, strict=True):
        assert (seen[key] == 1).all()
        np.testing.assert_array_equal(got[key], value.astype(dtype))
    # the same key set again: the cached route gives the same messages
    again = list(planner.push(kind, keys, values, sync=True))
    assert [(m.server, m.keys, m.shared) for m in again] == [
        (m.server, m.keys, m.shared) for m in messages
    ]


@settings(max_examples=80, deadline=None)
@given(calls(), st.sampled_from(["2bit", "1bit"]), st.integers(0, 2**32 - 1))
def test_compression_returns_residuals_and_keeps_none(call, kind, seed):
    """The plan leaves the residuals it is given alone and returns the ones the sequential
    encoder would keep: the driver stores them only once the messages are sent."""
    num_server, bound, keys, sizes, dtypes, shm, piece = call
    dtypes = [np.dtype("f4")] * len(keys)
    planner = _planner(num_server, bound, keys, sizes, dtypes, shm, piece)
    codec = Compression.from_params({"type": kind})
    residuals: dict = {}
    reference: dict = {}
    for step in range(3):
        values = _values(keys, sizes, seed + step)
        before = {k: v.copy() for k, v in residuals.items()}
        messages = list(planner.push("push", keys, values, True, codec, residuals))
        assert residuals.keys() == before.keys()
        for k, v in residuals.items():
            np.testing.assert_array_equal(v, before[k])
        for m in messages:
            assert not m.shared  # codes never go through a segment
            for (key, part), packed, header in zip(
                m.keys, m.arrays, m.body["headers"], strict=True
            ):
                _, _, lo, hi = next(p for p in planner.layout[key] if p[1] == part)
                piece = values[keys.index(key)].astype(np.float32)[lo:hi]
                want, want_header = codec.encode(reference, (key, part), piece)
                np.testing.assert_array_equal(packed, want)
                assert header == want_header
        for m in messages:
            residuals.update(m.residuals)
        for k, v in reference.items():
            np.testing.assert_array_equal(residuals[k], v)


def _replies(planner, keys, stored):
    """What honest servers answer to a pull of ``keys``: {server: (wire keys, arrays)}."""
    out = {}
    for i, m in enumerate(planner.pull(keys)):
        arrays = []
        for key, part in m.keys:
            _, _, lo, hi = next(p for p in planner.layout[key] if p[1] == part)
            arrays.append(stored[key][lo:hi])
        out[i] = (m.keys, arrays)  # by message: a server may get several
    return out


@settings(max_examples=150, deadline=None)
@given(calls(), st.integers(0, 2**32 - 1), st.data())
def test_a_collector_writes_exactly_the_replies_of_a_call_not_cancelled(call, seed, data):
    planner = _planner(*call)
    keys, sizes, dtypes = call[2], call[3], call[4]
    stored = {
        key: value.astype(dtype)
        for key, value, dtype in zip(keys, _values(keys, sizes, seed), dtypes, strict=True)
    }
    # outs: some direct (contiguous, right dtype), some needing a cast or a second device copy
    outs, shapes = [], []
    for size, dtype in zip(sizes, dtypes, strict=True):
        kind = data.draw(st.sampled_from(["direct", "cast", "two"]))
        first = np.full(size, -7, dtype if kind != "cast" else np.float64)
        outs.append([first] if kind != "two" else [first, np.full(size, -7, dtype)])
        shapes.append((size,))
    collector = Collector(planner, keys, outs, shapes)
    replies = _replies(planner, keys, stored)
    ids = {server: 100 + server for server in replies}
    for server, (wire, _) in replies.items():
        collector.expect(ids[server], wire)
    order = data.draw(st.permutations(sorted(replies)))
    cancel_at = data.draw(st.integers(0, len(order)))  # == len(order): never cancelled
    for i, server in enumerate(order):
        if i == cancel_at:
            collector.cancel()
            snapshot = [[o.copy() for o in key_outs] for key_outs in outs]
        wire, arrays = replies[server]
        collector.receive(ids[server], wire, arrays)
        collector.receive(ids[server], wire, arrays)  # a repeat: not expected any more
    if cancel_at == len(order):
        snapshot = None
        assert not collector.waiting
    collector.finish()
    for key, key_outs in zip(keys, outs, strict=True):
        for out in key_outs:
            if snapshot is None:
                np.testing.assert_array_equal(out, stored[key].astype(out.dtype))
    if snapshot is not None:  # nothing written once cancelled, not even by finish()
        for key_outs, before in zip(outs, snapshot, strict=True):
            for out, old in zip(key_outs, before, strict=True):
                np.testing.assert_array_equal(out, old)


def test_a_reply_that_answers_something_else_writes_nothing_and_cancels():
    planner = Planner(1, 10**6)
    planner.add_key("w", 4, "f4")
    out = np.zeros(4, np.float32)
    collector = Collector(planner, ["w"], [[out]], [(4,)])
    collector.expect(1, (("w", 0),))
    with pytest.raises(ReplyError, match="expected 4 x float32"):
        collector.receive(1, [["w", 0]], [np.ones(4, np.int32)])  # same size, other dtype
    assert collector.cancelled and (out == 0).all()
    collector = Collector(planner, ["w"], [[out]], [(4,)])
    collector.expect(2, (("w", 0),))
    with pytest.raises(ReplyError, match="expected 4 x float32"):
        collector.receive(2, [["w", 0]], [np.ones(3, np.float32)])
    collector = Collector(planner, ["w"], [[out]], [(4,)])
    collector.expect(3, (("w", 0),))
    with pytest.raises(ReplyError, match="holds key"):
        collector.receive(3, [["v", 0]], [np.ones(4, np.float32)])
    assert (out == 0).all()


def test_a_pull_plan_names_each_part_once_and_carries_no_arrays():
    planner = Planner(3, 10)
    planner.add_key("big", 30, "f4")
    planner.add_key(4, 2, "f4")
    messages = planner.pull(["big", 4])
    assert sorted((m.server, m.keys) for m in messages) == [
        (0, (("big", 0),)),
        (1, (("big", 1), (4, 0))),
        (2, (("big", 2),)),
    ]
    assert all(m.kind == "pull" and m.arrays == () for m in messages)


def test_a_compressed_push_quantises_each_message_one_ahead_of_its_sending():
    """So the driver sends message k while message k+2 is quantised; the servers take turns,
    so each link has a piece early."""
    planner = Planner(2, 10, piece_bytes=64)
    planner.add_key("big", 160, "f4")  # 640 bytes: 10 pieces of 16 floats, 5 per server
    codec = Compression.from_params({"type": "2bit", "threshold": 0.5})
    calls = []
    real = codec.quantize

    def counted(residual, grad):
        calls.append(grad.size)
        return real(residual, grad)

    value = np.random.default_rng(1).standard_normal(160).astype(np.float32)
    with mock.patch.object(Compression, "quantize", side_effect=counted):
        messages = planner.push("push", ["big"], [value], True, codec, {})
        assert calls == []
        first = next(messages)
        assert calls == [16, 16] and first.server == 0
        second = next(messages)
        assert len(calls) == 3 and second.server == 1
        rest = [second, *messages]
    assert len(calls) == 10
    assert [m.server for m in [first, *rest]] == [0, 1] * 5
    assert [m.keys[0][1] for m in [first, *rest]] == list(range(10))  # part k is piece k
