"""kvstore and gloo across a simulated network: two hosts as network namespaces joined by a
veth link shaped with ``tc`` (token bucket), each host running one worker and one server (the
colocated layout BytePS deploys), the scheduler on the first.

    sudo python benchmarks/netsim.py --rates 1gbit,10gbit --sizes 4M,64M

For each link rate it measures, per worker: ``dist_sync`` pushpull, the same with 2-bit and
1-bit compression, and gloo's ``all_reduce`` between the two hosts (when torch is installed),
and prints one JSON line per measurement and a table. ``--compressions`` picks the kvstore
rows (``none``, ``2bit``, ``1bit``, and ``2bit+pull``, ``1bit+pull``: the pulls compressed
too, ``{'pull': True}``). With ``--torch-step`` it measures
instead ``benchmarks/torch_step.py``'s kvstore.torch step (one worker per host), float32
and ``Compression.fp16``:

    sudo python benchmarks/netsim.py --rates 1gbit --torch-step --batch-size 16

With ``--sparse ROWSxDIMxREQ`` it measures instead ``benchmarks/sparse.py``'s row-sparse
anchor step (a push of REQ random rows then a ``row_sparse_pull`` of them, and the same as
one ``pushpull``; the rows spread by hash and by range), one worker per host:

    sudo python benchmarks/netsim.py --rates 1gbit,10gbit --sparse 100000x64x4096

It creates the namespaces and the link
itself and removes them whatever happens (needs root, ``ip`` and ``tc``; otherwise it says so
and exits 0). The kernel here has no ``netem``, so the link has a rate but no added delay.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pushpull import collect, mean_over_workers, worker_command  # noqa: E402
from zmq_bound import human  # noqa: E402

HOSTS = ("kvsimA", "kvsimB")
ADDRESS = {"kvsimA": "10.77.0.1", "kvsimB": "10.77.0.2"}


def why_not() -> str:
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2)"
    return ""


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


class Link:
    """Two namespaces and a shaped veth pair between them; removed on exit."""

    def __init__(self, rate: str):
        self.rate = rate

    def __enter__(self):
        self.__exit__()
        for ns in HOSTS:
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", "kvsimA0", "type", "veth", "peer", "name", "kvsimB0")
        for ns, dev in zip(HOSTS, ("kvsimA0", "kvsimB0"), strict=True):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ADDRESS[ns]}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            burst = "4mb" if "10g" in self.rate else "512kb"
            sh(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                self.rate,
                "burst",
                burst,
                "latency",
                "20ms",
            )
        return self

    def __exit__(self, *exc):
        for ns in HOSTS:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)


def in_ns(ns: str, argv: list[str], env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, **kw)


def kvstore_env() -> dict:
    return dict(
        os.environ,
        DMLC_PS_ROOT_URI=ADDRESS["kvsimA"],
        DMLC_PS_ROOT_PORT="9511",
        DMLC_NUM_SERVER="2",
        DMLC_NUM_WORKER="2",
        PYTHONPATH=str(ROOT),
        KVSTORE_SECRET=secrets.token_hex(32),
        KVSTORE_STATUS_PORT="0",
        # the namespaces share this machine's memory: shared memory would bypass the link
        KVSTORE_SHM="0",
    )


def run_kvstore(args, compression: str | None) -> list[dict]:
    worker_cmd = worker_command("dist_sync", args.sizes, args.reps, args.budget, 0, compression)
    return mean_over_workers(collect_from(kvstore_job(worker_cmd), collect, args.timeout))


def run_torch_step(args, fp16: bool) -> dict:
    """benchmarks/torch_step.py's kvstore.torch step, one worker per host: its row."""
    worker_cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "torch_step.py"),
        "--role",
        "kvstore-worker",
        *("--steps", str(args.steps), "--warmup", "2", "--batch-size", str(args.batch_size)),
    ] + (["--fp16"] if fp16 else [])

    def rank0(workers, timeout):
        outs = [w.communicate(timeout=timeout)[0] for w in workers]
        for w, out in zip(workers, outs, strict=True):
            if w.returncode:
                raise SystemExit(f"a torch step worker failed ({w.returncode}):\n{out}")
        line = next(o for o in outs if "RESULT " in o).split("RESULT ", 1)[1].splitlines()[0]
        return json.loads(line)

    result = collect_from(kvstore_job(worker_cmd), rank0, args.timeout)
    return {
        "config": f"torch step {'fp16' if fp16 else 'fp32'}",
        "batch_size": args.batch_size,
        "step_s_median": statistics.median(result["medians"]),
        "per_worker_median_s": result["medians"],
    }


def run_sparse(args) -> list[dict]:
    """benchmarks/sparse.py's anchor step, one worker per host: rows/s per worker (the mean
    over the workers of each repeat, then the median of the repeats)."""
    worker_cmd = [sys.executable, str(ROOT / "benchmarks" / "sparse.py"), "--as-worker"]
    worker_cmd += ["--dims", "", "--run-anchor", "--anchor", args.sparse]
    worker_cmd += ["--anchor-steps", str(args.steps), "--anchor-repeats", "3"]

    def read(workers, timeout):
        outs = [w.communicate(timeout=timeout)[0] for w in workers]
        for w, out in zip(workers, outs, strict=True):
            if w.returncode:
                raise SystemExit(f"a sparse worker failed ({w.returncode}):\n{out}")
        return [json.loads(o.split("RESULTS ", 1)[1].splitlines()[0]) for o in outs]

    per_worker = collect_from(kvstore_job(worker_cmd), read, args.timeout)
    rows = []
    for recs in zip(*per_worker, strict=True):
        runs = [statistics.fmean(r["rows_per_s"][i] for r in recs) for i in range(3)]
        rows.append(
            {
                "config": f"{recs[0]['op']}, rows by {recs[0]['sharding']}",
                "size": args.sparse,
                "median": statistics.median(runs),
                "runs": runs,
            }
        )
    return rows


def kvstore_job(worker_cmd: list[str]) -> tuple[list, list]:
    """A scheduler on the first host, a server and a worker on each: (every process,
    the workers)."""
    env = kvstore_env()
    procs = []
    try:
        procs.append(
            in_ns(
                "kvsimA",
                [sys.executable, "-m", "kvstore.scheduler"],
                dict(env, DMLC_ROLE="scheduler", DMLC_NODE_HOST=ADDRESS["kvsimA"]),
            )
        )
        for i, ns in enumerate(HOSTS):
            host_env = dict(env, DMLC_NODE_HOST=ADDRESS[ns], KVSTORE_RANK=str(i))
            procs.append(
                in_ns(
                    ns, [sys.executable, "-m", "kvstore.server"], dict(host_env, DMLC_ROLE="server")
                )
            )
        workers = [
            in_ns(
                ns,
                worker_cmd,
                dict(env, DMLC_ROLE="worker", DMLC_NODE_HOST=ADDRESS[ns], KVSTORE_RANK=str(i)),
                stdout=subprocess.PIPE,
                text=True,
            )
            for i, ns in enumerate(HOSTS)
        ]
        procs += workers
    except BaseException:
        stop(procs)
        raise
    return procs, workers


def collect_from(job: tuple[list, list], read, timeout: float):
    """``read(workers, timeout)``, then every process of the job stopped."""
    procs, workers = job
    try:
        return read(workers, timeout)
    finally:
        stop(procs)


def stop(procs: list) -> None:
    for p in procs:  # by PID
        if p.poll() is None:
            p.kill()
            p.wait(10)


GLOO = r"""
import json, sys, time, numpy as np, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[5])
from zmq_bound import parse_sizes, summary, timed
rank, sizes, reps, budget = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://10.77.0.1:9512", rank=rank, world_size=2)
out = []
for name, nbytes in parse_sizes(sizes).items():
    t = torch.ones(nbytes // 4)
    times = timed(lambda: dist.all_reduce(t), reps, budget)
    out.append(summary("gloo all_reduce", name, "B/s", [nbytes / x for x in times]))
print("RESULTS " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def run_gloo(args) -> list[dict]:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch not installed: no gloo line", file=sys.stderr)
        return []
    argv = [sys.executable, "-c", GLOO]
    tail = [args.sizes, str(args.reps), str(args.budget), str(ROOT / "benchmarks")]
    procs = [
        in_ns(
            ns,
            [*argv, str(i), *tail],
            dict(os.environ, GLOO_SOCKET_IFNAME=f"{ns}0"),
            stdout=subprocess.PIPE,
            text=True,
        )
        for i, ns in enumerate(HOSTS)
    ]
    try:
        per_rank = collect(procs, args.timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return mean_over_workers(per_rank)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1gbit,10gbit")
    p.add_argument("--sizes", default="4M,64M")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument(
        "--compressions",
        default="none,2bit,1bit,2bit+pull,1bit+pull",
        help="kvstore rows: none, 2bit, 1bit, 2bit+pull, 1bit+pull (comma-separated)",
    )
    p.add_argument("--torch-step", action="store_true", help="the torch step only (fp32, fp16)")
    p.add_argument("--batch-size", type=int, default=16, help="per worker, for --torch-step")
    p.add_argument("--steps", type=int, default=10, help="timed steps (--torch-step, --sparse)")
    p.add_argument("--sparse", default="", help="ROWSxDIMxREQ: the row-sparse anchor only")
    args = p.parse_args(argv)
    why = why_not()
    if why:
        print(f"netsim: skipped: {why}")
        return 0
    if args.torch_step:
        return torch_step_rows(args)
    if args.sparse:
        return sparse_rows(args)
    rows = []
    for rate in args.rates.split(","):
        with Link(rate):
            for name in args.compressions.split(","):
                compression = None if name == "none" else name
                for r in run_kvstore(args, compression):
                    r["config"] = f"{rate} {r['config']}"
                    rows.append(r)
            if not args.no_gloo:
                for r in run_gloo(args):
                    r["config"] = f"{rate} {r['config']}"
                    rows.append(r)
    for r in rows:
        print(json.dumps(r))
    print(f"\n{'link / config':34} {'size':>6} {'median':>14}")
    for r in rows:
        print(f"{r['config']:34} {r['size']:>6} {human(r['median'], r['unit']):>14}")
    return 0


def sparse_rows(args) -> int:
    rows = []
    for rate in args.rates.split(","):
        with Link(rate):
            for r in run_sparse(args):
                rows.append(dict(r, link=rate))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'link':8} {'config':40} {'rows/s per worker (median)':>27}")
    for r in rows:
        print(f"{r['link']:8} {r['config']:40} {r['median']:>27,.0f}")
    return 0


def torch_step_rows(args) -> int:
    rows = []
    for rate in args.rates.split(","):
        with Link(rate):
            for fp16 in (False, True):
                rows.append(dict(run_torch_step(args, fp16), link=rate))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'link':8} {'config':16} {'batch':>5} {'step (median)':>14}")
    for r in rows:
        step = f"{r['step_s_median'] * 1000:.0f} ms"
        print(f"{r['link']:8} {r['config']:16} {r['batch_size']:>5} {step:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
