"""The control link's count of the scheduler's silence (``control.Silence``): a node blames
the scheduler only for silence while it could listen, never for time it was not running."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.control import _STALL, Silence

BEAT = 0.2  # the tests' KVSTORE_HEARTBEAT_INTERVAL: the longest a poll waits


def test_a_link_turning_on_time_counts_every_second_of_silence():
    silence, now = Silence(0.0), 0.0
    for _ in range(16):
        now += BEAT
        silent = silence.turn(now, BEAT)
    assert silent == now  # 3.2 s: a dead scheduler is noticed after the timeout (3 s)


def test_a_node_frozen_for_less_than_the_timeout_does_not_blame_the_scheduler():
    """Heard 0.15 s before a 2.9 s freeze (SIGSTOP, a VM paused): the scheduler never failed
    this node over. Counting wall time said 3.05 s, over a 3 s timeout, and the node stopped
    itself ("the scheduler sent nothing"); a replaced node frozen about as long said that
    instead of hearing it was fenced (CI, test_replication's freeze case)."""
    silence = Silence(0.0)
    silence.heard(0.05)
    assert silence.turn(0.2, BEAT) == pytest.approx(0.15)
    # frozen 0.05 s into this turn's poll, for 2.9 s: the next turn comes 2.95 s later
    assert silence.turn(0.2 + 0.05 + 2.9, BEAT) < 0.5


def test_a_freeze_longer_than_the_timeout_is_not_counted_either():
    silence = Silence(0.0)
    silence.turn(BEAT, BEAT)
    assert silence.turn(BEAT + 10.0, BEAT) < 0.5
    # and the silence after it counts again in full
    assert silence.turn(BEAT + 10.0 + 3.0, 3.0) > 3.0


def test_a_starved_link_still_notices_a_dead_scheduler():
    """Turns a little late (under _STALL) every time, as on a loaded machine: counted."""
    silence, now = Silence(0.0), 0.0
    for _ in range(12):
        now += BEAT + _STALL * 0.9
        silent = silence.turn(now, BEAT)
    assert silent == now > 3.0


@given(
    st.lists(
        st.tuples(
            st.floats(0, 1),  # the longest the turn's poll may wait
            st.floats(0, 1),  # the part of it the poll waited (an event ends it early)
            st.floats(0, 20),  # then the process does not run (a freeze), or 0
            st.booleans(),  # the scheduler was heard when the poll returned
        ),
        max_size=30,
    )
)
def test_silence_is_between_the_time_running_and_the_wall_time_since_heard(turns):
    silence, now, heard, stalls = Silence(0.0), 0.0, 0.0, 0.0
    waited = 0.0
    for most, part, stall, hear in turns:
        silent = silence.turn(now, waited)
        assert now - heard - stalls - 1e-9 <= silent <= now - heard + 1e-9
        waited = most
        now += most * part
        if hear:
            silence.heard(now)
            heard, stalls = now, 0.0
        now += stall
        stalls += stall
