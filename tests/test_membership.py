"""The scheduler's state machine (:mod:`kvstore.membership`) against a plain model.

No processes and no sockets: hypothesis writes the job (how many servers and workers, their
addresses and rank hints, the order they register in) and what its nodes then do (barriers of
every group, joins, the servers' acks of joins, finalizes, heartbeats, the passing of time).
A harness plays the nodes: it sends only what a real node could send in its state (a node in
a barrier or a join waits), carries out every action, and checks each answer against the
model: a barrier completes exactly once, only when every member arrived or joined; join_done
goes to every joined worker once, only after every worker joined or finished and every server
acknowledged every join; ranks are a permutation; a silent node fails the job exactly once.
"""

from __future__ import annotations

import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.config import Config
from kvstore.errors import EXIT_FAILED, EXIT_PEER_LOST
from kvstore.membership import (
    GROUPS,
    Broadcast,
    Exit,
    Log,
    Membership,
    Send,
    StallSeen,
    report_every,
)
from kvstore.protocol import Message


def make_cfg(num_server=1, num_worker=2, **kw) -> Config:
    kw.setdefault("insecure", True)
    kw.setdefault("heartbeat_timeout", 1e9)
    return Config("scheduler", "127.0.0.1", 9091, num_server, num_worker, "127.0.0.1", **kw)


def register(role, host="h", port=0, pid=1, hint=-1, num_server=1, num_worker=2, cred="c"):
    body = {
        "role": role,
        "host": host,
        "port": port,
        "pid": pid,
        "num_server": num_server,
        "num_worker": num_worker,
        "rank_hint": hint,
        "cred": cred,
    }
    return Message("register", 0, role, body)


class Harness:
    """Plays the nodes and keeps the model: each node free, in a barrier, in a join, or done."""

    def __init__(self, num_server: int, num_worker: int, **cfg):
        self.S, self.W = num_server, num_worker
        self.cfg = make_cfg(num_server, num_worker, **cfg)
        self.now = 0.0
        self.m = Membership(self.cfg, self.now)
        self.ids = 0
        self.role: dict[bytes, str] = {}
        self.rank: dict[bytes, int] = {}
        self.state: dict[
            bytes, tuple
        ] = {}  # ("free",) ("barrier", group, id) ("join", id) ("done",)
        self.books: dict[bytes, dict] = {}
        self.pending_acks: dict[bytes, list] = {}  # server -> joins (ranks) not yet acked
        self.acks = 0  # acks given for the joins under way
        self.join_order: list[int] = []  # ranks, in join order, of the joins under way
        self.exits: list[int] = []
        self.failed_nodes: list[str] = []
        self.done_sent: list = []  # (identity, request id) of every barrier_done / join_done

    # ---- set-up
    def start(self, nodes: list[tuple]) -> None:
        """``nodes``: (role, host, port, pid, hint) in registration order."""
        for i, (role, host, port, pid, hint) in enumerate(nodes):
            identity = f"{role}-{i}".encode()
            self.role[identity] = role
            self.state[identity] = ("free",)
            msg = register(role, host, port, pid, hint, self.S, self.W)
            self.run(self.m.receive(identity, msg, self.now))
        assert self.m.ready and set(self.books) == set(self.role)

    # ---- events
    def send(self, identity: bytes, kind: str, body=None) -> int:
        self.ids += 1
        self.run(self.m.receive(identity, Message(kind, self.ids, "x", body or {}), self.now))
        return self.ids

    def barrier(self, identity: bytes, group: str) -> None:
        assert self.state[identity] == ("free",)
        req = self.ids + 1
        self.state[identity] = ("barrier", group, req)
        assert self.send(identity, "barrier", {"group": group}) == req

    def join(self, identity: bytes) -> None:
        assert self.state[identity] == ("free",)
        req = self.ids + 1
        self.state[identity] = ("join", req)
        self.join_order.append(self.rank[identity])
        assert self.send(identity, "join") == req

    def ack(self, server: bytes) -> None:
        assert self.pending_acks[server]
        rank = self.pending_acks[server].pop(0)
        self.acks += 1
        self.send(server, "joined_ack", {"rank": rank})

    def finalize(self, identity: bytes) -> None:
        assert self.state[identity] == ("free",)
        self.state[identity] = ("done",)
        self.send(identity, "finalize")

    def tick(self, dt: float) -> None:
        self.now += dt
        self.run(self.m.tick(self.now))

    # ---- the model
    def members(self, group: str) -> list[bytes]:
        return [i for i, r in self.role.items() if r in GROUPS[group]]

    def barrier_may_complete(self, group: str) -> bool:
        return all(
            self.state[i][:2] == ("barrier", group) or self.state[i][0] == "join"
            for i in self.members(group)
        )

    def join_may_complete(self) -> bool:
        workers = [i for i, r in self.role.items() if r == "worker"]
        return (
            bool(self.join_order)
            and all(self.state[i][0] in ("join", "done") for i in workers)
            and self.acks == len(self.join_order) * self.S
        )

    # ---- the actions
    def run(self, actions: list) -> None:
        before = dict(self.state)  # each answer is judged by the state it answers
        may_barrier = {g: self.barrier_may_complete(g) for g in GROUPS}
        may_join = self.join_may_complete()
        last = self.join_order[-1] if self.join_order else None
        joined_done = False
        for action in actions:
            if isinstance(action, Send):
                self._sent(action.identity, action.message, before, may_barrier, may_join, last)
                joined_done |= action.message.kind == "join_done"
            elif isinstance(action, Broadcast):
                targets = self.m.identities(action.roles, action.skip)
                assert set(targets) == {
                    i for i, r in self.role.items() if r in action.roles and i != action.skip
                }
                kind = action.message.kind
                if kind == "worker_joined":
                    assert action.roles == ("server",)
                    for server in targets:
                        owed = self.pending_acks.setdefault(server, [])
                        owed.append(action.message.body["rank"])
                elif kind == "node_failed":
                    self.failed_nodes.append(action.message.body["node"])
            elif isinstance(action, Exit):
                self.exits.append(action.status)
            else:
                assert isinstance(action, (Log, StallSeen)), action
        if joined_done:
            self.join_order, self.acks = [], 0

    def _sent(self, identity, msg, before, may_barrier, may_join, last) -> None:
        kind, state = msg.kind, before[identity]
        if kind == "book":
            assert identity not in self.books, "a second book"
            self.books[identity] = msg.body
            self.rank[identity] = msg.body["rank"]
        elif kind == "barrier_done":
            group = msg.body["group"]
            assert state == ("barrier", group, msg.id), (identity, state, msg)
            assert may_barrier[group], f"barrier({group}) completed before all arrived"
            self.state[identity] = ("free",)
            self.done_sent.append((identity, msg.id))
        elif kind == "join_done":
            assert state == ("join", msg.id), (identity, state, msg)
            assert may_join, "join_done before every worker joined and every server acked"
            assert msg.body["last"] == last
            self.state[identity] = ("free",)
            self.done_sent.append((identity, msg.id))
        elif kind == "error":
            assert state[0] == "barrier" and msg.id == state[2], (identity, state, msg)
            group = state[1]
            gone = [i for i in self.members(group) if before[i] == ("done",)]
            assert gone, msg.body["message"]  # only a finished member fails a barrier here
            assert (
                "finished (closed its store) without reaching this barrier" in (msg.body["message"])
            )
            self.state[identity] = ("free",)
        elif kind == "stall":
            assert state[0] in ("barrier", "join"), (identity, state)
        else:
            assert kind in ("heartbeat", "ack"), msg

    def check_settled(self) -> None:
        """Nothing that may complete is still waiting."""
        for group in GROUPS:
            waiting = [i for i in self.members(group) if self.state[i][:2] == ("barrier", group)]
            if waiting and self.barrier_may_complete(group):
                raise AssertionError(f"barrier({group}) never completed: {self.state}")
        if self.join_may_complete():
            raise AssertionError(f"join never completed: {self.state}")


# ---------------------------------------------------------------- registration and ranks

nodes_st = st.tuples(
    st.sampled_from(["a", "b"]), st.integers(0, 3), st.integers(1, 5), st.integers(-1, 3)
)


@st.composite
def jobs(draw):
    S, W = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    valid_hints = draw(st.booleans())
    nodes = []
    for role, n in (("server", S), ("worker", W)):
        hints = draw(st.permutations(range(n))) if valid_hints else None
        for k in range(n):
            host, port, pid, hint = draw(nodes_st)
            port = port if role == "server" else 0
            nodes.append((role, host, port, 100 * k + pid, hints[k] if hints else hint))
    return S, W, draw(st.permutations(nodes))


@settings(max_examples=150, deadline=None)
@given(jobs())
def test_ranks_are_the_hints_or_sorted_by_address(job):
    S, W, nodes = job
    h = Harness(S, W)
    h.start(nodes)
    for role, n in (("server", S), ("worker", W)):
        mine = [(i, node) for i, node in enumerate(nodes) if node[0] == role]
        ranks = {i: h.rank[f"{role}-{i}".encode()] for i, _ in mine}
        assert sorted(ranks.values()) == list(range(n))
        hints = [node[4] for _, node in mine]
        if sorted(hints) == list(range(n)):
            assert all(ranks[i] == node[4] for i, node in mine)
        else:
            order = sorted(mine, key=lambda x: (x[1][1], x[1][2], x[1][3]))
            assert [ranks[i] for i, _ in order] == list(range(n))
    servers = sorted((n for n in nodes if n[0] == "server"), key=lambda n: (n[1], n[2], n[3]))
    if sorted(n[4] for n in servers) == list(range(S)):
        servers.sort(key=lambda n: n[4])
    for body in h.books.values():
        assert body["servers"] == [[n[1], n[2]] for n in servers]


def test_registration_refusals_keep_their_messages():
    m = Membership(make_cfg(1, 1, insecure=False), 0.0)

    def refused(identity, msg):
        actions = m.receive(identity, msg, 0.0)
        sends = [a for a in actions if isinstance(a, Send)]
        assert len(sends) == 1 and sends[0].message.kind == "error", actions
        return sends[0].message.body["message"]

    text = refused(b"x", register("worker", num_worker=3, num_server=1))
    assert "belongs to a different job: it expects 1 servers and 3 workers" in text
    text = refused(b"x", register("worker", num_worker=1, cred=""))
    assert text == "scheduler: registration without a credential"
    assert "cannot register role 'scheduler'" in refused(b"x", register("scheduler", num_worker=1))
    assert "from an unregistered node" in refused(
        b"x", Message("barrier", 1, "x", {"group": "all"})
    )
    m.receive(b"w", register("worker", num_worker=1), 0.0)
    again = m.receive(b"w", register("worker", num_worker=1), 0.0)  # a retried link's: the same
    assert not [a for a in again if isinstance(a, Send)], again
    assert "duplicate registration from worker ? (h pid 1)" in refused(
        b"w", register("worker", pid=3, num_worker=1)
    )
    text = refused(b"v", register("worker", pid=2, num_worker=1))
    assert "too many workers: worker at h pid 2 arrived but all 1 have registered" in text
    m.receive(b"s", register("server", port=7, num_worker=1), 0.0)
    assert m.ready
    assert "unexpected heartbeat2" in refused(b"s", Message("heartbeat2", 1, "x", {}))


# ---------------------------------------------------------------- barriers and joins

ops_st = st.lists(
    st.tuples(
        st.sampled_from(["barrier", "join", "ack", "finalize", "tick"]),
        st.integers(0, 7),
        st.sampled_from(sorted(GROUPS)),
    ),
    max_size=40,
)


def play(S: int, W: int, ops: list, **cfg) -> Harness:
    h = Harness(S, W, **cfg)
    h.start(
        [("server", "h", 10 + s, 1, -1) for s in range(S)]
        + [("worker", "h", 0, 10 + w, -1) for w in range(W)]
    )
    servers = [i for i, r in h.role.items() if r == "server"]
    workers = sorted((i for i, r in h.role.items() if r == "worker"), key=h.rank.get)
    for op, who, group in ops:
        if h.exits:
            break
        if op == "barrier":
            free = [i for i in h.members(group) if h.state[i] == ("free",)]
            if free:
                h.barrier(free[who % len(free)], group)
        elif op == "join":
            free = [i for i in workers if h.state[i] == ("free",)]
            if free:
                h.join(free[who % len(free)])
        elif op == "ack":
            owed = [s for s in servers if h.pending_acks.get(s)]
            if owed:
                h.ack(owed[who % len(owed)])
        elif op == "finalize":
            free = [i for i in workers if h.state[i] == ("free",)]
            if free:
                h.finalize(free[who % len(free)])
        else:
            h.tick(0.3 * who)
        h.check_settled()
    return h


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2), st.integers(1, 3), ops_st)
def test_barriers_and_joins_against_the_model(S, W, ops):
    h = play(S, W, ops)
    assert len(h.done_sent) == len(set(h.done_sent))  # each request answered once
    finished = all(h.state[i] == ("done",) for i, r in h.role.items() if r == "worker")
    assert h.exits == ([0] if finished else [])


def test_regression_finalize_completes_a_join():
    """Shrunk: worker 0 joins, the server acks, worker 1 finishes: join_done (last 0)."""
    h = play(1, 2, [("join", 0, "all"), ("ack", 0, "all"), ("finalize", 0, "all")])
    assert len(h.done_sent) == 1 and h.exits == []


def test_regression_a_joined_worker_counts_in_a_barrier_of_all():
    """Shrunk: the server waits in barrier(all); the only worker joins: the barrier is done."""
    h = play(1, 1, [("barrier", 0, "all"), ("join", 0, "all")])
    assert len(h.done_sent) == 1  # the barrier; the join still waits for the server's ack
    h.ack(next(i for i, r in h.role.items() if r == "server"))
    assert len(h.done_sent) == 2


def test_regression_a_finished_worker_fails_the_barrier_at_once():
    """The barrier's only arrival is told at once (the harness checks the error's text)."""
    h = play(1, 2, [("barrier", 0, "worker"), ("finalize", 0, "all")])
    assert all(s in (("free",), ("done",)) for s in h.state.values()), h.state
    assert h.done_sent == []


def test_barrier_round_timeout_names_the_absent():
    h = Harness(1, 2, round_timeout=5.0)
    h.start([("server", "h", 1, 1, -1), ("worker", "h", 0, 2, 0), ("worker", "h", 0, 3, 1)])
    w0 = next(i for i, r in h.rank.items() if r == 0 and h.role[i] == "worker")
    h.send(w0, "barrier", {"group": "worker"})
    actions = h.m.tick(5.1)
    errors = [a.message for a in actions if isinstance(a, Send) and a.message.kind == "error"]
    assert [e.body["message"] for e in errors] == [
        "barrier(worker) timed out after 5s (KVSTORE_ROUND_TIMEOUT): worker 1 (h pid 3) never "
        "arrived"
    ]


# ---------------------------------------------------------------- heartbeats


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 2),
    st.integers(1, 3),
    st.lists(st.tuples(st.integers(0, 4), st.floats(0, 2.0)), max_size=30),
)
def test_a_silent_node_fails_the_job_exactly_once(S, W, beats):
    h = Harness(S, W, heartbeat_timeout=3.0)
    h.start(
        [("server", "h", 10 + s, 1, -1) for s in range(S)]
        + [("worker", "h", 0, 10 + w, -1) for w in range(W)]
    )
    nodes = list(h.role)
    last = dict.fromkeys(nodes, 0.0)
    silent_seen = False
    for who, dt in beats:
        h.now += dt
        silent_seen |= any(h.now - last[i] > 3.0 for i in nodes)
        h.run(h.m.tick(h.now))
        assert h.exits == ([EXIT_PEER_LOST] if silent_seen else [])
        if not h.exits:
            node = nodes[who % len(nodes)]
            h.send(node, "heartbeat")
            last[node] = h.now
    h.run(h.m.tick(h.now + 100))  # later deadlines: only the first fails the job
    h.run(h.m.tick(h.now + 200))
    assert h.exits == [EXIT_PEER_LOST] and len(h.failed_nodes) == 1
    assert "sent no heartbeat for" in next(n.failed for n in h.m.nodes.values() if n.failed)


def test_start_up_deadline_names_who_is_missing():
    m = Membership(make_cfg(1, 2, start_timeout=4.0), 0.0)
    m.receive(b"w", register("worker"), 1.0)
    assert m.tick(3.9) == []
    actions = m.tick(4.1)
    assert actions[-1] == Exit(EXIT_PEER_LOST)
    text = actions[0].text
    assert "only 0 of 1 servers and 1 of 2 workers registered with the scheduler" in text
    assert m.tick(10.0) == []


# ---------------------------------------------------------------- stall reports


def two_workers(**cfg) -> tuple[Membership, bytes, bytes, bytes]:
    m = Membership(make_cfg(1, 2, **cfg), 0.0)
    m.receive(b"s", register("server", port=7), 0.0)
    m.receive(b"w0", register("worker", pid=1, hint=0), 0.0)
    m.receive(b"w1", register("worker", pid=2, hint=1), 0.0)
    return m, b"s", b"w0", b"w1"


def stalls(actions) -> list[tuple[bytes, str]]:
    return [
        (a.identity, a.message.body["message"])
        for a in actions
        if isinstance(a, Send) and a.message.kind == "stall"
    ]


def logged(actions) -> list[str]:
    return [a.text for a in actions if isinstance(a, Log) and a.level == logging.WARNING]


def test_a_barrier_that_waits_tells_its_workers_why_at_the_deadline_cadence():
    """KVSTORE_TIMEOUT=6: reports every 2s from the first second; logged every 60s."""
    m, _, w0, w1 = two_workers(request_timeout=6.0, stall_report=60.0)
    assert report_every(m.cfg) == 2.0
    m.receive(w1, Message("barrier", 5, "x", {"group": "worker"}), 10.0)
    m.receive(w0, Message("heartbeat", 1, "x", {}), 10.8)
    assert stalls(m.tick(10.9)) == []
    actions = m.tick(11.0)
    assert stalls(actions) == [
        (
            w1,
            "stall: barrier(worker) has waited 1s for worker 0: worker 0 is in no call the "
            "scheduler knows of, last heartbeat 0.2s ago (no deadline: set "
            "KVSTORE_ROUND_TIMEOUT to fail it)",
        )
    ]
    assert logged(actions) == []
    times = [t / 10 for t in range(111, 800)]
    sent = [t for t in times if stalls(m.tick(t))]
    assert sent[:3] == [13.0, 15.0, 17.0] and len(sent) == 34
    m.receive(w0, Message("barrier", 9, "x", {"group": "worker"}), 80.0)
    assert m.barriers == {}


def test_a_barrier_is_logged_every_stall_report_and_never_with_zero():
    m, _, w0, w1 = two_workers(request_timeout=600.0, stall_report=5.0)
    m.receive(w1, Message("barrier", 5, "x", {"group": "worker"}), 0.0)
    logs = [t for t in range(1, 30) if logged(m.tick(float(t)))]
    assert logs == [6, 11, 16, 21, 26]  # with a report (1s, then every 5s), once 5s passed
    m, _, w0, w1 = two_workers(request_timeout=6.0, stall_report=0.0)
    m.receive(w1, Message("barrier", 5, "x", {"group": "worker"}), 0.0)
    ticks = [m.tick(t / 2) for t in range(1, 60)]
    assert not any(logged(a) for a in ticks)
    assert sum(bool(stalls(a)) for a in ticks) == 15  # at 1s, then every 2s


def test_a_join_that_waits_names_the_workers_and_then_the_servers():
    m, s, w0, w1 = two_workers(request_timeout=6.0)
    m.receive(w0, Message("join", 3, "x", {}), 0.0)
    (msg,) = stalls(m.tick(1.0))
    assert msg[0] == w0
    assert msg[1].startswith("stall: join() has waited 1s for worker 1: worker 1 is in no call")
    m.receive(w1, Message("join", 4, "x", {}), 1.5)
    sent = stalls(m.tick(3.0))
    assert {i for i, _ in sent} == {w0, w1}
    assert "waited 3s for 2 acknowledgement(s) of the joins from the servers" in sent[0][1]
    m.receive(s, Message("joined_ack", 1, "x", {"rank": m.nodes[w0].rank}), 3.1)
    actions = m.receive(s, Message("joined_ack", 2, "x", {"rank": m.nodes[w1].rank}), 3.2)
    done = [a for a in actions if isinstance(a, Send) and a.message.kind == "join_done"]
    assert [(a.identity, a.message.id, a.message.body) for a in done] == [
        (w0, 3, {"last": 1}),
        (w1, 4, {"last": 1}),
    ]
    assert stalls(m.tick(20.0)) == []


def round_report(age, missing=(0,), waiting=(1,)):
    body = {
        "key": "'w'",
        "round": 3,
        "age": age,
        "missing": list(missing),
        "silent": [-1.0] * len(missing),
        "present": list(waiting),
        "waiting": list(waiting),
    }
    return Message("stalled", 1, "server", body)


def test_round_stalls_reach_the_waiting_workers_at_once_logged_every_stall_report():
    m, s, w0, w1 = two_workers(request_timeout=6.0, stall_report=10.0)
    actions = m.receive(s, round_report(1.0), 1.0)
    ((who, text),) = stalls(actions)
    assert who == w1 and text.startswith("stall: dist_sync round 3 of key 'w' on server 0")
    assert "worker 0 never pushed it, is in no call the scheduler knows of" in text
    assert logged(actions) == [] and any(isinstance(a, StallSeen) for a in actions)
    (line,) = logged(m.receive(s, round_report(10.0), 10.0))
    assert line.startswith(text.split(" has waited")[0] + " has waited 10s"), line
    assert logged(m.receive(s, round_report(12.0), 12.0)) == []
    assert stalls(m.receive(s, round_report(12.0), 12.0))
    assert logged(m.receive(s, round_report(20.0), 20.0))


def test_round_deadlock_fails_the_round_and_the_barrier():
    m, s, w0, w1 = two_workers()
    m.receive(w0, Message("barrier", 7, "x", {"group": "worker"}), 0.0)
    actions = m.receive(s, round_report(1.0), 1.0)
    sends = {(a.identity, a.message.kind) for a in actions if isinstance(a, Send)}
    assert sends == {(s, "fail_round"), (w0, "error")}
    assert m.failure.startswith("deadlock: dist_sync round 3 of key 'w' on server 0")
    assert m.doing(0) == "is in no call the scheduler knows of"
    m.receive(w0, Message("finalize", 8, "x", {}), 2.0)
    actions = m.receive(w1, Message("failed", 9, "x", {"reason": "raised"}), 2.0)
    assert actions[-1] == Exit(EXIT_FAILED)  # quietly: the deadlock was the failure


def test_snapshot_is_plain_data():
    m, s, w0, w1 = two_workers()
    m.receive(w0, Message("barrier", 7, "x", {"group": "all"}), 0.0)
    m.receive(w1, Message("join", 8, "x", {}), 0.5)
    snap = m.snapshot(1.0)
    assert snap["ready"] and snap["uptime"] == 1.0
    assert snap["barriers"] == {"all": [0]} and snap["joined"] == [1]
    by_rank = {(n["role"], n["rank"]): n for n in snap["nodes"]}
    assert by_rank["worker", 0]["in_barrier"] and by_rank["worker", 1]["joined"]
    assert by_rank["server", 0]["heartbeat_age"] == 1.0


def test_replicas_a_dead_server_is_failed_over_then_fenced_and_a_lost_part_ends_the_job():
    """KVSTORE_REPLICAS=2, S=3: chains [0,1], [1,2], [2,0]. Server 0 goes silent: a new epoch,
    not the end of the job; when it speaks again it is told it is fenced. Then server 1
    goes silent too: server 0's parts had servers 0 and 1 only, so the job ends, naming it."""
    cfg = make_cfg(3, 1, heartbeat_timeout=3.0, replicas=2)
    m = Membership(cfg, 0.0)
    nodes = {}
    for s in range(3):
        nodes[f"s{s}"] = f"s{s}".encode()
        m.receive(
            nodes[f"s{s}"], register("server", port=10 + s, hint=s, num_server=3, num_worker=1), 0.0
        )
    actions = m.receive(b"w0", register("worker", pid=5, num_server=3, num_worker=1), 0.0)
    books = [a.message.body for a in actions if isinstance(a, Send) and a.message.kind == "book"]
    assert books and all(b["replicas"] == [[0, 1], [1, 2], [2, 0]] for b in books)
    for who in (b"s1", b"s2", b"w0"):
        m.receive(who, Message("heartbeat", 0, "x"), 2.5)
    actions = m.tick(3.5)  # server 0 silent for 3.5 s
    kinds = [
        (type(a).__name__, getattr(getattr(a, "message", None), "kind", None)) for a in actions
    ]
    assert ("Broadcast", "failover") in kinds and not any(isinstance(a, Exit) for a in actions)
    failover = next(a for a in actions if isinstance(a, Broadcast)).message.body
    assert failover["epoch"] == 1 and failover["dead"] == [0]
    assert b"s0" not in m.identities()  # nothing more is sent to it
    assert m.snapshot(3.5)["failovers"][0]["server"] == 0
    fenced = m.receive(b"s0", Message("heartbeat", 0, "server"), 4.0)  # it wakes up
    assert [a.message.kind for a in fenced] == ["fenced"]
    assert "fenced" in fenced[0].message.body["reason"]
    for who in (b"s2", b"w0"):
        m.receive(who, Message("heartbeat", 0, "x"), 6.0)
    actions = m.tick(7.0)  # server 1 silent since 2.5 s: both of server 0's replicas lost
    assert any(isinstance(a, Exit) and a.status == EXIT_PEER_LOST for a in actions)
    lost = next(a for a in actions if isinstance(a, Broadcast)).message
    assert lost.kind == "node_failed" and "server 1" in lost.body["node"]
