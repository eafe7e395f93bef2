"""The bounds kvstore is measured against, on this machine.

- ZeroMQ alone: a DEALER sends an array to an echo ROUTER in another process and gets an
  array of the same size back, zero-copy on both sides: the best a push + pull of those bytes
  can do through pyzmq.
- 1000 pipelined round trips of 1 KiB: all sent, then all received.
- Memory: a NumPy copy and an in-place add of 64 MiB.

    python benchmarks/zmq_bound.py [--sizes 4K,256K,4M,64M] [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
import zmq

from kvstore.config import sched_batch_of
from kvstore.cpu import batch
from kvstore.memory import tune_allocator

SIZES = {"4K": 4 << 10, "256K": 256 << 10, "4M": 4 << 20, "64M": 64 << 20}


def parse_sizes(text: str) -> dict:
    return {name: SIZES[name] if name in SIZES else int(name) for name in text.split(",")}


def _echo(port_queue) -> None:
    tune_allocator()  # the same allocator settings kvstore's processes use
    batch(sched_batch_of(os.environ))  # and the same CPU policy
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    # no high-water mark: 1000 pipelined replies must not be dropped (a ROUTER drops what it
    # cannot queue), which left the caller waiting for ever
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    port_queue.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[1].bytes == b"stop":
            break
        sock.send_multipart(frames, copy=False)
    sock.close(linger=0)
    ctx.term()


class EchoServer:
    """An echo ROUTER in a separate process (as a kvstore server is)."""

    def __enter__(self):
        tune_allocator()
        queue = mp.get_context("spawn").Queue()
        self.proc = mp.get_context("spawn").Process(target=_echo, args=(queue,), daemon=True)
        self.proc.start()
        port = queue.get(timeout=30)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 60_000)  # a lost reply is an error, not a hang
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        return self

    def __exit__(self, *exc):
        self.sock.send(b"stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.sock.close(linger=0)
        self.ctx.term()


def _job_client(ports, nbytes, steps, barrier, results) -> None:
    """One worker of :func:`job_rates`: each step sends ``nbytes`` to every echo server and
    waits for them all to come back (copied out, as a pull's rows are)."""
    tune_allocator()
    batch(sched_batch_of(os.environ))
    ctx = zmq.Context()
    socks = []
    for port in ports:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)  # a lost reply is an error, not a hang
        sock.connect(f"tcp://127.0.0.1:{port}")
        socks.append(sock)
    arrays = [np.ones(nbytes // 4, np.float32) for _ in ports]
    back = [np.empty_like(a) for a in arrays]
    times = []
    for i in range(steps + 2):  # two untimed steps first, each side connected
        if i == 2:
            barrier.wait(60)
        t0 = time.perf_counter()
        for sock, a in zip(socks, arrays, strict=True):
            sock.send(a, copy=False)
        for sock, b in zip(socks, back, strict=True):
            b[...] = np.frombuffer(sock.recv(copy=False).buffer, np.float32)
        times.append(time.perf_counter() - t0)
    results.put(times[2:])
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


def job_rates(workers: int, servers: int, nbytes: int, steps: int) -> list[float]:
    """Seconds per step of a bare ZeroMQ job of kvstore's shape: ``workers`` processes each
    sending ``nbytes`` to each of ``servers`` echo processes at once and waiting for them
    all, every worker ``steps`` times. Per step, the mean over workers of its seconds."""
    spawn = mp.get_context("spawn")
    queue, results, barrier = spawn.Queue(), spawn.Queue(), spawn.Barrier(workers)
    echoes = [spawn.Process(target=_echo, args=(queue,), daemon=True) for _ in range(servers)]
    clients = []
    try:
        for p in echoes:
            p.start()
        ports = [queue.get(timeout=30) for _ in echoes]
        clients = [
            spawn.Process(
                target=_job_client, args=(ports, nbytes, steps, barrier, results), daemon=True
            )
            for _ in range(workers)
        ]
        for p in clients:
            p.start()
        per_worker = [results.get(timeout=300) for _ in clients]
    finally:
        for p in echoes + clients:  # by PID, whatever happened
            if p in clients:
                p.join(0.5)
            if p.is_alive():
                p.kill()
                p.join(10)
    return [statistics.fmean(step) for step in zip(*per_worker, strict=True)]


def timed(fn, reps: int, budget: float, warmup: int = 2) -> list[float]:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then up to ``reps`` timed ones
    within ``budget`` seconds (at least 3)."""
    for _ in range(warmup):
        fn()
    times, deadline = [], time.monotonic() + budget
    while len(times) < reps and (len(times) < 3 or time.monotonic() < deadline):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def summary(config: str, size: str, unit: str, values: list[float]) -> dict:
    return {
        "config": config,
        "size": size,
        "unit": unit,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def roundtrip_rates(sizes: dict, reps: int, budget: float, keys: int = 1000) -> list[dict]:
    """Bytes per second of one array there and back, per size; steps/s of ``keys`` round
    trips of 1 KiB, pipelined."""
    results = []
    with EchoServer() as echo:
        for name, nbytes in sizes.items():
            array = np.ones(nbytes // 4, np.float32)
            out = np.empty_like(array)

            def once(array=array, out=out):
                echo.sock.send(array, copy=False)
                frame = echo.sock.recv(copy=False)
                out[...] = np.frombuffer(frame.buffer, np.float32)

            times = timed(once, reps, budget)
            results.append(summary("zmq", name, "B/s", [nbytes / t for t in times]))
        small = [np.ones(256, np.float32) for _ in range(keys)]

        def pipelined():
            for a in small:
                echo.sock.send(a, copy=False)
            for a in small:
                a[...] = np.frombuffer(echo.sock.recv(copy=False).buffer, np.float32)

        times = timed(pipelined, reps, budget)
        results.append(summary("zmq", f"{keys}x1K", "steps/s", [1 / t for t in times]))
    return results


def memory_rates(reps: int = 10) -> list[dict]:
    a = np.ones(16 << 20, np.float32)  # 64 MiB
    b = np.empty_like(a)
    copy = timed(lambda: np.copyto(b, a), reps, 5)
    add = timed(lambda: np.add(b, a, out=b), reps, 5)
    return [
        summary("numpy copy", "64M", "B/s", [a.nbytes / t for t in copy]),
        summary("numpy add", "64M", "B/s", [a.nbytes / t for t in add]),
    ]


def human(value: float, unit: str) -> str:
    if unit == "steps/s":
        return f"{value:.1f} steps/s"
    for scale, prefix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if value >= scale:
            return f"{value / scale:.2f} {prefix}/s"
    return f"{value:.0f} B/s"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="4K,256K,4M,64M")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget", type=float, default=5.0, help="seconds per measurement at most")
    args = p.parse_args(argv)
    results = roundtrip_rates(parse_sizes(args.sizes), args.reps, args.budget) + memory_rates()
    for r in results:
        print(json.dumps(r))
    for r in results:
        print(f"{r['config']:>12} {r['size']:>8}  {human(r['median'], r['unit'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
