"""Train a PyTorch MLP on the digits through a KVStore with the Horovod API (kvstore.torch).

    python launch.py -n 2 -s 1 python examples/pytorch_dist.py --kv-store dist_sync

Each worker takes its partition (``rank::num_workers``) of every epoch's shuffled order and
averages gradients through the store, so W workers with batch B match one process with
batch W x B.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

import kvstore.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_mlp import load_data  # noqa: E402  (the same data and split)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-store", default="local")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--save-weights", help="rank 0 writes the final parameters here (.npz)")
    args = p.parse_args(argv)

    hvd.init(args.kv_store)
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed + rank)  # different on each worker: the broadcast fixes it
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    steps = len(y_train) // (args.batch_size * size)
    for epoch in range(args.epochs):
        order = np.random.default_rng(args.seed + 1 + epoch).permutation(len(y_train))
        mine = order[rank::size]
        total = 0.0
        for s in range(steps):
            idx = torch.from_numpy(mine[s * args.batch_size : (s + 1) * args.batch_size])
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach())
        print(f"rank {rank} epoch {epoch}: loss {total / steps:.4f}", flush=True)
    with torch.no_grad():
        pred = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()
    print(f"rank {rank}: test accuracy {(pred == y_test).mean():.4f}", flush=True)
    if args.save_weights and rank == 0:
        np.savez(
            args.save_weights, **{n: t.detach().numpy() for n, t in model.state_dict().items()}
        )
    return 0  # the store closes at exit (hvd.shutdown)


if __name__ == "__main__":
    raise SystemExit(main())
