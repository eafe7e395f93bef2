"""Supervise the processes of a job: start them, prefix their output, wait, stop them all.

Each process is started in its own session, its output read line by line and written with
its name in front (``[worker 0] epoch 1 ...``). The first process to exit non-zero (in the
order the processes end) brings the job down: the others are stopped and the launcher exits
with that status, saying which process failed and how. Once every worker has exited 0, the
scheduler and servers get a moment to end by themselves (they do once the workers closed their
stores); any still running then are stopped and the job ends with status 0, with a warning
when the scheduler was still waiting (no worker created a distributed store). Ctrl-C (or
SIGTERM) stops every process the launcher started.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from ..errors import EXIT_PEER_LOST


@dataclass
class Proc:
    name: str  # "worker 0"
    argv: list[str]
    env: dict | None = None
    where: str = "localhost"
    role: str = ""  # "scheduler", "server", "worker"; "" for one process of many tasks (mpirun)
    prefixed: bool = False  # output already carries role names (mpirun, srun, ...)
    stdin: bytes = b""  # written to the process's stdin first (ssh: the job secret)
    popen: subprocess.Popen | None = field(default=None, repr=False)
    last_lines: list = field(default_factory=list, repr=False)
    retired: bool = False  # stopped by the launcher (its host left, or the job ended)
    kill_at: float = 0.0  # retired: when it is killed if SIGTERM has not ended it (0: never)
    reader: threading.Thread | None = field(default=None, repr=False)  # relays its output

    def holds_on(self) -> bool:
        """Whether it runs, or something of its group still holds its output (a child)."""
        return self.popen.poll() is None or (self.reader is not None and self.reader.is_alive())


class Supervisor:
    # After the last worker exits 0, how long the scheduler and servers get to end themselves.
    # They normally end within a fraction of a second; a scheduler still running then was
    # never joined by any worker.
    after_workers_grace = 2.0
    # After an elastic job's scheduler ended it (every worker present finished), how long a
    # worker still running gets to exit by itself: one started in a freed slot too late
    # waits for a scheduler that is gone, while one that closed its store may still be
    # saving what it trained (long enough for that, short of the newcomer's own 65 s).
    after_job_grace = 30.0
    # How long a process the launcher stops gets between SIGTERM and SIGKILL: a frozen one
    # (SIGSTOP, a hung syscall) never acts on SIGTERM.
    stop_grace = 5.0
    # After the first failure, how long the others get to fail on their own (so that a cause
    # slower to exit than what it caused is still named): half the scheduler's rule for a
    # closed connection (dead after two heartbeat intervals), so the job is stopped before
    # that rule reports again a process that failed with its own error ("node failed")
    failure_window = 1.0

    def __init__(self, out=None):
        self.out = out or sys.stdout
        # the job's settings (an ssh process's environment lives in its remote command):
        # a worker's failure does not end an elastic job, nor a server's a replicated one
        self.elastic = self.replicated = False
        # --host-discovery-script: (discover() -> hosts, make(rank, host) -> Proc, MAX workers)
        self.discovery = None
        self._hosts: list = []
        self._cooling: dict = {}  # host name -> until when it gets no new worker
        self._host_failures: dict = {}  # host name -> when its workers failed, recently
        self._next_look = 0.0
        self.procs: list[Proc] = []
        self.lock = threading.Lock()
        self.readers: list[threading.Thread] = []
        self.exits: queue.Queue = queue.Queue()

    def say(self, text: str) -> None:
        with self.lock:
            self.out.write(f"launch: {text}\n")
            self.out.flush()

    def start(self, proc: Proc) -> None:
        try:
            proc.popen = subprocess.Popen(
                proc.argv,
                env=proc.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise RuntimeError(
                f"cannot start {proc.name} ({proc.argv[0]}): {exc.strerror}"
            ) from None
        if proc.stdin:
            try:
                proc.popen.stdin.write(proc.stdin)
                proc.popen.stdin.flush()
            except OSError:  # it exited at once (ssh could not connect): its exit says why
                pass
        self.procs.append(proc)
        self.say(f"started {proc.name} on {proc.where} (pid {proc.popen.pid})")
        proc.reader = threading.Thread(target=self._relay, args=(proc,), daemon=True)
        proc.reader.start()
        self.readers.append(proc.reader)

    def _relay(self, proc: Proc) -> None:
        for raw in proc.popen.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            proc.last_lines = (proc.last_lines + [line])[-5:]
            with self.lock:
                self.out.write(f"{line}\n" if proc.prefixed else f"[{proc.name}] {line}\n")
                self.out.flush()
        proc.popen.wait()
        self.exits.put(proc)  # in the order the processes ended

    def wait(self, timeout: float | None = None) -> int:
        """Wait for every process; the first failure stops the rest. Returns the exit status
        (after Ctrl-C, 130, with SIGINT ignored from then on)."""
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        deadline = None if timeout is None else time.monotonic() + timeout
        ended: list[Proc] = []
        grace_end = None  # set once every worker has exited 0
        restarts: list = []  # elastic jobs: (when, worker) to start again
        failures: dict = {}  # elastic jobs: worker name -> when it failed, recently
        aside: list[Proc] = []  # elastic jobs: workers whose slot failed too often
        done_at = None  # elastic jobs: when the scheduler ended the job
        try:
            while len(ended) < len(self.procs) or restarts:
                now = time.monotonic()
                if self.discovery is not None and now >= self._next_look:
                    self._next_look = now + 2.0
                    self._follow_hosts(now)
                for when, old in [r for r in restarts if r[0] <= now]:
                    restarts.remove((when, old))
                    others = [w for w in self._latest_workers() if w is not old]
                    if self._job_done():
                        self.say(f"the job has finished: {old.name} is not started again")
                        continue
                    if others and all(w.popen.poll() == 0 for w in others):
                        return self._end_after_last_failed(old)
                    self.start(dataclasses.replace(old, popen=None, last_lines=[]))
                if done_at is not None and now > done_at + self.after_job_grace:
                    done_at = None
                    self._stop_latecomers()
                self._kill_overdue(now)
                if deadline is not None and now > deadline:
                    self.say(f"job still running after {timeout:g}s; stopping it")
                    self.stop()
                    return 124
                if grace_end is not None and now > grace_end:
                    self._stop_after_workers([p for p in self.procs if p not in ended])
                    return self._aside_status(aside)
                try:
                    proc = self.exits.get(timeout=0.1)
                except queue.Empty:
                    continue
                ended.append(proc)
                if proc.retired:
                    continue
                if self.elastic and proc.role == "scheduler" and proc.popen.returncode == 0:
                    done_at = now  # every worker present finished: the job is done
                    continue
                if (
                    proc.popen.returncode
                    and self.elastic
                    and self.discovery is not None
                    and proc.role == "worker"
                ):
                    self._host_failed(proc, now)  # its slot is filled at the next look
                    continue
                if proc.popen.returncode and self.elastic and proc.role == "worker":
                    alike = self._failed_alike()
                    if alike is not None:
                        self.say(
                            f"{proc.name} on {proc.where} {_describe(proc.popen.returncode)}: "
                            f'every worker failed the same way ("{alike}"), so would its '
                            "replacement: stopping the job"
                        )
                        self.stop()
                        return _status(proc.popen.returncode)
                    recent = [t for t in failures.get(proc.name, []) if t > now - 60] + [now]
                    failures[proc.name] = recent
                    if len(recent) >= 3:
                        self.say(
                            f"{proc.name} on {proc.where} {_describe(proc.popen.returncode)}, "
                            f"its third failure in 60s: its slot is set aside (the others go on)"
                        )
                        aside.append(proc)
                        if {p.name for p in aside} >= {w.name for w in self._latest_workers()}:
                            self.say("every worker slot is set aside: stopping the job")
                            self.stop()
                            return _status(proc.popen.returncode)
                    elif (others := [w for w in self._latest_workers() if w is not proc]) and all(
                        w.popen.poll() == 0 for w in others
                    ):
                        return self._end_after_last_failed(proc)
                    else:
                        going = any(w.popen.poll() is None for w in self._latest_workers())
                        self.say(
                            f"{proc.name} on {proc.where} {_describe(proc.popen.returncode)}; "
                            f"{'the others go on, and ' if going else ''}a new one takes its "
                            "slot in 1s"
                        )
                        restarts.append((now + 1.0, proc))
                    continue
                if proc.popen.returncode and self.replicated and proc.role == "server":
                    # its replicas answer for its keys; the scheduler ends the job if not
                    self.say(
                        f"{proc.name} on {proc.where} {_describe(proc.popen.returncode)}; "
                        "its replicas go on (KVSTORE_REPLICAS)"
                    )
                    continue
                if proc.popen.returncode:  # the first to fail is the cause, or one of them
                    cause = self._report_failures(proc)
                    self.stop()
                    # the cause's status (a worker's own error: 1), not that of a process that
                    # merely lost it (129) and happened to exit first
                    return _status(cause.popen.returncode)
                workers = self._latest_workers()
                if (
                    grace_end is None
                    and workers
                    and not restarts
                    and all(w in ended for w in workers)
                ):
                    grace_end = time.monotonic() + self.after_workers_grace
            self._drain()
            return self._aside_status(aside)
        except KeyboardInterrupt as exc:  # Ctrl-C: 130; SIGTERM: 143, as a shell says
            # a second one (Ctrl-C pressed twice): the stop goes on, bounded by stop_grace,
            # with no traceback; SIGINT stays ignored after (the launcher is ending: its
            # timeline merge, its exit)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            terminated = isinstance(exc, _Terminated)
            self.say(f"{'terminated' if terminated else 'interrupted'}; stopping every process")
            self.stop()
            return 143 if terminated else 130
        finally:
            signal.signal(signal.SIGTERM, previous)

    # ---- --host-discovery-script (elastic jobs over ssh)
    def _follow_hosts(self, now: float) -> None:
        """Look at the discovered hosts: stop the workers of hosts that left, start workers
        in free slots on hosts with room (not those cooling down after failures)."""
        discover, make, slots = self.discovery
        try:
            hosts = discover()
        except ValueError as exc:
            self.say(f"{exc}; keeping the hosts seen before")
            return
        names = {h.name for h in hosts}
        if [h.name for h in hosts] != [h.name for h in self._hosts]:
            self.say(f"hosts now: {', '.join(f'{h.name}:{h.slots}' for h in hosts) or 'none'}")
        self._hosts = hosts
        latest = self._latest_workers()
        running = [p for p in latest if p.popen.poll() is None]
        for proc in running:
            if proc.where not in names:
                self.say(f"host {proc.where} left: stopping {proc.name}")
                self._retire(proc)
        used: dict = {}
        for proc in running:
            if not proc.retired:
                used[proc.where] = used.get(proc.where, 0) + 1
        # a slot whose worker finished (exited 0) stays its: a new worker there would join
        # mid-job, or come after the job ended and fail it (the launcher stops it)
        finished = {p.name for p in latest if p.popen.poll() == 0 and not p.retired}
        taken = {p.name for p in running if not p.retired} | finished
        free = [] if self._job_done() else [r for r in range(slots) if f"worker {r}" not in taken]
        for host in hosts:
            if self._cooling.get(host.name, 0) > now:
                continue
            while free and used.get(host.name, 0) < host.slots:
                rank = free.pop(0)
                used[host.name] = used.get(host.name, 0) + 1
                self.start(make(rank, host))

    def _host_failed(self, proc: Proc, now: float) -> None:
        recent = [t for t in self._host_failures.get(proc.where, []) if t > now - 60] + [now]
        self._host_failures[proc.where] = recent
        note = ""
        if len(recent) >= 3:
            self._cooling[proc.where] = now + 60
            self._host_failures[proc.where] = []
            note = f"; host {proc.where} failed three times in 60s: no new worker there for 60s"
        self.say(
            f"{proc.name} on {proc.where} {_describe(proc.popen.returncode)}; the others go on"
            + note
        )

    def _aside_status(self, aside: list[Proc]) -> int:
        """0; or, in an elastic job, the status of the first worker slot set aside, or of
        the first worker when every slot's last process failed (each told the scheduler it
        finished, and the scheduler ended the job as done)."""
        if aside:
            names = ", ".join(p.name for p in aside)
            self.say(f"the others finished, but {names} failed three times in 60s (set aside)")
            return _status(aside[0].popen.returncode)
        if not self.elastic:
            return 0
        # each slot by its last process the launcher did not stop: a newcomer stopped after
        # the job ended (it never joined) neither fails its slot nor hides its failure
        ran = {p.name: p for p in self.procs if p.role == "worker" and not p.retired}
        if ran and all(p.popen.returncode for p in ran.values()):
            self.say("every worker's last process failed: the job failed")
            return _status(next(iter(ran.values())).popen.returncode)
        return 0

    def _failed_alike(self) -> str | None:
        """The last line every worker slot's latest process ended with, when two or more
        slots have no process running, each exited with the same failing status and that
        same line (a bug in the script, the same everywhere: the replacements would fail
        alike); else None."""
        latest = self._latest_workers()
        # each exited with the same status, not killed (a signal is not the script's doing)
        ends = {(p.popen.poll(), p.last_lines[-1] if p.last_lines else None) for p in latest}
        if len(latest) < 2 or len(ends) != 1:
            return None
        code, line = ends.pop()
        if code is None or code <= 0 or line is None or line.startswith("killed by SIG"):
            return None  # (over ssh a signal comes as 128 + N, said by ssh._WATCH)
        return line

    def _job_done(self) -> bool:
        """An elastic job's scheduler ended it: every worker present had finished."""
        return any(p.role == "scheduler" and p.popen.poll() == 0 for p in self.procs)

    def _stop_latecomers(self) -> None:
        """Workers still running a while after the scheduler ended the job (started in a
        freed slot after the others finished) find no job to join: stop them, not to fail
        later for want of a scheduler."""
        for proc in self._latest_workers():
            if proc.popen.poll() is None:
                self.say(
                    f"the job has finished (every worker in it finished): stopping "
                    f"{proc.name}, still running {self.after_job_grace:g}s later"
                )
                self._retire(proc)

    def _retire(self, proc: Proc) -> None:
        """Stop ``proc`` while the job goes on: SIGTERM now, SIGKILL if it is still running
        :attr:`stop_grace` seconds later (:meth:`_kill_overdue`)."""
        proc.retired = True
        proc.kill_at = time.monotonic() + self.stop_grace
        _signal_group(proc.popen, signal.SIGTERM)

    def _kill_overdue(self, now: float) -> None:
        for proc in self.procs:
            if proc.kill_at and now > proc.kill_at:
                proc.kill_at = 0.0
                if proc.popen.poll() is None:
                    self.say(
                        f"{proc.name} on {proc.where} did not stop within "
                        f"{self.stop_grace:g}s of SIGTERM (frozen?): killing it"
                    )
                # its whole group: a child of it may be frozen while it exited
                _signal_group(proc.popen, signal.SIGKILL)

    def _latest_workers(self) -> list[Proc]:
        """Each worker's latest process (an elastic job starts a failed one again)."""
        latest: dict = {}
        for proc in self.procs:
            if proc.role == "worker":
                latest[proc.name] = proc
        return list(latest.values())

    def _stop_after_workers(self, running: list[Proc]) -> None:
        """Every worker exited 0 a while ago and ``running`` did not end: stop them."""
        names = ", ".join(p.name for p in running)
        if any(p.role == "scheduler" for p in running):
            self.say(
                "warning: every worker exited 0 but no worker created a distributed store "
                "(did you pass --kv-store dist_sync?); the scheduler and servers were still "
                f"waiting for workers to join. Stopping {names}"
            )
        else:
            self.say(f"every worker exited 0; stopping {names}, still running")
        self.stop()

    def _end_after_last_failed(self, proc: Proc) -> int:
        """An elastic job whose other workers have all finished, and ``proc``, the last still
        training, failed: a newcomer in its slot would have nobody to take the model from,
        so the job ends now with its status (not after the scheduler's start-up timeout)."""
        self.say(
            f"{proc.name} on {proc.where} {_describe(proc.popen.returncode)}{_tail(proc)}; "
            "the other workers have finished, so no new one takes its slot: stopping the job"
        )
        self.stop()
        return _status(proc.popen.returncode)

    def _report_failures(self, first: Proc) -> Proc:
        """Name ``first`` and every process that fails on its own within
        :attr:`failure_window` seconds: when one failure causes another, the cause may be the
        slower one to exit. Returns
        the cause: the first of those the others name, else of all, that did not exit 129
        (a process that lost a peer, kvstore.errors.EXIT_PEER_LOST), else ``first``."""
        failed = [first]
        deadline = time.monotonic() + self.failure_window
        while time.monotonic() < deadline:
            try:
                proc = self.exits.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if proc.popen.returncode:
                failed.append(proc)
        # A process that the others name as failed ("worker 1 (host pid N) failed: ...") is
        # the cause: say it first.
        # Their last output is the cause's message passed on: said once, with the cause.
        causes = [p for p in failed if _named_by_others(p, failed)]
        failed = causes + [p for p in failed if p not in causes]
        for proc in failed:
            named = _named_cause(proc, causes) if proc not in causes else None
            tail = f" (passing on {named.name}'s failure)" if named else _tail(proc)
            self.say(f"{proc.name} on {proc.where} {_describe(proc.popen.returncode)}{tail}")
        self.say("stopping the other processes")
        return next((p for p in failed if p.popen.returncode != EXIT_PEER_LOST), failed[0])

    def stop(self) -> None:
        """SIGTERM each process's group and close its stdin (remote ones stop on that; the
        scheduler, which takes a closed pipe for a launcher that died, has ended by then),
        then kill what is still running :attr:`stop_grace` seconds later."""
        for p in self.procs:  # (an output still being read to its end: a moment)
            if p.popen.poll() is not None and p.reader is not None:
                p.reader.join(0.2)
        # running, or exited leaving a child that holds its output (frozen, say)
        live = [p for p in self.procs if p.holds_on()]
        for p in live:
            _signal_group(p.popen, signal.SIGTERM)
            try:
                p.popen.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + self.stop_grace
        for p in live:
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            if p.reader is not None:  # and a child holding its output: the same grace
                p.reader.join(max(0.0, deadline - time.monotonic()))
            _signal_group(p.popen, signal.SIGKILL)  # what is left of its group, if any
            p.popen.wait(5)
        self._drain()

    def _drain(self) -> None:
        for reader in self.readers:
            reader.join(2)


class _Terminated(KeyboardInterrupt):
    """SIGTERM to the launcher: it stops the job as on Ctrl-C, and exits 128 + 15."""


def _raise_interrupt(signum, frame):
    raise _Terminated


def _signal_group(popen: subprocess.Popen, sig) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _status(code: int) -> int:
    return code if code > 0 else 128 - code


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _tail(proc: Proc) -> str:
    return f" (last output: {proc.last_lines[-1]!r})" if proc.last_lines else ""


def _says_failed(name: str, lines) -> bool:
    """Whether one of ``lines`` says ``<name> (<where>) failed``."""
    said = re.compile(rf"\b{re.escape(name)} \([^)]*\) failed")
    return any(said.search(line) for line in lines)


def _named_cause(proc: Proc, causes: list) -> Proc | None:
    """The one of ``causes`` whose failure ``proc``'s last output passes on, if any."""
    return next((c for c in causes if _says_failed(c.name, proc.last_lines[-1:])), None)


def _named_by_others(proc: Proc, failed: list) -> bool:
    """Whether another process says ``<proc's name> (<where>) failed``: the cause, not one
    that merely passed the news on (``server 0 (...): worker 1 (...) failed: ...``)."""
    return any(_says_failed(proc.name, other.last_lines) for other in failed if other is not proc)
