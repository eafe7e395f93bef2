"""A click-through-rate model on a row-sparse embedding table, trained through a KVStore.

Synthetic clicks from a planted model: each sample has ``--fields`` categorical features,
each drawn from a power law (a few values are common, most are rare) and hashed with its
field into one table of ``--table-rows`` logical rows (2^30 by default: never allocated); a
click comes with probability ``sigmoid(bias + the sum of each feature's true weight)``. The
model is an embedding bag (the mean of the sample's rows, ``--dim`` wide) and an MLP on it.

    python examples/ctr.py --kv-store local
    python launch.py -n 2 -s 2 python examples/ctr.py --kv-store dist_sync

Each step a worker pulls the rows of its batch's features (``row_sparse_pull``), computes
the log loss's gradient, and pushes the rows' gradient (a ``RowSparse``: only the rows its
batch touched) and the MLP's (a dense key); the servers apply Adam, lazily (only the rows
touched and their state). After each epoch rank 0 prints the held-out AUC, the rows per
second it pulled and pushed, and what the servers hold (``kv.server_stats()``).

For a fixed set of workers (it reads its rank and the worker count once, and calls
``barrier()`` each epoch): not an elastic job's script (README: Elastic workers).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kvstore
from kvstore.sparse import RowSparse, normal

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-store", default="local", choices=kvstore.TYPES)
    p.add_argument("--samples", type=int, default=400_000, help="training samples, all workers")
    p.add_argument("--test-samples", type=int, default=20_000)
    p.add_argument("--fields", type=int, default=8)
    p.add_argument("--vocab", type=int, default=100_000, help="distinct values per field")
    p.add_argument("--table-rows", type=int, default=2**30, help="the table's logical rows")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=512, help="per worker")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--wd", type=float, default=0.0, help="weight decay (of the rows touched)")
    p.add_argument("--sharding", default="hash", choices=["hash", "range"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---------------------------------------------------------------- the planted data


def make_data(args, n: int, stream: int):
    """``n`` samples: (row ids (n, fields), clicks (n,), the planted logits), the same for
    the same seed."""
    rng = np.random.default_rng([args.seed, stream])
    truth = np.random.default_rng([args.seed, 99])  # the planted weights: one per value
    weights = truth.normal(0.0, 0.6, (args.fields, args.vocab))
    values = (rng.zipf(1.2, (n, args.fields)) - 1) % args.vocab
    logit = -1.0 + weights[np.arange(args.fields), values].sum(axis=1)
    clicks = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return row_ids(values, args.table_rows), clicks, logit


def row_ids(values: np.ndarray, table_rows: int) -> np.ndarray:
    """Hash (field, value) into the table: a multiplicative hash, as hashed features are."""
    fields = np.arange(values.shape[1], dtype=np.uint64)
    keys = (fields << np.uint64(40)) | values.astype(np.uint64)
    mixed = (keys * _GOLDEN) >> np.uint64(20)
    return (mixed % np.uint64(table_rows)).astype(np.int64)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The area under the ROC curve (the rank statistic; ties count a half)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(scores.size)
    ranks[order] = np.arange(1, scores.size + 1)
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)  # ties: the mean rank
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))


# ---------------------------------------------------------------- the model


class MLP:
    """The dense part: one flat float32 array (one key), viewed as its weights."""

    def __init__(self, dim: int, hidden: int, seed: int):
        self.shapes = {"w1": (dim, hidden), "b1": (hidden,), "w2": (hidden,), "b2": (1,)}
        self.flat = np.zeros(sum(int(np.prod(s)) for s in self.shapes.values()), np.float32)
        rng = np.random.default_rng(seed)
        self.view("w1")[...] = rng.normal(0, 1 / np.sqrt(dim), (dim, hidden))
        self.view("w2")[...] = rng.normal(0, 1 / np.sqrt(hidden), hidden)

    def view(self, name: str, flat=None) -> np.ndarray:
        flat = self.flat if flat is None else flat
        start = 0
        for key, shape in self.shapes.items():
            size = int(np.prod(shape))
            if key == name:
                return flat[start : start + size].reshape(shape)
            start += size
        raise KeyError(name)

    def forward(self, bag: np.ndarray):
        w1, b1, w2, b2 = (self.view(k) for k in self.shapes)
        pre = bag @ w1 + b1
        hidden = np.maximum(pre, 0)
        return hidden @ w2 + b2[0], (bag, pre, hidden)

    def backward(self, cache, dlogit: np.ndarray):
        """(the MLP's flat gradient, the gradient of the bag)."""
        bag, pre, hidden = cache
        grad = np.zeros_like(self.flat)
        self.view("w2", grad)[...] = hidden.T @ dlogit
        self.view("b2", grad)[...] = dlogit.sum()
        dpre = np.outer(dlogit, self.view("w2")) * (pre > 0)
        self.view("w1", grad)[...] = bag.T @ dpre
        self.view("b1", grad)[...] = dpre.sum(axis=0)
        return grad, dpre @ self.view("w1").T


def predict(kv, mlp: MLP, ids: np.ndarray, shape) -> np.ndarray:
    unique, inverse = np.unique(ids, return_inverse=True)
    rows = RowSparse.empty(shape, np.float32)
    kv.row_sparse_pull("emb", out=rows, row_ids=unique)
    bag = rows.data[inverse.reshape(ids.shape)].mean(axis=1)
    return mlp.forward(bag)[0]


# ---------------------------------------------------------------- training


def main(argv=None) -> int:
    args = parse_args(argv)
    kv = kvstore.create(args.kv_store)
    rank, workers = kv.rank, kv.num_workers
    shape = (args.table_rows, args.dim)
    init = normal(0.0, 0.05, seed=args.seed)
    kv.init("emb", RowSparse.empty(shape, np.float32, init=init, sharding=args.sharding))
    mlp = MLP(args.dim, args.hidden, args.seed)
    kv.init("mlp", mlp.flat)
    # the gradients are means over each worker's batch: the servers sum the workers'
    adam = kvstore.optimizer.Adam(learning_rate=args.lr, wd=args.wd, rescale_grad=1 / workers)
    kv.set_optimizer(adam)
    ids, clicks, _ = make_data(args, args.samples, stream=1)
    test_ids, test_clicks, planted = make_data(args, args.test_samples, stream=2)
    if rank == 0:  # the best any model can do on these clicks
        print(f"the planted model's test AUC: {auc(planted, test_clicks):.4f}", flush=True)
    # every worker the same number of steps (a dist_sync round needs every worker's push)
    steps = args.samples // (args.batch_size * workers)
    rows_buf = RowSparse.empty(shape, np.float32)
    for epoch in range(1, args.epochs + 1):
        order = np.random.default_rng([args.seed, epoch]).permutation(args.samples)
        mine = order[rank::workers]  # this worker's part of the epoch, as DistributedSampler
        moved, loss_sum, started = 0, 0.0, time.perf_counter()
        for step in range(steps):
            batch = mine[step * args.batch_size : (step + 1) * args.batch_size]
            x, y = ids[batch], clicks[batch]
            unique, inverse = np.unique(x, return_inverse=True)
            inverse = inverse.reshape(x.shape)
            kv.row_sparse_pull("emb", out=rows_buf, row_ids=unique)
            kv.pull("mlp", out=mlp.flat)
            embedded = rows_buf.data[inverse]  # (batch, fields, dim)
            logit, cache = mlp.forward(embedded.mean(axis=1))
            p = 1 / (1 + np.exp(-logit))
            loss_sum += float(np.mean(np.logaddexp(0, logit) - y * logit))
            dlogit = ((p - y) / y.size).astype(np.float32)
            grad, dbag = mlp.backward(cache, dlogit)
            # each field's row gets the bag's gradient over the fields; repeats add up
            drows = np.zeros((unique.size, args.dim), np.float32)
            per_field = (dbag / args.fields).astype(np.float32)
            for f in range(args.fields):
                np.add.at(drows, inverse[:, f], per_field)
            kv.push("emb", RowSparse(unique, drows, shape))
            kv.push("mlp", grad)
            moved += 2 * unique.size
        kv.pull("mlp", out=mlp.flat)
        seconds = time.perf_counter() - started
        if rank == 0:
            score = auc(predict(kv, mlp, test_ids, shape), test_clicks)
            stats = kv.server_stats()
            stored = sum(s["rows"]["emb"]["rows"] for s in stats)
            held = sum(s["rows"]["emb"]["bytes"] for s in stats)
            processes = {s["process"]: s["rss"] for s in stats}  # after a failover: fewer
            rss = sum(processes.values())
            print(
                f"epoch {epoch}: loss {loss_sum / max(steps, 1):.4f}, test AUC {score:.4f}, "
                f"{moved / seconds:,.0f} rows/s pulled and pushed; servers: {stored:,} rows "
                f"stored ({held / 2**20:.1f} MiB with Adam's state), {rss / 2**20:.0f} MiB "
                f"resident in {len(processes)} server process(es)",
                flush=True,
            )
        kv.barrier()
    if rank == 0:
        print(f"rank 0: test AUC {score:.4f}", flush=True)
    kv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
