"""kvstore._rowsearch (C) against kvstore.rowsearch's NumPy reference, and the install that
has no C compiler."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import rowsearch
from kvstore.sharding import row_server

from .cluster import can_build_c

ROOT = Path(__file__).resolve().parent.parent


def test_the_c_module_is_built_where_there_is_a_compiler():
    if not can_build_c():
        pytest.skip("no C compiler or Python headers here: kvstore runs its NumPy reference")
    assert rowsearch.FAST, "pip install built no kvstore._rowsearch although a C compiler is here"


fast_only = pytest.mark.skipif(not rowsearch.FAST, reason="kvstore._rowsearch not built")

int64s = st.integers(-(2**63), 2**63 - 1)
# ids near each other (runs, gaps, duplicates) and anywhere in int64 (the extremes)
near = st.integers(-40, 40)


@fast_only
@settings(max_examples=400, deadline=None)
@given(
    stored=st.sets(st.one_of(near, int64s), max_size=60),
    queries=st.lists(st.one_of(near, int64s), max_size=60),
    sort=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_find_matches_the_numpy_reference(stored, queries, sort, seed):
    stored = np.array(sorted(stored), np.int64)
    slots = np.random.default_rng(seed).permutation(stored.size).astype(np.int32)
    ids = np.array(sorted(queries) if sort else queries, np.int64)
    found, where = rowsearch.find(stored, slots, ids, fast=True)
    ref_found, ref_where = rowsearch.find(stored, slots, ids, fast=False)
    assert found.tolist() == ref_found.tolist()
    assert where.dtype == np.int32 and where.tolist() == ref_where.tolist()
    # and the plain meaning: the slot of each id present, -1 of each absent
    slot_of = dict(zip(stored.tolist(), slots.tolist(), strict=True))
    assert where.tolist() == [slot_of.get(i, -1) for i in ids.tolist()]


@settings(max_examples=400, deadline=None)
@given(
    stored=st.sets(st.integers(0, 80), max_size=40),
    queries=st.sets(st.integers(0, 80), max_size=40),
    sort=st.booleans(),
    direct=st.booleans(),
    again=st.booleans(),
    dtype=st.sampled_from(["float32", "float64", "float16", "complex64"]),
    dim=st.integers(0, 5),
    given=st.sampled_from(["same", "float64", "strided"]),  # rows the wrapper casts or copies
    fast=st.sampled_from([False, True] if rowsearch.FAST else [False]),
    seed=st.integers(0, 2**32 - 1),
)
def test_assign_matches_a_plain_model(
    stored, queries, sort, direct, again, dtype, dim, given, fast, seed
):
    """A push written in the search's pass: each id found gets its row and the step, unless
    (with ``again``) its row is at the step already (left, flag 2); absent ids flag 1. Both
    the C module and the NumPy reference, through a sorted index or a direct map, any dtype
    (moved as bytes)."""
    rng = np.random.default_rng(seed)
    stored = np.array(sorted(stored), np.int64)
    n = stored.size
    slots = rng.permutation(n).astype(np.int32)
    ids = np.array(sorted(queries), np.int64)
    if not sort:
        ids = rng.permutation(ids)
    capacity = n + 3 if n or seed % 2 else 0  # (room beyond the rows stored; or none)
    block = rng.standard_normal((capacity, dim)).astype(dtype)
    changed = rng.integers(6, 8, capacity).astype(np.int32)
    rows = rng.standard_normal((ids.size, dim)).astype(dtype)
    if given == "float64":
        rows = rows.astype(np.float64) if dtype != "complex64" else rows
    elif given == "strided":
        rows = np.repeat(rows, 2, axis=0)[::2]
    want_block, want_changed = block.copy(), changed.copy()
    slot_of = dict(zip(stored.tolist(), slots.tolist(), strict=True))
    want_where, want_flags = [], []
    for i, x in enumerate(ids.tolist()):
        slot = slot_of.get(x, -1)
        want_where.append(slot)
        if slot < 0:
            want_flags.append(1)
        elif again and changed[slot] == 7:
            want_flags.append(2)
        else:
            want_flags.append(0)
            want_block[slot] = rows[i]
            want_changed[slot] = 7
    if direct:
        index = np.zeros(81, np.int32)
        index[stored] = slots + 1
        args = (None, index)
    else:
        args = (stored, slots)
    where, flags, found, hits = rowsearch.assign(
        *args, ids, rows, block, changed, 7, again, fast=fast
    )
    assert where.dtype == np.int32 and where.tolist() == want_where
    assert flags.tolist() == want_flags
    assert (found, hits) == (sum(f != 1 for f in want_flags), want_flags.count(2))
    assert block.tobytes() == want_block.tobytes() and changed.tolist() == want_changed.tolist()


@fast_only
def test_find_of_a_big_table_and_sorted_queries():
    """Galloping far (10^6 rows stored, 2,048 sorted queries, half of them absent)."""
    rng = np.random.default_rng(5)
    stored = np.unique(rng.integers(0, 10**12, 10**6))
    slots = rng.permutation(stored.size).astype(np.int32)
    ids = np.sort(
        np.concatenate([rng.choice(stored, 1024, replace=False), rng.integers(0, 10**12, 1024)])
    )
    found, where = rowsearch.find(stored, slots, ids, fast=True)
    ref = rowsearch.find(stored, slots, ids, fast=False)
    assert (found == ref[0]).all() and (where == ref[1]).all() and found.sum() >= 1024


@fast_only
@settings(max_examples=400, deadline=None)
@given(
    ids=st.lists(st.one_of(near, int64s), max_size=40),
    sort=st.booleans(),
    rows=st.one_of(st.integers(1, 50), st.just(2**63 - 1)),
    # few servers, and the widest counts (the C remainder is a 32-bit multiply)
    num_server=st.one_of(st.integers(1, 7), st.sampled_from([65537, 2**31 - 1, 2**31])),
    server=st.integers(0, 6),
)
def test_check_matches_the_numpy_reference(ids, sort, rows, num_server, server):
    ids = np.array(sorted(set(ids)) if sort else ids, np.int64)
    got = rowsearch.check(ids, rows, num_server, server, fast=True)
    assert got == rowsearch.check(ids, rows, num_server, server, fast=False)
    # and the plain meaning
    listed = ids.tolist()
    ordered = listed == sorted(set(listed)) and all(0 <= i < rows for i in listed)
    mine = num_server == 1 or all(s == server for s in row_server(ids, num_server).tolist())
    assert got == (
        rowsearch.GOOD if ordered and mine else rowsearch.ORDER if not ordered else rowsearch.SERVER
    )


@fast_only
@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.one_of(near, int64s), max_size=60),
    num_server=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 65537]),  # wide: one in ten
)
def test_split_matches_the_numpy_reference(ids, num_server):
    ids = np.array(ids, np.int64)
    got = rowsearch.split(ids, num_server, fast=True)
    ref = rowsearch.split(ids, num_server, fast=False)
    assert len(got) == len(ref) == num_server
    assert all(a.tolist() == b.tolist() for a, b in zip(got, ref, strict=True))
    # and the plain meaning: every position once, each with its server, in order
    want: dict = {}
    for i, s in enumerate(row_server(ids, num_server).tolist()):
        want.setdefault(s, []).append(i)
    assert {k: p.tolist() for k, p in enumerate(got) if p.size} == want


@fast_only
def test_the_c_module_refuses_wrong_sizes_with_a_clear_error():
    from kvstore import _rowsearch

    stored = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="4 stored ids need as many slots"):
        _rowsearch.find(stored, np.zeros(3, np.int32), stored, np.empty(4, np.int32))
    with pytest.raises(TypeError, match="ids: expected int64, got items of format 'i'"):
        _rowsearch.check(np.zeros(3, np.int32), 10, 1, 0)
    with pytest.raises(TypeError, match="stored: expected int64"):
        _rowsearch.find(stored.astype(float), np.zeros(4, np.int32), stored, np.empty(4, np.int32))
    with pytest.raises(TypeError, match="slots: expected int32"):  # not misread as twice as many
        _rowsearch.find(stored, stored, stored, np.empty(4, np.int32))
    block, changed = np.zeros((4, 2), np.float32), np.zeros(4, np.int32)
    ok = (stored, np.zeros(4, np.int32), stored, block, block, changed, 1, True)
    with pytest.raises(ValueError, match="4 ids need as many wheres"):
        _rowsearch.assign(*ok, np.empty(3, np.int32), np.empty(4, np.uint8))
    with pytest.raises(ValueError, match="flags \\(got 2\\)"):
        _rowsearch.assign(*ok, np.empty(4, np.int32), np.empty(2, np.uint8))
    with pytest.raises(ValueError, match="needs a row per changed entry"):
        _rowsearch.assign(*ok[:4], block[:2], *ok[5:], np.empty(4, np.int32), np.empty(4, np.uint8))
    with pytest.raises(ValueError, match="rows of the block's \\(got 64 bytes\\)"):  # 4 of dim 4
        _rowsearch.assign(
            *ok[:3],
            np.zeros((4, 4), np.float32),
            *ok[4:],
            np.empty(4, np.int32),
            np.empty(4, np.uint8),
        )
    with pytest.raises(
        ValueError, match="need rows of \\(4, 2\\), got \\(4, 1\\)"
    ):  # not broadcast
        rowsearch.assign(*ok[:3], block[:, :1], *ok[4:7])
    with pytest.raises(TypeError, match="changed: expected int32"):
        _rowsearch.assign(*ok[:5], stored, *ok[6:], np.empty(4, np.int32), np.empty(4, np.uint8))
    with pytest.raises(ValueError, match="an id outside the direct map"):
        _rowsearch.assign(
            None, np.zeros(3, np.int32), *ok[2:], np.empty(4, np.int32), np.empty(4, np.uint8)
        )
    with pytest.raises(ValueError, match="a slot outside the table"):
        _rowsearch.assign(
            stored, np.full(4, 9, np.int32), *ok[2:], np.empty(4, np.int32), np.empty(4, np.uint8)
        )
    with pytest.raises(TypeError, match="expected int64"):  # unsigned is not signed
        _rowsearch.check(np.zeros(3, np.uint64), 10, 1, 0)
    with pytest.raises(TypeError, match="expected int64"):  # nor big-endian
        _rowsearch.check(np.zeros(3, ">i8"), 10, 1, 0)
    read_only = np.zeros(4, np.int32)
    read_only.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        _rowsearch.find(stored, np.zeros(4, np.int32), stored, read_only)
    with pytest.raises(ValueError, match="3 servers 4 starts"):
        _rowsearch.split(stored, 3, np.empty(4, np.int64), np.empty(3, np.int64))
    with pytest.raises(ValueError, match="not C-contiguous"):
        _rowsearch.find(stored, np.zeros(4, np.int32), stored, np.zeros(8, np.int32)[::2])


@pytest.mark.slow
def test_without_a_c_compiler_the_install_goes_on_without_the_c_module(tmp_path):
    """What a machine without gcc gets: a wheel without kvstore._rowsearch, not a failed
    install (and kvstore.rowsearch runs NumPy's passes)."""
    if shutil.which("pip", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("no pip in this environment")
    # the sources as a fresh clone has them (not this tree's own build of the module)
    src = tmp_path / "src"
    junk = ("*.so", ".venv", ".git", "__pycache__", "build", "*.egg-info", ".*_cache")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*junk))
    env = {"PATH": "/usr/bin:/bin", "CC": "/bin/false", "LDSHARED": "/bin/false"}
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path), str(src)],
        timeout=300,
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = tmp_path.glob("kvstore_ps-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvstore/rowsearch.py" in names
    assert not [n for n in names if "_rowsearch" in n and n.endswith(".so")], names


def test_a_stale_build_of_the_c_module_is_not_called():
    """An editable install's build from before a change of the C functions (another API)
    runs NumPy's path, and `python -m kvstore` says to build it again."""
    probe = (
        "import sys, types\n"
        "sys.modules['kvstore._rowsearch'] = types.ModuleType('kvstore._rowsearch')\n"
        "from kvstore import rowsearch\n"
        "from kvstore.__main__ import describe\n"
        "print(rowsearch.FAST, rowsearch.STALE)\n"
        "print(describe({}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "False True"
    assert "another version's build: run `pip install -e .` again" in out.stdout
