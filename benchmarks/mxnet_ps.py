"""MXNet 1.9.1 ps-lite KVStore (dist_sync / dist_async) throughput on loopback.

The peer kvstore replaces, measured with kvstore's metric; ``pushpull.py --mxnet PYTHON`` runs
this script under that Python, interleaved with kvstore's own runs. It needs only the standard
library and MXNet (not kvstore), so it runs in a separate environment.

Launcher (default): starts 1 scheduler + S servers + W workers as separate processes (env
DMLC_ROLE, DMLC_PS_ROOT_URI=127.0.0.1, DMLC_PS_ROOT_PORT=<free>, DMLC_NUM_SERVER,
DMLC_NUM_WORKER, DMLC_NODE_HOST=127.0.0.1), waits for them (bounded by --timeout), kills
leftovers by PID, aggregates worker JSON.

Each worker, per size: kv.init(key, zeros); warmup; then a fixed number of
  kv.push(key, grad); kv.pull(key, out=arr); arr.wait_to_read()
steps (``--op pushpull``: one kv.pushpull(key, grad, out=arr) instead)
(the same count on every worker, so dist_sync never hangs). Repeated --repeats times, each
run starts after kv._barrier(). Metric: per-worker gradient bytes pushed per second
(size*steps/time); the same bytes are pulled back, so wire traffic per worker is 2x that.
``--per-step`` times every step instead and reports the median of the per-step rates, with
the slowest and fastest step as min and max (each averaged over workers): pushpull.py's metric.

--many-keys: N keys x K bytes, list API push(keys, grads); pull(keys, outs); waitall();
reports steps/s.

Prints one JSON line per measurement (runs/median/min/max over repeats; each run value is the
mean over workers of per-worker throughput).

Needs a Python with MXNet 1.9.1, outside the repository:
  python3 -m venv /work/mxnet-venv
  /work/mxnet-venv/bin/pip install mxnet==1.9.1 'numpy<1.24' pyzmq msgpack
Examples:
  /work/mxnet-venv/bin/python benchmarks/mxnet_ps.py -W 2 -S 2 --sizes 4K,256K,4M,64M \\
      --many-keys 1000x1K
  /work/mxnet-venv/bin/python benchmarks/mxnet_ps.py -W 2 -S 1 --mode dist_async --sizes 4M
  /work/mxnet-venv/bin/python benchmarks/mxnet_ps.py -W 2 -S 2 --sizes '' \\
      --row-sparse 100000x64x4096
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

METRIC = {"single_key": "gbps", "many_keys": "steps_per_s", "row_sparse": "rows_per_s"}
UNIT = {
    "single_key": "GB/s pushed per worker",
    "many_keys": "steps/s per worker",
    "row_sparse": "rows/s pushed (and pulled) per worker",
}


def parse_size(s: str) -> int:
    """Bytes of a size such as ``4K``, ``256KiB`` or ``64M``: ``parse_size("4K") == 4096``."""
    s = s.strip().upper().rstrip("B").rstrip("I")
    mult = 1
    if s.endswith("K"):
        mult, s = 1024, s[:-1]
    elif s.endswith("M"):
        mult, s = 1024**2, s[:-1]
    elif s.endswith("G"):
        mult, s = 1024**3, s[:-1]
    return int(float(s) * mult)


def fmt_size(n: int) -> str:
    for unit, m in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return f"{n}B"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steps_for(size: int, budget: int, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, budget // size)))


def timed_run(step, steps: int, per_step: bool) -> tuple[float, list[float]]:
    """Seconds for ``steps`` calls of ``step``, and each call's seconds when ``per_step``."""
    times = []
    t0 = time.perf_counter()
    for _ in range(steps):
        if per_step:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        else:
            step()
    return time.perf_counter() - t0, times


def rates(rec: dict, metric: str, work: float, elapsed: float, times: list[float]) -> dict:
    """``rec`` with ``metric``, ``work`` done per step per second: over the whole run, or, with
    per-step times, the median of the per-step rates and the slowest and fastest step."""
    if not times:
        return dict(rec, **{metric: work * rec["steps"] / elapsed})
    per_step = [work / t for t in times]
    return dict(
        rec,
        **{metric: statistics.median(per_step)},
        step_min=min(per_step),
        step_max=max(per_step),
    )


# --------------------------------------------------------------------------- worker
def worker_main(a: argparse.Namespace) -> None:
    # imported here, not at the top: the launcher runs without MXNet
    import mxnet as mx

    kv = mx.kv.create(a.mode)
    measure(a, kv)
    kv._barrier()
    del kv  # rank 0 stops servers in the destructor
    gc.collect()


def measure(a: argparse.Namespace, kv) -> None:
    """Every case asked for, on the store ``kv``: one ``RESULT {json}`` line per run."""
    import mxnet as mx
    import numpy as np

    rank, nw = kv.rank, kv.num_workers

    def emit(rec):
        rec.update({"rank": rank, "num_workers": nw})
        print("RESULT " + json.dumps(rec), flush=True)

    if a.mode == "dist_async" or a.optimizer != "none":
        # dist_async needs a server-side updater; plain SGD (C++ sgd_update)
        opt = mx.optimizer.SGD(learning_rate=0.0, momentum=0.0, wd=0.0, rescale_grad=1.0)
        kv.set_optimizer(opt)

    def exchange(key, grad, out):
        if a.op == "pushpull":
            kv.pushpull(key, grad, out=out)
        else:
            kv.push(key, grad)
            kv.pull(key, out=out)

    budget = parse_size(a.budget)
    key_base = 0
    for size in [parse_size(s) for s in a.sizes.split(",")] if a.sizes else []:
        n = size // 4
        key = key_base
        key_base += 1
        kv.init(key, mx.nd.zeros((n,)))
        grad = mx.nd.array(np.random.rand(n).astype(np.float32) * 1e-3)
        arr = mx.nd.zeros((n,))

        def step(key=key, grad=grad, arr=arr):
            exchange(key, grad, arr)
            arr.wait_to_read()

        steps = steps_for(size, budget, a.min_steps, a.max_steps)
        for _ in range(min(3, steps)):  # warmup
            step()
        for r in range(a.repeats):
            kv._barrier()
            el, times = timed_run(step, steps, a.per_step)
            rec = {"case": "single_key", "size": fmt_size(size), "bytes": size, "repeat": r}
            rec.update(steps=steps, seconds=el, ms_per_step=el / steps * 1e3)
            emit(rates(rec, "gbps", size / 1e9, el, times))
    if a.many_keys:
        nkeys_s, ksize_s = a.many_keys.lower().split("x")
        nkeys, ksize = int(nkeys_s), parse_size(ksize_s)
        n = ksize // 4
        keys = list(range(1000, 1000 + nkeys))
        kv.init(keys, [mx.nd.zeros((n,)) for _ in keys])
        grads = [mx.nd.array(np.random.rand(n).astype(np.float32) * 1e-3) for _ in keys]
        outs = [mx.nd.zeros((n,)) for _ in keys]

        def many():
            exchange(keys, grads, outs)
            mx.nd.waitall()

        steps = a.many_keys_steps
        for _ in range(2):
            many()
        for r in range(a.repeats):
            kv._barrier()
            el, times = timed_run(many, steps, a.per_step)
            rec = {"case": "many_keys", "nkeys": nkeys, "key_size": fmt_size(ksize), "repeat": r}
            rec.update(steps=steps, seconds=el, gbps=nkeys * ksize * steps / el / 1e9)
            emit(rates(rec, "steps_per_s", 1, el, times))
    if a.row_sparse:
        row_sparse(a, kv, emit)


def row_sparse(a: argparse.Namespace, kv, emit) -> None:
    """A ROWS x DIM row_sparse table; each step every worker pushes REQ random rows (ones) and
    row_sparse_pulls the same rows back."""
    import mxnet as mx
    import numpy as np

    rows, dim, req = (int(x) for x in a.row_sparse.lower().split("x"))
    key = 5000
    # MXNet refuses to init a row_sparse key with no rows ("init with empty data"), and stores
    # every row anyway: init with a full table, as its nightly test does
    kv.init(key, mx.nd.ones((rows, dim)).tostype("row_sparse"))
    rs_out = mx.nd.sparse.zeros("row_sparse", (rows, dim))
    rng = np.random.default_rng(kv.rank)
    vals = np.ones((req, dim), np.float32)

    def one():
        ids = np.unique(rng.integers(0, rows, req)).astype(np.int64)
        g = mx.nd.sparse.row_sparse_array((vals[: len(ids)], ids), shape=(rows, dim))
        kv.push(key, g)
        kv.row_sparse_pull(key, out=rs_out, row_ids=mx.nd.array(ids, dtype="int64"))
        rs_out.wait_to_read()
        return len(ids)

    for _ in range(2):
        one()
    for r in range(a.repeats):
        kv._barrier()
        t0 = time.perf_counter()
        n = sum(one() for _ in range(a.row_sparse_steps))
        el = time.perf_counter() - t0
        emit(
            {
                "case": "row_sparse",
                "size": a.row_sparse,
                "repeat": r,
                "steps": a.row_sparse_steps,
                "seconds": el,
                "rows_per_s": n / el,
                "gbps": n * dim * 4 / el / 1e9,
            }
        )


# --------------------------------------------------------------------------- launcher
def launch(a: argparse.Namespace) -> int:
    """Run the job; print one JSON line per measurement; 0 when every process ended well."""
    port = a.port or free_port()
    base = dict(os.environ)
    base.update(
        {
            "DMLC_PS_ROOT_URI": "127.0.0.1",
            "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_SERVER": str(a.servers),
            "DMLC_NUM_WORKER": str(a.workers),
            "DMLC_NODE_HOST": "127.0.0.1",  # advertise loopback only
            "DMLC_INTERFACE": "lo",
            "PS_VERBOSE": "0",
        }
    )
    if a.omp_threads:
        base["OMP_NUM_THREADS"] = str(a.omp_threads)
    if a.van_local:
        base["DMLC_LOCAL"] = "1"  # ps-lite zmq van uses ipc:// sockets in the temp dir
    if a.bigarray_bound:
        base["MXNET_KVSTORE_BIGARRAY_BOUND"] = str(a.bigarray_bound)

    me = os.path.abspath(__file__)
    logdir = tempfile.mkdtemp(prefix="mxps-")
    procs = []

    def start(role, idx, argv):
        env = dict(base, DMLC_ROLE=role)
        f = open(os.path.join(logdir, f"{role}{idx}.log"), "w")  # closed in launch's finally
        p = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)
        procs.append((role, idx, p, f))
        return p

    server_argv = [sys.executable, "-c", "import mxnet"]  # import runs server/scheduler loop
    start("scheduler", 0, server_argv)
    for i in range(a.servers):
        start("server", i, server_argv)
    wargv = [sys.executable, me, "--worker", "--mode", a.mode, "--repeats", str(a.repeats)]
    wargv += ["--budget", a.budget, "--min-steps", str(a.min_steps)]
    wargv += ["--max-steps", str(a.max_steps), "--op", a.op, "--optimizer", a.optimizer]
    wargv += ["--many-keys-steps", str(a.many_keys_steps), "--sizes", a.sizes]
    if a.per_step:
        wargv += ["--per-step"]
    if a.many_keys:
        wargv += ["--many-keys", a.many_keys]
    if a.row_sparse:
        wargv += ["--row-sparse", a.row_sparse, "--row-sparse-steps", str(a.row_sparse_steps)]
    for i in range(a.workers):
        start("worker", i, wargv)

    deadline = time.time() + a.timeout
    status = "ok"
    try:
        for role, _, p, _ in procs:
            if role != "worker":
                continue
            left = deadline - time.time()
            try:
                p.wait(timeout=max(1, left))
            except subprocess.TimeoutExpired:
                status = "timeout"
                break
        # servers/scheduler should exit once rank 0 stops them
        for role, _, p, _ in procs:
            if role == "worker":
                continue
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for _, _, p, f in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL by PID, only our own children
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            f.close()

    rcs = {f"{role}{idx}": p.returncode for role, idx, p, _ in procs}
    results = []
    for role, idx, _, _ in procs:
        if role != "worker":
            continue
        with open(os.path.join(logdir, f"worker{idx}.log")) as fh:
            for line in fh:
                if line.startswith("RESULT "):
                    results.append(json.loads(line[7:]))
    cfg = {
        "mode": a.mode,
        "W": a.workers,
        "S": a.servers,
        "op": a.op,
        "optimizer": "sgd" if (a.mode == "dist_async" or a.optimizer != "none") else "none",
        "van": "ipc(DMLC_LOCAL)" if a.van_local else "tcp",
        "omp_threads": a.omp_threads or "default",
        "bigarray_bound": a.bigarray_bound or 1000000,
        "per_step": a.per_step,
    }
    ok = status == "ok" and all(rc in (0, None) for rc in rcs.values())
    if not ok:
        tails = {}
        for role, idx, _, _ in procs:
            with open(os.path.join(logdir, f"{role}{idx}.log"), errors="replace") as fh:
                tails[f"{role}{idx}"] = fh.read()[-1500:]
        error = {"bench": "mxnet_ps_error", **cfg, "status": status, "rcs": rcs}
        print(json.dumps({**error, "log_tails": tails, "logdir": logdir}), flush=True)
    for rec in aggregate(results, cfg):
        print(json.dumps(rec), flush=True)
    if ok:
        shutil.rmtree(logdir, ignore_errors=True)  # keep logs only on failure
    return 0 if ok else 1


def aggregate(results: list[dict], cfg: dict) -> list[dict]:
    """Per repeat, the mean over workers; then the median, min and max over repeats (with
    per-step figures, min and max are the slowest and fastest step, averaged over workers)."""
    groups: dict = {}
    for r in results:
        k = (r["case"], r.get("size") or f"{r['nkeys']}x{r['key_size']}")
        groups.setdefault(k, {}).setdefault(r["repeat"], []).append(r)
    records = []
    for (case, label), reps in groups.items():
        metric = METRIC[case]
        runs = [rs for _, rs in sorted(reps.items())]
        vals = [statistics.mean(x[metric] for x in rs) for rs in runs]
        first = runs[0][0]
        rec = {"bench": "mxnet_ps", **cfg, "case": case, "size": label, "unit": UNIT[case]}
        rec.update(median=statistics.median(vals), min=min(vals), max=max(vals))
        if "step_min" in first:
            rec["min"] = min(statistics.mean(x["step_min"] for x in rs) for rs in runs)
            rec["max"] = max(statistics.mean(x["step_max"] for x in rs) for rs in runs)
        rec.update(runs=[round(v, 4) for v in vals], steps=first["steps"], workers=len(runs[0]))
        if case == "single_key":
            rec["bytes"] = first["bytes"]
            ms = [statistics.mean(x["ms_per_step"] for x in rs) for rs in runs]
            rec["ms_per_step_median"] = round(statistics.median(ms), 3)
        else:  # many_keys, row_sparse
            g = [statistics.mean(x["gbps"] for x in rs) for rs in runs]
            rec["gbps_median"] = round(statistics.median(g), 4)
        records.append(rec)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("-W", "--workers", type=int, default=2)
    ap.add_argument("-S", "--servers", type=int, default=1)
    ap.add_argument("--mode", default="dist_sync", choices=["dist_sync", "dist_async"])
    ap.add_argument("--sizes", default="4K,256K,4M,64M", help="'' to skip single-key case")
    ap.add_argument("--many-keys", default="", help="e.g. 1000x1K")
    ap.add_argument("--many-keys-steps", type=int, default=30)
    ap.add_argument("--row-sparse", default="", help="ROWSxDIMxREQ, e.g. 100000x64x4096")
    ap.add_argument("--row-sparse-steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", default="512M", help="bytes pushed per run -> steps")
    ap.add_argument("--min-steps", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--op", default="push_pull", choices=["push_pull", "pushpull"])
    ap.add_argument(
        "--per-step",
        action="store_true",
        help="time each step: median of per-step rates, slowest/fastest step (pushpull.py's)",
    )
    ap.add_argument(
        "--optimizer",
        default="none",
        choices=["none", "sgd"],
        help="server updater for dist_sync (dist_async always uses sgd)",
    )
    ap.add_argument("--omp-threads", type=int, default=1)
    ap.add_argument("--van-local", action="store_true", help="DMLC_LOCAL=1 (ipc transport)")
    ap.add_argument("--bigarray-bound", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=400)
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(a)
        return 0
    env = {"bench": "env", "python": platform.python_version(), "nproc": os.cpu_count()}
    print(json.dumps(env), flush=True)
    return launch(a)


if __name__ == "__main__":
    sys.exit(main())
