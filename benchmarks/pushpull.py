"""Push/pull throughput of kvstore on 127.0.0.1, beside raw ZeroMQ and torch's gloo.

Starts a scheduler, S servers and W workers; every worker measures ``pushpull`` of one key
(4 KiB, 256 KiB, 4 MiB, 64 MiB of float32) as gradient bytes per second, and the steps per
second of 1000 keys of 1 KiB pushed and pulled as one list; for ``dist_sync`` and
``dist_async``, and with 2-bit compression. The same bytes through a bare pyzmq round trip
(``zmq_bound.py``) and, when torch is installed, through a gloo ``all_reduce`` of W ranks, are
measured in the same run. Prints one JSON line per measurement, then a table.

``--mxnet PYTHON`` (a Python with MXNet 1.9.1, e.g. a venv outside the repository) also runs
MXNet's KVStore on ps-lite (``mxnet_ps.py`` under that Python) with the same metric and the
same W, S and sizes (``kv.pushpull``, the call kvstore's side makes; ``--mxnet-op push_pull``:
push then pull; always ``--reps`` steps, as its workers must agree on the count), interleaved with
kvstore: MXNet, kvstore, MXNet, kvstore, ... for ``--repeats`` rounds per mode. Each kvstore
or MXNet row is then the median over rounds (min and max: over all rounds), and a
``kvstore/mxnet MODE`` row per size gives the paired ratio: the median of the per-round
ratios kvstore/MXNet, with their min and max.

    python benchmarks/pushpull.py -w 2 -s 2
    python benchmarks/pushpull.py --modes dist_sync --no-compression --no-gloo \
        --mxnet ../mxnet-venv/bin/python --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zmq_bound import human, memory_rates, parse_sizes, roundtrip_rates, summary, timed  # noqa

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- inside a worker


def worker_main(args) -> int:
    import kvstore

    kv = kvstore.create(args.mode)
    if args.compression:  # 2bit, 1bit; "+pull": compressed pulls too
        scheme, _, pull = args.compression.partition("+")
        params = {"type": scheme}
        if scheme == "2bit":
            params["threshold"] = 0.5
        if pull:
            params["pull"] = True
        kv.set_gradient_compression(params)
    sizes = parse_sizes(args.sizes)
    results = []
    for name, nbytes in sizes.items():
        grad = np.random.default_rng(kv.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(grad)
        kv.init(f"k{name}", np.zeros_like(grad))
        times = timed_together(
            kv,
            f"vote{name}",
            lambda grad=grad, out=out, name=name: kv.pushpull(f"k{name}", grad, out=out),
            args.reps,
            args.budget,
        )
        kv.barrier()
        results.append(summary(label(args), name, "B/s", [nbytes / t for t in times]))
    if args.keys:
        keys = [f"small{i}" for i in range(args.keys)]
        grads = [np.ones(256, np.float32) for _ in keys]
        outs = [np.empty(256, np.float32) for _ in keys]
        kv.init(keys, grads)
        step = lambda: kv.pushpull(keys, grads, out=outs)  # noqa: E731
        times = timed_together(kv, "vote.keys", step, args.reps, args.budget)
        kv.barrier()
        results.append(summary(label(args), f"{args.keys}x1K", "steps/s", [1 / t for t in times]))
    kv.close()
    print("RESULTS " + json.dumps(results), flush=True)
    return 0


def timed_together(kv, vote: str, fn, reps: int, budget: float, every: int = 8) -> list[float]:
    """:func:`timed` for a collective ``fn``: every worker makes the same number of calls.
    After every ``every`` calls the workers sum their wish to stop (untimed, on key ``vote``)
    and stop together once any has run out of calls or of ``budget``; a worker that stopped
    alone would leave the others' rounds waiting for it."""
    fn()
    fn()  # warm-up
    kv.init(vote, np.zeros(1, np.float32))
    flag, total = np.zeros(1, np.float32), np.zeros(1, np.float32)
    times, deadline = [], time.monotonic() + budget
    while True:
        for _ in range(min(every, reps - len(times))):  # the same count on every worker
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        flag[0] = len(times) >= reps or time.monotonic() >= deadline
        kv.pushpull(vote, flag, out=total)
        if total[0] > 0:
            return times


def label(args) -> str:
    replicas = int(os.environ.get("KVSTORE_REPLICAS") or 1)
    return (
        f"kvstore {args.mode}"
        + (f" {args.compression}" if args.compression else "")
        + (f" R={replicas}" if replicas > 1 else "")
    )


# ---------------------------------------------------------------- the driver

SECURITY = {  # --security: what the job runs with (see kvstore.auth)
    "auth": {"KVSTORE_SECRET": secrets.token_hex(32)},
    "encrypt": {"KVSTORE_SECRET": secrets.token_hex(32), "KVSTORE_ENCRYPT": "1"},
    "none": {"KVSTORE_INSECURE": "1"},
}


def run_cluster(args, mode: str, compression: str | None, replicas: int = 1) -> list[dict]:
    env = dict(
        os.environ,
        KVSTORE_REPLICAS=str(replicas),
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(free_port()),
        DMLC_NUM_SERVER=str(args.servers),
        DMLC_NUM_WORKER=str(args.workers),
        DMLC_NODE_HOST="127.0.0.1",
        PYTHONPATH=str(ROOT),
        **SECURITY[args.security],
    )
    procs = []
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
        cmd = worker_command(mode, args.sizes, args.reps, args.budget, args.keys, compression)
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
        per_worker = collect(workers, args.timeout)
        for p in procs[: 1 + args.servers]:
            p.wait(30)
    finally:
        for p in procs:  # by PID, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return mean_over_workers(per_worker)


def worker_command(mode, sizes, reps, budget, keys, compression=None) -> list[str]:
    """This script as one benchmark worker of a cluster (``--as-worker``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--as-worker", "--mode", mode]
    cmd += ["--sizes", sizes, "--reps", str(reps), "--budget", str(budget), "--keys", str(keys)]
    return cmd + (["--compression", compression] if compression else [])


def collect(workers: list, timeout: float) -> list[list[dict]]:
    """Each benchmark worker's results (its ``RESULTS`` line), or exit naming the failure."""
    per_worker = []
    for w in workers:
        out, _ = w.communicate(timeout=timeout)
        if w.returncode:
            raise SystemExit(f"a benchmark worker failed ({w.returncode}):\n{out}")
        per_worker.append(json.loads(out.split("RESULTS ", 1)[1]))
    return per_worker


def mean_over_workers(per_worker: list[list[dict]]) -> list[dict]:
    """One row per measurement: each statistic averaged over the workers (or ranks)."""
    merged = []
    for rows in zip(*per_worker, strict=True):
        row = dict(rows[0], workers=len(rows))
        for stat in ("median", "min", "max"):
            row[stat] = statistics.fmean(r[stat] for r in rows)
        merged.append(row)
    return merged


def run_mxnet(args, mode: str) -> list[dict]:
    """One MXNet ps-lite job (``mxnet_ps.py`` under ``args.mxnet``) measuring what a kvstore
    cluster measures, in the same rows: per-step rates, ``args.reps`` steps, means over workers.
    """
    sizes = parse_sizes(args.sizes)
    cmd = [args.mxnet, str(Path(__file__).resolve().parent / "mxnet_ps.py")]
    cmd += ["-W", str(args.workers), "-S", str(args.servers), "--mode", mode, "--repeats", "1"]
    cmd += ["--sizes", ",".join(str(n) for n in sizes.values()), "--per-step"]
    cmd += ["--min-steps", str(args.reps), "--max-steps", str(args.reps)]
    cmd += ["--op", args.mxnet_op, "--timeout", str(args.timeout)]
    if args.keys:
        cmd += ["--many-keys", f"{args.keys}x1K", "--many-keys-steps", str(args.reps)]
    # its own session: should it outlive the timeout (or Ctrl-C), its whole group (scheduler,
    # servers, workers) is killed through its PID
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = job.communicate(timeout=args.timeout + 60)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"the MXNet job ran past {args.timeout + 60:.0f}s: {cmd}") from None
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(10)
    if job.returncode:
        raise SystemExit(f"the MXNet job failed ({job.returncode}): {' '.join(cmd)}\n{out}")
    names = {nbytes: name for name, nbytes in sizes.items()}
    rows = []
    for rec in (json.loads(line) for line in out.splitlines() if line.startswith("{")):
        if rec["bench"] != "mxnet_ps":
            continue
        single = rec["case"] == "single_key"
        scale = 1e9 if single else 1  # its GB/s to B/s
        row = {
            "config": f"mxnet {mode}",
            "size": names[rec["bytes"]] if single else f"{args.keys}x1K",
            "unit": "B/s" if single else "steps/s",
            **{stat: rec[stat] * scale for stat in ("median", "min", "max")},
            "n": rec["steps"],
            "workers": rec["workers"],
            "op": rec["op"],
        }
        rows.append(row)
    return rows


def merge_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per measurement over several rounds of the same job: the median of the rounds'
    medians, the min and max over all rounds, and each round's median."""
    if len(rounds) == 1:
        return rounds[0]
    merged = []
    for rows in zip(*rounds, strict=True):
        medians = [r["median"] for r in rows]
        row = dict(rows[0], median=statistics.median(medians), rounds=medians)
        row.update(min=min(r["min"] for r in rows), max=max(r["max"] for r in rows))
        row["n"] = sum(r["n"] for r in rows)
        merged.append(row)
    return merged


def paired_ratios(
    ours: list[list[dict]], peer: list[list[dict]], mode: str, name: str = "kvstore/mxnet"
) -> list[dict]:
    """Per size, kvstore's median over MXNet's in each round (the two ran back to back): the
    median of these ratios, their min and max.

    >>> a = [[{"size": "4K", "median": 2.0}], [{"size": "4K", "median": 3.0}]]
    >>> b = [[{"size": "4K", "median": 1.0}], [{"size": "4K", "median": 2.0}]]
    >>> paired_ratios(a, b, "dist_sync")[0]["pairs"]
    [2.0, 1.5]
    """
    per_size: dict = {}
    for kv_rows, mx_rows in zip(ours, peer, strict=True):
        mx_median = {r["size"]: r["median"] for r in mx_rows}
        for r in kv_rows:
            if r["size"] in mx_median:
                per_size.setdefault(r["size"], []).append(r["median"] / mx_median[r["size"]])
    return [
        {
            "config": f"{name} {mode}",
            "size": size,
            "unit": "ratio",
            "median": statistics.median(pairs),
            "min": min(pairs),
            "max": max(pairs),
            "n": len(pairs),
            "pairs": pairs,
        }
        for size, pairs in per_size.items()
    ]


def _gloo_rank(rank, world, port, sizes, reps, budget, queue):
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = []
    for name, nbytes in sizes.items():
        tensor = torch.ones(nbytes // 4)
        times = timed(lambda tensor=tensor: dist.all_reduce(tensor), reps, budget)
        results.append(summary("gloo all_reduce", name, "B/s", [nbytes / t for t in times]))
        dist.barrier()
    dist.destroy_process_group()
    queue.put((rank, results))


def run_gloo(args) -> list[dict]:
    try:
        import torch.multiprocessing as tmp
    except ImportError:
        print("torch not installed: no gloo line (pip install -e '.[bench]')", file=sys.stderr)
        return []
    ctx = tmp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(
            target=_gloo_rank,
            args=(r, args.workers, port, parse_sizes(args.sizes), args.reps, args.budget, queue),
        )
        for r in range(args.workers)
    ]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=args.timeout) for _ in procs]
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return mean_over_workers([r for _, r in sorted(rows)])


def table(results: list[dict]) -> str:
    bound = {r["size"]: r["median"] for r in results if r["config"] == "zmq"}
    lines = [f"{'config':<26} {'size':>8} {'median':>18} {'min':>18} {'max':>18} {'vs zmq':>7}"]
    for r in results:
        paired = r["unit"] == "ratio"  # kvstore/MXNet: no bound
        ratio = r["median"] / bound[r["size"]] if r["size"] in bound and not paired else None
        lines.append(
            f"{r['config']:<26} {r['size']:>8} {shown(r['median'], r['unit']):>18} "
            f"{shown(r['min'], r['unit']):>18} {shown(r['max'], r['unit']):>18} "
            f"{'' if ratio is None else f'{ratio:6.0%}':>7}"
        )
    return "\n".join(lines)


def shown(value: float, unit: str) -> str:
    return f"{value:.2f}x" if unit == "ratio" else human(value, unit)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-w", "--workers", type=int, default=2)
    p.add_argument("-s", "--servers", type=int, default=2)
    p.add_argument("--modes", default="dist_sync,dist_async")
    p.add_argument("--sizes", default="4K,256K,4M,64M")
    p.add_argument("--keys", type=int, default=1000, help="the many-small-keys case (0: skip)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget", type=float, default=5.0, help="seconds per measurement at most")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument(
        "--security", choices=sorted(SECURITY), default="auth", help="default: auth (as jobs run)"
    )
    p.add_argument("--no-compression", action="store_true")
    p.add_argument(
        "--mxnet",
        metavar="PYTHON",
        help="a Python with MXNet 1.9.1: measure its ps-lite KVStore beside kvstore, interleaved",
    )
    p.add_argument(
        "--mxnet-op",
        choices=["pushpull", "push_pull"],
        default="pushpull",
        help="MXNet's kv.pushpull (one round trip, as Gluon's Trainer) or kv.push then kv.pull",
    )
    p.add_argument(
        "--replicas",
        default="1",
        help="KVSTORE_REPLICAS values to run side by side, e.g. 1,2 (each mode's clusters "
        "alternate between them; the paired ratio to the first is printed)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of each mode's cluster (with --mxnet: MXNet, kvstore, MXNet, kvstore, ...)",
    )
    p.add_argument(
        "--plot", help="draw the results into this PNG (needs matplotlib: the bench extra)"
    )
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--compression", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.as_worker:
        return worker_main(args)
    started = time.monotonic()
    results = roundtrip_rates(parse_sizes(args.sizes), args.reps, args.budget, args.keys or 1)
    modes = args.modes.split(",")
    if args.mxnet and not Path(args.mxnet).exists():
        raise SystemExit(f"--mxnet {args.mxnet}: no such interpreter (a Python with MXNet 1.9.1)")
    counts = [int(r) for r in args.replicas.split(",")]
    if any(not 1 <= r <= args.servers for r in counts):
        raise SystemExit(f"--replicas {args.replicas}: each between 1 and -s {args.servers}")
    ours: dict = {(mode, r): [] for mode in modes for r in counts}
    peer: dict = {mode: [] for mode in modes}
    for _ in range(args.repeats):  # rounds, so that a slow spell of the machine hits both
        for mode in modes:
            if args.mxnet:
                peer[mode].append(run_mxnet(args, mode))
            for r in counts:
                ours[mode, r].append(run_cluster(args, mode, None, r))
    for mode in modes:
        first = ours[mode, counts[0]]
        results += merge_rounds(first)
        for r in counts[1:]:
            name = f"R={r}/R={counts[0]}"
            results += merge_rounds(ours[mode, r]) + paired_ratios(ours[mode, r], first, mode, name)
        if args.mxnet:
            results += merge_rounds(peer[mode]) + paired_ratios(first, peer[mode], mode)
    if not args.no_compression:
        results += run_cluster(args, "dist_sync", "2bit")
    if not args.no_gloo:
        results += run_gloo(args)
    results += memory_rates()
    for r in results:
        print(json.dumps({**r, "cores": os.cpu_count()}))
    print(
        f"\nW={args.workers} S={args.servers} on {os.cpu_count()} cores, "
        f"{time.monotonic() - started:.0f}s; kvstore, MXNet and gloo figures are per worker"
        + (f"; {args.repeats} rounds, medians over rounds" if args.repeats > 1 else "")
    )
    print(table(results))
    if args.plot:
        plot(results, args.plot, f"W={args.workers} S={args.servers}, {os.cpu_count()} cores")
    return 0


def plot(results: list[dict], path: str, title: str) -> None:
    """Throughput against message size, log-log: a line per system and mode, bounds dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return
    sizes: dict = {}  # "4M" -> bytes, for the sizes measured (not the many-keys case)
    for r in results:
        if "x" not in r["size"]:
            sizes.update(parse_sizes(r["size"]))
    lines: dict = {}
    for r in results:
        if r["unit"] == "B/s" and r["size"] in sizes and not r["config"].startswith("numpy"):
            lines.setdefault(r["config"], []).append((sizes[r["size"]], r["median"] / 2**20))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config, points in lines.items():
        points.sort()
        xs, ys = zip(*points, strict=True)
        bound = config == "zmq"
        ax.plot(
            xs,
            ys,
            "--" if bound else "-",
            marker="o",
            label="raw ZeroMQ round trip" if bound else config,
        )
    memory = [r["median"] / 2**20 for r in results if r["config"] == "numpy copy"]
    if memory:
        ax.axhline(memory[0], linestyle=":", color="grey", label="NumPy copy (memory bound)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("MiB/s per worker")
    ax.set_title(f"pushpull throughput, {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
