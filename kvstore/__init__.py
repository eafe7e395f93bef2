"""kvstore: a parameter-server key-value store for data-parallel training.

>>> import numpy as np, kvstore
>>> kv = kvstore.create('local')
>>> kv.init(3, np.ones((2, 3), np.float32))
>>> kv.push(3, [np.ones((2, 3), np.float32) * 2, np.ones((2, 3), np.float32) * 3])
>>> out = np.empty((2, 3), np.float32); kv.pull(3, out=out); float(out[0, 0])
5.0
"""

from . import optimizer
from .errors import KVStoreError
from .store import KVStore, LocalStore

__all__ = ["KVStore", "KVStoreError", "create", "optimizer"]
__version__ = "0.1.0"

TYPES = ("local", "device", "dist_sync", "dist_device_sync", "dist_async")


def create(name: str = "local") -> KVStore:
    """Create a store: ``local``, ``device``, ``dist_sync``, ``dist_device_sync``, ``dist_async``.

    A distributed type reads the cluster from the ``DMLC_*`` environment (set by the launcher)
    and returns once every node has registered. In a process started with
    ``DMLC_ROLE=server`` or ``scheduler`` it runs that role until the job ends, then exits.
    """
    if not isinstance(name, str) or name not in TYPES:
        raise ValueError(f"unknown KVStore type {name!r}; valid types: {', '.join(TYPES)}")
    if name in ("local", "device"):
        return LocalStore(name)
    from .worker import create_dist

    return create_dist(name)
