"""Workers come and go while a job trains: joins, graceful leaves and kill -9, at random.

A ``dist_sync`` job on 127.0.0.1 with elastic workers (slots = --max, at least --min left):
every few seconds one change, chosen at random among those allowed (a join into a free slot
while fewer than --max run; a graceful leave or a SIGKILL while more than --min run). Each
worker (``tests/workers/elastic_soak.py``) pushes [1, 2**slot] into the key "tally" every
step. Checks, and prints:

- no hang: after every change, every live worker completes a step within --hang seconds;
- every round's sum is exactly the pushes of its members: the tally's count equals the number
  of slots in its set, for every step of every worker (a push counted twice or half-lost
  breaks it);
- survivors never restart or roll back: each process's steps go 0, 1, 2, ... without a gap;
- a newcomer contributes within one round: its first round's "who" holds its own slot;
- throughput: steps per second per live worker, against a run of the same length with no
  change, in the same run.

With ``--keys K`` each worker pushes K keys a step (spread over the servers), one blocking
``pushpull`` after another (Gluon's per-parameter loop), or with ``--pattern async`` a
``pushpull_async`` of each then a wait for all (Horovod's); every key's tally is checked.

    python scripts/elastic_soak.py --changes 60            # every 5-10 s, as the issue asks
    python scripts/elastic_soak.py --changes 6 --every 1,2 # a short one
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster import base_env, poll_until  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "elastic_soak.py"


class Job:
    def __init__(
        self,
        tmp: Path,
        slots: int,
        least: int,
        servers: int,
        pause: float,
        keys=1,
        pattern="blocking",
    ):
        self.tmp, self.pause, self.keys, self.pattern = tmp, pause, keys, pattern
        self.env = base_env(
            servers,
            slots,
            KVSTORE_MIN_WORKERS=least,
            KVSTORE_HEARTBEAT_TIMEOUT=2,
            KVSTORE_ROUND_TIMEOUT=0,
        )
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[int, tuple] = {}  # slot -> (process, log path)
        self.logs: list[Path] = []
        self.n = 0
        self._spawn("scheduler", [sys.executable, "-m", "kvstore.scheduler"], "scheduler")
        for i in range(servers):
            self._spawn(f"server{i}", [sys.executable, "-m", "kvstore.server"], "server")

    def _spawn(self, name, argv, role, **extra):
        log = self.tmp / f"{name}-{self.n}.log"
        self.n += 1
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv,
                env=dict(self.env, DMLC_ROLE=role, **extra),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.tmp,
            )
        self.procs.append(proc)
        return proc, log

    def join(self, slot: int) -> None:
        proc, log = self._spawn(
            f"worker{slot}",
            [sys.executable, str(WORKER), str(self.pause), str(self.keys), self.pattern],
            "worker",
            KVSTORE_RANK=str(slot),
        )
        self.workers[slot] = (proc, log)
        self.logs.append(log)

    def leave(self, slot: int) -> None:
        (self.tmp / f"leave-{slot}").touch()
        proc, _ = self.workers.pop(slot)
        proc.wait(30)
        (self.tmp / f"leave-{slot}").unlink()

    def kill(self, slot: int) -> None:
        proc, _ = self.workers.pop(slot)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def steps(self, slot: int) -> int:
        text = self.workers[slot][1].read_text(errors="replace")
        return len(re.findall(r"^step ", text, re.M))

    def stop(self) -> None:
        (self.tmp / "stop").touch()
        for proc, _ in list(self.workers.values()):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:  # by PID, whatever happened
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def progress(job: Job, hang: float) -> str:
    """'' once every live worker made a step after now, else who did not."""
    before = {slot: job.steps(slot) for slot in job.workers}
    ok = poll_until(lambda: all(job.steps(s) > before[s] for s in before), hang, 0.1)
    if ok:
        return ""
    return ", ".join(f"slot {s}" for s in before if job.steps(s) <= before[s])


def check(logs: list[Path]) -> tuple[list[str], float, int]:
    """(problems, steps per second per worker, rounds seen)."""
    problems, rates, rounds = [], [], 0
    for log in logs:
        text = log.read_text(errors="replace")
        start = re.search(r"start slot (\d+) pid \d+ late (\d)", text)
        lines = re.findall(
            r"^step (\d+) count (\S+) who (\d+) workers \d+ epoch \d+ t (\S+)(.*)$", text, re.M
        )
        if start is None:
            problems.append(f"{log.name}: never started")
            continue
        slot, late = int(start[1]), start[2] == "1"
        steps = [int(line[0]) for line in lines]
        if steps != list(range(len(steps))):
            problems.append(f"{log.name}: steps not 0..n in order (a restart or a gap)")
        for s, count, who, _, more in lines:
            rounds += 1
            tallies = [(count, who)] + re.findall(r"(\S+)/(\d+)", more)
            for k, (count, who) in enumerate(tallies):
                if bin(int(who)).count("1") != float(count):
                    problems.append(
                        f"{log.name} step {s} key {k}: count {count} but who {int(who):b}"
                    )
        if late and lines and not int(lines[0][2]) >> slot & 1:
            problems.append(f"{log.name}: a newcomer's first round lacks its own push")
        if len(lines) > 10:
            times = [float(line[3]) for line in lines]
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    rate = sum(rates) / len(rates) if rates else 0.0
    return problems, rate, rounds


def run(args, changes: int, seed: int) -> tuple[list[str], float, int, int]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(Path(tmp), args.max, args.min, args.servers, args.pause, args.keys, args.pattern)
        problems: list[str] = []
        try:
            for slot in range(args.start):
                job.join(slot)
            stuck = progress(job, 60)
            if stuck:
                return [f"start: no step from {stuck}"], 0.0, 0, 0
            done = 0
            low, high = args.every
            while done < changes:
                time.sleep(rng.uniform(low, high))
                live = sorted(job.workers)
                free = [s for s in range(args.max) if s not in job.workers]
                moves = []
                if free:
                    moves.append("join")
                if len(live) > args.min:
                    moves += ["leave", "kill"]
                move = rng.choice(moves)
                slot = rng.choice(free if move == "join" else live)
                getattr(job, move)(slot)
                done += 1
                print(f"change {done}: {move} slot {slot} ({len(job.workers)} workers)", flush=True)
                stuck = progress(job, args.hang)
                if stuck:
                    problems.append(
                        f"change {done} ({move} slot {slot}): HANG, no step from {stuck}"
                    )
                    for log in sorted(job.tmp.glob("*.log")):  # what they said, for the report
                        tail = log.read_text(errors="replace").splitlines()[-6:]
                        problems.append(f"--- {log.name}\n" + "\n".join(tail))
                    break
        finally:
            job.stop()
        found, rate, rounds = check(job.logs)
        return problems + found, rate, rounds, done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=60)
    parser.add_argument("--every", default="5,10", help="seconds between changes: LOW,HIGH")
    parser.add_argument("--min", type=int, default=2)
    parser.add_argument("--max", type=int, default=6)
    parser.add_argument("--start", type=int, default=4, help="workers at the start")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--pause", type=float, default=0.05, help="seconds a step computes")
    parser.add_argument("--keys", type=int, default=1, help="keys pushed a step, in turn")
    parser.add_argument("--pattern", default="blocking", choices=["blocking", "async"])
    parser.add_argument("--hang", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    args.every = tuple(float(x) for x in args.every.split(","))
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"seed {seed}", flush=True)
    started = time.monotonic()
    problems, rate, rounds, done = run(args, args.changes, seed)
    took = time.monotonic() - started
    # the same length of time with no change, for the throughput per live worker
    args_still = argparse.Namespace(**vars(args))
    base_problems, base_rate, _, _ = run_still(args_still, took, seed)
    for p in problems + base_problems:
        print(p)
    print(
        f"{done} changes in {took:.0f}s, {rounds} worker-rounds checked, "
        f"{len(problems)} problem(s); steps/s per live worker {rate:.2f} with changes, "
        f"{base_rate:.2f} without ({rate / base_rate if base_rate else 0:.2f}x)"
    )
    return 0 if not problems and not base_problems else 1


def run_still(args, seconds: float, seed: int) -> tuple[list[str], float, int, int]:
    """The job with no change for ``seconds``: the throughput to compare with."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(Path(tmp), args.max, args.min, args.servers, args.pause, args.keys, args.pattern)
        try:
            for slot in range(args.start):
                job.join(slot)
            progress(job, 60)
            time.sleep(min(seconds, 600))
        finally:
            job.stop()
        found, rate, rounds = check(job.logs)
        return found, rate, rounds, 0


if __name__ == "__main__":
    sys.exit(main())
