"""kvstore.torch: an nn.Embedding(sparse=True) marked with row_sparse trains through
DistributedOptimizer, its gradient travelling as rows. Every rank ends with the weights of
one process training on the union of the ranks' batches (averaged), including a step where
a rank does not use the embedding at all (it pushes no rows).

``set`` (W=3): the optimizer's process set is [0, 2]: its members train on the union of
their batches (the row-sparse key is the set's), rank 1 (outside) on its own batch alone."""

import copy
import sys
import warnings

import torch

import kvstore.torch as hvd

# a user reads no warning each step (torch 2.14's on sparse tensors made unchecked)
warnings.filterwarnings("error", message="Sparse invariant checks")
mode = sys.argv[1] if len(sys.argv) > 1 else "global"
ps = hvd.ProcessSet([0, 2]) if mode == "set" else hvd.global_process_set
hvd.init(process_sets=[ps] if mode == "set" else None)
rank, W = hvd.rank(), hvd.size()
team = (ps.ranks if rank in ps.ranks else [rank]) if mode == "set" else list(range(W))
torch.manual_seed(0)
model = torch.nn.ModuleDict(
    {"emb": torch.nn.Embedding(1000, 4, sparse=True), "lin": torch.nn.Linear(4, 1)}
)
reference = copy.deepcopy(model)
reference["emb"].sparse = False
hvd.row_sparse(model["emb"])
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1),
    named_parameters=model.named_parameters(),
    process_set=ps,
)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)


def loss_of(net, r, step):
    g = torch.Generator().manual_seed(100 * step + r)
    ids = torch.randint(0, 20, (6,), generator=g)  # repeats within and across ranks
    if step == 1 and r == team[-1]:
        return net["lin"](torch.ones(1, 4)).sum()  # no embedding this step
    return net["lin"](net["emb"](ids)).sum() * (r + 1)


for step in range(3):
    opt.zero_grad()
    loss_of(model, rank, step).backward()
    opt.step()
    ref_opt.zero_grad()
    (sum(loss_of(reference, r, step) for r in team) / len(team)).backward()
    ref_opt.step()
    for name in ("emb", "lin"):
        for got, want in zip(model[name].parameters(), reference[name].parameters(), strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (step, name)
if mode == "global":  # three steps touching row 999 only: the servers drop rows 0..19
    for _ in range(3):
        opt.zero_grad()
        model["lin"](model["emb"](torch.tensor([999]))).sum().backward()
        opt.step()
    stats = hvd._require().comm.run(lambda kv: kv.server_stats())
    stored = sum(n["rows"] for s in stats for n in s["rows"].values())
    assert stored == 1, stats  # (without evict_after: 21)
print(f"rank {rank} OK torch rows {mode}", flush=True)
