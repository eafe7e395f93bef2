"""Placement of keys on servers: every element of a key lands in exactly one part."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.sharding import place, server_of

keys = st.one_of(st.integers(0, 2**40), st.text(max_size=20))


@given(keys, st.integers(0, 10_000), st.integers(1, 9), st.integers(1, 5_000))
def test_parts_cover_the_key_once(key, size, num_server, bound):
    parts = place(key, size, num_server, bound)  # no piece limit: MXNet's placement
    assert parts[0][2] == 0 and parts[-1][3] == size
    for (_, _, _, hi), (_, _, lo, _) in zip(parts, parts[1:], strict=False):
        assert hi == lo  # contiguous, no gap, no overlap
    assert all(0 <= server < num_server for server, *_ in parts)
    if size >= bound and num_server > 1:
        assert [p[0] for p in parts] == [p[1] for p in parts] == list(range(num_server))
        lengths = [hi - lo for _, _, lo, hi in parts]
        assert max(lengths) - min(lengths) <= 1  # an equal share for every server
    else:
        assert parts == [(server_of(key, num_server), 0, 0, size)]


@given(keys, st.integers(1, 9))
def test_a_small_key_has_one_home_in_every_process(key, num_server):
    assert server_of(key, num_server) == server_of(key, num_server)
    assert 0 <= server_of(key, num_server) < num_server


def test_str_keys_are_placed_by_a_stable_hash_not_python_hash():
    # crc32, fixed across runs, processes and machines (Python's str hash is salted)
    assert [server_of(k, 4) for k in ("w", "b", "layer0.w", "x")] == [2, 1, 0, 3]


@given(
    keys,
    st.integers(0, 100_000),
    st.integers(1, 9),
    st.integers(1, 50_000),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 4096),
)
def test_pieces_cover_the_key_once_and_respect_the_limit(
    key, size, num_server, bound, itemsize, piece_bytes
):
    parts = place(key, size, num_server, bound, itemsize, piece_bytes)
    assert [p[1] for p in parts] == list(range(len(parts)))
    assert parts[0][2] == 0 and parts[-1][3] == size
    for (_, _, _, hi), (_, _, lo, _) in zip(parts, parts[1:], strict=False):
        assert hi == lo
    lengths = [hi - lo for _, _, lo, hi in parts]
    assert max(lengths) - min(lengths) <= 1  # equal pieces
    split = size >= bound and num_server > 1
    if split:  # round-robin over every server, each the same number of pieces
        assert [p[0] for p in parts] == [i % num_server for i in range(len(parts))]
        assert len(parts) % num_server == 0 or len(parts) == size
    else:
        assert {p[0] for p in parts} == {server_of(key, num_server)}
    if len(parts) > (num_server if split else 1):  # pieced: none much over the limit
        assert max(lengths) * itemsize <= piece_bytes + itemsize
    else:
        assert parts == place(key, size, num_server, bound)


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**63 - 1), max_size=40),
    servers=st.integers(1, 9),
    step=st.integers(1, 3),
)
def test_row_server_is_the_fibonacci_hash(ids, servers, step):
    """row_server against the formula in plain integers (its in-place NumPy form must give
    the same server for every id, any stride, power-of-two server counts or not)."""
    import numpy as np

    from kvstore.sharding import row_server

    want = [((i * 0x9E3779B97F4A7C15) % 2**64 >> 32) % servers for i in ids[::step]]
    got = row_server(np.array(ids, np.int64)[::step], servers)
    assert got.dtype == np.int64 and got.tolist() == want
