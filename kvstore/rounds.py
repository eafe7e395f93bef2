"""The rounds of every key on one server, without I/O: events in, actions out.

A server feeds :class:`Rounds` what its workers ask (``push``, ``pull``), what the scheduler
tells it (``finished``, ``joined``) and the time (``tick``); each call returns the actions to
carry out, in order: :class:`Apply` a value to a stored key, :class:`Reply` to a request whose
keys are all ready, :class:`Fail` a request. Nothing here reads a clock, draws a random number
or touches a socket, so a standby that replays the same events reaches the same state, and the
tests drive it with events alone (``tests/test_rounds.py``, against a sequential model).

``dist_sync`` semantics, per key:

- Each worker's pushes go to consecutive rounds: its n-th push of a key is in round n, however
  far ahead of the others it runs. Round n completes when every worker has pushed it, or has
  called ``join`` (it then counts as pushing zeros); the sum is then applied once.
- A push is answered when its round completes.
- A round's sum is the same bits whatever the order its pushes arrive in (``reproducible``,
  the default): it is a fixed pairwise tree over the ranks (:func:`pairwise_sum`), each node
  added as soon as both its halves are in. A worker that joined is left out of the rounds it
  did not push (its half of a node is the other half, as is): the same bits as a push of
  zeros, but for the sign of a zero sum. ``reproducible=False`` adds in arrival order.
- A pull is answered once the key has completed as many rounds as this worker pushed it, so it
  sees all of the worker's own pushes and never waits for anyone's future pushes.
- A round that a finished worker never pushed, or that stays open past the round deadline, can
  never complete correctly: every request that needs it fails, naming the cause.

``dist_ssp`` (bounded staleness ``s``, the ``staleness`` argument; 0 is ``dist_sync``): rounds
complete and are applied exactly as in ``dist_sync``; only the answers come sooner. A worker's
clock on a key is the number of its pushes of it.

- A push that takes its worker to clock ``c`` is answered once rounds ``0 .. c-s-1`` are
  complete, so a worker never has more than ``s`` answered pushes beyond the slowest worker.
- A pull at clock ``c`` is answered once rounds ``0 .. c-s-1`` are complete: it reads every
  worker's pushes of those clocks, and never a round the reader has not pushed itself.

``dist_async``: a push is applied on arrival (:class:`Apply` with ``accumulate``) and
answered; a pull is answered at once.

>>> import numpy as np
>>> r = Rounds(num_workers=2, round_timeout=60)
>>> r.add_key("w")
>>> r.push("a", 0, [("w", np.ones(2))], sync=True, now=0.0)
[]
>>> [type(a).__name__ for a in r.push("b", 1, [("w", np.ones(2))], sync=True, now=0.1)]
['Apply', 'Reply', 'Reply']
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .half import add


# Actions are named tuples: immutable, and made once per key and round (the hot path).
class Apply(NamedTuple):
    """Store ``value`` under ``key``: with ``accumulate`` (an async push) add it to the stored
    value (or run the updater on it); else it is a round's sum (assign, or run the updater).
    ``value`` is the caller's from now on."""

    key: Hashable
    value: np.ndarray
    accumulate: bool


class Reply(NamedTuple):
    """Every key of ``request`` is ready: answer it (a pull reads the stored values now)."""

    request: Any


class Fail(NamedTuple):
    request: Any
    text: str


@dataclass(frozen=True)
class Stall:
    """A round that waits: for whom, how long each has been silent on the key (seconds since
    its last push of it; -1: never pushed), who pushed it, and the requests waiting on it.
    Under ``dist_ssp`` also the bound and every worker's clock (its pushes of the key)."""

    key: Hashable
    round: int
    age: float
    missing: list
    silent: list
    present: list
    waiting: list
    staleness: int | None = None
    clocks: list | None = None


@dataclass(eq=False)
class _Key:
    name: Hashable
    pushed: list  # per worker rank: pushes received (the round its next push goes to)
    done: int = 0  # rounds completed
    count: int = 0  # pushes summed into the open round (round ``done``)
    first: np.ndarray | None = None  # arrival order: the open round's only push, uncopied
    acc: np.ndarray | None = None  # arrival order: the open round's sum once a second push came
    nodes: list | None = None  # the tree, heap-ordered: the sums waiting for their sibling
    owned: list | None = None  # the tree: per node, whether it is a buffer of ours
    total: np.ndarray | None = None  # the tree: its root once every rank's leaf is in
    spares: list = field(default_factory=list)  # buffers given back, to sum into
    started: float = 0.0  # when the open round got its first push
    last_push: list = field(default_factory=list)  # per rank: when it last pushed (-1: never)
    queued: dict = field(default_factory=lambda: defaultdict(list))  # round -> [(rank, grad)]
    waiting: dict = field(default_factory=lambda: defaultdict(list))  # rounds done -> [request]
    dead_from: int | None = None  # rounds from this one on can never complete
    dead_why: str = ""
    staleness: int | None = None  # dist_ssp's bound, from its first request (None: dist_sync)
    members: tuple | None = None  # a group's key: only these ranks push it (None: every rank)
    outsiders: frozenset = frozenset()  # the ranks not in ``members``: never in its rounds
    # elastic jobs: newcomers that have not pushed this key yet, out of its rounds until then
    absent: set = field(default_factory=set)
    zeroed: int = -1  # the round whose absent newcomers' leaves are in (as zeros)
    firsts: dict = field(default_factory=dict)  # round -> newcomers whose first push it holds


class Rounds:
    """The sync and async round state of every key of one server."""

    def __init__(
        self, num_workers: int, round_timeout: float, describe=repr, reproducible: bool = True
    ):
        self.num_workers = num_workers
        self.reproducible = reproducible  # sum in the fixed tree (else in arrival order)
        # The tree in heap order: node 1 is the root, node p's halves are 2p and 2p + 1, rank
        # r's leaf is node leaves + r. A hollow node holds no rank (beyond W).
        self._leaves = 1 << (num_workers - 1).bit_length()
        self._hollow = [False] * (2 * self._leaves)
        for p in range(2 * self._leaves - 1, 0, -1):
            self._hollow[p] = (
                p - self._leaves >= num_workers
                if p >= self._leaves
                else self._hollow[2 * p] and self._hollow[2 * p + 1]
            )
        # the most buffers a round holds at once: a tree's nodes of two pushes, else one
        self._most_spares = max(1, num_workers // 2) if reproducible else 1
        self.round_timeout = round_timeout
        self.describe = describe  # a key's name in error messages
        self.keys: dict[Hashable, _Key] = {}
        self.finished_ranks: set[int] = set()
        self.joined_ranks: set[int] = set()
        self.left: set[int] = set()  # elastic jobs: slots no worker holds now
        self._arrived = False  # a slot was taken mid-job: rounds are not counted by pushes
        self.arrived_at: dict[int, int] = {}  # slot -> the membership epoch its holder came
        # slot -> arrival epoch of the newcomers that may still be absent from a key (arrive,
        # until enter or leave): a key a replica takes over needs them (add_key's absent)
        self.newcomers: dict[int, int] = {}
        # newcomers seen in a completed round of this server: slot -> its arrival epoch (the
        # server's replies say so; see expect)
        self.entered: dict[int, int] = {}
        self._open: set[Hashable] = set()  # keys with a sync round under way
        self._requests: dict[Any, int] = {}  # request -> keys it still waits for

    # ---- keys
    def add_key(
        self, key: Hashable, members=None, rounds: int = 0, arrivals=None, absent=()
    ) -> None:
        """``members``: the ranks of a group's key (Horovod's process sets): its rounds are
        complete when every member has pushed; other ranks may not push or pull it.
        ``rounds``: the key has had that many rounds elsewhere (a replica taking over), so
        every rank's next push goes to round ``rounds``. ``arrivals``: per member, when the
        holder of its slot that made the group came (an elastic job's generation): a slot
        held by another worker since is out of the group, as if it had come later.
        ``absent``: newcomers (of :attr:`newcomers`) out of the key's rounds until their first
        push of it, as :meth:`arrive` leaves them (a replica taking over: those whose pushes
        of the key it holds none of)."""
        if key in self.keys:
            raise ValueError(f"key {key!r} is already initialised")
        state = _Key(key, [rounds] * self.num_workers, last_push=[-1.0] * self.num_workers)
        state.done = rounds
        if members is None:
            state.absent = {r for r in absent if r in self.newcomers}
        if members is not None:
            state.members = tuple(sorted(members))
            out = set(range(self.num_workers)) - set(members)
            if arrivals is not None:
                held = self.arrived_at
                out |= {m for m, a in zip(members, arrivals, strict=True) if held.get(m, 0) != a}
            state.outsiders = frozenset(out)
        self.keys[key] = state

    def give_back(self, key: Hashable, buffer: np.ndarray) -> None:
        """Offer a writable buffer that nobody reads any more (e.g. the value an
        :class:`Apply` replaced) for the key's next sum."""
        state = self.keys.get(key)
        if state is not None and buffer.flags.writeable:
            self._recycle(state, buffer)

    # ---- events
    def push(
        self,
        request,
        rank: int,
        grads: list,
        sync: bool,
        now: float,
        staleness: int | None = None,
        held: int = 0,
    ) -> list:
        """``grads``: ``[(key, array)]``, the keys known and the arrays checked by the caller.
        ``staleness``: ``dist_ssp``'s bound (``None``: ``dist_sync``, or ``dist_async`` when
        not ``sync``; -1: ``dist_ssp`` unbounded, whose pushes are async); under a bound a
        push is answered before its round completes, so the caller gives arrays nobody
        writes to. ``held``: the request's other keys, whose push is already applied (a
        re-sent request after a failover): ready at once."""
        actions: list = []
        self._requests[request] = len(grads) + held
        for key, grad in grads:
            state = self.keys[key]
            if state.staleness != staleness or state.outsiders:  # the common case skips both
                wrong = self._check_staleness(state, rank, staleness)
                wrong = wrong or self._check_member(state, rank)
                if wrong:
                    self._fail(request, wrong, actions)
                    continue
            if not sync:
                actions.append(Apply(key, grad, accumulate=True))
                self._key_ready(request, actions)
                continue
            if rank in self.joined_ranks:
                self._fail(
                    request,
                    f"worker {rank} pushed key {self.describe(key)} after join(): a worker "
                    "that joined pushes nothing until every worker has joined",
                    actions,
                )
                continue
            if state.absent and rank in state.absent:  # a newcomer's first push of it
                state.absent.discard(rank)
                state.pushed[rank] = max(state.pushed[rank], state.done)
                if rank not in self.entered:  # (its holder now: the slot may change hands)
                    first = (rank, self.arrived_at.get(rank))
                    state.firsts.setdefault(state.pushed[rank], []).append(first)
            n = state.pushed[rank]
            state.pushed[rank] = n + 1
            state.last_push[rank] = now
            if self.finished_ranks and self._check_finished(state):
                self._fail_dead(state, actions)
            if state.dead_from is not None and n >= state.dead_from:
                self._fail(request, state.dead_why, actions)
                continue
            need = n + 1 - (staleness or 0)
            if need <= state.done:
                self._key_ready(request, actions)
            else:
                state.waiting[need].append(request)
            if n == state.done:
                self._add(state, rank, grad, now)
            else:
                state.queued[n].append((rank, grad))
            if state.total is not None or not self.reproducible or state.absent:
                self._advance(state, now, actions)
        for _ in range(held):
            self._key_ready(request, actions)
        return actions

    def pull(
        self, request, rank: int, keys: list, staleness: int | None = None, flush: bool = False
    ) -> list:
        """A pull waits, per key, for the rounds this worker has pushed (less ``staleness``;
        a ``flush`` waits for all of them, whatever the bound)."""
        actions: list = []
        self._requests[request] = len(keys)
        for key in keys:
            state = self.keys[key]
            if state.staleness != staleness or state.outsiders:  # the common case skips both
                wrong = self._check_staleness(state, rank, staleness)
                wrong = wrong or self._check_member(state, rank)
                if wrong:
                    self._fail(request, wrong, actions)
                    continue
            bound = staleness if staleness is not None and staleness > 0 and not flush else 0
            need = state.pushed[rank] - bound
            if state.done >= need:
                self._key_ready(request, actions)
            elif state.dead_from is not None and need > state.dead_from:
                self._fail(request, state.dead_why, actions)
            else:
                state.waiting[need].append(request)
        return actions

    def finished(self, rank: int) -> list:
        """Worker ``rank`` closed its store: it will never push again."""
        actions: list = []
        self.finished_ranks.add(rank)
        for state in self.keys.values():
            if self._check_finished(state):
                self._fail_dead(state, actions)
        return actions

    def joined(self, rank: int, now: float) -> list:
        """Worker ``rank`` is out of data: it counts as pushing zeros into every round until
        every worker has joined."""
        actions: list = []
        new = rank not in self.joined_ranks
        self.joined_ranks.add(rank)
        for key in list(self._open):
            state = self.keys[key]
            if (
                new
                and self.reproducible
                and state.pushed[rank] <= state.done
                and rank not in state.outsiders
            ):
                self._place(state, rank, _ZERO, False)  # it will not push the open round
            self._advance(state, now, actions)
        if len(self.joined_ranks) == self.num_workers:
            # Everyone is out of data: the rounds a worker skipped count as pushed, and the
            # next epoch starts even.
            self.joined_ranks.clear()
            for state in self.keys.values():
                state.pushed = [max(n, state.done) for n in state.pushed]
        return actions

    def leave(self, rank: int, now: float) -> list:
        """An elastic job's worker is gone: the rounds it pushed keep its pushes, the others
        complete without it (as for a worker that joined, but for good)."""
        actions: list = []
        placed = rank in self.joined_ranks or rank in self.left  # its zero is in open rounds
        self.left.add(rank)
        self.joined_ranks.discard(rank)
        self.entered.pop(rank, None)
        self.newcomers.pop(rank, None)
        for key in list(self._open):
            state = self.keys[key]
            out = rank in state.outsiders
            if self.reproducible and not placed and not out and state.pushed[rank] <= state.done:
                self._place(state, rank, _ZERO, False)  # it will not push the open round
            self._advance(state, now, actions)
        for state in self.keys.values():
            state.absent.discard(rank)
        return actions

    def arrive(self, rank: int, epoch: int = 0) -> None:
        """A worker takes slot ``rank`` of an elastic job. It is in a key's rounds from its
        first push of the key on: nobody waits for a newcomer that has not pushed it yet (it
        may first meet the others elsewhere, as kvstore.elastic's reset does). That push goes
        to the key's open round, unless the round was open before the newcomer came (then to
        the next). A group's key made before it came is not its: a group is the workers that
        made it (elastic keys are made anew by the workers of each membership), so the slot
        stays out of it."""
        self.left.discard(rank)
        self._arrived = True
        self.arrived_at[rank] = epoch
        self.newcomers[rank] = epoch
        self.entered.pop(rank, None)
        for key, state in self.keys.items():
            if state.members is not None:
                state.outsiders = state.outsiders | {rank}
                continue
            state.absent.add(rank)
            start = state.done + (1 if key in self._open else 0)
            state.pushed[rank] = max(state.pushed[rank], start)
            state.last_push[rank] = -1.0

    def tick(self, now: float) -> list:
        """Fail the rounds open longer than the round deadline (none when it is 0)."""
        actions: list = []
        for key in list(self._open) if self.round_timeout > 0 else ():
            state = self.keys[key]
            if now - state.started <= self.round_timeout:
                continue
            missing = self._missing(state)
            self._kill(
                state,
                state.done,
                f"{_kind(state)} round {state.done} of key {self.describe(key)} timed out after "
                f"{self.round_timeout:g}s (KVSTORE_ROUND_TIMEOUT): worker rank(s) {missing} "
                f"did not push it; rank(s) {self._present(state)} did",
                actions,
            )
        return actions

    def fail_all(self, text: str) -> list:
        """The job failed: fail every request still waiting."""
        actions: list = []
        for request in list(self._requests):
            self._fail(request, text, actions)
        return actions

    def fail_round(self, key: Hashable, text: str) -> list:
        """Fail the open round of ``key`` and every request that needs it (a deadlock)."""
        actions: list = []
        state = self.keys[key]
        if state.name in self._open:
            self._kill(state, state.done, text, actions)
        return actions

    # ---- clocks (dist_ssp's staleness metric)
    def rounds_done(self, key: Hashable) -> int:
        return self.keys[key].done

    def clock(self, key: Hashable, rank: int) -> int:
        """``rank``'s pushes of ``key`` so far."""
        return self.keys[key].pushed[rank]

    # ---- what is waiting (for stall reports)
    def stalled(self, now: float, after: float) -> list[Stall]:
        """The rounds open for ``after`` seconds or more."""
        found = []
        for key in sorted(self._open, key=repr):
            state = self.keys[key]
            if now - state.started < after:
                continue
            missing = self._missing(state)
            silent = [
                now - state.last_push[r] if state.last_push[r] >= 0 else -1.0 for r in missing
            ]
            waiting = [q for n, qs in state.waiting.items() if n > state.done for q in qs]
            if not waiting:  # dist_ssp: workers ahead within the bound wait for nothing
                continue
            found.append(
                Stall(
                    key,
                    state.done,
                    now - state.started,
                    missing,
                    silent,
                    self._present(state),
                    waiting,
                    state.staleness,
                    list(state.pushed) if state.staleness else None,
                )
            )
        return found

    # ---- internals
    def _check_staleness(self, state: _Key, rank: int, staleness: int | None) -> str:
        """Every request of a key must use one bound: the rules would disagree otherwise."""
        if state.staleness == staleness:
            return ""
        if state.staleness is None and not any(state.pushed):
            state.staleness = staleness  # the key's first request sets it
            return ""
        return (
            f"worker {rank} uses {_mode(staleness)} for key {self.describe(state.name)}, "
            f"but the key's earlier requests used {_mode(state.staleness)}: every worker must "
            "create the same store type with the same KVSTORE_STALENESS"
        )

    def _check_member(self, state: _Key, rank: int) -> str:
        if rank not in state.outsiders:
            return ""
        return (
            f"worker {rank} used key {self.describe(state.name)} of the group of ranks "
            f"{list(state.members)}: only its members push or pull it"
        )

    def _add(self, state: _Key, rank: int, grad: np.ndarray, now: float) -> None:
        if state.count == 0:
            state.started = now
            self._open.add(state.name)
        state.count += 1
        if self.reproducible:
            if state.count == 1 and (self.joined_ranks or state.outsiders or self.left):
                # a round opens: joined ranks, slots nobody holds and those outside a group's
                # key are out (newcomers yet to push it once the others have: _advance)
                for r in state.outsiders:  # (a push it queued before it left counts)
                    if state.pushed[r] <= state.done:
                        self._place(state, r, _ZERO, False)
                for r in (self.joined_ranks | self.left) - state.outsiders:
                    if state.pushed[r] <= state.done:
                        self._place(state, r, _ZERO, False)
            self._place(state, rank, grad, False)
        elif state.count == 1:
            state.first = grad
        elif state.count == 2:
            acc = self._buffer(state, grad)
            add(state.first, grad, acc)
            state.acc, state.first = acc, None
        else:
            add(state.acc, grad, state.acc)

    def _place(self, state: _Key, rank: int, value, mine: bool) -> None:
        """Put rank's leaf in the open round's tree and add up every node it completes.

        A node is an array (``mine``: a buffer of ours, else a push nobody writes to) or
        ``_ZERO`` (a joined rank's leaf, or a node with only those under it: left out)."""
        nodes, owned, hollow = state.nodes, state.owned, self._hollow
        if nodes is None:
            nodes = state.nodes = [None] * (2 * self._leaves)
            owned = state.owned = [False] * (2 * self._leaves)
        pos = self._leaves + rank
        while pos > 1:
            sibling = pos ^ 1
            if not hollow[sibling]:  # else nothing to add: the node is this half, as is
                other = nodes[sibling]
                if other is None:  # wait for it
                    nodes[pos], owned[pos] = value, mine
                    return
                nodes[sibling] = None
                # a + b == b + a bit for bit: sum into whichever half is a buffer of ours
                if other is _ZERO:
                    pass
                elif value is _ZERO:
                    value, mine = other, owned[sibling]
                elif mine:
                    add(value, other, value)
                    if owned[sibling]:
                        self._recycle(state, other)
                elif owned[sibling]:
                    add(other, value, other)
                    value, mine = other, True
                else:
                    out = self._buffer(state, value)
                    add(value, other, out)
                    value, mine = out, True
            pos >>= 1
        state.total = value

    def _buffer(self, state: _Key, like: np.ndarray) -> np.ndarray:
        """A buffer to sum into: a spare that fits, else a new one."""
        while state.spares:
            spare = state.spares.pop()
            if spare.shape == like.shape and spare.dtype == like.dtype:
                return spare
        return np.empty_like(like)

    def _recycle(self, state: _Key, buffer: np.ndarray) -> None:
        if len(state.spares) < self._most_spares:
            state.spares.append(buffer)

    def _complete(self, state: _Key) -> bool:
        if self.reproducible:  # the root is in once every rank's leaf is
            return state.total is not None
        if state.count == 0:
            return False
        out = state.outsiders
        if not self.joined_ranks and not self.left and not self._arrived:  # count the pushes
            return state.count == self.num_workers - len(out)
        return all(
            n > state.done
            or rank in self.joined_ranks
            or rank in out
            or rank in self.left
            or rank in state.absent
            for rank, n in enumerate(state.pushed)
        )

    def _clear(self, state: _Key) -> None:
        state.first = state.acc = state.total = None
        state.count = 0
        self._open.discard(state.name)

    def _advance(self, state: _Key, now: float, actions: list) -> None:
        # the hot path of a many-key step (once per key and round): _complete, _clear and
        # _key_ready written out
        reproducible, requests = self.reproducible, self._requests
        while True:
            if reproducible and state.absent and state.count and state.total is None:
                self._close_absent(state)  # (elastic jobs: newcomers yet to push the key)
            if not (state.total is not None if reproducible else self._complete(state)) or (
                state.dead_from is not None and state.done >= state.dead_from
            ):
                return
            if reproducible:
                total = state.total
            else:
                total = state.first if state.count == 1 else state.acc
            state.first = state.acc = state.total = None
            state.count = 0
            self._open.discard(state.name)
            actions.append(Apply(state.name, total, False))
            state.done = done = state.done + 1
            if state.firsts:
                self._entered(state.firsts.pop(done - 1, ()))
            waiting = state.waiting.pop(done, None)
            if waiting:
                for request in waiting:
                    left = requests.get(request)
                    if left is None:  # failed already
                        continue
                    if left == 1:
                        del requests[request]
                        actions.append(Reply(request))
                    else:
                        requests[request] = left - 1
            queued = state.queued.pop(done, None)
            if queued:
                for rank, grad in queued:
                    self._add(state, rank, grad, now)

    def enter(self, rank: int, now: float) -> list:
        """Newcomer ``rank`` is in every key's rounds from now on, not only from its first
        push of each (kvstore.elastic's reset: the workers of the new membership meet, then
        go on in step). An open round goes on without it (as a zero); the next has it."""
        actions: list = []
        self.newcomers.pop(rank, None)
        for key, state in self.keys.items():
            if rank not in state.absent:
                continue
            state.absent.discard(rank)
            if key not in self._open:
                state.pushed[rank] = max(state.pushed[rank], state.done)
                continue
            if state.pushed[rank] <= state.done:  # its leaf is not in the open round yet
                if self.reproducible:
                    self._place(state, rank, _ZERO, False)
                state.pushed[rank] = state.done + 1
            self._advance(state, now, actions)
        return actions

    def _entered(self, firsts) -> None:
        """A round with these newcomers' first pushes (``(slot, arrival epoch)``) completed:
        each one still holding its slot is in (a slot's later holder has pushed nothing)."""
        for rank, epoch in firsts:
            if epoch is not None and self.arrived_at.get(rank) == epoch and rank not in self.left:
                self.entered[rank] = epoch

    def expect(self, newcomers, keys) -> None:
        """A worker pushing ``keys`` saw ``newcomers`` (``[[slot, arrival epoch]]``) in a
        completed round (a server's reply told it): each is in these keys' rounds from the
        open one on, even before its first push of them.

        Why: a newcomer's rounds begin at its first push of each key, and each server places
        that push alone. In a loop of blocking pushpulls over keys on several servers, a
        newcomer whose push of key B came just after B's round closed without it would be a
        round ahead on B (waiting for the others) while they wait for it in key A's next
        round: a deadlock. Every push the others make after the newcomer's first round
        completed comes after it in their loop, as the newcomer's own pushes do, so from
        such a push on the key's rounds wait for it: its pushes and theirs stay in step.
        ``Rounds.enter`` (kvstore.elastic's reset) does the same for every key at once."""
        for slot, epoch in newcomers:
            if self.arrived_at.get(slot) != epoch:  # an old holder's, or not heard of yet
                continue
            for key in keys:
                state = self.keys.get(key)
                if state is not None and state.absent and slot in state.absent:
                    state.absent.discard(slot)
                    state.pushed[slot] = max(state.pushed[slot], state.done)

    def _close_absent(self, state: _Key) -> None:
        """Once every other worker pushed the open round, the newcomers that have not pushed
        the key yet are out of it (their leaves are zeros): it completes without them."""
        if state.zeroed != state.done and not self._missing(state):
            state.zeroed = state.done
            for r in state.absent - self.joined_ranks:  # (a joined one's zero is in)
                if state.pushed[r] <= state.done:
                    self._place(state, r, _ZERO, False)

    def _missing(self, state: _Key) -> list:
        return [
            r
            for r, n in enumerate(state.pushed)
            if n <= state.done
            and r not in self.joined_ranks
            and r not in state.outsiders
            and r not in self.left
            and r not in state.absent
        ]

    def _present(self, state: _Key) -> list:
        return [r for r, n in enumerate(state.pushed) if n > state.done]

    def _check_finished(self, state: _Key) -> bool:
        """Mark the rounds a finished worker never pushed as dead; True if that is new."""
        gone = [
            (n, r)
            for r, n in enumerate(state.pushed)
            if r in self.finished_ranks and r not in self.joined_ranks and r not in state.outsiders
        ]
        if not gone:
            return False
        limit, rank = min(gone)
        if max(state.pushed) <= limit or (state.dead_from is not None and state.dead_from <= limit):
            return False  # nobody waits on a round the finished worker skipped
        state.dead_from = limit
        state.dead_why = (
            f"{_kind(state)} round {limit} of key {self.describe(state.name)} can never complete: "
            f"worker {rank} finished (closed its store) after {limit} push(es) of it, while "
            f"rank(s) {[r for r, n in enumerate(state.pushed) if n > limit]} pushed more. Every "
            "worker must push each key the same number of times; a worker out of data calls join()"
        )
        return True

    def _kill(self, state: _Key, from_round: int, why: str, actions: list) -> None:
        if state.dead_from is None or from_round < state.dead_from:
            state.dead_from, state.dead_why = from_round, why
        self._fail_dead(state, actions)

    def _fail_dead(self, state: _Key, actions: list) -> None:
        """Fail every request that waits for a round at or after ``dead_from``."""
        for rounds_done in sorted(state.waiting):
            if rounds_done > state.dead_from:
                for request in state.waiting.pop(rounds_done):
                    self._fail(request, state.dead_why, actions)
        for n in [n for n in state.queued if n >= state.dead_from]:
            del state.queued[n]
        if state.done >= state.dead_from:
            self._clear(state)
            state.nodes = state.owned = None  # the tree of a round that failed half way

    def _key_ready(self, request, actions: list) -> None:
        left = self._requests.get(request)
        if left is None:  # failed already
            return
        if left == 1:
            del self._requests[request]
            actions.append(Reply(request))
        else:
            self._requests[request] = left - 1

    def _fail(self, request, text: str, actions: list) -> None:
        if self._requests.pop(request, None) is not None:
            actions.append(Fail(request, text))


def _kind(state: _Key) -> str:
    return "dist_sync" if state.staleness is None else "dist_ssp"


_ZERO = object()  # a joined rank's leaf in the tree: left out of the sum


def pairwise_sum(pushes: list) -> np.ndarray | None:
    """The sum a reproducible round applies, from its pushes in rank order (``None``: a rank
    that joined): the fixed pairwise tree over ranks ``0 .. W-1``. Level by level, ranks
    ``(0, 1), (2, 3), ...`` are added, then those pairs in pairs, and so on; a node whose
    right half holds no rank is its left half, and a node one of whose halves holds only
    joined ranks is the other half, as is. What :class:`Rounds` computes, whatever the order
    the pushes arrive in; the tests' reference. Each node is rounded to the pushes' dtype: a
    float16 ``a + b`` is NumPy's float16 add, which the servers' faster ``kvstore.half.add``
    matches bit for bit.

    >>> ones = [np.float32(x) for x in (1e8, 1, -1e8, 1)]
    >>> float(pairwise_sum(ones)), float(ones[0] + ones[2] + ones[1] + ones[3])
    (0.0, 2.0)
    """
    nodes = list(pushes)
    while len(nodes) > 1:
        pairs = []
        for i in range(0, len(nodes), 2):
            a, b = nodes[i], nodes[i + 1] if i + 1 < len(nodes) else None
            pairs.append(a if b is None else b if a is None else a + b)
        nodes = pairs
    return nodes[0] if nodes else None


def _mode(staleness: int | None) -> str:
    if staleness is None:
        return "dist_sync or dist_async"
    return f"dist_ssp with staleness {'inf' if staleness < 0 else staleness}"
