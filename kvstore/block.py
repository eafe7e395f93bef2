"""Block momentum (BMUF, CNTK's block momentum) and local SGD: one exchange per block.

Each worker trains its own copy of the model with a local optimizer; after every block of
samples it pushes the block's pseudo-gradient ``w_start - w_local`` (as CNTK's
``blockGrad = prev - current`` and DiLoCo's outer gradient) and pulls the model the next
block starts from. The servers' optimizer is the outer step: :func:`block_momentum` gives
CNTK's (``delta = eta * delta + zeta * G``, ``w += delta``, workers start from
``w + eta * delta`` with Nesterov), and any other optimizer serves too, with
``rescale_grad = 1 / num_workers`` (``NAG(learning_rate=0.7, momentum=0.9)``: DiLoCo's outer
Nesterov; ``Adam``: its Adam variant).

``block_size`` counts samples over all workers, as CNTK's ``block_size``: each worker
syncs after ``block_size // num_workers`` of its own samples. So a block is the same amount of
data whatever the number of workers, and a momentum given as a time constant (in samples)
means the same thing at any W.

Example (under ``launch.py``; ``gradients`` and ``batches`` are the user's)::

    kv = kvstore.create('dist_sync')
    kv.set_optimizer(block_momentum(kv.num_workers, block_size=1024))
    kv.init(list(params), list(params.values()))
    local = kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9)
    trainer = BlockTrainer(kv, params, local, block_size=1024)
    for x, y in batches:
        trainer.step(gradients(params, x, y), len(y))  # pushes once per block
    trainer.finish()  # the last, partial block
"""

from __future__ import annotations

import math
import os

import msgpack

from .arrays import copy_into, namespace
from .optimizer import BlockMomentum, Optimizer, Updater, pack_array, unpack_array


def block_momentum(
    num_workers: int,
    block_size: int | None = None,
    momentum: float | None = None,
    time_constant: float | None = None,
    learning_rate: float = 1.0,
    nesterov: bool = True,
    **kwargs,
) -> BlockMomentum:
    """The outer optimizer with CNTK's defaults: block learning rate ``learning_rate`` (1),
    block momentum ``1 - 1/num_workers``, Nesterov on.

    ``time_constant`` (samples, needs ``block_size``) sets the momentum as CNTK's
    ``block_momentum_as_time_constant``: ``momentum = exp(-block_size / time_constant)``.

    >>> round(block_momentum(4).momentum, 3), block_momentum(4).rescale_grad
    (0.75, 0.25)
    >>> round(block_momentum(2, block_size=100, time_constant=100).momentum, 4)
    0.3679
    """
    if num_workers < 1:
        raise ValueError(f"block_momentum: num_workers must be >= 1, got {num_workers}")
    if momentum is not None and time_constant is not None:
        raise ValueError("block_momentum: give momentum or time_constant, not both")
    if time_constant is not None:
        if block_size is None or block_size < 1 or time_constant <= 0:
            raise ValueError(
                "block_momentum: a time_constant (> 0 samples) needs block_size (>= 1 sample)"
            )
        momentum = math.exp(-block_size / time_constant)
    if momentum is None:
        momentum = 1.0 - 1.0 / num_workers
    return BlockMomentum(
        learning_rate=learning_rate,
        momentum=momentum,
        nesterov=nesterov,
        rescale_grad=1.0 / num_workers,
        **kwargs,
    )


class BlockTrainer:
    """Trains ``params`` locally and exchanges them once per block through ``kv``.

    ``params`` maps each key to the worker's model array (updated in place); the keys must
    be initialised in ``kv`` (``kv.init``), whose value the first block starts from, and
    ``kv`` must hold the outer optimizer (``kv.set_optimizer``) before the first block ends.
    ``local_optimizer`` runs here on every :meth:`step`; with ``reset_momentum`` (CNTK's
    ``reset_sgd_momentum``, on by default) its state is zeroed when a block starts.

    Every worker must see the same number of samples per block (the same batch size), so
    that each takes part in every block's round; a worker out of data calls
    :meth:`finish`, then ``kv.join()`` if the others may still run.
    """

    def __init__(
        self,
        kv,
        params: dict,
        local_optimizer: Optimizer,
        block_size: int,
        reset_momentum: bool = True,
    ):
        workers = kv.num_workers
        if block_size < workers:
            raise ValueError(
                f"BlockTrainer: block_size ({block_size} samples over all workers) must be at "
                f"least the number of workers ({workers})"
            )
        if not params:
            raise ValueError("BlockTrainer: params is empty")
        self.kv, self.params, self.keys = kv, params, list(params)
        self.block_size = int(block_size)
        self.samples_per_worker = block_size // workers  # CNTK's m_syncPeriodPerWorker
        self.local = Updater(local_optimizer)
        self.reset_momentum = bool(reset_momentum)
        kv.pull(self.keys, out=[params[k] for k in self.keys])
        self.start = {k: v.copy() for k, v in params.items()}
        self.samples_in_block = 0  # this worker's, since the block started
        self.blocks = 0  # exchanges done: one push of every key each

    def step(self, grads: dict, num_samples: int) -> bool:
        """Apply the local optimizer to every key's gradient; at the end of a block,
        exchange. Returns whether this step ended a block."""
        for key in self.keys:
            self.local(key, grads[key], self.params[key])
        self.samples_in_block += int(num_samples)
        if self.samples_in_block >= self.samples_per_worker:
            self.sync()
            return True
        return False

    def sync(self) -> None:
        """End the block now: push ``w_start - w_local``, start the next block from the
        servers' answer."""
        pseudo = [self.start[k] - self.params[k] for k in self.keys]
        self.kv.pushpull(self.keys, pseudo, out=[self.params[k] for k in self.keys])
        for key in self.keys:
            copy_into(self.start[key], self.params[key])
        self.samples_in_block = 0
        self.blocks += 1
        if self.reset_momentum:
            for state in self.local.states.values():
                for array in state:
                    array[...] = 0

    def finish(self) -> None:
        """Exchange the last, partial block (if any samples were seen since the last one),
        as CNTK's final aggregation; afterwards every worker holds the same model."""
        if self.samples_in_block:
            self.sync()

    # ---- checkpoints: this worker's block state (the servers' is their optimizer state)
    def state_bytes(self) -> bytes:
        """This worker's block state: block start, local model, local optimizer state, and
        the samples seen in the block (msgpack; arrays as raw little-endian buffers)."""
        return msgpack.packb(
            {
                "keys": self.keys,
                "start": [pack_array(self.start[k]) for k in self.keys],
                "params": [pack_array(self.params[k]) for k in self.keys],
                "local": self.local.dumps(),
                "samples_in_block": self.samples_in_block,
                "blocks": self.blocks,
                "samples_per_worker": self.samples_per_worker,
            }
        )

    def load_state_bytes(self, blob: bytes) -> None:
        """Restore :meth:`state_bytes`: the block goes on where it was saved."""
        try:
            data = msgpack.unpackb(blob, strict_map_key=False)
            keys = data["keys"]
            start = [unpack_array(a) for a in data["start"]]
            params = [unpack_array(a) for a in data["params"]]
        except Exception as exc:
            raise ValueError(f"not a block state written by kvstore: {exc}") from None
        if keys != self.keys or data["samples_per_worker"] != self.samples_per_worker:
            raise ValueError(
                f"block state for keys {keys} and {data['samples_per_worker']} samples per "
                f"worker; this trainer has {self.keys} and {self.samples_per_worker}"
            )
        for key, s, p in zip(self.keys, start, params, strict=True):
            copy_into(self.start[key], namespace(self.start[key]).asarray(s))
            copy_into(self.params[key], namespace(self.params[key]).asarray(p))
        self.local = Updater(self.local.optimizer)
        self.local.loads(data["local"], like=self.params)
        self.samples_in_block, self.blocks = data["samples_in_block"], data["blocks"]

    def save(self, path: str) -> None:
        """Write :meth:`state_bytes` to ``path`` atomically."""
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(self.state_bytes())
        os.replace(tmp, path)

    def load(self, path: str) -> None:
        with open(path, "rb") as f:
            self.load_state_bytes(f.read())
