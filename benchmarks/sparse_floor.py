"""How fast a row-sparse parameter server in Python can be on this machine: MXNet's anchor step
(W workers, S servers, a ROWS x DIM table, REQ random draws a step, unique, pushed as ones and
pulled back; a round's pushes are summed and the sum becomes the rows) done by bare designs with
nothing but the step's own work: no protocol, validation, failure handling or optimizer.

Each worker writes its ids and rows into its own shared segment (as kvstore's same-host workers
do), and each server holds its rows (by hash, ``id % S``, or by range) in a dense NumPy block.
A round is one small message from each worker to each server and one back: a push and a pull
in one call, as kvstore's ``pushpull``. The designs add one change at a time:

- ``zmq``: ZeroMQ ROUTER/DEALER over TCP; the server scatters the sum and gathers the rows back
  into the worker's segment by 2-D fancy indexing. kvstore's same-host design.
- ``zmq-whole``: the same, with each row scattered and gathered as one item (a void view).
- ``zmq-block``: also, each server's block lives in a shared segment and the worker gathers its
  sums from it once the server says the round is done (safe under ``dist_sync``: a block
  changes only when every worker has pushed again).
- ``pipe-block``: also, the messages go on named pipes (a 12-byte record): no ZeroMQ I/O
  thread to wake.

The four processes share the machine's cores, as kvstore's and MXNet's do in the same
benchmark. A worker checks the rows of its last five steps against the pushes (every push is
ones: a row is how many workers pushed it), so a design that skipped work fails rather than
looking fast. ``benchmarks/sparse.py --mxnet`` (or ``--floor``) prints these beside kvstore
and MXNet in the same run.

    python benchmarks/sparse_floor.py                   # every design, by hash and by range
    python benchmarks/sparse_floor.py --designs zmq --sharding range --steps 500
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import multiprocessing as mp
import os
import queue
import select
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvstore.config import sched_batch_of  # noqa: E402
from kvstore.cpu import batch  # noqa: E402
from kvstore.memory import tune_allocator  # noqa: E402

DESIGNS = ("zmq", "zmq-whole", "zmq-block", "pipe-block")
CHECKED = 5  # the last steps each worker checks
WAIT_S = 60  # a peer silent this long has failed: raise, never hang
RECORD = struct.Struct("<iii")  # worker, first row in its segment, rows (-1: stop)


def unique_ids(ids: np.ndarray) -> np.ndarray:
    """``np.unique(ids)`` of non-negative ints: the same ids, sorted. The anchor's step draws
    its ids with ``np.unique``: about 45 us for 4,096 ids of 100,000 in MXNet's NumPy 1.23,
    but 320 us in NumPy 2.4 (a hash table), whose sort alone takes 95 us here: that would be
    a tenth of the step we measure, and not the parameter server's. A bitmap of the id range
    takes 30 us (ids spread over more than 64 per draw: a sort, as before)."""
    if not ids.size:
        return ids.astype(np.int64)
    top = int(ids.max()) + 1
    if top > 64 * ids.size:
        ids = np.sort(ids)
        return ids[np.r_[True, ids[1:] != ids[:-1]]]
    seen = np.zeros(top, bool)
    seen[ids] = True
    return np.flatnonzero(seen)


def _edges(rows: int, servers: int) -> np.ndarray:
    return np.array([rows * s // servers for s in range(servers + 1)], np.int64)


def _local_rows(cfg: dict, s: int) -> int:
    servers = cfg["servers"]
    if cfg["sharding"] == "hash":  # ids s, s + S, s + 2S, ...
        return (cfg["rows"] - s + servers - 1) // servers
    edges = _edges(cfg["rows"], servers)
    return int(edges[s + 1] - edges[s])


def _create_segment(path: Path, nbytes: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _map_segment(path: Path, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _rows_of(seg, dim: int, count: int, offset: int = 0) -> np.ndarray:
    return np.frombuffer(seg, np.float32, count * dim, offset).reshape(count, dim)


def _whole_rows(block: np.ndarray) -> np.ndarray:
    """One void item per row: a row scattered or gathered as one element (2-3x faster than
    2-D fancy indexing here). ``np.take`` on it runs with ``mode="clip"``: with ``out=`` the
    default mode buffers the whole result first; the slots are computed, never out of range."""
    return block.view(np.dtype((np.void, block.shape[1] * block.itemsize))).reshape(-1)


class _Zmq:
    """ROUTER on each server, a DEALER per server on each worker, over TCP."""

    def __init__(self, cfg: dict, me: str, index: int):
        import zmq

        self.zmq, self.ctx = zmq, zmq.Context()
        self.routes: dict[int, bytes] = {}
        if me == "server":
            self.sock = self._socket(zmq.ROUTER)
            port = self.sock.bind_to_random_port("tcp://127.0.0.1")
            (cfg["dir"] / f".port{index}").write_text(str(port))
            (cfg["dir"] / f".port{index}").rename(cfg["dir"] / f"port{index}")  # whole, at once
        else:
            self.socks = []
            for s in range(cfg["servers"]):
                path, deadline = cfg["dir"] / f"port{s}", time.monotonic() + WAIT_S
                while not path.exists():
                    if time.monotonic() > deadline:
                        raise SystemExit(f"floor server {s} never bound its port")
                    time.sleep(0.01)
                sock = self._socket(zmq.DEALER)
                sock.connect(f"tcp://127.0.0.1:{path.read_text()}")
                self.socks.append(sock)

    def close(self) -> None:
        """Sent messages are delivered before the sockets go (the stop records)."""
        self.ctx.destroy(linger=WAIT_S * 1000)

    def _socket(self, kind):
        sock = self.ctx.socket(kind)
        for option, value in ((self.zmq.RCVTIMEO, WAIT_S * 1000), (self.zmq.LINGER, 0)):
            sock.setsockopt(option, value)
        return sock

    def push(self, s: int, record: bytes) -> None:
        self.socks[s].send(record)

    def wait_servers(self) -> None:
        for sock in self.socks:
            sock.recv()

    def pushes(self, count: int) -> list[tuple]:
        got = []
        for _ in range(count):
            route, record = self.sock.recv_multipart()
            got.append(RECORD.unpack(record))
            self.routes[got[-1][0]] = route
        return got

    def done(self, w: int) -> None:
        self.sock.send_multipart([self.routes[w], b""])


class _Pipes:
    """A named pipe into each server (every worker writes its records there) and one into
    each worker (a byte per server whose round is done)."""

    def __init__(self, cfg: dict, me: str, index: int):
        self.cfg = cfg
        self.mine = os.open(cfg["dir"] / f"{me}{index}.fifo", os.O_RDWR)  # never EOF
        peers = "worker" if me == "server" else "server"
        count = cfg["workers"] if me == "server" else cfg["servers"]
        self.peers = [os.open(cfg["dir"] / f"{peers}{i}.fifo", os.O_RDWR) for i in range(count)]

    def _read(self, nbytes: int) -> bytes:
        data = b""
        while len(data) < nbytes:
            if not select.select([self.mine], [], [], WAIT_S)[0]:
                raise SystemExit(f"floor: nothing on a pipe for {WAIT_S} s")
            data += os.read(self.mine, nbytes - len(data))
        return data

    def push(self, s: int, record: bytes) -> None:
        os.write(self.peers[s], record)

    def wait_servers(self) -> None:
        self._read(self.cfg["servers"])

    def pushes(self, count: int) -> list[tuple]:
        data = self._read(count * RECORD.size)
        return [RECORD.unpack_from(data, i * RECORD.size) for i in range(count)]

    def done(self, w: int) -> None:
        os.write(self.peers[w], b"x")

    def close(self) -> None:  # a pipe keeps what was written after its writer exits
        pass


def _channel(cfg: dict, me: str, index: int) -> _Zmq | _Pipes:
    return (_Pipes if cfg["design"] == "pipe-block" else _Zmq)(cfg, me, index)


def server(s: int, cfg: dict) -> None:
    tune_allocator()  # kvstore's processes' allocator settings
    batch(sched_batch_of(os.environ))  # and CPU policy
    workers, dim, req = cfg["workers"], cfg["dim"], cfg["req"]
    by_hash, whole_rows, workers_read_block = _choices(cfg)
    local = _local_rows(cfg, s)
    if workers_read_block:
        block = _rows_of(_map_segment(cfg["dir"] / f"block{s}", local * dim * 4), dim, local)
    else:
        block = np.empty((local, dim), np.float32)
    block[:] = 1
    whole = _whole_rows(block)
    stamp = np.zeros(local, np.int64)  # the round that last wrote each row
    segments = []
    for w in range(workers):
        seg = _map_segment(cfg["dir"] / f"worker{w}", req * 8 + req * dim * 4)
        segments.append((np.frombuffer(seg, np.int64, req), _rows_of(seg, dim, req, req * 8)))
    base = int(_edges(cfg["rows"], cfg["servers"])[s])
    chan = _channel(cfg, "server", s)
    round_ = 0
    while True:
        got = chan.pushes(workers)
        if any(first < 0 for _, first, _ in got):
            return
        round_ += 1
        for i, (w, first, count) in enumerate(got):  # the round's sum becomes the rows
            ids, rows = (a[first : first + count] for a in segments[w])
            slots = ids // cfg["servers"] if by_hash else ids - base
            again = stamp[slots] == round_ if i else None
            if again is not None and again.any():
                block[slots[again]] += rows[again]
                slots, rows = slots[~again], rows[~again]
            if whole_rows:
                whole[slots] = _whole_rows(rows)
            else:
                block[slots] = rows
            stamp[slots] = round_
        for w, first, count in got:
            if not workers_read_block:  # the sums back into the worker's segment
                ids, rows = (a[first : first + count] for a in segments[w])
                slots = ids // cfg["servers"] if by_hash else ids - base
                if whole_rows:
                    np.take(whole, slots, out=_whole_rows(rows), mode="clip")
                else:
                    np.take(block, slots, axis=0, out=rows, mode="clip")
            chan.done(w)


def _choices(cfg: dict) -> tuple[bool, bool, bool]:
    """(rows by hash, rows moved whole, workers read the server's block) of ``cfg``."""
    design = cfg["design"]
    return cfg["sharding"] == "hash", design != "zmq", design in ("zmq-block", "pipe-block")


def _draws(cfg: dict, steps: int) -> list[list[np.ndarray]]:
    """Each worker's ids at each of the last :data:`CHECKED` of ``steps`` steps."""
    draws = []
    for rank in range(cfg["workers"]):
        rng = np.random.default_rng(rank)
        every = (unique_ids(rng.integers(0, cfg["rows"], cfg["req"])) for _ in range(steps))
        draws.append(list(itertools.islice(every, steps - CHECKED, steps)))
    return draws


def _check(w: int, cfg: dict, pulled: list[np.ndarray], steps: int) -> None:
    """Every push is ones: each row pulled back is how many workers pushed it in that step."""
    draws = _draws(cfg, steps)
    for mine, rows, *others in zip(draws[w], pulled, *draws, strict=True):
        counts = sum(np.isin(mine, ids) for ids in others)
        if not np.array_equal(rows, np.broadcast_to(counts[:, None], rows.shape)):
            raise SystemExit(f"floor worker {w}: a row pulled back is not the sum of its pushes")


def worker(w: int, cfg: dict, barrier, results) -> None:
    tune_allocator()
    batch(sched_batch_of(os.environ))
    servers, dim, req = cfg["servers"], cfg["dim"], cfg["req"]
    by_hash, whole_rows, workers_read_block = _choices(cfg)
    edges = _edges(cfg["rows"], servers)
    seg = _map_segment(cfg["dir"] / f"worker{w}", req * 8 + req * dim * 4)
    seg_ids, seg_rows = np.frombuffer(seg, np.int64, req), _rows_of(seg, dim, req, req * 8)
    blocks = []
    for s in range(servers) if workers_read_block else ():
        local = _local_rows(cfg, s)
        block = _map_segment(cfg["dir"] / f"block{s}", local * dim * 4)
        blocks.append(_whole_rows(_rows_of(block, dim, local)))
    chan = _channel(cfg, "worker", w)
    rng = np.random.default_rng(w)
    vals = np.ones((req, dim), np.float32)
    out = np.empty((req, dim), np.float32)
    out_whole, seg_whole, vals_whole = _whole_rows(out), _whole_rows(seg_rows), _whole_rows(vals)

    def step() -> int:
        ids = unique_ids(rng.integers(0, cfg["rows"], req))
        if by_hash:  # each server's ids and rows gathered into the segment, one after another
            owner = ids % servers
            parts = [np.flatnonzero(owner == s) for s in range(servers)]
            firsts = np.cumsum([0] + [p.size for p in parts])
            for s, part in enumerate(parts):
                at = slice(firsts[s], firsts[s + 1])
                np.take(ids, part, out=seg_ids[at], mode="clip")
                if whole_rows:
                    np.take(vals_whole, part, out=seg_whole[at], mode="clip")
                else:
                    np.take(vals, part, axis=0, out=seg_rows[at], mode="clip")
                chan.push(s, RECORD.pack(w, firsts[s], part.size))
        else:  # sorted ids: each server's rows are a slice
            firsts = np.searchsorted(ids, edges)
            parts = [slice(firsts[s], firsts[s + 1]) for s in range(servers)]
            seg_ids[: ids.size] = ids
            seg_rows[: ids.size] = vals[: ids.size]
            for s in range(servers):
                chan.push(s, RECORD.pack(w, firsts[s], firsts[s + 1] - firsts[s]))
        chan.wait_servers()
        for s, part in enumerate(parts):
            at = slice(firsts[s], firsts[s + 1])
            if workers_read_block:
                slots = seg_ids[at] // servers if by_hash else seg_ids[at] - edges[s]
                if by_hash:
                    out_whole[part] = np.take(blocks[s], slots, mode="clip")
                else:
                    np.take(blocks[s], slots, out=out_whole[part], mode="clip")
            elif whole_rows:  # the server put them in the segment
                out_whole[part] = seg_whole[at]
            else:
                out[part] = seg_rows[at]
        return ids.size

    runs = []
    for _ in range(2):
        step()
    for _ in range(cfg["repeats"]):
        barrier.wait(WAIT_S)
        t0 = time.perf_counter()
        n = sum(step() for _ in range(cfg["steps"]))
        runs.append(n / (time.perf_counter() - t0))
    pulled = [out[: step()].copy() for _ in range(CHECKED)]
    _check(w, cfg, pulled, 2 + cfg["repeats"] * cfg["steps"] + CHECKED)
    results.put((w, runs))
    barrier.wait(WAIT_S)
    if w == 0:
        for s in range(servers):
            for who in range(cfg["workers"]):  # every record a server waits for
                chan.push(s, RECORD.pack(who, -1, 0))
    chan.close()


def run(
    workers: int = 2,
    servers: int = 2,
    anchor: str = "100000x64x4096",
    steps: int = 300,
    repeats: int = 3,
    design: str = "zmq",
    sharding: str = "hash",
    timeout: float = 600,
) -> dict:
    """The record of one design: rows per second per worker (the mean over workers) in each
    repeat (``runs``), their median, min and max.

        >>> run(anchor="2000x16x256", steps=20, design="pipe-block")["median"] > 0
        True
    """
    if design not in DESIGNS:
        raise ValueError(f"design {design!r}: expected one of {', '.join(DESIGNS)}")
    rows, dim, req = (int(x) for x in anchor.lower().split("x"))
    where = Path(tempfile.mkdtemp(prefix="kvstore-floor-", dir="/dev/shm"))  # 0700, ours
    cfg = dict(
        workers=workers, servers=servers, rows=rows, dim=dim, req=req, steps=steps,
        repeats=repeats, design=design, sharding=sharding, dir=where,
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    results, barrier, procs = ctx.Queue(), ctx.Barrier(workers), []
    try:
        for w in range(workers):
            _create_segment(where / f"worker{w}", req * 8 + req * dim * 4)
        for s in range(servers) if _choices(cfg)[2] else ():
            _create_segment(where / f"block{s}", _local_rows(cfg, s) * dim * 4)
        if design == "pipe-block":
            names = [f"server{s}" for s in range(servers)] + [f"worker{w}" for w in range(workers)]
            for name in names:
                os.mkfifo(where / f"{name}.fifo", 0o600)
        procs = [ctx.Process(target=server, args=(s, cfg)) for s in range(servers)]
        procs += [
            ctx.Process(target=worker, args=(w, cfg, barrier, results)) for w in range(workers)
        ]
        for p in procs:
            p.start()
        per_worker, deadline = [], time.monotonic() + timeout
        while len(per_worker) < workers:  # a process that failed ends the run at once
            failed = [p.exitcode for p in procs if p.exitcode]
            if failed:
                raise SystemExit(f"the floor ({design}) failed: its processes ended {failed}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the floor ({design}) took more than {timeout} s")
            try:
                per_worker.append(results.get(timeout=1)[1])
            except queue.Empty:
                pass
        for p in procs:
            p.join(30)
            if p.exitcode != 0:  # None: still running (a server never told to stop)
                raise SystemExit(f"a floor process ({design}) ended {p.exitcode}")
    finally:
        for p in procs:  # by PID, whatever happened
            if p.is_alive():
                p.kill()
                p.join(10)
        shutil.rmtree(where, ignore_errors=True)
    runs = [statistics.fmean(r[i] for r in per_worker) for i in range(repeats)]
    stats = {"median": statistics.median(runs), "min": min(runs), "max": max(runs)}
    return {"op": "anchor", "config": f"floor {design}", "size": anchor, "sharding": sharding,
            **stats, "runs": runs}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-w", "--workers", type=int, default=2)
    ap.add_argument("-s", "--servers", type=int, default=2)
    ap.add_argument("--anchor", default="100000x64x4096", help="ROWSxDIMxREQ")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--designs", default=",".join(DESIGNS))
    ap.add_argument("--sharding", default="hash,range")
    args = ap.parse_args(argv)
    for design in args.designs.split(","):
        for sharding in args.sharding.split(","):
            record = run(
                args.workers, args.servers, args.anchor, args.steps, args.repeats, design,
                sharding,
            )  # fmt: skip
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
