"""The same-host path: big parts through shared memory, exact values, nothing left behind."""

from __future__ import annotations

import os

import pytest

from kvstore import shm

from .cluster import poll_until, shm_left

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm or boot id here")


def _ours() -> set:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith("kvs-")}


def test_a_segment_is_shared_and_its_name_removed_once_mapped():
    segments = shm.WorkerSegments(rank=3)
    mine = segments.get(("w", 0), 1024)
    theirs = shm.open_for(mine.name, 3, 1024)
    mine.push[:4] = [1, 2, 3, 4]
    mine.counters[0] = 7
    assert list(theirs.push[:4]) == [1, 2, 3, 4] and int(theirs.counters[0]) == 7
    theirs.pull[:2] = [9, 9]
    assert list(mine.pull[:2]) == [9, 9]
    mine.unlink()
    assert mine.name not in _ours()
    mine.push[0] = 5  # the mappings outlive the name
    assert theirs.push[0] == 5
    theirs.close()
    segments.close()


def test_a_server_opens_only_that_workers_segments_of_the_right_size():
    segments = shm.WorkerSegments(rank=1)
    seg = segments.get(("w", 0), 64)
    with pytest.raises(ValueError, match="is not worker 0's"):
        shm.open_for(seg.name, 0, 64)
    with pytest.raises(ValueError, match="wrong size"):
        shm.open_for(seg.name, 1, 128)
    with pytest.raises(ValueError):
        shm.open_for("../../etc/passwd", 1, 64)
    segments.close()
    assert seg.name not in _ours()


@pytest.mark.parametrize("use,chan", [("1", "1"), ("1", "0"), ("0", "1")])
def test_jobs_on_one_host_share_memory_exactly(cluster, use, chan):
    """Shared segments, with the messages by the same-host channel (kvstore.channel) or by
    TCP; or neither (KVSTORE_SHM=0 turns the channel off too)."""
    before = _ours()
    c = cluster(2, 3, KVSTORE_BIGARRAY_BOUND=1000, KVSTORE_SHM=use, KVSTORE_CHANNEL=chan)
    outs = c.run_workers("random_rounds.py", [3, 20], timeout=90)
    expected = "2" if use == "1" else "0"
    channels = "2" if use == chan == "1" else "0"
    for out in outs:
        assert f"shares memory with {expected} servers" in out, out
        assert f"talks by channel with {channels} servers" in out, out
        assert "pulled values exact" in out, out
    c.wait([c.procs["server0"], c.procs["server1"]], 20)
    # no file left behind (the names a worker unlinks once its server mapped them go within ms)
    assert poll_until(lambda: not shm_left(before), 5), shm_left(before)
