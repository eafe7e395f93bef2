"""kvstore.torch: hvd.row_sparse and hvd.join (W=2). Rank 0 joins after one step; rank 1
steps four more times alone (rows 10..13; rank 0 counts as pushing no rows), then joins; then
both step once (rows 50 and 51). That step's gradient must hold rows 50 and 51 only, on both:
rank 0 sat out four rounds, which are not this step's."""

import torch

import kvstore.torch as hvd

hvd.init()
rank = hvd.rank()
torch.manual_seed(0)
emb = torch.nn.Embedding(100, 2, sparse=True)
hvd.row_sparse(emb)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(emb.parameters(), lr=0.1), named_parameters=emb.named_parameters()
)


def step(ids):
    opt.zero_grad()
    emb(torch.tensor(ids)).sum().backward()
    opt.step()


step([rank])
for s in range(4 if rank == 1 else 0):
    step([10 + s])
hvd.join()
step([50 + rank])
grad = emb.weight.grad.coalesce()
got = sorted(grad.indices()[0].tolist())
assert got == [50, 51], f"rank {rank}: the last step's gradient rows are {got}"
assert torch.equal(grad.values(), torch.full((2, 2), 0.5)), grad.values()  # averaged over 2
print(f"rank {rank} OK rows after join", flush=True)
