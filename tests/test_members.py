"""Keys of a group of workers (``init(..., members=)``, for Horovod's process sets): the
round machine's rules, and a real job where one worker is outside the group."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.rounds import Apply, Fail, Reply, Rounds


@pytest.mark.parametrize("reproducible", [True, False])
def test_a_group_s_round_completes_with_its_members_and_refuses_others(reproducible):
    r = Rounds(num_workers=4, round_timeout=0, reproducible=reproducible)
    r.add_key("g", members=[1, 3])
    (fail,) = r.push("outsider", 0, [("g", np.ones(2))], True, 0.0)
    assert isinstance(fail, Fail) and "group of ranks [1, 3]" in fail.text
    (fail,) = r.pull("outsider pull", 2, ["g"])
    assert isinstance(fail, Fail) and "only its members" in fail.text
    assert r.push("a", 1, [("g", np.full(2, 2.0))], True, 0.0) == []
    (stall,) = r.stalled(now=5.0, after=1.0)
    assert stall.missing == [3]  # not 0 or 2: they are not in the group
    got = r.push("b", 3, [("g", np.full(2, 5.0))], True, 0.0)
    (apply,) = [a for a in got if isinstance(a, Apply)]
    np.testing.assert_array_equal(apply.value, [7.0, 7.0])
    assert {a.request for a in got if isinstance(a, Reply)} == {"a", "b"}


@pytest.mark.parametrize("reproducible", [True, False])
def test_a_joined_member_counts_as_zeros_and_a_finished_outsider_changes_nothing(reproducible):
    r = Rounds(num_workers=3, round_timeout=0, reproducible=reproducible)
    r.add_key("g", members=[0, 1])
    assert r.finished(2) == []  # an outsider closing its store kills no round of the group
    r.joined(1, 0.0)
    got = r.push("a", 0, [("g", np.ones(1))], True, 0.0)
    assert [type(a).__name__ for a in got] == ["Apply", "Reply"]


def test_workers_outside_a_group_neither_wait_nor_take_part(cluster):
    c = cluster(2, 3, KVSTORE_BIGARRAY_BOUND=1000)
    outs = c.run_workers("members.py", timeout=60)
    assert all("OK" in o for o in outs), outs
    assert "is not in members=[0, 2]" in outs[1], outs
