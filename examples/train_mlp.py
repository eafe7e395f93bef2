"""Train a small MLP classifier on scikit-learn's bundled digits through a KVStore.

Single process::

    python examples/train_mlp.py --kv-store local

A local cluster of 2 workers and 2 servers::

    python launch.py -n 2 -s 2 python examples/train_mlp.py --kv-store dist_sync

Each worker reads only its partition of every epoch's shuffled order (``rank::num_workers``,
as PyTorch's DistributedSampler), computes the mean gradient of its batch (split over
``--num-devices`` device arrays, reduced by the store as MXNet's multi-device training does)
and pushes it; the optimizer divides the sum by the number of workers (``rescale_grad``). So
W workers with batch B take exactly the steps one process takes with batch W x B.

``--kv-store dist_ssp`` is bounded staleness (``KVSTORE_STALENESS``, default 1): a worker may
run that many steps ahead of the slowest. ``--step-ms`` makes every step sleep that long (a
bigger model's compute) and ``--slow F`` makes a straggler sleep F times as long::

    python launch.py -n 4 -s 1 python examples/train_mlp.py --kv-store dist_ssp \
        --step-ms 20 --slow 3

With ``--block-size N`` (block momentum, CNTK's BMUF) each worker instead trains its own copy
with the local optimizer and exchanges the model once every N samples (counted over all
workers, as CNTK): the servers apply the outer block-momentum step (``kvstore.block``)::

    python launch.py -n 4 -s 1 python examples/train_mlp.py --kv-store dist_sync --block-size 1024
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import kvstore
from kvstore.arrays import cupy, namespace, to_host
from kvstore.block import BlockTrainer, block_momentum

PARAMS = ("w1", "b1", "w2", "b2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-store", default="local", choices=kvstore.TYPES)
    p.add_argument(
        "--num-devices",
        type=int,
        default=1,
        help="split each batch over N device arrays (GPUs when CuPy sees them)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="per worker, as in MXNet")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument(
        "--scale-lr",
        action="store_true",
        help="multiply --lr by the number of workers (linear scaling)",
    )
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps")
    p.add_argument(
        "--optimizer", default="sgd", choices=["sgd", "nag", "adam", "adagrad", "rmsprop"]
    )
    p.add_argument("--momentum", type=float, default=0.9, help="sgd and nag")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        help="train these steps as one process on the whole batch, then synchronise "
        "(CNTK's distributed_after)",
    )
    p.add_argument("--checkpoint-dir", help="save weights and optimizer state every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--gradient-compression", choices=["2bit", "1bit"])
    p.add_argument("--compression-threshold", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--uneven",
        action="store_true",
        help="give the workers different amounts of data (the last rank 30%% less): each "
        "calls kv.join() when its partition runs out, and the others train on",
    )
    p.add_argument("--save-weights", help="rank 0 writes the final weights here (.npz)")
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="every step sleeps this many milliseconds more: a bigger model's compute",
    )
    p.add_argument(
        "--slow",
        type=float,
        default=1.0,
        help="a straggler sleeps this many times --step-ms; see --slow-rank",
    )
    p.add_argument(
        "--slow-rank",
        type=int,
        default=-1,
        help="the straggler: this rank on every step; -1: a rank drawn at random each step "
        "(the same draw on every worker), as noisy neighbours make one",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=0,
        help="block momentum (BMUF): exchange the model every N samples, counted over all "
        "workers (CNTK's block_size); 0: exchange gradients every step",
    )
    p.add_argument(
        "--block-momentum",
        type=float,
        default=None,
        help="the outer momentum eta (default 1 - 1/workers, as CNTK)",
    )
    p.add_argument("--block-lr", type=float, default=1.0, help="the outer learning rate zeta")
    p.add_argument(
        "--no-nesterov", action="store_true", help="start blocks from w, not w + eta * delta"
    )
    p.add_argument(
        "--no-momentum-reset",
        action="store_true",
        help="keep the local optimizer's momentum across blocks (CNTK resets it)",
    )
    return p.parse_args(argv)


def load_data(seed: int):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    split = int(0.8 * len(y))
    return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def init_params(hidden: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((64, hidden)) * np.sqrt(2 / 64)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, 10)) * np.sqrt(1 / hidden)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def forward_backward(params: dict, x, y):
    """Softmax cross-entropy summed over the batch: (loss, correct, gradients)."""
    xp = namespace(x)
    h_pre = x @ params["w1"] + params["b1"]
    h = xp.maximum(h_pre, 0)
    logits = h @ params["w2"] + params["b2"]
    logits = logits - logits.max(axis=1, keepdims=True)
    p = xp.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    rows = xp.arange(len(y))
    loss = float(-xp.log(p[rows, y] + 1e-12).sum())
    correct = int((p.argmax(axis=1) == y).sum())
    d_logits = p
    d_logits[rows, y] -= 1
    d_h = (d_logits @ params["w2"].T) * (h_pre > 0)
    grads = {
        "w1": x.T @ d_h,
        "b1": d_h.sum(axis=0),
        "w2": h.T @ d_logits,
        "b2": d_logits.sum(axis=0),
    }
    return loss, correct, grads


def devices(n: int) -> list[int]:
    """Device of each batch slice: GPUs round-robin when CuPy sees any, else the host."""
    if cupy is not None and n > 0:
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception:
            count = 0
        if count:
            return [i % count for i in range(n)]
    return [-1] * n


def to_device(array, device: int):
    if device < 0:
        return array
    with cupy.cuda.Device(device):
        return cupy.asarray(array)


def make_optimizer(args, num_workers: int):
    lr = args.lr * (num_workers if args.scale_lr else 1)
    common = dict(learning_rate=lr, wd=args.wd, rescale_grad=1.0 / num_workers)
    if args.optimizer in ("sgd", "nag"):
        common["momentum"] = args.momentum
    return kvstore.optimizer.create(args.optimizer, **common)


def make_block_optimizers(args, num_workers: int):
    """The worker's local optimizer (on its own batch means) and the servers' outer one."""
    local = make_optimizer(args, num_workers)
    local.rescale_grad = 1.0  # this worker's mean gradient, nobody else's
    outer = block_momentum(
        num_workers,
        momentum=args.block_momentum,
        learning_rate=args.block_lr,
        nesterov=not args.no_nesterov,
    )
    return local, outer


def block_state_path(directory: str, rank: int, step: int) -> str:
    return os.path.join(directory, f"block-rank{rank}-step{step}.state")


def save_block_checkpoint(directory: str, kv, trainer, epoch: int, step: int) -> None:
    """Every worker's block state (its own model, mid-block), then rank 0 commits: the
    servers' state (w and delta) and the block start, which the servers store."""
    os.makedirs(directory, exist_ok=True)
    trainer.save(block_state_path(directory, kv.rank, step))
    kv.barrier()  # every worker's state is on disk before the commit names this step
    if kv.rank == 0:
        save_checkpoint(directory, kv, trainer.start, epoch, step)
    # The commit before this one is done (rank 0 made it before this barrier): older
    # states are no longer needed.
    mine = f"block-rank{kv.rank}-step"
    names = [n for n in os.listdir(directory) if n.startswith(mine) and n.endswith(".state")]
    steps = sorted(int(n[len(mine) : -len(".state")]) for n in names)
    for old in steps[:-2]:
        os.remove(block_state_path(directory, kv.rank, old))


def save_checkpoint(directory: str, kv, params: dict, epoch: int, step: int) -> None:
    os.makedirs(directory, exist_ok=True)
    states = os.path.join(directory, "optimizer.states")
    kv.save_optimizer_states(states + ".tmp")
    os.replace(states + ".tmp", states)
    tmp = os.path.join(directory, "weights.tmp.npz")
    np.savez(tmp, epoch=epoch, step=step, **params)
    os.replace(tmp, os.path.join(directory, "weights.npz"))  # the commit point


def evaluate(params: dict, x, y) -> float:
    _, correct, _ = forward_backward(params, x, y)
    return correct / len(y)


def main(argv=None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    kv = kvstore.create(args.kv_store)
    rank, workers = kv.rank, kv.num_workers
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    params = init_params(args.hidden, args.seed)
    first_epoch, step = 0, 0
    checkpoint = os.path.join(args.checkpoint_dir or "", "weights.npz")
    if args.resume:
        if not os.path.exists(checkpoint):
            raise SystemExit(f"--resume: no checkpoint at {checkpoint}")
        saved = np.load(checkpoint)
        params = {k: saved[k] for k in PARAMS}
        first_epoch, step = int(saved["epoch"]) + 1, int(saved["step"])
        print(f"rank {rank}: resuming from epoch {first_epoch} (step {step})", flush=True)
    if args.gradient_compression:
        params_c = {"type": args.gradient_compression}
        if args.gradient_compression == "2bit":
            params_c["threshold"] = args.compression_threshold
        kv.set_gradient_compression(params_c)
    if args.block_size:
        optimizer, outer = make_block_optimizers(args, workers)
    else:
        optimizer = outer = make_optimizer(args, workers)
    slice_devices = devices(args.num_devices)
    global_batch = args.batch_size * workers
    steps_per_epoch = len(y_train) // global_batch

    def train_batch(store, batch_x, batch_y, split):
        """One step: gradients per device slice, pushed and pulled through ``store`` (or,
        for a :class:`BlockTrainer`, summed here and applied locally)."""
        loss = correct = 0
        per_device = {k: [] for k in PARAMS}
        for xs, ys, dev in zip(
            np.array_split(batch_x, split),
            np.array_split(batch_y, split),
            slice_devices[:split] if split > 1 else slice_devices[:1],
            strict=True,
        ):
            local = {k: to_device(v, dev) for k, v in params.items()}
            l, c, g = forward_backward(local, to_device(xs, dev), to_device(ys, dev))
            loss, correct = loss + l, correct + c
            for k in PARAMS:  # the batch mean: the scale 2-bit compression's threshold expects
                per_device[k].append(g[k] / len(batch_y))
        if isinstance(store, BlockTrainer):
            store.step({k: sum(to_host(g) for g in per_device[k]) for k in PARAMS}, len(batch_y))
            return loss, correct
        outs = [params[k] for k in PARAMS]
        store.pushpull(list(PARAMS), [per_device[k] for k in PARAMS], out=outs)
        return loss, correct

    # Warm-up: every worker trains on the whole global batch alone, so all stay identical.
    if step < args.warmup_steps:
        warm = kvstore.create("local")
        warm_optimizer = make_optimizer(args, workers)
        warm_optimizer.rescale_grad = 1.0  # one mean gradient of the global batch, not W
        warm.set_optimizer(warm_optimizer)
        warm.init(list(PARAMS), [params[k] for k in PARAMS])
        order = np.random.default_rng(args.seed).permutation(len(y_train))
        while step < args.warmup_steps:
            idx = order[(step % steps_per_epoch) * global_batch :][:global_batch]
            train_batch(warm, x_train[idx], y_train[idx], args.num_devices)
            step += 1
        print(f"rank {rank}: {args.warmup_steps} warm-up steps done; synchronising", flush=True)

    kv.set_optimizer(outer)
    kv.init(list(PARAMS), [params[k] for k in PARAMS])
    if args.resume and rank == 0:  # the servers hold one copy of the state: load it once
        kv.load_optimizer_states(os.path.join(args.checkpoint_dir, "optimizer.states"))
    kv.barrier()
    store = kv
    if args.block_size:
        store = BlockTrainer(
            kv, params, optimizer, args.block_size, reset_momentum=not args.no_momentum_reset
        )
        if args.resume:  # this worker's model and local state, in the middle of its block
            store.load(block_state_path(args.checkpoint_dir, rank, step))

    for epoch in range(first_epoch, args.epochs):
        order = np.random.default_rng(args.seed + 1 + epoch).permutation(len(y_train))
        mine = order[rank::workers]  # this worker's partition of the epoch
        my_steps = steps_per_epoch
        if args.uneven:  # rank r has 30% * r / (W - 1) fewer batches than rank 0
            my_steps = int(steps_per_epoch * (1 - 0.3 * rank / max(1, workers - 1)))
        started, total_loss, total_correct, seen = time.perf_counter(), 0.0, 0, 0
        stragglers = np.random.default_rng(args.seed + 1000 + epoch).integers(0, workers, my_steps)
        for s in range(my_steps):
            if args.max_steps and step >= args.max_steps:
                break
            idx = mine[s * args.batch_size : (s + 1) * args.batch_size]
            loss, correct = train_batch(store, x_train[idx], y_train[idx], args.num_devices)
            if args.step_ms:  # compute a bigger model would take (a straggler's: --slow x)
                straggler = stragglers[s] if args.slow_rank < 0 else args.slow_rank
                time.sleep(args.step_ms / 1000 * (args.slow if rank == straggler else 1.0))
            total_loss, total_correct, seen = (
                total_loss + loss,
                total_correct + correct,
                seen + len(idx),
            )
            step += 1
        if args.uneven:
            kv.join()  # out of data: count as pushing zeros until every worker is
        elapsed = time.perf_counter() - started
        if seen:
            print(
                f"rank {rank} epoch {epoch}: loss {total_loss / seen:.4f} train accuracy "
                f"{total_correct / seen:.4f} {seen * workers / elapsed:.0f} samples/s",
                flush=True,
            )
        if args.checkpoint_dir and args.block_size:
            save_block_checkpoint(args.checkpoint_dir, kv, store, epoch, step)
            print(f"rank {rank}: checkpoint saved for epoch {epoch}", flush=True)
        elif args.checkpoint_dir and rank == 0:
            save_checkpoint(args.checkpoint_dir, kv, params, epoch, step)
            print(f"rank {rank}: checkpoint saved for epoch {epoch}", flush=True)
        if args.max_steps and step >= args.max_steps:
            break

    if args.kv_store == "dist_ssp":  # every round in: all workers end with the same model
        kv.barrier()
        kv.pull(list(PARAMS), out=[params[k] for k in PARAMS])
    if args.block_size:
        store.finish()  # the last, partial block: every worker ends with the same model
        pushes = store.blocks
    else:
        pushes = step - min(step, args.warmup_steps)
    samples = (step - min(step, args.warmup_steps)) * args.batch_size
    print(
        f"rank {rank}: {pushes} pushes of the model for {samples} samples "
        f"({pushes / max(samples, 1):.4f} per sample)",
        flush=True,
    )
    accuracy = evaluate({k: to_host(v) for k, v in params.items()}, x_test, y_test)
    print(
        f"rank {rank}: test accuracy {accuracy:.4f} after {step} steps "
        f"in {time.perf_counter() - began:.1f}s",
        flush=True,
    )
    if args.save_weights and rank == 0:
        np.savez(args.save_weights, **params)
    kv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
