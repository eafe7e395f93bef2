"""kvstore.torch: an nn.Embedding(sparse=True) marked with row_sparse trains through
DistributedOptimizer, its gradient travelling as rows. Every rank ends with the weights of
one process training on the union of the ranks' batches (averaged), including a step where
rank 1 does not use the embedding at all (it pushes no rows)."""

import copy

import torch

import kvstore.torch as hvd

hvd.init()
rank, W = hvd.rank(), hvd.size()
torch.manual_seed(0)
model = torch.nn.ModuleDict(
    {"emb": torch.nn.Embedding(1000, 4, sparse=True), "lin": torch.nn.Linear(4, 1)}
)
reference = copy.deepcopy(model)
reference["emb"].sparse = False
hvd.row_sparse(model["emb"])
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)


def loss_of(net, r, step):
    g = torch.Generator().manual_seed(100 * step + r)
    ids = torch.randint(0, 20, (6,), generator=g)  # repeats within and across ranks
    if step == 1 and r == 1:
        return net["lin"](torch.ones(1, 4)).sum()  # no embedding this step
    return net["lin"](net["emb"](ids)).sum() * (r + 1)


for step in range(3):
    opt.zero_grad()
    loss_of(model, rank, step).backward()
    opt.step()
    ref_opt.zero_grad()
    (sum(loss_of(reference, r, step) for r in range(W)) / W).backward()
    ref_opt.step()
    for name in ("emb", "lin"):
        for got, want in zip(model[name].parameters(), reference[name].parameters(), strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (step, name)
print(f"rank {rank} OK torch rows", flush=True)
