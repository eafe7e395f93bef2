"""Row-sparse throughput of kvstore on 127.0.0.1, beside raw ZeroMQ and MXNet ps-lite.

Starts a scheduler, S servers and W workers (``dist_sync``, no optimizer: a round's sum
becomes the rows). Each worker has one table per dim (``--rows`` x dim, rows created when
first pushed) and measures, per dim (16, 64, 256) and rows per request (1k, 4k, 64k):

- ``push``: K pushes of REQ random unique rows, then a one-row ``row_sparse_pull`` (which
  waits for every round of this worker's pushes): rows pushed per second;
- ``pull``: ``row_sparse_pull`` of REQ random rows: rows per second;
- ``step``: a push of REQ rows then a ``row_sparse_pull`` of the same rows (MXNet's anchor
  metric): rows per second, and the bytes of the rows (``REQ * dim * 4``) per second beside
  bare pyzmq round trips of the same bytes in the same run (``zmq_bound.py``): between one
  pair of processes with the machine to themselves (``zmq pair``), and by a bare job of
  kvstore's shape (``zmq job``: W processes, each sending REQ / S rows' bytes to each of S
  echo processes at once and waiting for them all back, per worker).

Then the memory of one server's row store against touched rows (dim 64, with and without
SGD momentum's state); with ``--job-memory`` the resident memory (VmRSS) of a whole job
(scheduler, 2 servers, 1 worker) holding 10^6 touched rows of a 10^9 x 64 table; and with
``--mxnet PYTHON`` (a Python with MXNet 1.9.1) MXNet's KVStore
(``/work/shared/anchors/mxnet_ps.py --row-sparse 100000x64x4096``, W and S the same)
beside kvstore's identical step, run back to back, with the ratio (both tables initialised
with every row, ones, as the anchor does). Between them (and with ``--floor`` alone) the
same step done by bare designs with nothing but NumPy and one small message each way per
server (``sparse_floor.py``): how fast a Python parameter server can be on this machine.
Each measurement times enough calls to move 128 MiB of rows (10 to 300 calls; ``--reps N``:
N), the bare ZeroMQ bounds as many (the job bound at least 20). ``--pairs N`` runs the grid
and then its ZeroMQ bounds N times, alternated (and MXNet's anchor and kvstore's), and prints
the ratio of each pair and their median: this machine's speed moves by a third within
minutes, so one run is one sample.

    python benchmarks/sparse.py                     # W=2 S=2, every dim and size
    python benchmarks/sparse.py --no-memory --pairs 3    # the grid against its bounds, 3 pairs
    python benchmarks/sparse.py --mxnet /work/mxnet-venv/bin/python
    python benchmarks/sparse.py --dims "" --no-memory --mxnet /work/mxnet-venv/bin/python \
        --anchor-steps 300 --pairs 5       # the anchor's ratio, five alternated pairs
    python benchmarks/sparse.py --dims "" --no-memory --floor    # kvstore's anchor, the floors
    python benchmarks/sparse.py --dims 16 --reqs 1K --budget 0.3 --no-memory   # a smoke run
    python benchmarks/sparse.py --dims "" --no-memory --job-memory   # the whole job's RSS
    python benchmarks/sparse.py --dims 64 --reqs 4K --no-memory --replicas 2   # with replicas
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sparse_floor  # noqa: E402
from pushpull import SECURITY, free_port  # noqa: E402
from zmq_bound import EchoServer, job_rates, timed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ANCHOR = Path("/work/shared/anchors/mxnet_ps.py")
REQS = {"1K": 1024, "4K": 4096, "64K": 65536}
MEASURED_BYTES = 128 << 20  # rows' bytes a measurement moves (--reps 0), within its call limits
CALLS = (10, 300)  # calls per measurement, at least and at most


def calls_for(reps: int, dim: int, req: int) -> int:
    """Timed calls per measurement of REQ rows of ``dim``: ``reps``, or with 0 enough calls to
    move :data:`MEASURED_BYTES` (a 1 ms call timed ten times is a sample of this machine's
    minute, not of the design), within :data:`CALLS`. The same on every worker (their rounds
    must match) and for the bare ZeroMQ bounds of the same shape.

    >>> calls_for(0, 16, 1024), calls_for(0, 64, 4096), calls_for(0, 256, 65536)
    (300, 128, 10)
    >>> calls_for(7, 16, 1024)
    7
    """
    if reps:
        return reps
    return min(max(-(-MEASURED_BYTES // (req * dim * 4)), CALLS[0]), CALLS[1])


# ---------------------------------------------------------------- inside a worker


def worker_main(args) -> int:
    import kvstore
    from kvstore.sparse import RowSparse, uniform

    kv = kvstore.create("dist_sync")
    rng = np.random.default_rng(kv.rank)
    results = []
    for dim in [int(d) for d in args.dims.split(",") if d]:
        shape = (args.rows, dim)
        key = f"emb{dim}"
        init = uniform(-0.1, 0.1, seed=1)
        kv.init(key, RowSparse.empty(shape, np.float32, init=init, sharding=args.sharding))
        for name in args.reqs.split(","):
            req = REQS.get(name) or int(name)
            grads = [
                RowSparse(
                    np.sort(rng.choice(args.rows, req, replace=False)),
                    rng.standard_normal((req, dim), dtype=np.float32),
                    shape,
                )
                for _ in range(4)
            ]
            # every worker runs the same number of steps (rounds must match): fixed counts
            for what, fn, rows_per_call in calls(kv, key, shape, grads, req):
                kv.barrier()
                times = timed(fn, calls_for(args.reps, dim, req), 1e9, warmup=1)
                rates = [rows_per_call / t for t in times]
                results.append(
                    {
                        "op": what,
                        "dim": dim,
                        "req": name,
                        "sharding": args.sharding,
                        "rows_per_s": rates,
                    }
                )
        kv.barrier()
    if args.run_anchor:  # MXNet's anchor case: 100000 x 64, 4096 random draws (unique) per step
        rows, dim, req = (int(x) for x in args.anchor.lower().split("x"))
        shape = (rows, dim)
        # every row stored from the start, as MXNet's anchor inits it (ones: MXNet refuses an
        # empty row_sparse init); an empty table would create rows during the first repeats;
        # the rows spread by hash (our default) and by range (MXNet's layout)
        vals = np.ones((req, dim), np.float32)
        out = RowSparse.empty(shape, np.float32)
        for sharding in ("hash", "range"):
            key = f"anchor-{sharding}"
            kv.init(
                key, RowSparse(np.arange(rows), np.ones(shape, np.float32), shape, None, sharding)
            )

            def anchor_step(key=key):  # MXNet's: a push, then a row_sparse_pull of the same rows
                ids = sparse_floor.unique_ids(rng.integers(0, rows, req))
                kv.push(key, RowSparse(ids, vals[: ids.size], shape))
                kv.row_sparse_pull(key, out=out, row_ids=ids)
                return ids.size

            def anchor_pushpull(key=key):  # the same work in one call (one message per server)
                ids = sparse_floor.unique_ids(rng.integers(0, rows, req))
                kv.pushpull(key, RowSparse(ids, vals[: ids.size], shape), out=out)
                return ids.size

            for op, fn in (("anchor", anchor_step), ("anchor pushpull", anchor_pushpull)):
                for _ in range(2):
                    fn()
                runs = []
                for _ in range(args.anchor_repeats):
                    kv.barrier()
                    t0 = time.perf_counter()
                    n = sum(fn() for _ in range(args.anchor_steps))
                    runs.append(n / (time.perf_counter() - t0))
                results.append(
                    {
                        "op": op,
                        "dim": dim,
                        "req": str(req),
                        "sharding": sharding,
                        "rows_per_s": runs,
                    }
                )
    kv.close()
    print("RESULTS " + json.dumps(results), flush=True)
    return 0


def memory_worker(args) -> int:
    """The job-memory case's only worker: 10^6 random rows of a 10^9 x 64 table, 4,096 a
    step, each step a ``pushpull`` (a training step: the push, and the rows it updated back;
    with ``--momentum``: SGD with momentum), then it waits for a line on stdin while the
    driver reads every process's resident memory."""
    import kvstore
    from kvstore.sparse import RowSparse, uniform

    kv = kvstore.create("dist_sync")
    shape = (10**9, 64)
    kv.init("emb", RowSparse.empty(shape, np.float32, init=uniform(-0.1, 0.1, seed=1)))
    if args.momentum:
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    ids = sparse_floor.unique_ids(np.random.default_rng(0).integers(0, shape[0], args.touched))
    rows = np.ones((4096, shape[1]), np.float32)
    for lo in range(0, ids.size, 4096):
        chunk = ids[lo : lo + 4096]
        kv.pushpull("emb", RowSparse(chunk, rows[: chunk.size], shape))
    kv.barrier()
    print(f"READY {ids.size}", flush=True)
    sys.stdin.readline()
    kv.close()
    return 0


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def job_memory_rows(args) -> list[dict]:
    """VmRSS of each process of a job (scheduler, 2 servers, 1 worker) holding 10^6 rows."""
    rows = []
    for momentum in (False, True):
        env = dict(
            os.environ,
            DMLC_PS_ROOT_URI="127.0.0.1",
            DMLC_PS_ROOT_PORT=str(free_port()),
            DMLC_NUM_SERVER="2",
            DMLC_NUM_WORKER="1",
            DMLC_NODE_HOST="127.0.0.1",
            PYTHONPATH=str(ROOT),
            **SECURITY["auth"],
        )
        me = [sys.executable, str(Path(__file__).resolve()), "--as-memory-worker"]
        me += ["--touched", str(args.touched)] + (["--momentum"] if momentum else [])
        roles = [("scheduler", [sys.executable, "-m", "kvstore.scheduler"])]
        roles += [("server", [sys.executable, "-m", "kvstore.server"])] * 2
        procs = []
        try:
            for role, cmd in roles:
                procs.append((role, subprocess.Popen(cmd, env=dict(env, DMLC_ROLE=role), cwd=ROOT)))
            worker = subprocess.Popen(
                me,
                env=dict(env, DMLC_ROLE="worker", KVSTORE_RANK="0"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(("worker", worker))
            line = worker.stdout.readline()
            if not line.startswith("READY"):
                raise SystemExit(f"the memory worker failed: {line}{worker.stdout.read()}")
            mib = {f"{role} {i}": resident_mib(p.pid) for i, (role, p) in enumerate(procs)}
            worker.communicate("\n", timeout=args.timeout)
            for _, p in procs[:3]:
                p.wait(30)
        finally:
            for _, p in procs:  # by PID, whatever happened
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        rows.append(
            {
                "config": "job memory",
                "optimizer": "sgd momentum" if momentum else "none",
                "touched": int(line.split()[1]),
                "mib": mib,
                "total_mib": sum(mib.values()),
            }
        )
    return rows


def calls(kv, key, shape, grads, req) -> list:
    """(name, call, rows per call) of the measured operations on one table."""
    from kvstore.sparse import RowSparse

    out = RowSparse.empty(shape, np.float32)
    one = RowSparse.empty(shape, np.float32)
    turn = iter(range(1 << 30))

    def push_k(k=4):
        for _ in range(k):
            kv.push(key, grads[next(turn) % 4])
        kv.row_sparse_pull(key, out=one, row_ids=grads[0].indices[:1])

    def pull():
        kv.row_sparse_pull(key, out=out, row_ids=grads[next(turn) % 4].indices)

    def step():
        g = grads[next(turn) % 4]
        kv.push(key, g)
        kv.row_sparse_pull(key, out=out, row_ids=g.indices)

    def pushpull():
        kv.pushpull(key, grads[next(turn) % 4], out=out)

    return [
        ("push", push_k, 4 * req),
        ("pull", pull, req),
        ("step", step, req),
        ("pushpull", pushpull, req),
    ]


# ---------------------------------------------------------------- the driver


def run_cluster(args, anchor: str = "") -> list[dict]:
    env = dict(
        os.environ,
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(free_port()),
        DMLC_NUM_SERVER=str(args.servers),
        DMLC_NUM_WORKER=str(args.workers),
        DMLC_NODE_HOST="127.0.0.1",
        KVSTORE_REPLICAS=str(args.replicas),
        PYTHONPATH=str(ROOT),
        **SECURITY["auth"],
    )
    cmd = [sys.executable, str(Path(__file__).resolve()), "--as-worker", "--rows", str(args.rows)]
    cmd += ["--dims", args.dims if not anchor else "", "--reqs", args.reqs]
    cmd += ["--sharding", args.sharding]
    cmd += ["--reps", str(args.reps), "--anchor-steps", str(args.anchor_steps)]
    cmd += ["--anchor-repeats", str(args.anchor_repeats)]
    if anchor:
        cmd += ["--anchor", anchor, "--run-anchor"]
    procs, per_worker = [], []
    try:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "kvstore.scheduler"],
                env=dict(env, DMLC_ROLE="scheduler"),
                cwd=ROOT,  # -m puts the current directory first: this tree's kvstore, not another's
            )
        )
        procs += [
            subprocess.Popen(
                [sys.executable, "-m", "kvstore.server"],
                env=dict(env, DMLC_ROLE="server"),
                cwd=ROOT,
            )
            for _ in range(args.servers)
        ]
        workers = [
            subprocess.Popen(
                cmd,
                env=dict(env, DMLC_ROLE="worker", KVSTORE_RANK=str(i)),
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(args.workers)
        ]
        procs += workers
        for w in workers:
            out, _ = w.communicate(timeout=args.timeout)
            if w.returncode:
                raise SystemExit(f"a benchmark worker failed ({w.returncode}):\n{out}")
            per_worker.append(json.loads(out.split("RESULTS ", 1)[1]))
        for p in procs[: 1 + args.servers]:
            p.wait(30)
    finally:
        for p in procs:  # by PID, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait(10)
    rows = []
    for recs in zip(*per_worker, strict=True):  # per measurement: the mean over workers
        runs = [
            statistics.fmean(r["rows_per_s"][i] for r in recs)
            for i in range(len(recs[0]["rows_per_s"]))
        ]
        rows.append(
            {
                **{k: recs[0][k] for k in ("op", "dim", "req", "sharding")},
                "config": "kvstore",
                "median": statistics.median(runs),
                "min": min(runs),
                "max": max(runs),
                "n": len(runs),
                "workers": len(recs),
            }
        )
    return rows


def zmq_rows(args) -> list[dict]:
    """Bare pyzmq round trips of each request's row bytes (REQ x dim x 4), as rows/s: one
    pair (``zmq``: one process sends them all to one echo process, nothing else running), and
    a job of kvstore's shape (``zmq job``: W processes each send REQ / S rows' bytes to each
    of S echo processes at once, and wait for them all back)."""
    rows = []

    def record(config, dim, name, rates):
        rows.append(
            {
                "op": "step",
                "dim": dim,
                "req": name,
                "config": config,
                "median": statistics.median(rates),
                "min": min(rates),
                "max": max(rates),
                "n": len(rates),
            }
        )

    shapes = [
        (dim, name, REQS.get(name) or int(name))
        for dim in [int(d) for d in args.dims.split(",") if d]
        for name in args.reqs.split(",")
    ]
    with EchoServer() as echo:
        for dim, name, req in shapes:
            array = np.ones(req * dim, np.float32)
            back = np.empty_like(array)

            def once(array=array, back=back):
                echo.sock.send(array, copy=False)
                back[...] = np.frombuffer(echo.sock.recv(copy=False).buffer, np.float32)

            n = max(calls_for(args.reps, dim, req), 10)
            record("zmq", dim, name, [req / t for t in timed(once, n, 1e9)])
    for dim, name, req in shapes:
        nbytes = -(-req // args.servers) * dim * 4
        steps = job_rates(
            args.workers, args.servers, nbytes, max(calls_for(args.reps, dim, req), 20)
        )
        record("zmq job", dim, name, [req / t for t in steps])
    return rows


def memory_rows(touched=(10_000, 100_000, 1_000_000), dim: int = 64) -> list[dict]:
    """Bytes held by one row store of a 10^9-row table against rows touched (4k per push)."""
    from kvstore import optimizer as opt
    from kvstore.sparse import RowTable, uniform

    rows = []
    for momentum in (None, 0.9):
        for n in touched:
            table = RowTable(dim, np.float32, uniform(-0.1, 0.1, seed=1), rows=10**9)
            sgd = None if momentum is None else opt.SGD(learning_rate=0.1, momentum=momentum)
            ids = np.unique(np.random.default_rng(0).integers(0, 10**9, n))
            t0 = time.perf_counter()
            for chunk in np.array_split(ids, max(1, ids.size // 4096)):
                table.apply(chunk, np.ones((chunk.size, dim), np.float32), sgd, 1, 0.1)
            rows.append(
                {
                    "config": "memory",
                    "optimizer": "sgd momentum" if sgd else "none",
                    "touched": int(len(table)),
                    "dim": dim,
                    "bytes": table.nbytes,
                    "bytes_per_row": table.nbytes / len(table),
                    "insert_rows_per_s": len(table) / (time.perf_counter() - t0),
                }
            )
    return rows


def floor_rows(args) -> list[dict]:
    """The anchor's step done by bare designs with nothing but NumPy and one small message each
    way per server (``sparse_floor.py``), rows by hash and by range: how fast a Python
    parameter server can be here, and what each design choice is worth."""
    return [
        sparse_floor.run(
            args.workers,
            args.servers,
            args.anchor,
            args.anchor_steps,
            args.anchor_repeats,
            design,
            sharding,
            timeout=args.timeout,
        )  # fmt: skip
        for design, sharding in itertools.product(sparse_floor.DESIGNS, ("hash", "range"))
    ]


def run_mxnet(args) -> list[dict]:
    cmd = [
        args.mxnet,
        str(ANCHOR),
        "-W",
        str(args.workers),
        "-S",
        str(args.servers),
        "--sizes",
        "",
        "--row-sparse",
        args.anchor,
        "--row-sparse-steps",
        str(args.anchor_steps),
        "--repeats",
        str(args.anchor_repeats),
        "--timeout",
        str(args.timeout),
    ]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = job.communicate(timeout=args.timeout + 60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # its own session: its whole job, by PID
            job.wait(10)
    if job.returncode:
        raise SystemExit(f"the MXNet job failed ({job.returncode}): {' '.join(cmd)}\n{out}")
    for rec in (json.loads(x) for x in out.splitlines() if x.startswith("{")):
        if rec.get("bench") == "mxnet_ps" and rec.get("case") == "row_sparse":
            return [
                {
                    "op": "anchor",
                    "config": "mxnet",
                    "size": args.anchor,
                    **{k: rec[k] for k in ("median", "min", "max")},
                    "runs": rec["runs"],
                }
            ]
    raise SystemExit(f"the MXNet job printed no row_sparse result:\n{out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("-w", "--workers", type=int, default=2)
    ap.add_argument("-s", "--servers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=10**9, help="logical rows of each table")
    ap.add_argument("--dims", default="16,64,256")
    ap.add_argument("--reqs", default="1K,4K,64K", help="rows per request")
    ap.add_argument(
        "--reps",
        type=int,
        default=0,
        help="timed calls per measurement (0: enough to move 128 MiB of rows, 10 to 300)",
    )
    ap.add_argument("--sharding", default="hash", choices=["hash", "range"], help="the tables'")
    ap.add_argument("--replicas", type=int, default=1, help="KVSTORE_REPLICAS (copies of a part)")
    ap.add_argument("--anchor", default="100000x64x4096", help="ROWSxDIMxREQ")
    ap.add_argument("--run-anchor", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--anchor-steps", type=int, default=50)
    ap.add_argument("--anchor-repeats", type=int, default=3)
    ap.add_argument("--mxnet", default="", help="a Python with MXNet 1.9.1: run its anchor too")
    ap.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="run kvstore's grid and the bare ZeroMQ bounds this many times, alternated (and "
        "with --mxnet, MXNet's anchor and kvstore's), and print the ratio of each pair and "
        "their median (this machine's speed moves within minutes: one pair is one sample)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="kvstore's anchor beside sparse_floor.py's bare designs (--mxnet runs them too)",
    )
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--job-memory", action="store_true", help="a whole job's RSS, 10^6 rows")
    ap.add_argument("--touched", type=int, default=10**6, help=argparse.SUPPRESS)
    ap.add_argument("--as-memory-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--momentum", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error(f"--pairs {args.pairs}: at least 1")
    if args.as_worker:
        return worker_main(args)
    if args.as_memory_worker:
        return memory_worker(args)
    results = []
    if any(args.dims.split(",")):  # the grid, then its bare ZeroMQ bounds: --pairs times
        for pair in range(args.pairs):
            results += [dict(r, pair=pair) for r in run_cluster(args) + zmq_rows(args)]
    if args.mxnet or args.floor:  # back to back: MXNet, the floor, kvstore's same step; then
        # MXNet and kvstore again, alternated, --pairs times in all (the ratio of each pair)
        for pair in range(args.pairs):
            mx = run_mxnet(args) if args.mxnet else []
            floor = floor_rows(args) if pair == 0 else []
            ours = run_cluster(args, anchor=args.anchor)
            results += [dict(r, pair=pair) for r in mx] + floor + [dict(r, pair=pair) for r in ours]
    if not args.no_memory:
        results += memory_rows()
    if args.job_memory:
        results += job_memory_rows(args)
    for r in results:
        print(json.dumps(r), flush=True)
    print(table(results, args))
    return 0


def _or_low(x: float) -> float:
    """``max`` key: a missing (nan) rate loses to any measured one."""
    return -math.inf if math.isnan(x) else x


def table(results: list[dict], args) -> str:
    lines = [
        f"row-sparse, W={args.workers} S={args.servers} R={args.replicas} dist_sync, rows by "
        f"{args.sharding} "
        "(rows/s per worker; "
        "B/s = the better of push+pull and pushpull, rows/s x dim x 4; zmq pair: one "
        "round trip of those bytes between two processes alone; zmq job: W processes each "
        "sending them to S echo processes at once, kvstore's shape, per worker)",
        "",
    ]
    lines.append(
        f"{'dim':>4} {'rows/req':>8} {'push':>11} {'pull':>11} {'push+pull':>11} "
        f"{'pushpull':>11} {'B/s':>9} {'zmq pair':>9} {'vs pair':>7} {'zmq job':>9} "
        f"{'vs job':>7}"
    )
    grid = [r for r in results if r.get("config") in ("kvstore", "zmq", "zmq job") and "dim" in r]
    grid = [r for r in grid if not r["op"].startswith("anchor")]
    pairs = sorted({r.get("pair", 0) for r in grid})
    shapes = list(dict.fromkeys((r["dim"], r["req"]) for r in grid if r["config"] == "kvstore"))
    spread, nan = [], float("nan")
    for dim, req in shapes:
        # per pair: kvstore's rates and the bounds measured right after them
        rows = {p: {} for p in pairs}
        for r in grid:
            if (r["dim"], r["req"]) == (dim, req):
                name = r["op"] if r["config"] == "kvstore" else r["config"]
                rows[r.get("pair", 0)][name] = r["median"]
        per_pair = []
        for got in rows.values():  # (a cell a pair lacks: nan, left out of the medians)
            best = max(got.get("step", nan), got.get("pushpull", nan), key=_or_low) * dim * 4
            per_pair.append(
                {
                    **got,
                    "bytes": best,
                    "vs pair": best / (got.get("zmq", nan) * dim * 4),
                    "vs job": best / (got.get("zmq job", nan) * dim * 4),
                }
            )

        def mid(name, per_pair=per_pair):
            values = [p[name] for p in per_pair if not math.isnan(p.get(name, nan))]
            return statistics.median(values) if values else nan

        lines.append(
            f"{dim:>4} {req:>8} {mid('push'):>11,.0f} {mid('pull'):>11,.0f} "
            f"{mid('step'):>11,.0f} {mid('pushpull'):>11,.0f} {mid('bytes') / 1e6:>7.1f}MB "
            f"{mid('zmq') * dim * 4 / 1e6:>7.1f}MB {mid('vs pair'):>7.0%} "
            f"{mid('zmq job') * dim * 4 / 1e6:>7.1f}MB {mid('vs job'):>7.0%}"
        )
        if len(per_pair) > 1:
            spread.append(
                f"{dim:>4} {req:>8}: "
                + ", ".join(f"{p['vs pair']:.0%}/{p['vs job']:.0%}" for p in per_pair)
            )
    if spread:
        lines += [
            "",
            f"each of the {len(pairs)} alternated pairs (kvstore, then the bounds), vs pair/vs "
            "job (the table: the medians over the pairs):",
            *spread,
        ]
    mx = [r for r in results if r.get("config") == "mxnet"]
    mx_of = {r.get("pair", 0): r["median"] for r in mx}
    floor = {
        (r["config"].split()[1], r["sharding"]): r
        for r in results
        if r.get("config", "").startswith("floor ")
    }
    for (design, sharding), r in floor.items():
        lines.append(
            f"floor {args.anchor} (sparse_floor.py {design}, rows by {sharding}): "
            f"{r['median']:,.0f} rows/s"
            + (f", {r['median'] / mx[0]['median']:.2f}x MXNet" if mx else "")
        )
    for op, sharding in itertools.product(("anchor", "anchor pushpull"), ("hash", "range")):
        anchor = [
            r
            for r in results
            if r.get("op") == op and r.get("config") == "kvstore" and r["sharding"] == sharding
        ]
        if anchor and (mx or floor):
            call = "push + row_sparse_pull" if op == "anchor" else "pushpull"
            ours = anchor[0]["median"]
            line = f"anchor {args.anchor} ({call}, rows by {sharding}): kvstore {ours:,.0f} rows/s"
            if mx:
                line += f", MXNet {mx[0]['median']:,.0f} rows/s: {ours / mx[0]['median']:.2f}x"
            ratios = [r["median"] / mx_of[r["pair"]] for r in anchor if r.get("pair") in mx_of]
            if len(ratios) > 1:
                line += (
                    f" (in {len(ratios)} alternated pairs: "
                    + ", ".join(f"{x:.2f}x" for x in ratios)
                    + f"; median {statistics.median(ratios):.2f}x)"
                )
            for design in sparse_floor.DESIGNS:
                if (design, sharding) in floor:
                    line += f"; {ours / floor[design, sharding]['median']:.0%} of {design}"
            lines.append(line)
    for r in results:
        if r.get("config") == "job memory":
            parts = ", ".join(f"{k} {v:.0f}" for k, v in r["mib"].items())
            lines.append(
                f"whole job, {r['touched']:,} rows of dim 64 ({r['optimizer']}): "
                f"{r['total_mib']:.0f} MiB resident ({parts})"
            )
    mem = [r for r in results if r.get("config") == "memory"]
    if mem:
        lines += ["", "memory of one row store (10^9-row table, dim 64):"]
        for r in mem:
            lines.append(
                f"  {r['optimizer']:>12}: {r['touched']:>9,} rows  "
                f"{r['bytes'] / 2**20:8.1f} MiB  ({r['bytes_per_row']:.0f} B/row; "
                f"created at {r['insert_rows_per_s']:,.0f} rows/s)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
