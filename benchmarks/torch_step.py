"""Time per training step: kvstore.torch against DistributedDataParallel on gloo.

The same ResNet-18-sized CNN (defined here: 11.7 M parameters, 47 MB of float32 gradients),
the same synthetic batch and SGD, on W workers of this machine (CPU, one torch thread each):
once through ``kvstore.torch`` (``launch.py``, S servers; also with ``Compression.fp16``),
once through ``torch.nn.parallel.DistributedDataParallel`` on gloo. Prints one JSON line per
configuration (median and quartiles of the step time, over the workers' medians) and a table.
No timing is asserted anywhere.

    python benchmarks/torch_step.py -w 2 -s 1 --steps 20 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def resnet18(num_classes: int = 1000):
    """ResNet-18's layers (torchvision's shapes, without torchvision)."""
    import torch.nn as nn

    def block(cin, cout, stride):
        down = None
        if stride != 1 or cin != cout:
            down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        return Basic(cin, cout, stride, down)

    class Basic(nn.Module):
        def __init__(self, cin, cout, stride, down):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = down

        def forward(self, x):
            out = self.bn1(self.conv1(x)).relu()
            out = self.bn2(self.conv2(out))
            return (out + (x if self.down is None else self.down(x))).relu()

    layers = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [block(cin, cout, stride), block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_steps(model, opt, args, rank: int) -> list[float]:
    import torch

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    y = torch.randint(0, 1000, (args.batch_size,), generator=g)
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


# ---------------------------------------------------------------- inside a worker


def kvstore_worker(args) -> int:
    import torch

    import kvstore.torch as hvd

    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = resnet18()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
    buckets = {} if args.bucket_mb is None else {"bucket_cap_mb": args.bucket_mb}
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), compression=compression, **buckets
    )
    times = timed_steps(model, opt, args, hvd.rank())
    medians = hvd.allgather(torch.tensor([statistics.median(times)], dtype=torch.float64))
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"times": times, "medians": medians.tolist()}), flush=True)
    return 0


def ddp_worker(rank: int, args, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.workers)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(resnet18(), bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = timed_steps(model, opt, args, rank)
    queue.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the driver


def run_kvstore(args, fp16: bool) -> dict:
    argv = [
        sys.executable,
        str(ROOT / "launch.py"),
        "-n",
        str(args.workers),
        "-s",
        str(args.servers),
        "--launcher",
        "local",
        sys.executable,
        __file__,
        "--role",
        "kvstore-worker",
        *worker_args(args),
    ] + (["--fp16"] if fp16 else [])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if "RESULT " in line]
    if done.returncode or not lines:
        raise SystemExit(f"kvstore run failed:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}")
    return json.loads(lines[0].split("RESULT ", 1)[1])


def run_ddp(args) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=ddp_worker, args=(r, args, port, queue)) for r in range(args.workers)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=args.timeout) for _ in procs)
    for p in procs:
        p.join(60)
    return {
        "times": results[0],
        "medians": [statistics.median(results[r]) for r in sorted(results)],
    }


def worker_args(args) -> list[str]:
    return [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--image-size",
        str(args.image_size),
        "--threads",
        str(args.threads),
    ] + ([] if args.bucket_mb is None else ["--bucket-mb", str(args.bucket_mb)])


def summary(config: str, result: dict, args) -> dict:
    times = result["times"]
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {
        "config": config,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
        "step_s_median": statistics.median(result["medians"]),
        "step_s_rank0_q1": q[0],
        "step_s_rank0_q3": q[2],
        "per_worker_median_s": result["medians"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-w", "--workers", type=int, default=2)
    p.add_argument("-s", "--servers", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument(
        "--bucket-mb", type=float, default=None, help="default: kvstore.torch's 5, DDP's 25"
    )
    p.add_argument("--only", choices=["kvstore", "kvstore-fp16", "ddp"], action="append")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--role", default="driver", help=argparse.SUPPRESS)
    p.add_argument("--fp16", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "kvstore-worker":
        return kvstore_worker(args)
    configs = args.only or ["kvstore", "kvstore-fp16", "ddp"]
    rows = []
    for config in configs:
        if config == "ddp":
            result = run_ddp(args)
        else:
            result = run_kvstore(args, fp16=config == "kvstore-fp16")
        name = {"kvstore": "kvstore.torch", "kvstore-fp16": "kvstore.torch fp16"}.get(
            config, "DDP gloo"
        )
        rows.append(summary(name, result, args))
        print(json.dumps(rows[-1]), flush=True)
    ddp = next((r["step_s_median"] for r in rows if r["config"] == "DDP gloo"), None)
    print(
        f"\nW={args.workers} workers (S={args.servers} servers for kvstore), batch "
        f"{args.batch_size}/worker, {args.image_size}x{args.image_size}, {args.threads} thread(s)"
        f"/worker, {args.steps} steps\n"
    )
    print("| config | step time (median) | rank 0 quartiles | vs DDP |")
    print("|---|---|---|---|")
    for r in rows:
        ratio = f"{r['step_s_median'] / ddp:.2f}x" if ddp else ""
        print(
            f"| {r['config']} | {r['step_s_median'] * 1000:.0f} ms | "
            f"{r['step_s_rank0_q1'] * 1000:.0f}-{r['step_s_rank0_q3'] * 1000:.0f} ms | {ratio} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
