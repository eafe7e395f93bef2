"""Row-sparse values, the row store and row sharding, without processes: examples, MXNet
1.9.1's lazy updates, and hypothesis against a dense NumPy model."""

import contextlib
import functools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import optimizer as opt
from kvstore import rowsearch, sparse
from kvstore.sharding import row_server
from kvstore.sparse import RowSparse, RowTable

DATA = Path(__file__).parent / "data" / "mxnet_lazy.json"

# the row id search a test runs: its C module where built, and always NumPy's (what an install
# without a C compiler runs): the property tests below draw one per example
SEARCH_PATHS = [False, True] if rowsearch.FAST else [False]


@contextlib.contextmanager
def search_path(fast: bool):
    was, rowsearch.FAST = rowsearch.FAST, fast
    try:
        yield
    finally:
        rowsearch.FAST = was


def drawn_search_path(test):
    """Run ``test`` under the search path its ``c_search`` argument names."""

    @functools.wraps(test)
    def run(*args, c_search, **kwargs):
        with search_path(c_search):
            return test(*args, c_search=c_search, **kwargs)

    return run


def lazy_cases():
    recorded = json.loads(DATA.read_text())
    return [(recorded, case) for case in recorded["cases"]]


@pytest.mark.parametrize(
    "recorded,case", lazy_cases(), ids=lambda c: json.dumps(c.get("params", ""))[:60]
)
def test_lazy_updates_match_mxnet(recorded, case):
    """The weights after each step of row-sparse gradients equal MXNet 1.9.1's updater's."""
    w0 = np.array(recorded["w0"], np.float32)
    table = RowTable(w0.shape[1], np.float32)
    table.assign(np.arange(w0.shape[0]), w0)  # MXNet's server holds the full table
    optimizer = opt.create(case["name"], **case["params"])
    for t, (rows, grad, want) in enumerate(
        zip(recorded["row_sets"], recorded["grads"], case["weights"], strict=True), 1
    ):
        g = np.array(grad, np.float32).reshape(len(rows), w0.shape[1])
        table.apply(np.array(rows, np.int64), g, optimizer, t, optimizer.learning_rate(t))
        got = table.read(np.arange(w0.shape[0]))
        np.testing.assert_allclose(got, np.array(want, np.float32), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- properties vs a dense model

ROWS, DIM = 12, 3
ids_st = st.lists(st.integers(0, ROWS - 1), max_size=8)
push_st = st.lists(ids_st, min_size=1, max_size=3)  # one id list per device
op_st = st.one_of(
    st.tuples(st.just("push"), push_st, st.integers(0, 2**31)),
    st.tuples(st.just("pull"), st.lists(ids_st, min_size=1, max_size=2), st.just(0)),
    st.tuples(st.just("save"), st.integers(0, 6), st.just(0)),
    st.tuples(st.just("pushpull"), st.lists(ids_st, min_size=1, max_size=1), st.integers(0, 99)),
    st.tuples(st.just("load"), ids_st, st.integers(0, 99)),
)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(op_st, max_size=12),
    momentum=st.sampled_from([None, 0.0, 0.9]),
    init=st.sampled_from([sparse.zeros(), sparse.uniform(-1, 1, 5), sparse.normal(0, 1, 9)]),
)
def test_local_store_matches_dense_model(ops, momentum, init):
    """Every operation of a row-sparse key of the local store against a dense NumPy table:
    pushes (duplicates and devices summed; without an optimizer the touched rows become the
    sum; with SGD only the touched rows move), pushpull (the pushed rows come back), pulls of
    any ids into several outputs, save_rows (the rows changed after a step) and load_rows."""
    import kvstore

    kv = kvstore.create("local")
    shape = (ROWS, DIM)
    kv.init("e", RowSparse.empty(shape, np.float32, init=init))
    dense = sparse.init_rows(init, np.arange(ROWS), DIM, np.float32).astype(np.float64)
    mom = np.zeros_like(dense)
    changed = np.full(ROWS, -1)  # the step a row last changed (-1: never stored)
    lr, wd = 0.1, 0.01
    if momentum is not None:
        kv.set_optimizer(opt.SGD(learning_rate=lr, momentum=momentum, wd=wd))
    step = 0
    for op, arg, seed in ops:
        if op == "load":  # rows set as given, no optimizer, at the current step
            ids = np.unique(np.array(arg, np.int64))
            rows = np.random.default_rng(seed).standard_normal((ids.size, DIM))
            kv.load_rows("e", RowSparse(ids, rows.astype(np.float32), shape))
            dense[ids] = rows.astype(np.float32)
            changed[ids] = step
            continue
        if op in ("push", "pushpull"):
            rng = np.random.default_rng(seed)
            devices = [
                RowSparse(ids, rng.standard_normal((len(ids), DIM)).astype(np.float32), shape)
                for ids in arg
            ]
            total = np.zeros_like(dense)
            for d in devices:
                np.add.at(total, d.indices, d.data.astype(np.float64))
            touched = np.unique(np.concatenate([d.indices for d in devices]))
            if op == "push":
                kv.push("e", devices)
            else:
                back = devices[0]
                kv.pushpull("e", back)  # the pushed rows come back, updated
            step += 1
            if momentum is None:
                dense[touched] = total[touched]
            else:
                g = total[touched] + wd * dense[touched]
                if momentum:
                    mom[touched] = momentum * mom[touched] - lr * g
                    dense[touched] += mom[touched]
                else:
                    dense[touched] -= lr * g
            changed[touched] = step
            if op == "pushpull":
                assert back.indices.tolist() == touched.tolist()
                np.testing.assert_allclose(back.data, dense[touched], rtol=1e-5, atol=1e-5)
        elif op == "pull":
            outs = [np.full(shape, 7.0, np.float32), RowSparse.empty(shape, np.float32)]
            kv.row_sparse_pull(
                "e", out=outs, row_ids=[np.array(arg[0], np.int64), np.array(arg[-1], np.int64)]
            )
            want = np.zeros(shape)
            want[arg[0]] = dense[arg[0]]
            np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5)
            assert outs[1].indices.tolist() == sorted(set(arg[-1]))
            np.testing.assert_allclose(
                outs[1].data, dense[sorted(set(arg[-1]))], rtol=1e-5, atol=1e-5
            )
        else:
            if arg > step:
                with pytest.raises(ValueError, match="past the current step"):
                    kv.save_rows("e", since=arg)
                arg = None
            rows, now = kv.save_rows("e", since=arg)
            assert now == step
            want = np.flatnonzero(changed >= 0 if arg is None else changed > arg)
            assert rows.indices.tolist() == want.tolist()
            np.testing.assert_allclose(rows.data, dense[rows.indices], rtol=1e-5, atol=1e-5)


@settings(max_examples=80, deadline=None)
@given(
    c_search=st.sampled_from(SEARCH_PATHS),
    writes=st.lists(st.lists(st.integers(0, 2**62), max_size=20), max_size=6),
    reads=st.lists(st.integers(0, 2**62), max_size=20),
)
@drawn_search_path
def test_row_table_matches_a_dict(writes, reads, c_search):
    """The sorted-index store against a dict of rows: writes create rows, reads of absent rows
    give their initial value without storing them; ids up to 2**62."""
    init = sparse.uniform(-1, 1, seed=3)
    table, model = RowTable(2, np.float32, init), {}
    for n, ids in enumerate(writes):
        ids = np.unique(np.array(ids, np.int64))
        rows = np.full((ids.size, 2), n, np.float32)
        table.apply(ids, rows)
        model.update({int(i): rows[0] for i in ids})
    assert len(table) == len(model) == table.ids.size
    ask = np.array(reads, np.int64)
    first = sparse.init_rows(init, ask, 2, np.float32)
    want = np.array([model.get(int(i), first[k]) for k, i in enumerate(ask)]).reshape(-1, 2)
    np.testing.assert_array_equal(table.read(ask), want)
    assert len(table) == len(model)  # reads create nothing


def test_direct_map_comes_once_it_is_small_beside_the_rows():
    """A table's direct id map (4 bytes a logical row) is made only once it is at most an
    eighth of the rows' block, and lookups give the same rows before and after."""
    table = RowTable(64, np.float32, sparse.uniform(-1, 1, 6), rows=1000)  # 256 B a row
    first = np.arange(0, 200, 2)
    table.assign(first, np.full((first.size, 64), 3, np.float32))
    assert table.direct is None  # 100 rows: 25.6 KB of rows, a map of 4 KB would be more
    before = table.read(np.arange(1000))
    more = np.arange(501, 701, 4)
    table.assign(more, np.full((more.size, 64), 5, np.float32))
    assert table.direct is not None  # 150 rows: 38.4 KB, the map 4 KB
    after = table.read(np.arange(1000))
    changed = np.zeros(1000, bool)
    changed[more] = True
    np.testing.assert_array_equal(after[~changed], before[~changed])
    assert (after[more] == 5).all() and (after[first] == 3).all()
    assert RowTable(64, np.float32, rows=2**23, direct_map=True).direct is None  # too many


@settings(max_examples=150, deadline=None)
@given(
    c_search=st.sampled_from(SEARCH_PATHS),
    ids=st.lists(st.integers(0, 2**63 - 2), max_size=40),
    servers=st.integers(1, 5),
    sharding=st.sampled_from(["hash", "range"]),
    canonical=st.booleans(),
)
@drawn_search_path
def test_row_split_is_a_partition(ids, servers, sharding, canonical, c_search):
    """Every id goes to exactly one server, the one row_server (or the range) names, in the
    order given; sorted ids of a range-sharded key as runs."""
    ids = np.array(ids, np.int64)
    if canonical:
        ids = np.unique(ids)
    rows = 2**63 - 1
    bounds = sparse.bounds_of(sharding, rows, servers)
    parts = sparse.split_by_server(ids, servers, bounds)
    assert len(parts) == servers
    index = [np.arange(ids.size)[p] for p in parts]  # a slice or an index array alike
    assert [sparse.size(p) for p in parts] == [i.size for i in index]
    assert sorted(np.concatenate(index).tolist()) == list(range(ids.size))
    if servers == 1 or (bounds is not None and canonical):
        assert all(isinstance(p, slice) for p in parts)
    for server, pos in enumerate(index):
        if bounds is not None:
            assert ((ids[pos] >= bounds[server]) & (ids[pos] < bounds[server + 1])).all()
        else:
            assert (row_server(ids[pos], servers) == server).all()
        assert (np.diff(pos) > 0).all()


def test_row_server_spreads_strided_ids():
    for stride in (1, 2, 64, 1000):
        counts = np.bincount(row_server(np.arange(0, 30000 * stride, stride), 3), minlength=3)
        assert counts.min() > 0.9 * counts.max(), (stride, counts)


def test_initializer_is_the_same_for_a_row_wherever_made():
    init = sparse.normal(0, 1, seed=11)
    ids = np.array([2**40, 7, 3], np.int64)
    together = sparse.init_rows(init, ids, 5, np.float32)
    alone = sparse.init_rows(init, ids[1:2], 5, np.float32)
    np.testing.assert_array_equal(together[1], alone[0])
    assert abs(sparse.init_rows(init, np.arange(20000), 8, np.float64).std() - 1) < 0.02
    other = sparse.init_rows(sparse.normal(0, 1, seed=12), ids, 5, np.float32)
    assert not np.array_equal(together, other)


def test_canonical_sums_duplicates_and_converters():
    g = RowSparse([4, 1, 4, 4], np.arange(8, dtype=np.float32).reshape(4, 2), (5, 2))
    c = g.canonical()
    assert c.indices.tolist() == [1, 4] and c.data.tolist() == [[2, 3], [10, 13]]
    scipy_sparse = pytest.importorskip("scipy.sparse")
    m = scipy_sparse.coo_matrix(([1.0, 2.0, 3.0], ([3, 0, 3], [1, 1, 1])), shape=(5, 2))
    s = RowSparse.from_scipy(m)
    assert s.indices.tolist() == [0, 3] and s.data.tolist() == [[0, 2], [0, 4]]
    torch = pytest.importorskip("torch")
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([[1, 4, 1]])).sum().backward()
    t = RowSparse.from_torch(emb.weight.grad)
    assert t.shape == (10, 3) and t.indices.tolist() == [1, 4]
    assert t.data.tolist() == [[2.0] * 3, [1.0] * 3]


def test_errors_say_what_is_wrong():
    import kvstore

    kv = kvstore.create("local")
    kv.init("emb", RowSparse.empty((10, 2)))
    with pytest.raises(ValueError, match=r"row id 12 is outside \[0, 10\)"):
        RowSparse([12], np.ones((1, 2)), (10, 2))
    with pytest.raises(ValueError, match=r"row_sparse_pull\(key='emb'\): row id 10 is outside"):
        kv.row_sparse_pull("emb", out=RowSparse.empty((10, 2)), row_ids=[3, 10])
    with pytest.raises(ValueError) as raised:  # as the README quotes it
        kv.row_sparse_pull("emb", out=RowSparse.empty((10, 2)), row_ids=[12])
    assert str(raised.value) == "row_sparse_pull(key='emb'): row id 12 is outside [0, 10)"
    with pytest.raises(ValueError, match=r"push\(key='emb'\): value shape \(11, 2\)"):
        kv.push("emb", RowSparse([1], np.ones((1, 2)), (11, 2)))
    with pytest.raises(TypeError, match="takes a kvstore.sparse.RowSparse"):
        kv.push("emb", np.ones(3, np.float32))
    with pytest.raises(ValueError, match="duplicate init"):
        kv.init("emb", RowSparse.empty((10, 2)))
    with pytest.raises(ValueError, match="row initializer"):
        RowSparse.empty((10, 2), init={"kind": "uniform", "low": 1})
    kv2 = kvstore.create("local")
    kv2.init("emb", RowSparse.empty((10, 2)))
    kv2.set_optimizer(opt.LAMB())
    with pytest.raises(ValueError, match=r"push\(key='emb'\): LAMB's update takes norms"):
        kv2.push("emb", RowSparse([1], np.ones((1, 2), np.float32), (10, 2)))
    with pytest.raises(ValueError, match="not pulled whole"):
        kv.init("big", RowSparse.empty((10**9, 4)))
        kv.pull("big", out=np.empty((1, 4), np.float32))


def test_memory_grows_with_rows_touched():
    """A 10^9-row table of dim 64 with 10^6 rows touched, SGD with momentum's state included,
    holds under 512 MiB (the block and the state grow with the rows, never the table)."""
    table = RowTable(64, np.float32, sparse.uniform(-0.1, 0.1, seed=1), rows=10**9)
    sgd = opt.SGD(learning_rate=0.1, momentum=0.9)
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(0, 10**9, 1_000_000))
    for chunk in np.array_split(ids, 32):
        table.apply(chunk, np.ones((chunk.size, 64), np.float32), sgd, 1, 0.1)
    assert len(table) == ids.size
    assert table.nbytes < 512 * 2**20, table.nbytes


@settings(max_examples=80, deadline=None)
@given(
    c_search=st.sampled_from(SEARCH_PATHS),
    rounds=st.lists(st.lists(st.integers(0, 15), max_size=6), max_size=14),
    admit=st.integers(1, 3),
    evict=st.sampled_from([0, 1, 2, 5]),
    direct=st.booleans(),
)
@drawn_search_path
def test_admission_and_eviction_match_a_model(rounds, admit, evict, direct, c_search):
    """A row is stored from the ``admit``-th round that pushes it; a row unchanged for
    ``evict`` rounds is dropped at the next check (every evict // 2 rounds); an absent row
    reads as its initial value. With a direct id map (16 rows) or the sorted index alone."""
    init = sparse.uniform(-1, 1, seed=2)
    spec = {**init, "admit_after": admit, "evict_after": evict}
    table = RowTable(2, np.float32, spec, rows=16, direct_map=direct)
    assert (table.direct is not None) == direct
    stored, counts, last, seen = {}, {}, {}, {}
    for r, ids in enumerate(rounds, 1):
        ids = sorted(set(ids))
        if evict and r % max(1, evict // 2) == 0:
            for i in [i for i in stored if last[i] <= r - 1 - evict]:
                del stored[i], last[i]
            for i in [i for i in counts if seen[i] <= r - 1 - evict]:  # candidates age too
                del counts[i], seen[i]
        for i in ids:
            if i not in stored:
                counts[i], seen[i] = counts.get(i, 0) + 1, r
                if counts[i] < admit:
                    continue
                del counts[i], seen[i]
            stored[i], last[i] = float(r), r
        table.apply(np.array(ids, np.int64), np.full((len(ids), 2), r, np.float32))
    everything = np.arange(16)
    first = sparse.init_rows(init, everything, 2, np.float32)
    want = np.array([[stored[i]] * 2 if i in stored else first[i] for i in everything])
    np.testing.assert_array_equal(table.read(everything), want)
    assert len(table) == len(stored)
    assert sorted(table.ids.tolist()) == sorted(stored)
    assert table.cand_ids.tolist() == sorted(counts)
    assert table.cand_counts.tolist() == [counts[i] for i in sorted(counts)]


def test_admission_candidates_age_out():
    """An id pushed once, then not for evict_after rounds, is no candidate any more: its
    count starts again, and the candidates cannot grow without bound."""
    table = RowTable(2, np.float32, {**sparse.zeros(), "admit_after": 2, "evict_after": 2})
    for r in range(200):
        table.apply(np.array([1000 + r], np.int64), np.ones((1, 2), np.float32))
    assert table.cand_ids.size <= 3, table.cand_ids.size
    table.apply(np.array([1000], np.int64), np.ones((1, 2), np.float32))
    assert len(table) == 0  # its first push was forgotten: one push counted, not two


@settings(max_examples=80, deadline=None)
@given(
    c_search=st.sampled_from(SEARCH_PATHS),
    rounds=st.lists(st.lists(ids_st, min_size=1, max_size=3), max_size=6),
    sgd=st.booleans(),
    seed=st.integers(0, 2**31),
    direct=st.booleans(),
)
@drawn_search_path
def test_server_rounds_match_a_plain_sum(rounds, sgd, seed, direct, c_search):
    """A server's round (SparseKeys.apply: the workers' pushes added straight into the rows
    without an optimizer, summed first with one) leaves the same bits as adding the pushes
    in rank order and applying the sum (pushes given as ``0 +`` themselves, as a same-host
    worker's shared segment holds them, or as pushed, -0.0 in both); the rows a pushpull
    answers are its pushed rows,
    without an optimizer as a delta (0 + its rows, but those another push touched too).
    With a direct id map, and with the sorted index alone (as the twin); bit for bit."""
    rng = np.random.default_rng(seed)
    keys, twin = sparse.SparseKeys(), RowTable(DIM, np.float32, sparse.uniform(-1, 1, 4))
    keys.add_key("k", ROWS, DIM, np.float32, sparse.uniform(-1, 1, 4))
    keys.tables["k"] = RowTable(DIM, np.float32, sparse.uniform(-1, 1, 4), ROWS, direct)
    optimizer = opt.SGD(learning_rate=0.1, momentum=0.9) if sgd else None
    shape = (ROWS, DIM)
    for n, pushes in enumerate(rounds):
        values = []
        for rank, ids in reversed(list(enumerate(pushes))):  # arrival order: any
            ids = np.unique(np.array(ids, np.int64))
            rows = rng.standard_normal((ids.size, DIM)).astype(np.float32)
            rows[rng.random(rows.shape) < 0.2] = -0.0
            normal = bool(rng.integers(2))  # as a same-host worker leaves them: 0 + rows
            given = np.add(np.float32(0), rows) if normal else rows
            keys.add("k", n, rank, ids, given, sync=True, normal=normal)
            values.append((rank, ids, RowSparse(ids, rows, shape)))
        keys.apply("k", False, optimizer, n + 1, 0.1)
        # the reference: 0 + each push in rank order, on a dense float32 table
        total = np.zeros(shape, np.float32)
        for _, _, v in sorted(values, key=lambda x: x[0]):
            np.add.at(total, v.indices, v.data)
        touched = np.unique(np.concatenate([v.indices for *_, v in values]))
        twin.apply(touched, total[touched], optimizer, n + 1, 0.1)
        table = keys.tables["k"]
        bits = np.testing.assert_array_equal
        for _, ids, v in values:  # (ids: the very array pushed, which its reply is of)
            want = twin.read(v.indices).view(np.uint32)
            bits(table.pushed_rows(v.indices).view(np.uint32), want)
            delta = table.pushed_delta(ids)
            assert (delta is None) == (optimizer is not None)
            if delta is not None:  # as a worker reads its reply
                at, given = delta
                got = np.add(np.float32(0), v.data)
                got[at] = given
                assert at.size == 0 or (np.diff(at) > 0).all()
                bits(got.view(np.uint32), want)
            # a pull of the same ids (another array: the step's pull) reads the same rows
            bits(table.read(v.indices.copy()).view(np.uint32), want)
        everything = np.arange(ROWS)
        bits(table.read(everything).view(np.uint32), twin.read(everything).view(np.uint32))
        assert table.changed_since(n)[0].tolist() == twin.changed_since(n)[0].tolist()


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(["float16", "float32", "float64", "complex64"]),
    dim=st.integers(0, 5),
    pushes=st.lists(st.lists(st.integers(0, 2 * ROWS - 1), max_size=8), min_size=1, max_size=3),
    pull=st.lists(st.integers(0, 2 * ROWS - 1), max_size=10),
    direct=st.booleans(),
    offset=st.integers(0, 15),
)
def test_rows_gathered_into_a_region_are_the_rows_read(dtype, dim, pushes, pull, direct, offset):
    """What a server writes into a pull region (RowTable.read / pushed_rows with ``out``: a
    view of raw bytes, misaligned too) is bit for bit what it reads into a new array, for
    any dtype and dim, pulled ids repeated, unsorted or never pushed, and empty sets; the
    reader's view of the region (``[:rows * dim].reshape(rows, dim)``) gives them back."""
    dtype = np.dtype(dtype)
    table = RowTable(dim, dtype, sparse.uniform(-1, 1, 5), rows=2 * ROWS, direct_map=direct)
    rng = np.random.default_rng(len(pull))
    rounds = []
    for ids in pushes:
        ids = np.unique(np.array(ids, np.int64))
        rounds.append((ids, rng.standard_normal((ids.size, dim)).astype(dtype), False))
    table.assign_sums(rounds)
    region = np.zeros(offset + 16 * 10 * dim * dtype.itemsize, np.uint8)[offset:]  # raw bytes
    asked = [(ids, table.pushed_rows) for ids, _, _ in rounds]
    asked.append((np.array(pull, np.int64), table.read))
    for ids, gather in asked:
        want = table.read(ids)
        need = ids.size * dim * dtype.itemsize
        got = gather(ids, region[:need].view(dtype).reshape(ids.size, dim))
        seen = region.view(dtype)[: ids.size * dim].reshape(ids.size, dim)  # the reader's view
        for rows in (got, seen):
            assert rows.shape == want.shape and rows.tobytes() == want.tobytes()


@pytest.mark.parametrize("name", ["adam", "sgd", "adagrad"])
def test_optimizer_states_of_rows_save_and_load(tmp_path, name):
    """save_optimizer_states holds a row-sparse key's state: a store restored from
    save_rows + save_optimizer_states continues exactly as the original."""
    import kvstore

    shape = (10**6, 3)
    params = {"learning_rate": 0.1, "momentum": 0.9} if name == "sgd" else {}
    rng = np.random.default_rng(1)
    grads = [
        RowSparse(rng.integers(0, 50, 8), rng.standard_normal((8, 3)).astype(np.float32), shape)
        for _ in range(4)
    ]
    kv = kvstore.create("local")
    kv.init("e", RowSparse.empty(shape, np.float32, init=sparse.uniform(-1, 1, 3)))
    kv.set_optimizer(opt.create(name, **params))
    for g in grads[:2]:
        kv.push("e", g)
    rows, _ = kv.save_rows("e")
    kv.save_optimizer_states(str(tmp_path / "states"))
    for g in grads[2:]:
        kv.push("e", g)
    restored = kvstore.create("local")
    restored.init("e", RowSparse.empty(shape, np.float32, init=sparse.uniform(-1, 1, 3)))
    restored.set_optimizer(opt.create(name, **params))
    restored.load_rows("e", rows)
    restored.load_optimizer_states(str(tmp_path / "states"))
    for g in grads[2:]:
        restored.push("e", g)
    ids = np.arange(50)
    a, b = RowSparse.empty(shape, np.float32), RowSparse.empty(shape, np.float32)
    kv.row_sparse_pull("e", out=a, row_ids=ids)
    restored.row_sparse_pull("e", out=b, row_ids=ids)
    np.testing.assert_array_equal(a.data, b.data)


def test_checkpoint_holds_rows_never_pushed():
    """save_rows() is a checkpoint: the rows a key was initialised with count, and a store
    restored with load_rows(step=...) gives the same rows and continues the step; a since
    past the current step is refused, saying what to do."""
    import kvstore

    shape = (10, 2)
    kv = kvstore.create("local")
    kv.init("e", RowSparse([1, 2], np.full((2, 2), 5.0, np.float32), shape))
    rows, step = kv.save_rows("e")
    assert rows.indices.tolist() == [1, 2] and step == 0
    kv.push("e", RowSparse([3], np.ones((1, 2), np.float32), shape))
    rows, step = kv.save_rows("e")
    assert rows.indices.tolist() == [1, 2, 3] and step == 1
    assert kv.save_rows("e", since=0)[0].indices.tolist() == [3]
    restored = kvstore.create("local")
    restored.init("e", RowSparse.empty(shape, np.float32))
    restored.load_rows("e", rows, step=step)
    again, now = restored.save_rows("e")
    assert again.indices.tolist() == [1, 2, 3] and now == step
    np.testing.assert_array_equal(again.data, rows.data)
    assert restored.save_rows("e", since=step)[0].nnz == 0
    restored.push("e", RowSparse([4], np.ones((1, 2), np.float32), shape))
    assert restored.save_rows("e", since=step)[0].indices.tolist() == [4]
    fresh = kvstore.create("local")
    fresh.init("e", RowSparse.empty(shape, np.float32))
    with pytest.raises(ValueError, match=r"since=1 is past the current step 0.*since=None"):
        fresh.save_rows("e", since=1)


def test_save_rows_step_is_the_smallest_servers_step():
    """dist_async: the servers' steps differ for a moment (one has applied a push another
    has not). save_rows returns the smallest, so an export since it cannot miss the rows of
    that push on the server that is behind."""
    from kvstore.protocol import Message
    from kvstore.store import Meta
    from kvstore.worker import DistStore

    shape = (10, 2)
    replies = {0: (5, [4]), 1: (3, [1])}  # server -> (its step, its rows changed)
    store = object.__new__(DistStore)  # no cluster: the servers' replies are given
    store._servers = [("127.0.0.1", 1), ("127.0.0.1", 2)]
    store._sparse = {"e": Meta(shape, np.dtype(np.float32))}

    def send(server, kind, body, arrays=(), on_reply=None):
        step, ids = replies[server]
        rows = [np.array(ids, np.int64), np.ones((len(ids), 2), np.float32)]
        on_reply(Message("ack", server, "server", {"step": step}, rows))
        return server

    store._send, store._wait = send, lambda what, ids=None: None
    rows, step = store._save_rows("e", 2)
    assert rows.indices.tolist() == [1, 4] and step == 3


@given(
    pushed=st.lists(st.integers(0, 50), max_size=30),
    asked=st.lists(st.integers(0, 50), max_size=30),
)
def test_holds_ids_is_a_subset_test(pushed, asked):
    """``holds_ids``: every asked id (any order, repeats) is among the pushed ones."""
    unique = np.unique(np.array(pushed, np.int64))
    ids = np.array(asked, np.int64)
    assert sparse.holds_ids(unique, ids) == set(asked).issubset(pushed)
    assert sparse.holds_ids(unique, unique)


def test_outputs_of_one_pull_do_not_share_rows():
    """Two outputs of one id set each get their own rows (changing one leaves the other)."""
    shape = (10, 2)
    ids = np.array([1, 4])
    block = np.arange(4, dtype=np.float32).reshape(2, 2)
    item = type("Item", (), {})()
    item.key, item.outs, item.ids = (
        "e",
        [RowSparse.empty(shape), RowSparse.empty(shape)],
        [ids, ids],
    )
    meta = type("Meta", (), {"shape": shape, "dtype": np.dtype(np.float32)})
    collector = sparse.RowCollector([(item, ids, [np.arange(2)])], {"e": meta})
    collector.expect(1, (("e", 0),))
    collector.receive(1, [["e", 0]], [block])
    collector.finish()
    first, second = item.outs
    first.data[...] = -1
    assert np.array_equal(second.data, block) and np.array_equal(second.indices, ids)


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    servers=st.integers(1, 4),
    sharding=st.sampled_from(["hash", "range"]),
    outs=st.integers(1, 2),
)
def test_plans_send_each_server_its_rows_and_write_the_replies_back(data, servers, sharding, outs):
    """A worker's row plans against a reference: a push (and pushpull) sends each server
    exactly its ids with their rows; a pull asks each server its unique ids; replies are
    written back to every output in id order, whatever the sharding."""
    from kvstore.store import Meta, RowsItem

    rows, dim = 40, 3
    metas = {"e": Meta((rows, dim), np.dtype(np.float32), sharding)}
    bounds = sparse.bounds_of(sharding, rows, servers)

    def owner(ids):
        if bounds is None:
            return row_server(ids, servers) if servers > 1 else np.zeros(ids.size, np.int64)
        return np.searchsorted(np.array(bounds), ids, side="right") - 1

    table = np.arange(rows * dim, dtype=np.float32).reshape(rows, dim) * -1  # the servers'
    ids = np.unique(np.array(data.draw(st.lists(st.integers(0, rows - 1), max_size=25)), np.int64))
    vals = np.arange(ids.size * dim, dtype=np.float32).reshape(-1, dim) + 1
    pushed = RowsItem("e", RowSparse(ids, vals, (rows, dim)))
    targets = [np.ones((rows, dim), np.float32), RowSparse.empty((rows, dim))][:outs]
    asked = [
        np.array(data.draw(st.lists(st.integers(0, rows - 1), max_size=25)), np.int64)
        for _ in targets
    ]
    pull = RowsItem("e", outs=targets, ids=asked)
    # the rows another worker pushed too: a pushpull's reply has their sums (2x here), as
    # every row (a full reply) or as a delta (their positions) over the rows pushed
    doubled = np.isin(ids, data.draw(st.lists(st.integers(0, rows - 1), max_size=25)))
    after = np.where(doubled[:, None], vals * 2, vals)
    as_delta = data.draw(st.booleans())
    for kind in ("pushpull", "pull"):
        if kind == "pushpull":
            pull.ids = [ids] * outs
            plan, collector = sparse.plan_push([pushed], servers, True, metas, [pull])
        else:
            pull.ids = asked
            plan, collector = sparse.plan_pull([pull], servers, metas)
        got = set()
        for request, leg in enumerate(plan):
            sent = leg.arrays[0]
            assert (owner(sent) == leg.server).all() and (np.diff(sent) > 0).all()
            got |= set(sent.tolist())
            collector.expect(request, leg.keys)
            if kind == "pull":
                collector.receive(request, leg.keys, [table[sent]])
                continue
            assert np.array_equal(leg.arrays[1], vals[np.searchsorted(ids, sent)])
            collector.pushed(request)
            mine = np.searchsorted(ids, sent)
            if as_delta:
                at = np.flatnonzero(doubled[mine]).astype("<i4")
                back, delta = after[mine[at]], [[0, at.tobytes()]]
                collector.receive(request, leg.keys, [back], delta=delta)
            else:
                collector.receive(request, leg.keys, [after[mine]])
        want_ids = ids if kind == "pushpull" else np.unique(np.concatenate(asked))
        assert got == set(want_ids.tolist())
        collector.finish()
        for out, wanted in zip(targets, pull.ids, strict=True):
            unique = np.unique(wanted)
            expect = np.zeros((rows, dim), np.float32)
            if kind == "pushpull":
                expect[ids] = after
            else:
                expect[unique] = table[unique]
            if isinstance(out, RowSparse):
                assert np.array_equal(out.indices, unique)
                assert np.array_equal(out.data, expect[unique])
            else:
                inside = np.isin(np.arange(rows), unique)[:, None]
                assert np.array_equal(out, np.where(inside, expect, 0))


def test_a_row_reply_delta_is_checked():
    """A reply's delta that does not fit the rows pushed, or answers a request whose rows
    were not put in place, is refused (ReplyError), and nothing is written after it."""
    from kvstore.plan import ReplyError
    from kvstore.store import Meta, RowsItem

    shape = (10, 2)
    metas = {"e": Meta(shape, np.dtype(np.float32))}
    ids = np.array([1, 3, 5])
    pushed = RowsItem("e", RowSparse(ids, np.ones((3, 2), np.float32), shape))
    bad = [
        ([[0, np.array([3], "<i4").tobytes()]], 1, True),  # past the rows pushed
        ([[0, np.array([2, 1], "<i4").tobytes()]], 2, True),  # not increasing
        ([[0, np.array([1], "<i4").tobytes()]], 2, True),  # one position, two rows
        ([[1, np.array([1], "<i4").tobytes()]], 1, True),  # no such key
        ([[0, b"abc"]], 1, True),  # not int32s
        ([[0, np.array([1], "<i4").tobytes()]], 1, False),  # the rows were not put in place
    ]
    for delta, count, in_place in bad:
        out = RowSparse.empty(shape)
        (leg,), collector = sparse.plan_push(
            [pushed], 1, True, metas, [RowsItem("e", [out], [ids])]
        )
        collector.expect(7, leg.keys)
        if in_place:
            collector.pushed(7)
        with pytest.raises(ReplyError):
            collector.receive(7, leg.keys, [np.ones((count, 2), np.float32)], delta=delta)
        assert collector.cancelled
        collector.finish()
        assert out.nnz == 0


def test_negative_zero_is_the_same_on_every_path():
    """A round's rows are the bits of 0 + a + b (no optimizer): a pushed -0.0 becomes 0.0
    whether or not another worker pushed in the round, with admission or without, and in a
    local store (review: the one-push path of sum_rows kept -0.0); an async push adds
    0 + its rows, through a shared segment or not."""
    import kvstore

    def server(admit_after, other_rows):
        keys = sparse.SparseKeys()
        init = dict(sparse.zeros(), admit_after=admit_after) if admit_after > 1 else None
        keys.add_key("e", 10, 1, np.float32, init)
        for n in range(admit_after):  # rounds until the row is admitted
            keys.add("e", n, 0, np.array([3]), np.array([[-0.0]], np.float32), True)
            ids = np.array([7]) if other_rows else np.empty(0, np.int64)
            keys.add("e", n, 1, ids, np.ones((ids.size, 1), np.float32), True)
            keys.apply("e", False)
        return bool(np.signbit(keys.tables["e"].read(np.array([3]))[0, 0]))

    def async_push(normal):  # a row at -0.0 (its init), an async push of -0.0 to it
        keys = sparse.SparseKeys()
        keys.add_key("e", 10, 1, np.float32, sparse.constant(-0.0))
        rows = np.array([[-0.0]], np.float32)
        given = np.add(np.float32(0), rows) if normal else rows  # a shared segment's: 0 +
        keys.add("e", 0, 0, np.array([3]), given, False, normal)
        keys.apply("e", True)
        return bool(np.signbit(keys.tables["e"].read(np.array([3]))[0, 0]))

    got = {(a, o): server(a, o) for a in (1, 2) for o in (False, True)}
    got.update({("async", normal): async_push(normal) for normal in (False, True)})
    kv = kvstore.create("local")
    shape = (10, 1)
    kv.init("e", RowSparse.empty(shape, np.float32))
    kv.push("e", RowSparse([3], np.array([[-0.0]], np.float32), shape))
    out = RowSparse.empty(shape, np.float32)
    kv.row_sparse_pull("e", out=out, row_ids=[3])
    got["local"] = bool(np.signbit(out.data[0, 0]))
    assert set(got.values()) == {False}, got


def test_pushpull_async_refuses_a_row_sparse_key_saying_what_to_use():
    import kvstore

    kv = kvstore.create("local")
    shape = (10, 2)
    kv.init("e", RowSparse.empty(shape, np.float32))
    for value in (RowSparse([1], np.ones((1, 2), np.float32), shape), np.ones(shape, np.float32)):
        with pytest.raises(TypeError, match="row-sparse key, which it does not take; use pushpull"):
            kv.pushpull_async("e", value)


def test_a_rowsparse_with_a_dense_or_unknown_key_and_float_ids_say_what_is_wrong():
    """A user's report: a RowSparse pushed to a dense key, or given as the out of one, said
    "expected a NumPy or CuPy array", and on a key never initialised the same, not that the
    key was never initialised; a Python list of float ids was taken for one list per
    output; an id of 1e30 or inf was cast to some other id (with NumPy's warning)."""
    import warnings

    import kvstore

    kv = kvstore.create("local")
    shape = (10, 2)
    value = RowSparse([1], np.ones((1, 2), np.float32), shape)
    out = RowSparse.empty(shape, np.float32)
    dense = np.arange(20, dtype=np.float32).reshape(shape)
    kv.init("d", dense)
    for call in (lambda: kv.push("u", value), lambda: kv.pull("u", out=out)):
        with pytest.raises(KeyError, match="key was never initialised; call init first"):
            call()
    with pytest.raises(TypeError, match="this key is dense: give value.to_dense()"):
        kv.push("d", value)
    for call in (
        lambda: kv.pull("d", out=out),
        lambda: kv.row_sparse_pull("d", out=out, row_ids=[1]),
    ):
        with pytest.raises(TypeError, match="this key is dense: give an array of the key's"):
            call()
    got = np.full(shape, -1, np.float32)
    kv.row_sparse_pull("d", out=got, row_ids=[5.0, 1.0])  # one set of ids, as MXNet's floats
    want = np.zeros(shape, np.float32)
    want[[1, 5]] = dense[[1, 5]]
    np.testing.assert_array_equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cast warning: refused before
        for bad in (1e30, np.inf, -1.0):
            with pytest.raises(ValueError, match="outside"):
                RowSparse(np.array([bad]), np.ones((1, 2), np.float32), shape)
            with pytest.raises(ValueError, match="outside"):
                kv.row_sparse_pull("d", out=got, row_ids=np.array([bad]))


def test_under_gradient_compression_row_sparse_keys_travel_as_they_are(caplog):
    """(From a user trial.) A CTR model's store compresses its dense keys; its embedding's
    rows were refused at every push, with advice nobody could follow (compression cannot be
    turned off). Now the rows travel uncompressed, exact, said once a key; the dense key
    beside them is still compressed (2-bit: 0.3 under a 0.5 threshold sends nothing)."""
    import kvstore

    kv = kvstore.create("local")
    kv.init("emb", RowSparse.empty((10, 2)))
    kv.init("fc", np.zeros(4, np.float32))
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    out = RowSparse.empty((10, 2), np.float32)
    with caplog.at_level("WARNING", logger="kvstore"):
        for _ in range(2):
            kv.push("emb", RowSparse([1, 4], np.full((2, 2), 0.3, np.float32), (10, 2)))
            kv.row_sparse_pull("emb", out=out, row_ids=[4, 1])
            assert out.indices.tolist() == [1, 4] and (out.data == np.float32(0.3)).all()
    said = [r.getMessage() for r in caplog.records if "travels uncompressed" in r.getMessage()]
    assert said == [
        "gradient compression applies to dense keys: row-sparse key 'emb' travels "
        "uncompressed (its pushes carry only the rows touched)"
    ], said
    kv.push("fc", np.full(4, 0.3, np.float32))
    fc = np.empty(4, np.float32)
    kv.pull("fc", out=fc)
    assert (fc == 0).all(), fc  # quantised: below the threshold, nothing yet


def test_pull_of_row_sparse_keys_follows_ignore_sparse(caplog):
    """(From a user trial.) MXNet's ``pull(..., ignore_sparse=True)`` (its default) skips
    a row-sparse key pulled into a sparse output, with a warning; it was taken and ignored
    here. Dense outputs get every row, as before, and so does ``ignore_sparse=False``. A
    wrong output names ``pull``, the call made (it named row_sparse_pull)."""
    import kvstore

    shape = (10, 2)
    kv = kvstore.create("local")
    kv.init("emb", RowSparse.empty(shape))
    kv.init("fc", np.zeros(3, np.float32))
    kv.push("emb", RowSparse([1], np.ones((1, 2), np.float32), shape))
    kv.push("fc", np.ones(3, np.float32))
    rows, fc = RowSparse.empty(shape, np.float32), np.zeros(3, np.float32)
    with caplog.at_level("WARNING", logger="kvstore"):
        kv.pull(["fc", "emb"], out=[fc, rows])
        kv.pull("emb", out=rows)
    assert rows.nnz == 0 and fc.tolist() == [1, 1, 1]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "pull(key='emb') into a RowSparse skipped" in said[0], said
    with pytest.raises(ValueError, match="duplicate keys"):
        kv.pull(["emb", "emb"], out=[rows, rows])
    kv.pull("emb", out=rows, ignore_sparse=False)
    assert rows.indices.tolist() == list(range(10)) and rows.data[:, 0].tolist()[:3] == [0, 1, 0]
    dense = np.full(shape, -1, np.float32)
    kv.pull("emb", out=dense)
    want = np.zeros(shape, np.float32)
    want[1] = 1
    np.testing.assert_array_equal(dense, want)
    with pytest.raises(TypeError, match=r"^pull\(key='emb'\): out must be"):
        kv.pull("emb", out=np.zeros((3, 2), np.float32))


def test_a_table_without_a_seed_has_its_key_s_own():
    """(Review finding.) Two random tables without a seed start apart in a local store too,
    int keys (0 beside 1) as str keys; a seed given is used as it is; a spec dict without a
    seed is taken as one left to the key."""
    import kvstore

    shape, ask = (10**6, 4), np.array([0, 7, 999_999])
    firsts = {}
    for keys in ((0, 1), ("user", "item")):
        kv = kvstore.create("local")
        for k in keys:
            kv.init(k, RowSparse.empty(shape, np.float32, init=sparse.uniform(-1, 1)))
        for k in keys:
            out = RowSparse.empty(shape, np.float32)
            kv.row_sparse_pull(k, out=out, row_ids=ask)
            want = sparse.init_rows(sparse.keyed(sparse.uniform(-1, 1), k), ask, 4, np.float32)
            np.testing.assert_array_equal(out.data, want)
            firsts[k] = out.data
        assert not np.array_equal(firsts[keys[0]], firsts[keys[1]]), keys
    spec = {"kind": "normal", "mean": 0.0, "std": 1.0}  # no seed in it
    kv.init("spec", RowSparse.empty(shape, np.float32, init=spec))
    out = RowSparse.empty(shape, np.float32)
    kv.row_sparse_pull("spec", out=out, row_ids=ask)
    own = sparse.keyed(sparse.normal(0, 1), "spec")
    np.testing.assert_array_equal(out.data, sparse.init_rows(own, ask, 4, np.float32))
    seeded = sparse.init_rows(sparse.uniform(-1, 1, seed=0), ask, 4, np.float32)
    assert sparse.keyed(sparse.uniform(-1, 1, seed=0), "user")["seed"] == 0
    assert not np.array_equal(seeded, firsts["user"])


def test_load_rows_refuses_a_row_given_twice():
    """(From a user trial.) ``load_rows`` of ids [5, 5] with rows 2 and 3 stored 5: a load
    sets rows, and a row given twice has no one value. Refused, the table unchanged."""
    import kvstore

    shape = (10, 2)
    kv = kvstore.create("local")
    kv.init("emb", RowSparse.empty(shape))
    kv.load_rows("emb", RowSparse([5], np.full((1, 2), 7, np.float32), shape))
    twice = RowSparse([5, 1, 5], np.array([[2, 2], [1, 1], [3, 3]], np.float32), shape)
    with pytest.raises(ValueError, match=r"load_rows\(key='emb'\): row id 5 is given more"):
        kv.load_rows("emb", twice)
    rows, _ = kv.save_rows("emb")
    assert rows.indices.tolist() == [5] and rows.data.tolist() == [[7, 7]]


def test_float_ids_past_their_exact_whole_numbers_are_refused():
    """(From a user trial.) float32 holds every whole number only below 2**24: an id meant
    as 16777217 arrives as 16777216 and named another row, silently. Such ids are refused,
    in a RowSparse and as row_sparse_pull's ids; float64 ids from 2**53 alike; below, and as
    integers, the same ids are taken."""
    import kvstore

    kv = kvstore.create("local")
    shape = (2**60, 2)
    kv.init("e", RowSparse.empty(shape, np.float32))
    out = RowSparse.empty(shape, np.float32)
    for dtype, exact in ((np.float16, 2**11), (np.float32, 2**24), (np.float64, 2**53)):
        near = np.array([3, exact - 1], dtype)
        assert RowSparse(near, np.ones((2, 2), np.float32), shape).indices.tolist() == [
            3,
            exact - 1,
        ]
        for far in (exact, 2 * exact):
            ids = np.array([3, far], dtype)
            with pytest.raises(ValueError, match=f"from 2\\*\\*.* = {exact} up.*as integers"):
                RowSparse(ids, np.ones((2, 2), np.float32), shape)
            with pytest.raises(ValueError, match="give row ids as integers"):
                kv.row_sparse_pull("e", out=out, row_ids=ids)
    kv.push("e", RowSparse(np.array([2**24 + 1]), np.ones((1, 2), np.float32), shape))
    kv.row_sparse_pull("e", out=out, row_ids=np.array([2**24 + 1, 2**24]))
    assert out.indices.tolist() == [2**24, 2**24 + 1]
    assert out.data.tolist() == [[0, 0], [1, 1]]


@settings(max_examples=60, deadline=None)
@given(
    rounds=st.lists(
        st.lists(st.integers(0, 40), max_size=12, unique=True).map(sorted), min_size=2, max_size=14
    ),
    cut=st.integers(1, 13),
    admit=st.integers(1, 3),
    evict=st.sampled_from([0, 3, 5]),
)
def test_a_restart_admits_and_evicts_as_the_job_would_have(rounds, cut, admit, evict):
    """(From a user trial.) A checkpoint (``save_rows`` with its step, then the optimizer
    states) restored into a new table, which goes on: the rows, their optimizer state, when
    each last changed, and the admission candidates are those of the table that never
    stopped (the candidates' counts and the rows' ages were lost: rows were evicted late,
    candidates admitted late)."""
    cut = min(cut, len(rounds) - 1)
    init = RowSparse.empty((1000, 2), admit_after=admit, evict_after=evict).init

    def go(table, up, which):
        for r in which:
            ids = np.array(rounds[r], np.int64)
            grad = np.full((ids.size, 2), r + 1.0, np.float32)
            t = up.counts["k"] = up.counts.get("k", 0) + 1
            table.apply(ids, grad, up.optimizer, t, 0.1)

    def fresh():
        return RowTable(2, np.float32, init, rows=1000), opt.Updater(opt.SGD(momentum=0.9))

    (whole, up), (first, up1) = fresh(), fresh()
    go(whole, up, range(len(rounds)))
    go(first, up1, range(cut))
    ids, rows = first.changed_since(None)
    step, blob = first.step, sparse.dump_states(up1, {"k": first})
    resumed, up2 = fresh()
    resumed._states_for(up2.optimizer)
    resumed.restore_step(step)  # load_rows(key, rows, step=step) ...
    resumed.assign(ids, rows)
    up2.loads(blob)  # ... then load_optimizer_states
    sparse.load_states(up2, {"k": resumed}, blob, dense=False)
    go(resumed, up2, range(cut, len(rounds)))
    for a, b in ((whole, resumed),):
        assert a.ids.tolist() == b.ids.tolist()
        assert np.array_equal(a.block[a.slots], b.block[b.slots])
        assert a.changed[a.slots].tolist() == b.changed[b.slots].tolist()
        assert np.array_equal(a.states[0][a.slots], b.states[0][b.slots])
        assert a.cand_ids.tolist() == b.cand_ids.tolist()
        assert a.cand_counts.tolist() == b.cand_counts.tolist()
        assert a.cand_last.tolist() == b.cand_last.tolist()


def test_a_refused_state_file_changes_nothing():
    """(From review.) A state file is checked whole before anything is loaded: one naming a
    key this store lacks used to load the keys before it, then fail (a primary so refused
    differed from its backup, which never got it)."""
    up = opt.Updater(opt.SGD(learning_rate=0.1, momentum=0.9))
    table, other = RowTable(2, np.float32), RowTable(2, np.float32)
    for t, value in ((table, 1.0), (other, 5.0)):
        t.apply(np.array([1, 4]), np.full((2, 2), value, np.float32), up.optimizer, 1, 0.1)
    up.counts["e"] = 1
    saved = sparse.dump_states(up, {"e": table})
    table.apply(np.array([1, 4]), np.full((2, 2), 2.0, np.float32), up.optimizer, 2, 0.1)
    up.counts["e"] = 2
    now = sparse.dump_states(up, {"e": table})
    bad = sparse.dump_states(up, {"e": other, "zz": other})  # (only "e" is known here)
    with pytest.raises(ValueError, match="not initialised"):
        sparse.load_states(up, {"e": table}, bad)
    assert sparse.dump_states(up, {"e": table}) == now
    import msgpack

    from kvstore.optimizer import pack_array

    def edited(change):
        data = msgpack.unpackb(saved, strict_map_key=False)
        change(data)
        return msgpack.packb(data)

    def book(i, value):
        return lambda d: d["admission"][0].__setitem__(i, value)

    malformed = [  # (from review: each used to load part of the file, then fail)
        book(1, 2**31),  # the step
        book(3, pack_array(np.array([[1, 1]], np.int32))),  # a 2-D changed
        book(3, pack_array(np.array([1, 99], np.int32))),  # changed after the step
        book(2, pack_array(np.array([4, 1]))),  # ids not increasing
        lambda d: d["rows"][0].__setitem__(2, pack_array(np.array([4, 4]))),  # repeated ids
        lambda d: d["rows"].append(d["rows"][0]),  # a key twice
        lambda d: d.pop("num_update"),
    ]
    for change in malformed:
        with pytest.raises(ValueError):
            sparse.load_states(up, {"e": table}, edited(change))
        assert sparse.dump_states(up, {"e": table}) == now
    sparse.load_states(up, {"e": table}, saved)  # a good one still loads
    assert sparse.dump_states(up, {"e": table}) != now


def test_an_older_checkpoint_loaded_mid_training_keeps_ages_from_now():
    """(From review.) States of step 1 loaded into a table at step 20 (rows just loaded
    with load_rows): the step stays, no row counts as changed before its load (an export
    since then lists it), and the candidates' ages move to now."""
    up = opt.Updater(opt.SGD(learning_rate=0.1))
    init = RowSparse.empty((100, 2), admit_after=2, evict_after=8).init
    table = RowTable(2, np.float32, init, rows=100)
    for ids in ([1, 4], [1, 4], [7]):  # 1, 4 admitted at step 2; 7 a candidate
        table.apply(np.array(ids), np.ones((len(ids), 2), np.float32), up.optimizer, 1, 0.1)
    saved = sparse.dump_states(up, {"e": table})
    for _ in range(17):
        table.apply(np.array([9]), np.ones((1, 2), np.float32), up.optimizer, 1, 0.1)
    assert table.step == 20
    table.assign(np.array([1, 4]), np.zeros((2, 2), np.float32))  # load_rows now
    sparse.load_states(up, {"e": table}, saved)
    assert table.step == 20
    assert {1, 4} <= set(table.changed_since(19)[0].tolist())
    assert table.cand_ids.tolist() == [7] and table.cand_last.tolist() == [20]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(["float16", "float32", "float64", "complex64"]),
    given_dtype=st.sampled_from(["same", "float64"]),
    dim=st.integers(0, 6),
    rows=st.integers(1, 12),
    picks=st.lists(st.integers(0, 11), max_size=12, unique=True),
    strided=st.booleans(),
)
def test_whole_row_scatter_is_numpy_s(dtype, given_dtype, dim, rows, picks, strided):
    """sparse._scatter (rows moved whole through a void view) writes what ``block[where] =
    rows`` writes, bit for bit, for contiguous rows, strided ones and another dtype (cast)."""
    dtype = np.dtype(dtype)
    where = np.array([p for p in picks if p < rows], np.int32)
    src_dtype = dtype if given_dtype == "same" else np.dtype(given_dtype)
    rng = np.random.default_rng(dim * 100 + rows)
    source = rng.standard_normal((where.size, 2 * dim)).astype(src_dtype)
    given_rows = source[:, ::2] if strided else np.ascontiguousarray(source[:, :dim])
    ours = rng.standard_normal((rows, dim)).astype(dtype)
    theirs = ours.copy()
    sparse._scatter(ours, where, given_rows)
    theirs[where] = given_rows
    assert ours.tobytes() == theirs.tobytes()
