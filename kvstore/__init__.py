"""kvstore: a parameter-server key-value store for data-parallel training.

Installed as the distribution ``kvstore-ps`` (``pip install kvstore-ps``); imported as
``kvstore``.

>>> import numpy as np, kvstore
>>> kv = kvstore.create('local')
>>> kv.init(3, np.ones((2, 3), np.float32))
>>> kv.push(3, [np.ones((2, 3), np.float32) * 2, np.ones((2, 3), np.float32) * 3])
>>> out = np.empty((2, 3), np.float32); kv.pull(3, out=out); float(out[0, 0])
5.0
"""

import logging as _logging

from . import optimizer, sparse
from .errors import KVStoreError
from .sparse import RowSparse
from .store import KVStore, LocalStore

__all__ = ["KVStore", "KVStoreError", "RowSparse", "create", "optimizer", "sparse"]
__version__ = "0.1.0"

# A library leaves output to the application (logging's own convention): its records reach
# whatever the user configured; the entry points (scheduler, server, launcher) set up stderr.
_logging.getLogger("kvstore").addHandler(_logging.NullHandler())

TYPES = ("local", "device", "dist_sync", "dist_device_sync", "dist_ssp", "dist_async")

# Every name MXNet's KVStore::Create gives a meaning (any letter case), with what it means
# here. MXNet reads the name by substrings: 'dist' -> distributed, '_async' -> asynchronous,
# 'device' -> reduce on the devices. 'nccl' reduces on the GPUs, as 'device' does here.
# 'local_update_cpu', 'local_allreduce_cpu' and 'local_allreduce_device' are the names of
# MXNet's old model.py docs. The device asynchronous names reduce on the devices before the
# push as 'device' does; the servers update on arrival as 'dist_async'.
ALIASES = {
    "local": "local",
    "local_update_cpu": "local",
    "local_allreduce_cpu": "local",
    "device": "device",
    "local_allreduce_device": "device",
    "nccl": "device",
    "dist": "dist_sync",
    "dist_sync": "dist_sync",
    "dist_device_sync": "dist_device_sync",
    "dist_sync_device": "dist_device_sync",
    "dist_ssp": "dist_ssp",
    "dist_async": "dist_async",
    "dist_async_device": "dist_async",
    "dist_device_async": "dist_async",
}


def create(name: str = "local", staleness: int | float | str | None = None) -> KVStore:
    """Create a store by MXNet's name: ``local``, ``device``, ``dist_sync`` (or ``dist``),
    ``dist_device_sync`` (or ``dist_sync_device``), ``dist_ssp``, ``dist_async``; any letter
    case, and
    every other name MXNet accepts (see :data:`ALIASES`). ``kv.type`` is the name given,
    in lower case, as in MXNet.

    ``dist_ssp`` is bounded staleness: ``staleness`` rounds (an int, or ``'inf'``; default
    ``KVSTORE_STALENESS``, else 1) that a worker may run ahead of the slowest (README,
    "Bounded staleness").

    A distributed type reads the cluster from the ``DMLC_*`` environment (set by the launcher)
    and returns once every node has registered. In a process started with
    ``DMLC_ROLE=server`` or ``scheduler`` it runs that role until the job ends, then exits.

    >>> kvstore.create('Dist_Sync').type  # doctest: +SKIP
    'dist_sync'
    """
    if not isinstance(name, str):
        raise TypeError(f"kvstore.create: name must be a str, got {type(name).__name__}")
    given = name.lower()
    kind = ALIASES.get(given)
    if kind is None:
        raise ValueError(
            f"unknown KVStore type {name!r}; valid types: {', '.join(TYPES)} (and MXNet's "
            f"names {', '.join(n for n in ALIASES if n not in TYPES)}, in any letter case)"
        )
    if staleness is not None and kind != "dist_ssp":
        raise ValueError(f"kvstore.create({name!r}): staleness= is for 'dist_ssp' only")
    if kind in ("local", "device"):
        store = LocalStore(kind)
    else:
        from .worker import create_dist

        store = create_dist(kind, staleness)
    store._type = given
    return store
