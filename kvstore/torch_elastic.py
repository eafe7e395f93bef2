"""Horovod's elastic API (``horovod.torch.elastic``) on kvstore.torch, as ``hvd.elastic``:

    import kvstore.torch as hvd

    hvd.init()
    model, opt = Net(), torch.optim.SGD(...)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader):
                ...                              # a step
                state.commit()                   # may raise HostsUpdatedInterrupt
            state.batch = 0

    state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0)
    train(state)

Run it with ``launch.py -n MIN:MAX``. What a reset is here: the survivors keep their process,
store and values (the servers hold them; nothing rolls back); at the first ``commit()`` (or
``check_host_updates()``) after a worker left or came, every worker of the job raises
:class:`HostsUpdatedInterrupt` at the same step, ``run`` agrees with the newcomers on the new
set of workers (``size()``, ``rank()``; a newcomer's ``hvd.init()`` waits for that
rendezvous, as Horovod's), calls the reset callbacks and ``state.sync()`` (rank 0's model,
optimizer and attributes on every worker), then the function again. A
:class:`HorovodInternalError` restores the last commit first, as Horovod's; a store that failed
stays failed, so there the error ends the process, and the launcher starts a newcomer in its
slot, which syncs from rank 0.
"""

from __future__ import annotations

import copy
import math
import random

import torch
import torch.utils.data

from . import torch as hvd
from .elastic import BaseState, run

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]


class State(BaseState):
    """Horovod's ``horovod.common.elastic.State``: what ``run`` saves, restores and syncs
    (kvstore.elastic's loop, on ``hvd``'s workers)."""

    _restore_on = (hvd.HorovodInternalError,)

    def _workers_changed(self) -> bool:
        return hvd._workers_changed()

    def _reset_workers(self) -> None:
        """Horovod's shutdown and init: here the store goes on, the workers agree on who is
        here."""
        if hvd._require().generation is not None:
            hvd._elastic_reset()


class ObjectState(State):
    """Plain Python attributes (``epoch=0, batch=0``): saved by value, synced from rank 0."""

    def __init__(self, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__()

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = hvd.broadcast_object(self._saved_state, root_rank=0)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's: a ``DistributedSampler`` that records what was processed this epoch, so
    that after a reset the rest of the epoch is split anew among ``hvd.size()`` workers.
    Put it in the :class:`TorchState` (``sampler=``), call ``record_batch`` after each batch
    and ``set_epoch`` at the end of each epoch.

    >>> sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)  # doctest: +SKIP
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (its own order when shuffling), nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every worker processed ``batch_size`` more samples."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices) -> None:
        """Horovod's older form: record the samples of this worker's batch (counted as one
        batch of that size on every worker)."""
        self.record_batch(0, len(indices))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Split what is left of the epoch among the workers now."""
        self.num_replicas = hvd.size()
        self.rank = hvd.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:  # the same order on every worker
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = self.remaining_indices[:]
        indices += indices[: self.total_size - len(indices)]  # even: repeat the first ones
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """One attribute of a TorchState with a state_dict: saved by copy, synced its own way."""

    def __init__(self, value):
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def set_value(self, value) -> None:
        self.value = value
        self.save()


class _ModelHandler(_Handler):
    def sync(self) -> None:
        hvd.broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        hvd.broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        self.value.load_state_dict(hvd.broadcast_object(self.value.state_dict(), root_rank=0))


_HANDLERS = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (ElasticSampler, _SamplerHandler),
]


class TorchState(ObjectState):
    """Horovod's: a model, an optimizer, samplers and plain attributes, as keyword arguments,
    each an attribute. ``commit()`` copies their state to memory (the model's and the
    optimizer's ``state_dict``, the attributes' values) and checks for workers that came or
    left; ``restore()`` goes back to the last commit; ``sync()`` makes every worker's rank 0's.

    >>> state = hvd.elastic.TorchState(model, optimizer, epoch=1, batch=0)  # doctest: +SKIP
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            kind = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if kind is None:
                plain[name] = value
            else:
                handlers[name] = kind(value)
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(**plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:  # a new model or optimizer: saved
            handlers[name].set_value(value)
        super().__setattr__(name, value)
