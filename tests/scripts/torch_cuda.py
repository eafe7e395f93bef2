"""kvstore.torch on CUDA tensors, 2 workers on the first GPU: collectives keep the device,
and SyncBatchNorm with DistributedOptimizer matches one process on the union batch (run by
tests/test_gpu.py)."""

import torch

import kvstore.torch as hvd

hvd.init()
r, dev = hvd.rank(), torch.device("cuda")
s = hvd.allreduce(torch.full((4,), float(r + 1), device=dev), op=hvd.Sum)
assert s.device.type == "cuda" and torch.equal(s.cpu(), torch.full((4,), 3.0)), s
g = hvd.allgather(torch.full((r + 1, 2), float(r), device=dev))
assert g.device.type == "cuda" and g.shape == (3, 2) and g.cpu()[1:].eq(1).all(), g
b = hvd.broadcast(torch.full((3,), float(r), device=dev), root_rank=1)
assert b.device.type == "cuda" and b.cpu().eq(1).all(), b


def net(norm):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), norm(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    ).to(dev)


data = [
    (torch.randn(8, 8, generator=torch.Generator().manual_seed(s)), torch.arange(8) % 3)
    for s in range(3)
]
m = net(hvd.SyncBatchNorm)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), named_parameters=m.named_parameters()
)
ref = net(torch.nn.BatchNorm1d)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
for x, y in data:
    x, y = x.to(dev), y.to(dev)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x[r * 4 : r * 4 + 4]), y[r * 4 : r * 4 + 4]).backward()
    opt.step()
    ref_opt.zero_grad()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    ref_opt.step()
for (name, p), q in zip(m.state_dict().items(), ref.state_dict().values(), strict=True):
    assert p.device.type == "cuda", name
    assert torch.allclose(p.float(), q.float(), rtol=1e-4, atol=1e-5), (name, (p - q).abs().max())
print(f"rank {r}: CUDA allreduce, allgather, broadcast, SyncBatchNorm + DistributedOptimizer OK")
