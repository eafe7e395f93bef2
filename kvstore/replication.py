"""Replicated key parts (``KVSTORE_REPLICAS`` > 1), without I/O: what a primary forwards and
when it may answer, what a backup holds and what it does at a failover.

Replication after aggregation, as the Parameter Server paper (OSDI'14) proposed: workers send
a part only to its primary; when a round of it completes, the primary applies the round's
input (the sum; under ``dist_async`` each push) and forwards that same input to the part's
backups, which apply it with the same optimizer and state. Sums are taken in a fixed order
(:func:`kvstore.rounds.pairwise_sum`) and updates are deterministic, so every replica holds
the same bits.

- **Answers wait for the backups.** A reply (of a push, a pull, anything that shows or
  confirms applied state) leaves the primary only once every live backup acknowledged the
  latest forward of every key the reply names, checked when it leaves (:class:`Primary`): so
  what a worker reads or is told was applied is on every live replica.
- **A backup is passive** (:class:`Backup`): it applies forwards, in order, and counts them;
  its copies of a part are in no round of its own until a failover makes it the acting server
  for that part (the first live server of the part's chain, :func:`kvstore.sharding.acting`).
- **Re-sent requests are idempotent.** Each forward names, per rank, the request id of the
  latest push it holds. After a failover a worker re-sends every request the dead server did
  not answer (same ids, in order, marked ``resend``); the new acting server treats a re-sent
  push of a key whose id it already holds as done (answered, not applied again), and a fresh
  one as any push. Its rounds go on from the count of rounds it received.
- **Changes that are no round go in order too.** A changed optimizer and loaded optimizer
  states travel as forwards with no entries, each named by the mark ``(None, home)`` where
  a key would be (no key is named None), so the answers wait for them as for a round; a
  re-sent state load already held is answered, not loaded again (:meth:`Backup.loaded`).
- **Elastic newcomers.** A copy taken over keeps out of its rounds the newcomers that came
  after the key was made and have no push of it among the rounds received, as
  ``Rounds.arrive`` left them on the primary (:meth:`Backup.not_pushed`).

The server (:mod:`kvstore.server`) owns the sockets and carries these decisions out; the
tests drive these classes with a model network that delays, drops, repeats and reorders
messages and crashes a primary at any step (``tests/test_replication.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from .protocol import arrival_of


class Primary:
    """A primary's side: the pushes each forward holds, the forwards each backup has not yet
    acknowledged, and the answers parked until they are."""

    def __init__(self):
        self._takers: dict = {}  # key -> rank -> deque[(round, request id)]
        self.rounds: dict = {}  # key -> sync rounds applied (the round of its next Apply)
        self.sent: dict[int, int] = {}  # backup -> the sequence number of its last forward
        self.acked: dict[int, int] = {}  # backup -> the last sequence number it acknowledged
        self.latest: dict = {}  # key -> {backup: the sequence number of its latest forward}
        self.parked: list = []  # (answer, the keys it names), in the order they came

    # ---- pushes and the forwards that hold them
    def pushed(self, key: Hashable, rank: int, round_: int, request_id: int) -> None:
        """A sync push of ``key`` by ``rank`` went into round ``round_``."""
        self._takers.setdefault(key, {}).setdefault(rank, deque()).append((round_, request_id))

    def applied(self, key: Hashable, accumulate: bool, pusher=None) -> list:
        """A round of ``key`` (or, ``accumulate``, an async push by ``pusher``: (rank, id)) is
        applied: ``[[rank, request id], ...]``, the latest push of each rank it holds."""
        if accumulate:
            return [list(pusher)] if pusher is not None else []
        n = self.rounds.get(key, 0)
        self.rounds[key] = n + 1
        held = []
        for rank, queue in self._takers.get(key, {}).items():
            last = None
            while queue and queue[0][0] <= n:
                last = queue.popleft()[1]
            if last is not None:
                held.append([rank, last])
        return held

    def start(self, key: Hashable, rounds: int) -> None:
        """This server acts for ``key`` from now on, ``rounds`` of it applied (a failover)."""
        self.rounds[key] = rounds

    # ---- acknowledgements
    def forwarded(self, backup: int, keys) -> int:
        """A forward of ``keys`` goes to ``backup``: its sequence number."""
        seq = self.sent[backup] = self.sent.get(backup, 0) + 1
        latest = self.latest
        for key in keys:
            held = latest.get(key)
            if held is None:
                latest[key] = {backup: seq}
            else:
                held[backup] = seq
        return seq

    def _held(self, keys) -> bool:
        """Whether every live backup holds the latest forward of each of ``keys``."""
        sent, acked, latest = self.sent, self.acked, self.latest
        for key in keys:
            for backup, seq in latest.get(key, {}).items():
                if backup in sent and acked.get(backup, 0) < seq:
                    return False
        return True

    def answer(self, action, keys) -> list:
        """``[action]`` when it may go out now, else ``[]`` (parked until the backups hold
        the latest forward of every key it names)."""
        if self._held(keys):
            return [action]
        self.parked.append((action, keys))
        return []

    def ack(self, backup: int, seq: int) -> list:
        """``backup`` holds every forward up to ``seq``: the answers that may go out now."""
        if backup in self.sent and seq > self.acked.get(backup, 0):
            self.acked[backup] = min(seq, self.sent[backup])
        return self._release()

    def drop(self, backup: int) -> list:
        """``backup`` is dead: nobody waits for it any more."""
        self.sent.pop(backup, None)
        self.acked.pop(backup, None)
        return self._release()

    def _release(self) -> list:
        out, still = [], []
        for action, keys in self.parked:
            (out if self._held(keys) else still).append((action, keys))
        self.parked = still
        return [action for action, _ in out]


class Backup:
    """A backup's side: the parts it holds for other servers, what it received of each."""

    def __init__(self):
        # key -> (home server, members, their arrivals): not in any round here
        self.passive: dict = {}
        self.home: dict = {}  # key -> its home server, for every key held for another one
        self.rounds: dict = {}  # key -> sync rounds received
        self.seen: dict = {}  # key -> {rank: the latest request id of its pushes held}
        # key -> {rank: the latest request id of its loads held} (a row-sparse key's
        # load_rows): apart from ``seen``, as a load is applied on arrival, before a round
        # that holds an earlier push of the same rank
        self.loads: dict = {}
        self.made_after: dict = {}  # key -> the newcomers it was made after (hold)

    def hold(
        self, key: Hashable, home: int, members, acting: bool, arrivals=None, newcomers=None
    ) -> None:
        """A part of server ``home``'s is kept here (``acting``: and answered for here).
        ``newcomers``: those of the job now (``{slot: arrival epoch}``), in the key's rounds
        from its start (made after they came: see :meth:`not_pushed`)."""
        self.home[key] = home
        self.made_after[key] = dict(newcomers or {})
        if not acting:
            self.passive[key] = (home, members, arrivals)

    def received(self, key: Hashable, accumulate: bool, held) -> None:
        """A forward of ``key`` was applied here."""
        if not accumulate:
            self.rounds[key] = self.rounds.get(key, 0) + 1
        seen = self.seen.setdefault(key, {})
        for rank, request_id in held:
            if request_id > seen.get(rank, 0):
                seen[rank] = request_id

    def take_over(self, homes) -> list:
        """This server now acts for the parts of ``homes``: ``[(key, members, rounds,
        arrivals)]``, the passive keys that become active, with the rounds they have had."""
        out = []
        for key, (home, members, arrivals) in list(self.passive.items()):
            if home in homes:
                del self.passive[key]
                out.append((key, members, self.rounds.get(key, 0), arrivals))
        return out

    def not_pushed(self, key: Hashable, newcomers: dict) -> set:
        """The newcomers (``{slot: arrival epoch}``) out of ``key``'s rounds until their first
        push of it, as ``Rounds.arrive`` left them on its primary: those that came after the
        key was made, with no push of it in the rounds held here (a request id says which
        holder of its slot sent it: :func:`arrival_of`)."""
        seen, made_after = self.seen.get(key, {}), self.made_after.get(key, {})
        return {
            r
            for r, epoch in newcomers.items()
            if made_after.get(r) != epoch and arrival_of(seen.get(r, 0)) < epoch
        }

    def loaded(self, key: Hashable, rank: int, request_id: int) -> None:
        """A forwarded load of ``key`` by ``rank`` was applied here."""
        held = self.loads.setdefault(key, {})
        held[rank] = max(held.get(rank, 0), request_id)

    def duplicate_load(self, key: Hashable, rank: int, request_id: int) -> bool:
        """Whether a re-sent load of ``key`` is already held (answer it, never load again:
        that would undo the rounds applied since)."""
        return request_id <= self.loads.get(key, {}).get(rank, 0)

    def duplicate(self, key: Hashable, rank: int, request_id: int) -> bool:
        """Whether a re-sent push of ``key`` is already held (answer it, never apply it)."""
        seen = self.seen.get(key)
        return seen is not None and request_id <= seen.get(rank, 0)
