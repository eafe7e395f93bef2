"""The floor of a row-sparse parameter server in Python on this machine: MXNet's anchor step
(W workers, S servers, a ROWS x DIM table, REQ random draws a step, unique, pushed then pulled
back) done with nothing but what the step cannot go without.

Each server holds its rows (by hash, ``id % S``, or by range) in a dense NumPy block. A round
is one message from each worker (its ids, and its rows in a shared segment, or in the message
with ``--tcp``); the rows' sum is scattered into the block, and each worker gets its rows back
(gathered into its segment, or in the reply). No protocol, no validation, no deadlines, no
failure handling, no optimizer: what is left is the NumPy work, one ZeroMQ message each way
per server, and the processes sharing the cores. kvstore does the same step with all of
those, so this is about the most it could reach here in Python. ``benchmarks/sparse.py
--mxnet`` (or ``--floor``) prints it beside kvstore and MXNet in the same run.

    python benchmarks/sparse_floor.py                  # W=2 S=2, 100000x64x4096, shared segments
    python benchmarks/sparse_floor.py --tcp --steps 500
    python benchmarks/sparse_floor.py --sharding range
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvstore.memory import tune_allocator  # noqa: E402

WAIT_MS = 60_000  # a peer that sends nothing for this long has failed: raise, never hang
SEGMENTS = Path("/dev/shm")


def _edges(rows: int, servers: int) -> np.ndarray:
    return np.array([rows * s // servers for s in range(servers + 1)], np.int64)


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def _map(path: Path, nbytes: int, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def server(s: int, cfg: dict, ports) -> None:
    tune_allocator()  # kvstore's processes' allocator settings
    workers, servers, dim = cfg["workers"], cfg["servers"], cfg["dim"]
    ctx = zmq.Context()
    sock = _socket(ctx, zmq.ROUTER)
    ports.put((s, sock.bind_to_random_port("tcp://127.0.0.1")))
    edges = _edges(cfg["rows"], servers)  # by range: ids [edges[s], edges[s + 1])
    by_hash = cfg["sharding"] == "hash"  # by hash: ids s, s + S, s + 2S, ...
    local = (cfg["rows"] - s + servers - 1) // servers if by_hash else edges[s + 1] - edges[s]
    block = np.ones((local, dim), np.float32)
    stamp = np.zeros(local, np.int64)  # the round that last wrote each row
    maps: dict[bytes, np.ndarray] = {}
    round_ = 0
    while True:
        got = []
        for _ in range(workers):
            route, ids_frame, rows_frame = sock.recv_multipart(copy=False)
            if ids_frame.bytes == b"stop":
                return
            ids = np.frombuffer(ids_frame.buffer, np.int64)
            slots = ids // servers if by_hash else ids - edges[s]
            if cfg["tcp"]:
                rows = np.frombuffer(rows_frame.buffer, np.float32).reshape(-1, dim)
            else:
                name = rows_frame.bytes
                if name not in maps:
                    seg = _map(SEGMENTS / name.decode(), cfg["req"] * dim * 4, create=False)
                    maps[name] = np.frombuffer(seg, np.float32).reshape(-1, dim)
                rows = maps[name][: slots.size]
            got.append((route.bytes, slots, rows))
        round_ += 1
        for i, (_, slots, rows) in enumerate(got):  # the round's sum becomes the rows
            again = stamp[slots] == round_ if i else None
            if again is not None and again.any():
                block[slots[again]] += rows[again]
                block[slots[~again]] = rows[~again]
            else:
                block[slots] = rows
            stamp[slots] = round_
        for route, slots, rows in got:
            sock.send(route, zmq.SNDMORE)
            if cfg["tcp"]:
                sock.send(block[slots], copy=False)
            else:
                np.take(block, slots, axis=0, out=rows)  # back into the worker's segment
                sock.send(b"")


def worker(w: int, cfg: dict, ports: dict, barrier, results) -> None:
    tune_allocator()
    servers, dim, req = cfg["servers"], cfg["dim"], cfg["req"]
    ctx = zmq.Context()
    socks = []
    for s in range(servers):
        sock = _socket(ctx, zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{ports[s]}")
        socks.append(sock)
    names = [f"kvstore-floor-{os.getpid()}-{s}" for s in range(servers)]
    segments = []
    if not cfg["tcp"]:
        for name in names:
            segments.append(_map(SEGMENTS / name, req * dim * 4, create=True))
    edges = _edges(cfg["rows"], servers)
    by_hash = cfg["sharding"] == "hash"
    rng = np.random.default_rng(w)
    vals = np.ones((req, dim), np.float32)
    out = np.empty((req, dim), np.float32)
    views = [np.frombuffer(seg, np.float32).reshape(req, dim) for seg in segments]

    def step() -> int:
        ids = np.unique(rng.integers(0, cfg["rows"], req))
        if by_hash:  # each server's rows gathered, and scattered back
            owner = ids % servers
            parts = [np.flatnonzero(owner == s) for s in range(servers)]
        else:  # sorted ids: each server's rows are a slice
            cut = np.searchsorted(ids, edges)
            parts = [slice(cut[s], cut[s + 1]) for s in range(servers)]
        sizes = [ids[part].size for part in parts]
        for s, part in enumerate(parts):
            socks[s].send(ids[part], zmq.SNDMORE, copy=False)
            if cfg["tcp"]:
                socks[s].send(vals[part], copy=False)
            elif by_hash:
                np.take(vals, part, axis=0, out=views[s][: sizes[s]])
                socks[s].send(names[s].encode())
            else:
                views[s][: sizes[s]] = vals[part]
                socks[s].send(names[s].encode())
        for s, part in enumerate(parts):
            reply = socks[s].recv(copy=False)
            if cfg["tcp"]:
                out[part] = np.frombuffer(reply.buffer, np.float32).reshape(-1, dim)
            else:
                out[part] = views[s][: sizes[s]]
        return ids.size

    runs = []
    try:
        for _ in range(2):
            step()
    finally:  # every server has mapped its segment by now: the names can go
        for name in names if segments else ():
            (SEGMENTS / name).unlink(missing_ok=True)
    for _ in range(cfg["repeats"]):
        barrier.wait(WAIT_MS / 1000)
        t0 = time.perf_counter()
        n = sum(step() for _ in range(cfg["steps"]))
        runs.append(n / (time.perf_counter() - t0))
    _check(w, cfg, out[: step()], 2 + cfg["repeats"] * cfg["steps"] + 1)
    results.put((w, runs))
    barrier.wait(WAIT_MS / 1000)
    if w == 0:
        for sock in socks:
            sock.send_multipart([b"stop", b""])
    views.clear()  # no array still points into a segment it closes
    for seg in segments:
        seg.close()
    for sock in socks:
        sock.close()
    ctx.term()


def _draws(rank: int, cfg: dict, step: int) -> np.ndarray:
    """The ids worker ``rank`` pushes at its ``step``-th step (1 is the first)."""
    rng = np.random.default_rng(rank)
    for _ in range(step):
        ids = np.unique(rng.integers(0, cfg["rows"], cfg["req"]))
    return ids


def _check(w: int, cfg: dict, pulled: np.ndarray, step: int) -> None:
    """Every push is ones: each row pulled back at ``step`` is how many workers pushed it."""
    mine = _draws(w, cfg, step)
    counts = sum(np.isin(mine, _draws(r, cfg, step)) for r in range(cfg["workers"]))
    if not np.array_equal(pulled, np.broadcast_to(counts[:, None], pulled.shape)):
        raise SystemExit(f"floor worker {w}: a row pulled back is not the sum of its pushes")


def run(
    workers: int = 2,
    servers: int = 2,
    anchor: str = "100000x64x4096",
    steps: int = 300,
    repeats: int = 3,
    tcp: bool = False,
    sharding: str = "hash",
    timeout: float = 600,
) -> list[float]:
    """Rows per second per worker (the mean over workers), one per repeat."""
    rows, dim, req = (int(x) for x in anchor.lower().split("x"))
    cfg = dict(
        workers=workers, servers=servers, rows=rows, dim=dim, req=req, steps=steps,
        repeats=repeats, tcp=tcp, sharding=sharding,
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    ports, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(workers)
    procs = [ctx.Process(target=server, args=(s, cfg, ports)) for s in range(servers)]
    try:
        for p in procs:
            p.start()
        where = dict(ports.get(timeout=60) for _ in range(servers))
        procs += [
            ctx.Process(target=worker, args=(w, cfg, where, barrier, results))
            for w in range(workers)
        ]
        for p in procs[servers:]:
            p.start()
        per_worker, deadline = [], time.monotonic() + timeout
        while len(per_worker) < workers:  # a process that failed ends the run at once
            failed = [p.exitcode for p in procs if p.exitcode]
            if failed:
                raise SystemExit(f"the floor failed: its processes ended {failed}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the floor took more than {timeout} s")
            try:
                per_worker.append(results.get(timeout=1)[1])
            except queue.Empty:
                pass
        for p in procs:
            p.join(30)
            if p.exitcode:
                raise SystemExit(f"a floor process failed ({p.exitcode})")
    finally:
        for p in procs:  # by PID, whatever happened
            if p.is_alive():
                p.kill()
                p.join(10)
    return [statistics.fmean(r[i] for r in per_worker) for i in range(repeats)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-w", "--workers", type=int, default=2)
    ap.add_argument("-s", "--servers", type=int, default=2)
    ap.add_argument("--anchor", default="100000x64x4096", help="ROWSxDIMxREQ")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tcp", action="store_true", help="rows in the messages, not in segments")
    ap.add_argument("--sharding", default="hash", choices=["hash", "range"])
    args = ap.parse_args(argv)
    runs = run(
        args.workers, args.servers, args.anchor, args.steps, args.repeats, args.tcp, args.sharding
    )
    print(
        json.dumps(
            {
                "op": "anchor",
                "config": "floor tcp" if args.tcp else "floor",
                "size": args.anchor,
                "sharding": args.sharding,
                "median": statistics.median(runs),
                "min": min(runs),
                "max": max(runs),
                "runs": runs,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
