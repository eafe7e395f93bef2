"""PyTorch on a KVStore, in the style of Horovod: broadcast the initial parameters from rank 0,
and average gradients through ``kv.pushpull`` before each optimizer step.

>>> import torch, kvstore, kvstore.torch as kvt               # doctest: +SKIP
>>> kv = kvstore.create('dist_sync')                           # doctest: +SKIP
>>> kvt.broadcast_parameters(kv, model.named_parameters())    # doctest: +SKIP
>>> opt = kvt.DistributedOptimizer(kv, torch.optim.SGD(model.parameters(), lr=0.1),
...                                model.named_parameters())  # doctest: +SKIP

Requires the ``torch`` extra. Tensors travel through host memory as NumPy arrays.
"""

from __future__ import annotations

import numpy as np
import torch

from .store import KVStore

_SUMMING_TYPES = ("local", "device", "dist_sync", "dist_device_sync")


def broadcast_parameters(kv: KVStore, named_params, prefix: str = "param:") -> None:
    """Make every worker's parameters equal to rank 0's (one batched call for all of them)."""
    named = [(n, p) for n, p in named_params]
    keys = [prefix + n for n, _ in named]
    host = [p.detach().cpu().numpy().copy() for _, p in named]
    kv.broadcast(keys, host, out=host)
    with torch.no_grad():
        for (_, p), value in zip(named, host, strict=True):
            p.copy_(torch.from_numpy(value))


class DistributedOptimizer:
    """Wrap a ``torch.optim`` optimizer: ``step()`` first replaces every gradient by the mean
    of all workers' gradients (one ``pushpull`` of every parameter), then steps.

    The store must sum without an optimizer of its own (``dist_sync``, ``dist_device_sync``,
    ``local``, ``device``); ``dist_async`` adds pushes into the stored value instead.
    """

    def __init__(
        self, kv: KVStore, optimizer: torch.optim.Optimizer, named_params, prefix: str = "grad:"
    ):
        if kv.type not in _SUMMING_TYPES:
            raise ValueError(
                f"DistributedOptimizer needs a summing store "
                f"({', '.join(_SUMMING_TYPES)}), not {kv.type!r}"
            )
        self.kv, self.optimizer = kv, optimizer
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        self.keys = [prefix + n for n, _ in self.named]
        self.buffers = [np.zeros(tuple(p.shape), _numpy_dtype(p)) for _, p in self.named]
        kv.init(self.keys, self.buffers)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        for (_, p), buf in zip(self.named, self.buffers, strict=True):
            if p.grad is None:
                buf[...] = 0  # every worker must push every key: an unused one pushes zeros
            else:
                buf[...] = p.grad.detach().cpu().numpy()
        self.kv.pushpull(self.keys, self.buffers)  # the sums come back in place
        scale = 1.0 / self.kv.num_workers
        with torch.no_grad():
            for (_, p), buf in zip(self.named, self.buffers, strict=True):
                mean = torch.from_numpy(buf).to(p.device) * scale
                if p.grad is None:
                    p.grad = mean.to(p.dtype)
                else:
                    p.grad.copy_(mean)
        return self.optimizer.step(closure)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


def _numpy_dtype(p: torch.Tensor):
    return torch.empty((), dtype=p.dtype).numpy().dtype
