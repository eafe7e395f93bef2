"""Replicated key parts (KVSTORE_REPLICAS=2), checked two ways.

**The rules, without processes.** A model network carries messages between W workers, a
primary P and its backup B, each server driving the same sans-I/O machines the real server
drives (``Rounds``, ``replication.Primary``/``Backup``), in the same order as ``server.py``
does. Hypothesis picks every step: which channel delivers its next message (channels are FIFO,
as a ZeroMQ connection is, and otherwise delayed and interleaved at will), when a worker sends
its next request (up to two in flight), when a server crashes (everything in flight to or
from it is lost), and when each survivor hears of the failover (a worker re-sends every
unanswered request to B, which holds back requests from an epoch it has not heard of yet).
Re-sent requests duplicate pushes that B may already hold. At the end: every worker finished
every round (nothing hangs); the surviving replica applied each round exactly once, with the
exact sum (none lost, none twice); replicas that both lived hold the same history; every
answer a worker got shows a round at least as new as its own push.

**The real thing.** W=4, S=3, R=2 ``dist_sync`` jobs with SGD momentum and Adam, a random
server killed (SIGKILL) or frozen (SIGSTOP, thawed once replaced: it is fenced) at a random
moment, seed printed: the final weights are bit-identical to a run without a failure. A
``dist_async`` job with a server killed: every acknowledged push is in the final counters
exactly once. Both replicas of one part killed: a clear error, no hang.
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvstore.replication import Backup, Primary
from kvstore.rounds import Apply, Fail, Reply, Rounds

from .cluster import ROOT, Cluster, poll_until, started_pids

KEY = ("w", 0)


def grad(rank: int, round_: int) -> np.ndarray:
    return np.array([1000.0 * round_ + 2.0**rank])


def round_sum(W: int, round_: int) -> float:
    return float(sum(grad(r, round_)[0] for r in range(W)))


class Req:
    """A request as a server holds it (rounds.py keeps requests opaque)."""

    def __init__(self, rank: int, msg_id: int):
        self.rank, self.id = rank, msg_id


class ModelServer:
    """One server as server.py drives it, for the one key KEY whose home is server 0."""

    def __init__(self, rank: int, W: int, net):
        self.rank, self.W, self.net = rank, W, net
        self.rounds = Rounds(W, 0)
        self.primary, self.backup = Primary(), Backup()
        self.history: list[float] = []  # the values applied, in order
        self.targets: list[int] = [1] if rank == 0 else []
        self.epoch = 0
        self.dead = False
        self.deferred: list = []
        self.pusher = None
        if rank == 0:
            self.rounds.add_key(KEY)
        else:
            self.backup.hold(KEY, 0, None, acting=False)

    def receive(self, src, msg) -> None:
        kind = msg[0]
        if kind == "push":
            _, rank, msg_id, value, resend, epoch = msg
            if epoch > self.epoch:  # a failover this server has not heard of yet
                self.deferred.append((src, msg))
                return
            grads, held = [(KEY, value)], 0
            if resend and self.backup.duplicate(KEY, rank, msg_id):
                grads, held = [], 1
                event("a re-sent push already held")
            self.pusher = (rank, msg_id)
            if self.targets:
                self.primary.pushed(KEY, rank, self.rounds.keys[KEY].pushed[rank], msg_id)
            self.execute(self.rounds.push(Req(rank, msg_id), rank, grads, True, 0.0, None, held))
        elif kind == "replica":
            _, seq, entries = msg
            for accumulate, held, value in entries:
                self.history.append(value)
                self.backup.received(KEY, accumulate, held)
            self.net.send(self.rank, src, ("ack", seq))
        elif kind == "ack":
            for request in self.primary.ack(src, msg[1]):
                self.answer(request)

    def execute(self, actions) -> None:
        entries, answers = [], []
        for action in actions:
            if isinstance(action, Apply):
                value = float(action.value[0])
                self.history.append(value)
                if self.targets:
                    held = self.primary.applied(KEY, action.accumulate, self.pusher)
                    entries.append((action.accumulate, held, value))
            elif isinstance(action, Reply):
                answers.append(action.request)
            elif isinstance(action, Fail):
                raise AssertionError(f"a request failed: {action.text}")
        if entries:
            for backup in self.targets:
                seq = self.primary.forwarded(backup, [KEY])
                self.net.send(self.rank, backup, ("replica", seq, entries))
        for request in answers:
            for ready in self.primary.answer(request, [KEY]):
                self.answer(ready)

    def answer(self, request: Req) -> None:
        self.net.send(self.rank, ("w", request.rank), ("reply", request.id, self.history[-1]))

    def failover(self, dead: int) -> None:
        self.epoch = 1
        if dead == 0:  # this backup answers for the key now
            for key, members, rounds, _ in self.backup.take_over({0}):
                self.rounds.add_key(key, members, rounds)
                self.primary.start(key, rounds)
        else:  # the backup died: nobody waits for it
            self.targets = []
            for request in self.primary.drop(dead):
                self.answer(request)
        deferred, self.deferred = self.deferred, []
        for src, msg in deferred:
            self.receive(src, msg)


class ModelWorker:
    def __init__(self, rank: int, rounds: int, net):
        self.rank, self.rounds, self.net = rank, rounds, net
        self.next_round = 0
        self.ids = iter(range(1, 10**6))
        self.unanswered: dict[int, tuple] = {}  # id -> (round, message)
        self.answers: list[tuple] = []  # (round pushed, value seen)
        self.server, self.epoch = 0, 0

    def can_send(self) -> bool:
        return self.next_round < self.rounds and len(self.unanswered) < 2

    def send_next(self) -> None:
        msg_id = next(self.ids)
        n = self.next_round
        self.next_round += 1
        msg = ("push", self.rank, msg_id, grad(self.rank, n), False, self.epoch)
        self.unanswered[msg_id] = (n, msg)
        self.net.send(("w", self.rank), self.server, msg)

    def receive(self, src, msg) -> None:
        _, msg_id, value = msg
        n, _ = self.unanswered.pop(msg_id)
        self.answers.append((n, value))

    def failover(self, dead: int) -> None:
        self.epoch = 1
        if dead != self.server:
            return
        self.server = 1
        for msg_id in sorted(self.unanswered):
            n, old = self.unanswered[msg_id]
            again = ("push", self.rank, msg_id, old[3], True, self.epoch)
            self.unanswered[msg_id] = (n, again)
            self.net.send(("w", self.rank), self.server, again)


class Network:
    """FIFO channels between endpoints; a crashed server's channels lose what they carry."""

    def __init__(self):
        self.channels: dict[tuple, deque] = {}
        self.nodes: dict = {}
        self.down: set = set()

    def send(self, src, dst, msg) -> None:
        if src in self.down or dst in self.down:
            return
        self.channels.setdefault((src, dst), deque()).append(msg)

    def busy(self) -> list[tuple]:
        return sorted((c for c, q in self.channels.items() if q), key=repr)

    def deliver(self, channel: tuple) -> None:
        src, dst = channel
        msg = self.channels[channel].popleft()
        if dst not in self.down:
            self.nodes[dst].receive(src, msg)

    def crash(self, server: int) -> None:
        self.down.add(server)
        for (src, dst), waiting in self.channels.items():
            if server in (src, dst):
                waiting.clear()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    W=st.integers(1, 3),
    rounds=st.integers(1, 4),
    crash=st.sampled_from([None, 0, 1]),
    data=st.data(),
)
def test_no_acknowledged_round_is_lost_or_applied_twice(W, rounds, crash, data):
    net = Network()
    servers = [ModelServer(0, W, net), ModelServer(1, W, net)]
    workers = [ModelWorker(r, rounds, net) for r in range(W)]
    net.nodes = {0: servers[0], 1: servers[1], **{("w", r): w for r, w in enumerate(workers)}}
    crash_at = data.draw(st.integers(0, 40), label="crash at step") if crash is not None else -1
    told: set = set()  # who has heard of the failover
    survivors = [s for s in (0, 1) if s != crash] + [("w", r) for r in range(W)]
    step = 0
    while True:
        choices = [("deliver", c) for c in net.busy()]
        choices += [("send", r) for r, w in enumerate(workers) if w.can_send()]
        if crash is not None and step >= crash_at and crash not in net.down:
            choices = [("crash", crash)]
        elif net.down:
            choices += [("tell", who) for who in survivors if who not in told]
        if not choices:
            break
        kind, what = (
            data.draw(st.sampled_from(choices), label="event") if step < 200 else choices[0]
        )
        step += 1
        assert step < 5000, "the model never settles"
        if kind == "deliver":
            net.deliver(what)
        elif kind == "send":
            workers[what].send_next()
        elif kind == "crash":
            net.crash(what)
        else:
            told.add(what)
            net.nodes[what].failover(crash)
    sums = [round_sum(W, n) for n in range(rounds)]
    for w in workers:  # nothing hangs: every round answered
        assert w.next_round == rounds and not w.unanswered, (w.rank, w.unanswered)
        for n, value in w.answers:  # an answer shows the worker's own push
            assert value in sums[n:], (w.rank, n, value, sums)
    acting = servers[1] if crash == 0 else servers[0]
    assert acting.history == sums  # each round once, with its exact sum
    if crash is None:
        assert servers[1].history == servers[0].history


# ---------------------------------------------------------------- real processes


def _hashes(cluster: Cluster, W: int) -> set:
    found = set()
    for i in range(W):
        match = re.search(r"weights (\w+)", cluster.output(f"worker{i}"))
        found.add(match[1] if match else None)
    return found


def _run(
    tmp, opt: str, call: str, steps: int, fault=None, seed=0, script="replicated.py", replicas=2
) -> tuple[set, str]:
    """A W=4, S=3 job; ``fault``: "kill" or "freeze" a random server at a random step."""
    W, S = 4, 3
    tmp.mkdir()
    # keys "b" and "big" are split over every server: every server holds parts
    cluster = Cluster(S, W, tmp, KVSTORE_REPLICAS=replicas, KVSTORE_BIGARRAY_BOUND=1000)
    try:
        procs = cluster.start_workers(script, [steps, opt, call])
        note = ""
        if fault:
            rng = random.Random(seed)
            victim, at = rng.randrange(S), rng.randrange(1, steps - 2)
            note = f"seed {seed}: {fault} server{victim} at step {at}"
            print(note, flush=True)
            cluster.wait_for_output(f"worker{rng.randrange(W)}", f"step {at} at", 60)
            proc = cluster.procs[f"server{victim}"]
            proc.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            if fault == "freeze":
                assert poll_until(lambda: "failover" in cluster.output("scheduler"), 30)
                proc.send_signal(signal.SIGCONT)  # replaced: it must be fenced and exit
                assert proc.wait(30) != 0, cluster.dump()
                assert "fenced" in cluster.output(f"server{victim}"), cluster.dump()
        codes = cluster.wait(procs, 120)
        assert codes == [0] * W, f"{note}\n{cluster.dump()}"
        if fault:
            assert "failover to epoch 1" in cluster.output("scheduler"), cluster.dump()
        return _hashes(cluster, W), note
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "opt,call,fault",
    [("sgd", "pushpull", "kill"), ("adam", "push", "freeze"), ("bmuf", "2bit", "kill")],
)
def test_a_server_dies_and_the_weights_are_bit_identical(tmp_path, opt, call, fault):
    seed = int.from_bytes(os.urandom(4), "little")
    clean, _ = _run(tmp_path / "clean", opt, call, 24)
    assert len(clean) == 1 and None not in clean, clean
    failed, note = _run(tmp_path / "failed", opt, call, 24, fault, seed)
    assert failed == clean, f"{note}: the weights differ from the run without a failure"


@pytest.mark.parametrize(
    "opt,call,fault",
    [("none", "pushpull", "kill"), ("adam", "push", "freeze"), ("sgd", "pushpull", "kill")],
)
def test_row_sparse_keys_survive_a_server_s_death_bit_for_bit(tmp_path, opt, call, fault):
    """Row-sparse keys (hash and range sharded) beside a dense one: the rows stored and the
    optimizer state after a server was killed or frozen at a random step are the bits of a
    job that ran without replicas and without a failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    script = "replicated_rows.py"
    plain, _ = _run(tmp_path / "plain", opt, call, 20, script=script, replicas=1)
    assert len(plain) == 1 and None not in plain, plain
    failed, note = _run(tmp_path / "failed", opt, call, 20, fault, seed, script)
    assert failed == plain, f"{note}: the rows differ from the run without replicas"


def test_async_every_acknowledged_push_counts_once(tmp_path):
    """dist_async with counters: W workers each push +1 to every key N times; a server is
    killed half way. Every push was acknowledged (the workers ran to the end), so every
    counter must be exactly W * N."""
    W, S, N = 3, 3, 40
    cluster = Cluster(S, W, tmp_path, KVSTORE_REPLICAS=2)
    try:
        procs = cluster.start_workers("replicated_async.py", [N])
        cluster.wait_for_output("worker0", "pushed 10", 60)
        cluster.procs[f"server{random.randrange(S)}"].send_signal(signal.SIGKILL)
        codes = cluster.wait(procs, 120)
        assert codes == [0] * W, cluster.dump()
        for i in range(W):
            assert f"counters {W * N}" in cluster.output(f"worker{i}"), cluster.dump()
    finally:
        cluster.stop()


def test_both_replicas_of_a_part_lost_is_a_clear_error(tmp_path):
    W, S = 2, 3
    cluster = Cluster(S, W, tmp_path, KVSTORE_REPLICAS=2)
    try:
        procs = cluster.start_workers("replicated.py", [400, "none", "pushpull"])
        cluster.wait_for_output("worker0", "step 3 at", 60)
        cluster.procs["server0"].send_signal(signal.SIGKILL)
        assert poll_until(lambda: "failover" in cluster.output("scheduler"), 30), cluster.dump()
        for i in (1, 2):  # one of them holds server0's parts now: both are lost
            cluster.procs[f"server{i}"].send_signal(signal.SIGKILL)
        codes = cluster.wait(procs, 60)
        assert all(code != 0 for code in codes), cluster.dump()
        said = cluster.output("worker0")
        assert "sent no heartbeat" in said and "failed" in said, cluster.dump()
    finally:
        cluster.stop()


def test_launch_with_replicas_goes_on_when_a_server_is_killed(tmp_path):
    """As a user runs it: ``launch.py --replicas 2``; a server is killed half way through
    (by its pid, from the launcher's "started" line); the job ends 0, says what happened,
    and both workers end with the same weights."""
    env = dict(os.environ, KVSTORE_HEARTBEAT_TIMEOUT="2", KVSTORE_BIGARRAY_BOUND="1000")
    script = ROOT / "tests" / "workers" / "replicated.py"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "-n", "2", "-s", "2", "--replicas", "2"]
        + [sys.executable, str(script), "40", "sgd", "pushpull"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not any("[worker 0] step 5 " in line for line in seen):
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, "".join(seen)
            try:
                seen.append(lines.get(timeout=min(left, 1)))
            except queue.Empty:
                continue
        os.kill(started_pids("".join(seen))["server 1"], signal.SIGKILL)
        assert proc.wait(timeout=90) == 0, "".join(seen)
        reader.join(5)
        while not lines.empty():
            seen.append(lines.get())
        out = "".join(seen)
        assert "server 1 on localhost" in out and "its replicas go on" in out, out
        weights = set(re.findall(r"weights (\w+)", out))
        assert len(weights) == 1 and out.count(" weights ") == 2, out
    finally:
        if proc.poll() is None:  # SIGTERM: the launcher stops everything it started
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def test_only_a_proved_server_can_forward(tmp_path):
    """A worker of the job posing as server 1 on server 0's replication link (no proof, or
    its own token) is refused; server 1 is then killed, and server 0's copies, which the job
    reads from then on, hold the exact values."""
    cluster = Cluster(2, 2, tmp_path, KVSTORE_REPLICAS=2, KVSTORE_HEARTBEAT_TIMEOUT=2)
    try:
        procs = cluster.start_workers("replica_impostor.py")
        cluster.wait_for_output("worker1", "ready for the kill", 60)
        said = cluster.output("worker1")
        assert said.count(": refused") == 3 and "ACCEPTED" not in said, cluster.dump()
        assert said.count("link not proved") == 2, said
        cluster.procs["server1"].send_signal(signal.SIGKILL)
        assert cluster.wait(procs, 60) == [0, 0], cluster.dump()
        assert all("OK" in cluster.output(f"worker{i}") for i in range(2)), cluster.dump()
    finally:
        cluster.stop()


def test_resuming_from_saved_optimizer_state_survives_a_failover(tmp_path):
    """load_optimizer_states reaches every replica of a part (through its primary, in order
    with the rounds): a job resumed from a checkpoint
    (weights and SGD momentum) ends with the same bits whether or not a server is killed
    after the load."""
    W, S = 2, 3
    saved = tmp_path / "ckpt"
    saved.mkdir()

    def job(name, phase, kill):
        (tmp_path / name).mkdir()
        cluster = Cluster(S, W, tmp_path / name, KVSTORE_REPLICAS=2, KVSTORE_BIGARRAY_BOUND=1000)
        try:
            procs = cluster.start_workers("replicated_resume.py", [phase, saved, 12])
            if kill:
                cluster.wait_for_output("worker0", "step 2 at", 60)
                cluster.procs["server1"].send_signal(signal.SIGKILL)
            assert cluster.wait(procs, 120) == [0] * W, cluster.dump()
            return _hashes(cluster, W)
        finally:
            cluster.stop()

    job("save", "save", False)
    clean = job("clean", "resume", False)
    failed = job("failed", "resume", True)
    assert len(clean) == 1 and None not in clean and failed == clean, (clean, failed)
