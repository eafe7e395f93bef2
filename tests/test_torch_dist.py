"""kvstore.torch with W=2 workers through launch.py, against one process; process sets with
W=3.

One job (this file run as the worker script) trains every scenario and checks the
collectives; the tests compare its saved weights with plain torch on one process with the
union batch. Horovod's pytorch_mnist.py runs through the launcher to the accuracy of one
process on the union batch; its synthetic benchmark and its ImageNet example (on random
JPEGs) run through the launcher with only their import changed. A worker killed under an
allreduce loop is a HorovodInternalError on the others.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
WORKERS, BATCH, STEPS = 2, 6, 4

# name: (optimizer, backward_passes_per_step, DistributedOptimizer kwargs, rtol, atol).
# Adam divides by sqrt(v): summation order alone moves a step by ~1e-6 where v is small.
# fp16: every gradient is rounded to float16 (11 significant bits) before the sum.
SCENARIOS = {
    "sgd": ("sgd", 1, {}, 1e-5, 1e-6),
    "adam": ("adam", 1, {}, 1e-4, 1e-5),
    "sgd_passes": ("sgd", 2, {}, 1e-5, 1e-6),
    "adam_passes_buckets": ("adam", 3, {"bucket_cap_mb": 2e-3}, 1e-4, 1e-5),
    "sgd_buckets": ("sgd", 1, {"bucket_cap_mb": 2e-3}, 1e-5, 1e-6),
    "sgd_fp16": ("sgd", 1, {"compression": "fp16", "bucket_cap_mb": 2e-3}, 2e-3, 5e-4),
    # SyncBatchNorm on W workers against BatchNorm2d on the union batch
    "sgd_syncbn": ("sgd", 1, {"syncbn": True}, 1e-4, 1e-5),
}


def model(norm=None):
    """The test CNN; ``norm`` (a BatchNorm class) after the first convolution."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3),
        *([] if norm is None else [norm(8)]),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 5),
    )


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def union_batches(passes):
    """Every step's batches of WORKERS x BATCH, one per backward pass."""
    g = torch.Generator().manual_seed(5)
    n = WORKERS * BATCH
    return [
        [(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g))]
        for _ in range(STEPS * passes)
    ]


def train(name, rank=None):
    """One scenario. ``rank`` None: plain torch on the union batch; else this worker's share
    through kvstore.torch."""
    opt_name, passes, kwargs, _, _ = SCENARIOS[name]
    kwargs = dict(kwargs)
    norm = None
    if kwargs.pop("syncbn", False):
        norm = torch.nn.BatchNorm2d
        if rank is not None:
            import kvstore.torch as hvd

            norm = hvd.SyncBatchNorm
    m = model(norm)
    opt = make_optimizer(opt_name, m.parameters())
    if rank is not None:
        import kvstore.torch as hvd

        if kwargs.get("compression") == "fp16":
            kwargs["compression"] = hvd.Compression.fp16
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=m.named_parameters(), backward_passes_per_step=passes, **kwargs
        )
    data = union_batches(passes)
    for s in range(STEPS):
        opt.zero_grad()
        for [(x, y)] in data[s * passes : (s + 1) * passes]:
            if rank is not None:
                x, y = x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]
            torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in m.state_dict().items()}


# Buckets in flight: one parameter (or two) per bucket, each gradient a known input, each
# backward slowed by a random delay per worker, so buckets leave and come back in a
# different rhythm on each worker while several are in flight.
FLIGHT_SIZES = [10, 30, 7, 50, 10, 20, 64, 3, 40, 5, 16, 33]
FLIGHT_STEPS = 4
FLIGHT_VARIANTS = {  # name: (DistributedOptimizer kwargs, zero_grad's set_to_none)
    "fp32": ({}, True),
    "fp32_accumulate_in_bucket": ({}, False),
    "fp16": ({"compression": "fp16"}, True),
}


def flight_inputs(step, rank):
    """What every parameter's gradient is on ``rank`` at ``step``."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(n, generator=g) for n in FLIGHT_SIZES]


def buckets_in_flight(hvd, name) -> dict:
    """Each step's averaged gradients (p.grad after synchronize) of one variant."""
    import random
    import threading

    class Delay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, p, seconds):
            ctx.seconds = seconds
            return p.clone()

        @staticmethod
        def backward(ctx, grad):
            threading.Event().wait(ctx.seconds)  # a slow layer, slower on one rank at random
            return grad, None

    kwargs, set_to_none = FLIGHT_VARIANTS[name]
    kwargs = dict(kwargs, bucket_cap_mb=1e-4)
    if kwargs.get("compression") == "fp16":
        kwargs["compression"] = hvd.Compression.fp16
    params = [torch.nn.Parameter(torch.zeros(n)) for n in FLIGHT_SIZES]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.0),
        named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
        **kwargs,
    )
    rng = random.Random(hvd.rank())
    out = {}
    for step in range(FLIGHT_STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        xs = flight_inputs(step, hvd.rank())
        delays = [rng.uniform(0, 0.005) for _ in params]
        parts = zip(params, xs, delays, strict=True)
        loss = sum((Delay.apply(p, seconds) * x).sum() for p, x, seconds in parts)
        loss.backward()
        opt.synchronize()
        for i, p in enumerate(params):
            out[f"{step}.{i}"] = p.grad.numpy().copy()
        with opt.skip_synchronize():
            opt.step()
    return out


# ---------------------------------------------------------------- the rest of Horovod's API


def api_inputs(rank):
    """Every worker's inputs to :func:`horovod_api`, known to the test too."""
    g = torch.Generator().manual_seed(77 + rank)
    return {
        "reduce": torch.randn(3, 2, generator=g),
        "ints": torch.tensor([rank + 2, -3 * rank - 1, 5]),
        "scatter": torch.randn(5, 2, generator=g),
        "gather": torch.randn(rank + 1, 3, generator=g),
        "weights": torch.randn(3, 2, generator=g),
        "gather_weights": torch.randn(3, 3, generator=g),  # one row per gathered row (1 + 2)
        "bn_x": torch.randn(4, 3, 5, 5, generator=g),
        "bn_g": torch.randn(4, 3, 5, 5, generator=g),
        "alltoall": torch.arange(4.0).reshape(4, 1) + 10 * rank,
        # row 3 from both workers, row 4 twice from rank 1 (uncoalesced)
        "sparse": torch.sparse_coo_tensor(
            torch.tensor([[0, 3]] if rank == 0 else [[3, 4, 4]]),
            torch.randn(2 + rank, 2, generator=g),
            (5, 2),
            check_invariants=True,
        ),
    }


ALLTOALL_SPLITS = [[1, 2], [3, 0]]  # rank 0 sends 1 row to itself, 2 to rank 1; rank 1: 3, 0


def sync_batch_norm(norm, xs, gs, steps=2):
    """(outputs, input gradients, weight and bias gradients, running stats) of ``norm``
    (a 3-channel BatchNorm) on ``xs`` with output gradients ``gs``, ``steps`` times."""
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        norm.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
    out = {}
    for step in range(steps):
        x = (xs * (step + 1)).requires_grad_()
        y = norm(x)
        (y * gs).sum().backward()
        out.update({f"y{step}": y.detach(), f"dx{step}": x.grad})
    out.update(
        {
            "dw": norm.weight.grad,
            "db": norm.bias.grad,
            "mean": norm.running_mean,
            "var": norm.running_var,
        }
    )
    return {k: v.detach().numpy().tolist() for k, v in out.items()}


def horovod_api(hvd, trace: str) -> dict:
    """Async forms, grouped ops, reducescatter, alltoall, Min/Max/Product, gradients through
    collectives, SyncBatchNorm, mismatched shapes, join, timeline: the results, as lists."""
    r = hvd.rank()
    x = api_inputs(r)
    out = {
        op: hvd.allreduce(x["reduce"], op=getattr(hvd, op), name=op).tolist()
        for op in ("Min", "Max", "Product", "Sum", "Average", "Adasum")
    }
    out["int_min_max"] = [hvd.allreduce(x["ints"], op=op).tolist() for op in (hvd.Min, hvd.Max)]
    out["int_scaled"] = [
        hvd.allreduce(x["ints"], op=op, postscale_factor=3).tolist()
        for op in (hvd.Sum, hvd.Average)
    ]
    # several in flight, finished in another order than started
    handles = [
        hvd.allreduce_async(x["reduce"], op=hvd.Sum, name="async"),
        hvd.allgather_async(x["gather"], name="async"),
        hvd.broadcast_async(x["reduce"], root_rank=1, name="async"),
        hvd.grouped_allreduce_async([x["reduce"], x["scatter"]], op=hvd.Sum, name="async"),
    ]
    inplace = x["scatter"].clone()
    handles.append(hvd.allreduce_async_(inplace, op=hvd.Max, name="async_"))
    results = [hvd.synchronize(h) for h in reversed(handles)][::-1]
    out["async"] = [results[0].tolist(), results[1].tolist(), results[2].tolist()]
    out["async_grouped"] = [t.tolist() for t in results[3]]
    out["async_inplace"] = [results[4] is inplace, inplace.tolist()]
    out["grouped_allgather"] = [
        t.tolist() for t in hvd.grouped_allgather([x["gather"], x["ints"]], name="ga")
    ]
    out["reducescatter"] = [
        hvd.reducescatter(x["scatter"], op=hvd.Sum).tolist(),
        hvd.reducescatter(x["scatter"]).tolist(),
    ]
    out["grouped_reducescatter"] = [
        t.tolist()
        for t in hvd.grouped_reducescatter([x["scatter"], x["reduce"]], op=hvd.Sum, name="gr")
    ]
    rows, received = hvd.alltoall(x["alltoall"], splits=ALLTOALL_SPLITS[r])
    out["alltoall"] = [rows.tolist(), received.tolist(), hvd.alltoall(x["alltoall"]).tolist()]
    h = hvd.alltoall_async(x["alltoall"], splits=ALLTOALL_SPLITS[r], name="async")
    out["alltoall_async"] = [t.tolist() for t in hvd.synchronize(h)]
    h = hvd.reducescatter_async(x["scatter"], op=hvd.Sum, name="async")
    out["reducescatter_async"] = hvd.synchronize(h).tolist()
    out["objects"] = hvd.allgather_object({"rank": r, "pad": "x" * (100 * r)})
    sparse = [hvd.sparse_allreduce_async(x["sparse"], "sp", op) for op in (hvd.Average, hvd.Sum)]
    out["sparse"] = [[t._nnz(), t.to_dense().tolist()] for t in (handle() for handle in sparse)]
    # gradients through collectives
    grads = {}
    for name, fn, weights in (
        ("allreduce", lambda t: hvd.allreduce(t, op=hvd.Sum, name="grad"), x["weights"]),
        ("average", lambda t: hvd.allreduce(t, name="grad_avg"), x["weights"]),
        ("broadcast", lambda t: hvd.broadcast(t, root_rank=1, name="grad"), x["weights"]),
    ):
        t = x["reduce"].clone().requires_grad_()
        (fn(t) * weights).sum().backward()
        grads[name] = t.grad.tolist()
    t = x["gather"].clone().requires_grad_()
    (hvd.allgather(t, name="grad") * x["gather_weights"]).sum().backward()
    grads["allgather"] = t.grad.tolist()
    out["grads"] = grads
    out["bn"] = sync_batch_norm(hvd.SyncBatchNorm(3), x["bn_x"], x["bn_g"])
    # mismatched shapes and dtypes: every worker raises, and the job goes on
    errors, caught_as = [], []
    for bad in (torch.zeros(2 + r), torch.zeros(2, dtype=torch.float64 if r else torch.float32)):
        for call in (
            hvd.allreduce,
            lambda t: hvd.broadcast(t, 0),
            lambda t: hvd.synchronize(hvd.allreduce_async(t)),
        ):
            try:
                call(bad)
            except ValueError as exc:
                errors.append(str(exc))
                # as Horovod's own tests catch it
                caught_as.append(
                    isinstance(exc, RuntimeError) and isinstance(exc, hvd.HorovodInternalError)
                )
    try:
        hvd.allgather(torch.zeros(1, 2 + r))
    except hvd.HorovodInternalError as exc:
        caught_as.append(isinstance(exc, ValueError))
    out["mismatch_errors"], out["mismatch_caught_as"] = errors, caught_as
    out["after_mismatch"] = hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist()
    # timeline: this worker's spans while recording
    hvd.start_timeline(trace)
    hvd.allreduce(torch.ones(3), name="timed")
    hvd.stop_timeline()
    # join: rank 0 runs out of data first; rank 1 reduces alone, then joins last
    ones = torch.full((2,), float(r + 1))
    hvd.allreduce(ones, op=hvd.Max, name="join")  # keys exist before the join
    if r == 1:
        out["joined_max"] = hvd.allreduce(ones, op=hvd.Max, name="join").tolist()
    out["join_last"] = hvd.join()
    return out


# ---------------------------------------------------------------- the worker


def collectives(hvd) -> dict:
    """Every collective with rank-dependent values; the results, checked by the test."""
    import os

    r = hvd.rank()
    out = {
        "identity": [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()],
        "env": [os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE")],
        "average": hvd.allreduce(torch.tensor([r + 1.0, 2.0 * r])).tolist(),
        "sum": hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum, name="s").tolist(),
        "int_average": hvd.allreduce(torch.tensor([r + 2])).tolist(),
        "fp16": hvd.allreduce(torch.tensor([1.0 / 3 + r]), compression=hvd.Compression.fp16)
        .double()
        .tolist(),
        "gather": hvd.allgather(torch.full((r + 1, 2), r)).tolist(),
        "object": hvd.broadcast_object({"from": r, "list": [r] * 3}, root_rank=1),
    }
    try:
        hvd.allgather(torch.zeros(1, 3 + r))
    except ValueError as exc:
        out["gather_error"] = str(exc)
    # parameters: rank 1's, twice (a new value the second time)
    m = model()
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(r + 1)
    hvd.broadcast_parameters(m.state_dict(), root_rank=1)
    first = [float(p.sum()) for p in m.parameters()]
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(10 * r)
    hvd.broadcast_parameters(m.named_parameters(), root_rank=1)
    out["params"] = [first, [float(p.sum()) for p in m.parameters()]]
    # optimizer state: rank 0 has stepped (lr changed too), rank 1 is fresh
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    if r == 0:
        m(torch.ones(1, 1, 8, 8)).sum().backward()
        opt.step()
        opt.param_groups[0]["lr"] = 0.5
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()
    out["opt_state"] = [
        state["param_groups"][0]["lr"],
        len(state["state"]),
        float(sum(s["exp_avg"].abs().sum() for s in state["state"].values())),
    ]
    # join: rank 1 runs out of data first; rank 0 goes on alone (rank 1 counts as zeros)
    m = model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters()
    )
    hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after_join")  # keys exist before a join
    if r == 0:
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        opt.synchronize()  # averaged with rank 1's zeros
        out["join_grad"] = sorted({float(v) for p in m.parameters() for v in p.grad.flatten()})
        out["join_sum"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after_join").tolist()
    else:
        out["join_last"] = hvd.join()
    if r == 0:
        out["join_last"] = hvd.join()
    return out


def train_adasum(rank=None) -> dict:
    """SGD through DistributedOptimizer(op=Adasum) on W workers; ``rank`` None: the reference
    in one process: each worker's own step from the same start, combined with Adasum's
    pairwise rule per parameter (its formula written out here)."""
    m = model()
    data = union_batches(1)

    def grads_of(r, x, y):
        m.zero_grad()
        xs, ys = x[r * BATCH : (r + 1) * BATCH], y[r * BATCH : (r + 1) * BATCH]
        torch.nn.functional.cross_entropy(m(xs), ys).backward()
        return [p.grad.detach().clone() for p in m.parameters()]

    if rank is not None:
        import kvstore.torch as hvd

        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1),
            named_parameters=m.named_parameters(),
            op=hvd.Adasum,
        )
        for [(x, y)] in data[:STEPS]:
            opt.zero_grad()
            xs, ys = x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]
            torch.nn.functional.cross_entropy(m(xs), ys).backward()
            opt.step()
        return {k: v.detach().numpy() for k, v in m.state_dict().items()}

    def pair(a, b):
        dot, aa, bb = (float((u.double() * v.double()).sum()) for u, v in ((a, b), (a, a), (b, b)))
        return (1 - dot / (2 * aa)) * a + (1 - dot / (2 * bb)) * b

    for [(x, y)] in data[:STEPS]:
        deltas = [[-0.1 * g for g in grads_of(r, x, y)] for r in range(WORKERS)]
        with torch.no_grad():
            for i, p in enumerate(m.parameters()):
                level = [d[i] for d in deltas]
                while len(level) > 1:
                    level = [pair(level[j], level[j + 1]) for j in range(0, len(level), 2)]
                p.add_(level[0])
    return {k: v.detach().numpy() for k, v in m.state_dict().items()}


def worker(outdir: str) -> int:
    import kvstore.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    out = Path(outdir)
    for name in SCENARIOS:
        np.savez(out / f"{name}.{hvd.rank()}.npz", **train(name, hvd.rank()))
    np.savez(out / f"adasum.{hvd.rank()}.npz", **train_adasum(hvd.rank()))
    (out / f"collectives.{hvd.rank()}.json").write_text(json.dumps(collectives(hvd)))
    for name in FLIGHT_VARIANTS:
        np.savez(out / f"flight.{name}.{hvd.rank()}.npz", **buckets_in_flight(hvd, name))
    api = horovod_api(hvd, str(out / "trace.json"))
    (out / f"api.{hvd.rank()}.json").write_text(json.dumps(api))
    return 0  # no shutdown: the store closes at exit, as in a Horovod script


# ---------------------------------------------------------------- process sets (W=3)

PS_WORKERS = 3
PS_SETS = {"A": [0, 2], "B": [1, 2]}  # rank 2 in both, ranks 0 and 1 in one each


def ps_inputs(rank):
    """Every worker's inputs to :func:`process_set_ops`, known to the test too."""
    g = torch.Generator().manual_seed(300 + rank)
    return {
        "reduce": torch.randn(3, 2, generator=g),
        "scatter": torch.randn(5, 2, generator=g),
        "gather": torch.randn(rank + 1, 3, generator=g),
        "weights": torch.randn(3, 2, generator=g),
        "alltoall": torch.arange(4.0).reshape(4, 1) + 10 * rank,
        "bn_x": torch.randn(4, 3, 5, 5, generator=g),
        "bn_g": torch.randn(4, 3, 5, 5, generator=g),
        "batch": (torch.randn(4, 4, generator=g), torch.randn(4, 3, generator=g)),
    }


def ps_splits(rank, n):
    return [(rank + j) % 2 for j in range(n)]


def ps_gather_weights(ranks, rank):
    """``rank``'s allgather output's gradient weights in a set (one row per gathered row)."""
    g = torch.Generator().manual_seed(400 + 10 * sum(ranks) + rank)
    return torch.randn(sum(r + 1 for r in ranks), 3, generator=g)


def ps_train(hvd=None, process_set=None, batches=()):
    """A linear model, two SGD steps: plain torch on ``batches`` (the union), or this
    worker's batch through DistributedOptimizer over ``process_set``."""
    torch.manual_seed(1)
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if hvd is not None:
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=m.named_parameters(), process_set=process_set
        )
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    return [p.detach().tolist() for p in m.parameters()]


def process_set_ops(hvd, ps) -> dict:
    """Every collective over ``ps`` (this worker a member), as lists."""
    r, n, x = hvd.rank(), ps.size(), ps_inputs(hvd.rank())
    root = ps.ranks[-1]  # a global rank, as Horovod's
    out = {"identity": [ps.rank(), ps.size(), ps.included()]}
    out.update(
        {
            op: hvd.allreduce(x["reduce"], op=getattr(hvd, op), name="ps", process_set=ps).tolist()
            for op in ("Sum", "Average", "Max")
        }
    )
    out["grouped"] = [
        t.tolist()
        for t in hvd.grouped_allreduce([x["reduce"], x["scatter"]], op=hvd.Sum, process_set=ps)
    ]
    inplace = x["scatter"].clone()
    handles = [
        hvd.allreduce_async_(inplace, op=hvd.Sum, name="ps", process_set=ps),
        hvd.allgather_async(x["gather"], name="ps", process_set=ps),
        hvd.broadcast_async(x["reduce"], root_rank=root, name="ps", process_set=ps),
    ]
    out["async"] = [t.tolist() for t in [hvd.synchronize(h) for h in reversed(handles)][::-1]]
    out["allgather"] = hvd.allgather(x["gather"], process_set=ps).tolist()
    out["grouped_allgather"] = [
        t.tolist() for t in hvd.grouped_allgather([x["gather"], x["reduce"]], process_set=ps)
    ]
    out["broadcast"] = hvd.broadcast(x["reduce"], root_rank=root, process_set=ps).tolist()
    rows, received = hvd.alltoall(x["alltoall"], splits=ps_splits(r, n), process_set=ps)
    even = torch.arange(2.0 * n).reshape(2 * n, 1) + 10 * r
    out["alltoall"] = [
        rows.tolist(),
        received.tolist(),
        hvd.alltoall(even, process_set=ps).tolist(),
    ]
    out["reducescatter"] = [
        hvd.reducescatter(x["scatter"], op=hvd.Sum, process_set=ps).tolist(),
        hvd.reducescatter(x["scatter"], process_set=ps).tolist(),
    ]
    out["object"] = hvd.broadcast_object({"from": r}, root_rank=root, process_set=ps)
    out["objects"] = hvd.allgather_object({"rank": r}, process_set=ps)
    hvd.barrier(process_set=ps)
    grads = {}
    for name, fn in (
        ("allreduce", lambda t: hvd.allreduce(t, op=hvd.Sum, name="g", process_set=ps)),
        ("broadcast", lambda t: hvd.broadcast(t, root_rank=root, name="g", process_set=ps)),
    ):
        t = x["reduce"].clone().requires_grad_()
        (fn(t) * x["weights"]).sum().backward()
        grads[name] = t.grad.tolist()
    t = x["gather"].clone().requires_grad_()
    (hvd.allgather(t, name="g", process_set=ps) * ps_gather_weights(ps.ranks, r)).sum().backward()
    grads["allgather"] = t.grad.tolist()
    out["grads"] = grads
    out["bn"] = sync_batch_norm(hvd.SyncBatchNorm(3, process_set=ps), x["bn_x"], x["bn_g"])
    errors = []
    for call in (
        lambda: hvd.allreduce(torch.zeros(2 + r), process_set=ps),  # shapes differ
        lambda: hvd.broadcast(
            x["reduce"], root_rank=(set(range(3)) - set(ps.ranks)).pop(), process_set=ps
        ),
        lambda: hvd.allreduce(x["reduce"], op=hvd.Adasum, process_set=ps),
    ):
        try:
            call()
        except (ValueError, NotImplementedError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    out["errors"] = errors
    return out


def process_sets_worker(outdir: str) -> int:
    import kvstore.torch as hvd

    sets = {k: hvd.ProcessSet(v) for k, v in PS_SETS.items()}
    every = hvd.ProcessSet([2, 1, 0])  # the global set's ranks: left invalid, as Horovod's
    hvd.init(process_sets=[sets["A"], sets["B"], every])
    torch.set_num_threads(1)
    r = hvd.rank()
    out = {"ids": [sets["A"].process_set_id, sets["B"].process_set_id, every.process_set_id]}
    outside = sets["A"] if r == 1 else sets["B"]  # rank 2 is in both: rank 0's outside B
    if r != 2:
        try:
            outside.rank()
        except ValueError as exc:
            out["outside_rank"] = str(exc)
        out["outside_size"] = [outside.size(), outside.included()]
        try:
            hvd.allreduce(torch.ones(1), process_set=outside)
        except ValueError as exc:
            out["outside_error"] = str(exc)
    for name, ps in sets.items():
        if ps.included():
            out[name] = process_set_ops(hvd, ps)
    # DistributedOptimizer over A on every worker: rank 1 (outside) steps on its own batch
    out["train"] = ps_train(hvd, sets["A"], [ps_inputs(r)["batch"]])
    # removed on every worker; the same ranks added again find their keys
    out["removed"] = [hvd.remove_process_set(sets["A"]), sets["A"].process_set_id]
    out["removed"].append(hvd.remove_process_set(sets["A"]))
    try:
        hvd.allreduce(torch.ones(1), process_set=sets["A"])
    except ValueError as exc:
        out["removed_error"] = str(exc)
    again = hvd.add_process_set([0, 2])
    late = hvd.add_process_set(hvd.ProcessSet([0, 1]))
    try:
        hvd.add_process_set([1, 0])
    except ValueError as exc:
        out["duplicate"] = str(exc)
    out["ids"] += [again.process_set_id, late.process_set_id]
    if again.included():
        out["again"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="ps", process_set=again)
        out["again"] = out["again"].tolist()
    if late.included():
        out["late"] = hvd.allgather(torch.tensor([r]), process_set=late).tolist()
    out["global"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).tolist()
    (Path(outdir) / f"psets.{r}.json").write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------- the tests


def launch(*command, timeout=240, workers=WORKERS):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "-n",
            str(workers),
            "-s",
            "1",
            "--launcher",
            "local",
            "--env",
            "KVSTORE_HEARTBEAT_INTERVAL=0.5",
            sys.executable,
            *map(str, command),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_dist")
    launch(__file__, out)
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_workers_match_one_process_on_the_union_batch(job, name):
    rtol, atol = SCENARIOS[name][3:]
    one = train(name)
    for rank in range(WORKERS):
        dist = dict(np.load(job / f"{name}.{rank}.npz"))
        assert dist.keys() == one.keys()
        for k in one:
            np.testing.assert_allclose(dist[k], one[k], rtol=rtol, atol=atol, err_msg=k)
    if "fp16" in name:  # within the tolerance, but rounded
        assert any(not np.allclose(dist[k], one[k], rtol=1e-6, atol=1e-7) for k in one)


def test_adasum_optimizer_combines_each_worker_s_step(job):
    one = train_adasum()
    plain = train("sgd")  # the average's path, to show Adasum's result differs from it
    for rank in range(WORKERS):
        dist = dict(np.load(job / f"adasum.{rank}.npz"))
        for k in one:
            np.testing.assert_allclose(dist[k], one[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert any(not np.allclose(one[k], plain[k], atol=1e-4) for k in one)


def test_collectives_across_workers(job):
    got = [json.loads((job / f"collectives.{r}.json").read_text()) for r in range(WORKERS)]
    for r, g in enumerate(got):
        assert g["identity"] == [r, 2, r, 2]
        assert g["env"] == [str(r), "2", str(r), "2"]
        assert g["average"] == [1.5, 1.0]
        assert g["sum"] == [3.0]
        assert g["int_average"] == [2]  # (2 + 3) // 2
        assert g["fp16"] == pytest.approx([1 / 3 + 0.5], rel=1e-3)
        assert g["gather"] == [[0, 0], [1, 1], [1, 1]]
        assert g["object"] == {"from": 1, "list": [1, 1, 1]}
        assert "rank 0: (1, 3), rank 1: (1, 4)" in g["gather_error"]
        sums = [float(2 * p.numel()) for p in model().parameters()]
        assert g["params"] == [sums, [s * 5 for s in sums]]
        assert g["opt_state"][:2] == [0.5, 8] and g["opt_state"][2] > 0
        assert g["join_last"] == 0
    assert got[0]["join_grad"] == [0.5]  # rank 1 joined: its zeros in the average
    assert got[0]["join_sum"] == [1.0, 1.0]


@pytest.mark.parametrize("name", list(FLIGHT_VARIANTS))
def test_buckets_in_flight_average_exactly(job, name):
    """Every worker gets exactly (g0 + g1) / 2 of its known gradients (fp16: of the gradients
    rounded to float16, summed in float16), whatever order the buckets came back in."""
    fp16 = "fp16" in name
    for rank in range(WORKERS):
        got = np.load(job / f"flight.{name}.{rank}.npz")
        for step in range(FLIGHT_STEPS):
            pairs = zip(flight_inputs(step, 0), flight_inputs(step, 1), strict=True)
            for i, (g0, g1) in enumerate(pairs):
                total = (g0.half() + g1.half()).float() if fp16 else g0 + g1
                np.testing.assert_array_equal(
                    got[f"{step}.{i}"], (total * 0.5).numpy(), err_msg=f"rank {rank} {step}.{i}"
                )


def test_horovod_api_across_workers(job):
    """Each function against plain torch on both workers' inputs."""
    got = [json.loads((job / f"api.{r}.json").read_text()) for r in range(WORKERS)]
    x0, x1 = api_inputs(0), api_inputs(1)

    def close(a, b, rtol=1e-6, atol=1e-7):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=rtol, atol=atol)

    a, b = x0["reduce"], x1["reduce"]
    total = x0["scatter"] + x1["scatter"]
    both = torch.cat([x0["gather"], x1["gather"]])
    avg_w = (x0["weights"] + x1["weights"]) / 2
    avg_gw = (x0["gather_weights"] + x1["gather_weights"]) / 2
    bn_ref = sync_batch_norm(
        torch.nn.BatchNorm2d(3),
        torch.cat([x0["bn_x"], x1["bn_x"]]),
        torch.cat([x0["bn_g"], x1["bn_g"]]),
    )
    sent = [x0["alltoall"], x1["alltoall"]]
    for r, g in enumerate(got):
        close(g["Min"], torch.minimum(a, b))
        close(g["Max"], torch.maximum(a, b))
        close(g["Product"], a * b)
        close(g["Sum"], a + b)
        close(g["Average"], (a + b) / 2)
        dot = float((a.double() * b.double()).sum())
        adasum = (1 - dot / (2 * float(a.double().square().sum()))) * a.double() + (
            1 - dot / (2 * float(b.double().square().sum()))
        ) * b.double()
        close(g["Adasum"], adasum, rtol=1e-6, atol=1e-6)
        assert g["int_min_max"] == [
            torch.minimum(x0["ints"], x1["ints"]).tolist(),
            torch.maximum(x0["ints"], x1["ints"]).tolist(),
        ]
        ints = x0["ints"] + x1["ints"]
        assert g["int_scaled"] == [
            (ints * 3).tolist(),
            torch.div(ints * 3, 2, rounding_mode="floor").tolist(),
        ]
        close(g["async"][0], a + b)
        close(g["async"][1], both)
        close(g["async"][2], b)
        close(g["async_grouped"][0], a + b)
        close(g["async_grouped"][1], total)
        assert g["async_inplace"][0] is True
        close(g["async_inplace"][1], torch.maximum(x0["scatter"], x1["scatter"]))
        close(g["grouped_allgather"][0], both)
        assert g["grouped_allgather"][1] == torch.cat([x0["ints"], x1["ints"]]).tolist()
        rows = slice(0, 3) if r == 0 else slice(3, 5)  # 5 rows: the first worker gets 3
        close(g["reducescatter"][0], total[rows])
        close(g["reducescatter"][1], total[rows] / 2)
        close(g["grouped_reducescatter"][0], total[rows])
        close(g["grouped_reducescatter"][1], (a + b)[slice(0, 2) if r == 0 else slice(2, 3)])
        if r == 0:  # rank 0 sent itself row 0; rank 1 sent it rows 0..2
            expected, received = torch.cat([sent[0][:1], sent[1][:3]]), [1, 3]
        else:  # rank 0 sent it rows 1..2; rank 1 sent it none
            expected, received = sent[0][1:3], [2, 0]
        assert g["alltoall"][:2] == g["alltoall_async"] == [expected.tolist(), received]
        close(g["reducescatter_async"], total[rows])
        halves = slice(0, 2) if r == 0 else slice(2, 4)
        assert g["alltoall"][2] == torch.cat([sent[0][halves], sent[1][halves]]).tolist()
        assert g["objects"] == [{"rank": 0, "pad": ""}, {"rank": 1, "pad": "x" * 100}]
        # gradients (Horovod's definitions)
        close(g["grads"]["allreduce"], x0["weights"] + x1["weights"])
        close(g["grads"]["average"], avg_w)
        close(g["grads"]["broadcast"], avg_w if r == 1 else torch.zeros(3, 2))
        close(g["grads"]["allgather"], avg_gw[0:1] if r == 0 else avg_gw[1:3])
        # SyncBatchNorm: rank r's rows of one BatchNorm2d on the union batch
        bn, half = g["bn"], slice(4 * r, 4 * r + 4)
        for k in ("y0", "y1", "dx0", "dx1"):
            close(bn[k], np.asarray(bn_ref[k])[half], rtol=1e-5, atol=1e-5)
        for k in ("mean", "var"):
            close(bn[k], bn_ref[k], rtol=1e-5, atol=1e-6)
        errors = g["mismatch_errors"]
        assert len(errors) == 6, errors
        for e in errors[:3]:
            assert "every worker must pass tensors of the same names, dtypes and shapes" in e
            assert "rank 0: [-: float32 (2,)]; rank 1: [-: float32 (3,)]" in e, e
        for e in errors[3:]:
            assert "rank 0: [-: float32 (2,)]; rank 1: [-: float64 (2,)]" in e, e
        assert g["mismatch_caught_as"] == [True] * 7
        assert g["after_mismatch"] == [2.0, 2.0]
        # sparse_allreduce_async: both workers' entries, kept apart (2 + 3), summed when dense
        dense = x0["sparse"].to_dense() + x1["sparse"].to_dense()
        (nnz_avg, avg), (nnz_sum, total_sparse) = g["sparse"]
        assert nnz_avg == nnz_sum == 5
        close(avg, dense / 2)
        close(total_sparse, dense)
        from kvstore import timeline

        events = timeline.read_events(str(job / f"trace.json.worker{r}"))
        spans = {(e["name"], (e.get("args") or {}).get("name")) for e in events}
        assert ("allreduce", "timed") in spans and any(n == "pushpull" for n, _ in spans), spans
        assert g["join_last"] == 1  # rank 0 joined first
    # the weight and bias gradients stay each worker's: their sum is the union's
    for k in ("dw", "db"):
        close(np.add(got[0]["bn"][k], got[1]["bn"][k]), bn_ref[k], rtol=1e-5, atol=1e-5)
    assert got[1]["joined_max"] == [2.0, 2.0]  # rank 0 joined: left out of the maximum


@pytest.fixture(scope="module")
def psets_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_psets")
    launch(__file__, out, "psets", workers=PS_WORKERS)
    return [json.loads((out / f"psets.{r}.json").read_text()) for r in range(PS_WORKERS)]


def test_process_sets_identity_and_refusals(psets_job):
    for r, g in enumerate(psets_job):
        # A and B from init(process_sets=...); the global set's ranks left invalid; after A
        # was removed, [0, 2] again and [0, 1]
        assert g["ids"] == [1, 2, None, 3, 4]
        if r != 2:
            assert g["outside_rank"] == "Process is not part of provided process set."
            assert g["outside_size"] == [2, False]
            assert f"rank {r} is not a member of the provided process set" in g["outside_error"]
        assert g["removed"] == [True, None, False]
        assert "has not been registered" in g["removed_error"]
        assert "Attempted to add a duplicate process set" in g["duplicate"]
        assert g["global"] == [3.0]
    assert [g.get("again") for g in psets_job] == [[2.0], None, [2.0]]
    assert [g.get("late") for g in psets_job] == [[0, 1], [0, 1], None]


@pytest.mark.parametrize("name", list(PS_SETS))
def test_process_set_collectives_match_one_process(psets_job, name):
    """Every collective over a set against plain torch on its members' inputs: ranks, sizes
    and rows within the set, root_rank a global rank."""
    members = PS_SETS[name]
    n, xs = len(members), {m: ps_inputs(m) for m in members}
    root = members[-1]

    def close(a, b, rtol=1e-6, atol=1e-7):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=rtol, atol=atol)

    def total(k):
        return sum(xs[m][k] for m in members)

    gathered = torch.cat([xs[m]["gather"] for m in members])
    avg_w = total("weights") / n
    avg_gw = sum(ps_gather_weights(members, m) for m in members) / n
    bn_ref = sync_batch_norm(
        torch.nn.BatchNorm2d(3),
        torch.cat([xs[m]["bn_x"] for m in members]),
        torch.cat([xs[m]["bn_g"] for m in members]),
    )
    bn_sum = {"dw": 0, "db": 0}
    for i, m in enumerate(members):
        g = psets_job[m][name]
        assert g["identity"] == [i, n, True]
        close(g["Sum"], total("reduce"))
        close(g["Average"], total("reduce") / n)
        close(g["Max"], torch.stack([xs[k]["reduce"] for k in members]).amax(0))
        close(g["grouped"][0], total("reduce"))
        close(g["grouped"][1], total("scatter"))
        close(g["async"][0], total("scatter"))
        close(g["async"][1], gathered)
        close(g["async"][2], xs[root]["reduce"])
        close(g["allgather"], gathered)
        close(g["grouped_allgather"][0], gathered)
        close(g["grouped_allgather"][1], torch.cat([xs[k]["reduce"] for k in members]))
        close(g["broadcast"], xs[root]["reduce"])
        pieces, received = [], []
        for s in members:
            splits = ps_splits(s, n)
            start = sum(splits[:i])
            pieces.append(xs[s]["alltoall"][start : start + splits[i]])
            received.append(splits[i])
        assert g["alltoall"][:2] == [torch.cat(pieces).tolist(), received]
        even = [torch.arange(2.0 * n).reshape(2 * n, 1) + 10 * s for s in members]
        assert g["alltoall"][2] == torch.cat([e[2 * i : 2 * i + 2] for e in even]).tolist()
        base, extra = divmod(5, n)  # the set's first 5 % n members get one row more
        start = i * base + min(i, extra)
        rows = slice(start, start + base + (i < extra))
        close(g["reducescatter"][0], total("scatter")[rows])
        close(g["reducescatter"][1], total("scatter")[rows] / n)
        assert g["object"] == {"from": root}
        assert g["objects"] == [{"rank": k} for k in members]
        close(g["grads"]["allreduce"], total("weights"))
        close(g["grads"]["broadcast"], avg_w if m == root else torch.zeros(3, 2))
        offset = sum(k + 1 for k in members[:i])
        close(g["grads"]["allgather"], avg_gw[offset : offset + m + 1])
        bn, mine = g["bn"], slice(4 * i, 4 * i + 4)
        for k in ("y0", "y1", "dx0", "dx1"):
            close(bn[k], np.asarray(bn_ref[k])[mine], rtol=1e-5, atol=1e-5)
        for k in ("mean", "var"):
            close(bn[k], bn_ref[k], rtol=1e-5, atol=1e-6)
        for k in bn_sum:
            bn_sum[k] = bn_sum[k] + np.asarray(bn[k])
        shapes = "; ".join(f"rank {k}: [-: float32 ({2 + k},)]" for k in members)
        mismatch, bad_root, adasum = g["errors"]
        assert mismatch.startswith("MismatchError: ") and shapes in mismatch, mismatch
        outsider = ({0, 1, 2} - set(members)).pop()
        assert f"root_rank={outsider} is not in the process set (ranks {members})" in bad_root
        assert adasum == "NotImplementedError: Adasum does not support non-global process sets yet."
    for k in bn_sum:
        close(bn_sum[k], bn_ref[k], rtol=1e-5, atol=1e-5)


def test_distributed_optimizer_over_a_process_set(psets_job):
    """Members of [0, 2] step on their average (one process on their union batch); rank 1,
    outside, on its own gradients (as Horovod's)."""
    union = ps_train(batches=[ps_inputs(0)["batch"], ps_inputs(2)["batch"]])
    alone = ps_train(batches=[ps_inputs(1)["batch"]])
    for r, g in enumerate(psets_job):
        expected = alone if r == 1 else union
        for got, want in zip(g["train"], expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_lost_worker_is_a_horovod_internal_error(cluster):
    """A worker killed under an allreduce loop: the others' ``except hvd.HorovodInternalError``
    (Horovod's) catches the loss, naming the dead worker, within seconds."""
    c = cluster(1, 3)
    workers = c.start_workers("torch_peer_lost.py")
    c.wait_for_output("worker0", "round 20", 60)
    workers[2].kill()
    assert c.wait(workers[:2], 30) == [3, 3], c.dump()
    for i in range(2):
        out = c.output(f"worker{i}")
        assert "HorovodInternalError (PeerLostError): " in out, c.dump()
        assert "worker 2 (127.0.0.1 pid" in out, c.dump()


def mnist_accuracy(out: str) -> list[float]:
    return [
        float(line.split("Accuracy: ")[1].rstrip("%\n"))
        for line in out.splitlines()
        if "Test set: Average loss" in line
    ]


def test_horovod_mnist_example_matches_one_process():
    example = ROOT / "examples" / "pytorch_mnist.py"
    assert "import kvstore.torch as hvd" in example.read_text()
    assert "horovod.torch" not in example.read_text().split("import argparse")[1]
    one = subprocess.run(
        [sys.executable, str(example), "--epochs", "2", "--batch-size", "128", "--lr", "0.05"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    # W=2 workers with half the batch each; the script scales lr by hvd.size()
    dist = launch(example, "--epochs", "2", "--batch-size", "64", "--lr", "0.025")
    acc_one, acc_dist = mnist_accuracy(one.stdout), mnist_accuracy(dist)
    assert len(acc_one) == len(acc_dist) == 2, dist
    assert acc_one[-1] >= 95 and abs(acc_dist[-1] - acc_one[-1]) <= 3, (acc_one, acc_dist)
    assert "Traceback" not in dist and "Exception ignored" not in dist


@pytest.mark.parametrize("net", ["resnet18", "resnet50"])
def test_horovod_synthetic_benchmark_example_runs(net):
    """Horovod's pytorch_synthetic_benchmark.py, its import changed, a few steps of a ResNet."""
    example = ROOT / "examples" / "horovod" / "pytorch_synthetic_benchmark.py"
    code = "\n".join(line for line in example.read_text().splitlines() if not line.startswith("#"))
    assert "import kvstore.torch as hvd" in code and "horovod.torch" not in code
    out = launch(
        example,
        *("--model", net, "--batch-size", "2", "--num-warmup-batches", "1"),
        *("--num-batches-per-iter", "1", "--num-iters", "2"),
    )
    assert f"Model: {net}" in out and "Number of CPUs: 2" in out, out
    assert "Img/sec per CPU: " in out and "Total img/sec on 2 CPU(s): " in out, out
    assert "Traceback" not in out


def needs(*modules: str) -> None:
    """Skip unless every module imports: torchvision from the registry beside another torch's
    build raises RuntimeError ('operator torchvision::nms does not exist'), not ImportError."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            pytest.skip(f"needs {name} (README: Install): {type(exc).__name__}: {exc}")


def image_folder(root: Path, classes: int = 2, train: int = 2, val: int = 1) -> Path:
    """``root/train`` and ``root/val`` as torchvision's ImageFolder reads ImageNet: a folder
    per class of small random JPEGs (the example crops and resizes them to 224x224)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.JPEG")
    return root


def test_horovod_imagenet_resnet50_example_runs(tmp_path):
    """Horovod's pytorch_imagenet_resnet50.py, its import changed, one epoch of torchvision's
    ResNet-50 on 4 training and 2 validation images: each worker one step of two sub-batches
    of one image (backward_passes_per_step=2), then one image to validate; rank 0 writes the
    checkpoint and the TensorBoard log."""
    needs("torchvision", "tqdm", "tensorboard")
    example = ROOT / "examples" / "horovod" / "pytorch_imagenet_resnet50.py"
    code = "\n".join(line for line in example.read_text().splitlines() if not line.startswith("#"))
    assert "import kvstore.torch as hvd" in code and "horovod.torch" not in code
    data = image_folder(tmp_path / "data")
    out = launch(
        example,
        *("--train-dir", data / "train", "--val-dir", data / "val", "--epochs", "1"),
        *("--batch-size", "1", "--batches-per-allreduce", "2", "--val-batch-size", "1"),
        *("--log-dir", tmp_path / "logs", "--checkpoint-format", tmp_path / "ckpt-{epoch}.tar"),
        timeout=120,
    )
    assert "Traceback" not in out, out
    # tqdm's bars, on the first worker only (as Horovod's); its \r reads as a new line
    for bar in ("Train Epoch     #1", "Validate Epoch  #1"):
        assert f"[worker 0] \n{bar}:   0%|" in out and f"{bar}: 100%|" in out, out
    assert "[worker 1]" not in out, out
    losses = [float(part.split("loss=")[1].split(",")[0]) for part in out.split("it/s, ")[1:]]
    assert losses and all(np.isfinite(losses)), out
    state = torch.load(tmp_path / "ckpt-1.tar")
    assert state["model"]["fc.weight"].shape == (1000, 2048)
    assert len(state["optimizer"]["state"]) == 161  # SGD's momentum for every parameter
    assert list((tmp_path / "logs").glob("events.out.tfevents.*"))
    (tmp_path / "ckpt-1.tar").unlink()  # 200 MB


def test_step_benchmark_smoke():
    """benchmarks/torch_step.py keeps working (tiny size; no timing is asserted)."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "torch_step.py"),
            *("--steps", "2", "--warmup", "1", "--batch-size", "2", "--image-size", "32"),
            *("--only", "kvstore", "--only", "ddp"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["config"] for r in rows] == ["kvstore.torch", "DDP gloo"]
    assert all(r["step_s_median"] > 0 and len(r["per_worker_median_s"]) == 2 for r in rows)
    assert "| kvstore.torch |" in done.stdout


if __name__ == "__main__":
    if sys.argv[2:] == ["psets"]:
        sys.exit(process_sets_worker(sys.argv[1]))
    sys.exit(worker(sys.argv[1]))
