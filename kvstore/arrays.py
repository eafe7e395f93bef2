"""The array module: one place that knows whether an array is NumPy or CuPy.

Everything else is written once against the namespace ``xp`` returned here, so the same code
reduces, updates and quantises on the host and on a GPU.

>>> import numpy as np
>>> namespace(np.zeros(3)) is np
True
"""

from __future__ import annotations

import numpy as np

try:  # CuPy is optional (the ``cuda`` extra); without it every array is a NumPy array.
    import cupy
except Exception:  # pragma: no cover - depends on the machine
    cupy = None


def namespace(array):
    """Return ``numpy`` or ``cupy``, whichever owns ``array``."""
    if cupy is not None and isinstance(array, cupy.ndarray):
        return cupy
    return np


def is_array(value) -> bool:
    return isinstance(value, np.ndarray) or (cupy is not None and isinstance(value, cupy.ndarray))


def device_id(array) -> int:
    """-1 for host memory, else the CUDA device the array lives on."""
    if namespace(array) is np:
        return -1
    return int(array.device.id)


def to_host(array) -> np.ndarray:
    """The array in host memory (no copy for a NumPy array)."""
    if namespace(array) is np:
        return array
    return cupy.asnumpy(array)


def empty_like_on(array, dtype, device: int):
    """An empty array shaped like ``array`` on ``device`` (-1 = host)."""
    if device < 0:
        return np.empty(array.shape, dtype)
    with cupy.cuda.Device(device):
        return cupy.empty(array.shape, dtype)


def copy_into(dst, src) -> None:
    """Copy ``src`` into ``dst`` across devices, casting to ``dst.dtype``."""
    if namespace(dst) is np:
        np.copyto(dst, to_host(src), casting="unsafe")
        return
    with cupy.cuda.Device(device_id(dst)):
        if namespace(src) is np or device_id(src) != device_id(dst):
            src = cupy.asarray(to_host(src)) if namespace(src) is np else _to_device(src, dst)
        dst[...] = src.astype(dst.dtype, copy=False)


def _to_device(src, dst):
    """Peer copy of a CuPy array to ``dst``'s device."""
    out = cupy.empty(src.shape, src.dtype)
    out.data.copy_from_device(src.data, src.nbytes)
    return out


def reduce_sum(arrays, dtype, on_device: bool):
    """Sum a list of same-shaped arrays into a new array of ``dtype``.

    ``on_device``: reduce on the first array's device (the ``device`` store); else on the host
    (the ``local`` store). With arrays on several GPUs, the others are copied to the first one.
    """
    first = arrays[0]
    target = device_id(first) if on_device else -1
    total = empty_like_on(first, dtype, target)
    copy_into(total, first)
    xp = namespace(total)
    scratch = None
    for other in arrays[1:]:
        if namespace(other) is xp and device_id(other) == target and other.dtype == total.dtype:
            xp.add(total, other, out=total)
            continue
        if scratch is None:
            scratch = empty_like_on(first, dtype, target)
        copy_into(scratch, other)
        xp.add(total, scratch, out=total)
    return total
