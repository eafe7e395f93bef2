"""Run a role's threads under Linux's ``SCHED_BATCH`` policy: the kernel's policy for
CPU-bound work that no one waits on interactively, which a training job is.

Why: a parameter server's processes wake each other all the time (a push wakes a server, its
reply wakes the worker). Under the default policy a woken thread preempts the thread that woke
it when it can, so a server that has just answered one worker is put aside before it answers
the next, and a worker before it has sent its push to every server. With 4 processes on 2
cores, that cost MXNet's anchor step (benchmarks/sparse.py) 18-24% of its rows/s. A
``SCHED_BATCH`` thread gets the same share of the CPU (``nice`` is kept) but does not preempt
the one that woke it: it runs at the waker's next wait, or on an idle core at once.

Servers and the scheduler call :func:`batch` at start, a worker when its store is created
(the calling thread and the threads kvstore starts after it; the caller's other threads keep
their policy). ``KVSTORE_SCHED_BATCH=0`` leaves every policy as it was. A thread under a
real-time policy (``SCHED_FIFO``, ``SCHED_RR``) or ``SCHED_IDLE`` is left alone; lowering
``SCHED_OTHER`` to ``SCHED_BATCH`` needs no privilege.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvstore")


def batch(enabled: bool = True) -> bool:
    """Put the calling thread (and the threads it starts from now on) under ``SCHED_BATCH``
    if it runs under ``SCHED_OTHER``. Returns whether it now runs under ``SCHED_BATCH``."""
    policy = getattr(os, "SCHED_BATCH", None)
    if not enabled or policy is None:  # (not Linux)
        return False
    try:
        now = os.sched_getscheduler(0)
        if now == policy:
            return True
        if now != os.SCHED_OTHER:
            names = {getattr(os, n, None): n for n in ("SCHED_FIFO", "SCHED_RR", "SCHED_IDLE")}
            log.info("CPU policy: %s kept (not made SCHED_BATCH)", names.get(now, now))
            return False
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:  # (a seccomp profile that refuses it)
        log.info("CPU policy: SCHED_BATCH refused (%s); the default policy stays", exc)
        return False
    log.info("CPU policy: SCHED_BATCH (KVSTORE_SCHED_BATCH=0 keeps the default)")
    return True
