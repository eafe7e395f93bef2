"""Optimizers with MXNet's update formulas, on NumPy and CuPy arrays alike.

An optimizer is described by a plain spec, ``{"name": "sgd", "params": {...}}``, so that a
worker can send it to the servers without pickle (:func:`from_spec` rebuilds it). The state an
optimizer keeps per key lives in an :class:`Updater`, which can save and load it.

Every update first forms the gradient as MXNet does: ``g = rescale_grad * grad``, clipped to
``[-clip_gradient, clip_gradient]`` when ``clip_gradient`` is set, and (where the formula says
so) ``+ wd * weight``.

>>> import numpy as np
>>> opt = SGD(learning_rate=0.1)
>>> w = np.ones(2, np.float32); Updater(opt)(0, np.ones(2, np.float32), w); w
array([0.9, 0.9], dtype=float32)
"""

from __future__ import annotations

import math

import msgpack
import numpy as np

from .arrays import namespace, to_host

# ---------------------------------------------------------------- learning-rate schedules


class FactorScheduler:
    """``lr = max(base_lr * factor ** floor((num_update - 1) / step), stop_factor_lr)``.

    As MXNet's FactorScheduler: the rate drops once ``num_update`` exceeds each multiple of
    ``step``.
    """

    def __init__(
        self, step: int, factor: float = 1.0, stop_factor_lr: float = 1e-8, base_lr: float = 0.01
    ):
        if step < 1:
            raise ValueError(f"FactorScheduler: step must be >= 1, got {step}")
        if factor > 1.0:
            raise ValueError(f"FactorScheduler: factor must be <= 1, got {factor}")
        self.step, self.factor, self.stop_factor_lr, self.base_lr = (
            int(step),
            float(factor),
            float(stop_factor_lr),
            float(base_lr),
        )

    def __call__(self, num_update: int) -> float:
        drops = max(0, (num_update - 1) // self.step)
        return max(self.base_lr * self.factor**drops, self.stop_factor_lr)

    def spec(self) -> dict:
        return {
            "name": "factor",
            "params": {
                "step": self.step,
                "factor": self.factor,
                "stop_factor_lr": self.stop_factor_lr,
                "base_lr": self.base_lr,
            },
        }


class MultiFactorScheduler:
    """``lr = base_lr * factor ** (number of steps s in ``step`` with num_update > s)``."""

    def __init__(self, step: list[int], factor: float = 1.0, base_lr: float = 0.01):
        if list(step) != sorted(step) or any(s < 1 for s in step):
            raise ValueError(f"MultiFactorScheduler: step must be increasing and >= 1: {step}")
        self.step, self.factor, self.base_lr = [int(s) for s in step], float(factor), float(base_lr)

    def __call__(self, num_update: int) -> float:
        return self.base_lr * self.factor ** sum(num_update > s for s in self.step)

    def spec(self) -> dict:
        return {
            "name": "multifactor",
            "params": {"step": self.step, "factor": self.factor, "base_lr": self.base_lr},
        }


_SCHEDULERS = {"factor": FactorScheduler, "multifactor": MultiFactorScheduler}

# ---------------------------------------------------------------- optimizers


class Optimizer:
    """Base: hyper-parameters, gradient preparation, spec. Subclasses give state and update."""

    name = ""
    _extra: tuple[str, ...] = ()  # subclass hyper-parameters, in spec order

    def __init__(
        self,
        learning_rate: float = 0.01,
        wd: float = 0.0,
        rescale_grad: float = 1.0,
        clip_gradient: float | None = None,
        lr_scheduler=None,
    ):
        if learning_rate < 0 or wd < 0:
            raise ValueError(f"{type(self).__name__}: learning_rate and wd must be >= 0")
        if clip_gradient is not None and clip_gradient <= 0:
            raise ValueError(f"{type(self).__name__}: clip_gradient must be > 0 or None")
        self.lr, self.wd, self.rescale_grad = float(learning_rate), float(wd), float(rescale_grad)
        self.clip_gradient = None if clip_gradient is None else float(clip_gradient)
        if lr_scheduler is not None and not callable(lr_scheduler):
            raise TypeError("lr_scheduler must be callable: lr = lr_scheduler(num_update)")
        if lr_scheduler is not None and hasattr(lr_scheduler, "base_lr"):
            lr_scheduler.base_lr = self.lr  # as MXNet: the optimizer's rate is the schedule's base
        self.lr_scheduler = lr_scheduler

    def learning_rate(self, num_update: int) -> float:
        return self.lr if self.lr_scheduler is None else float(self.lr_scheduler(num_update))

    def prepare_grad(self, grad, weight, with_wd: bool):
        """``rescale_grad * grad``, clipped, ``+ wd * weight`` if ``with_wd`` (a new array)."""
        xp = namespace(grad)
        g = grad * grad.dtype.type(self.rescale_grad)
        if self.clip_gradient is not None:
            xp.clip(g, -self.clip_gradient, self.clip_gradient, out=g)
        if with_wd and self.wd:
            g += weight.dtype.type(self.wd) * weight
        return g

    def create_state(self, weight) -> tuple:
        return ()

    def update(self, weight, grad, state: tuple, lr: float, t: int) -> None:
        raise NotImplementedError

    def spec(self) -> dict:
        params = {
            "learning_rate": self.lr,
            "wd": self.wd,
            "rescale_grad": self.rescale_grad,
            "clip_gradient": self.clip_gradient,
        }
        params.update({k: getattr(self, k) for k in self._extra})
        if self.lr_scheduler is not None:
            if not hasattr(self.lr_scheduler, "spec"):
                raise TypeError(
                    "a distributed store needs an lr_scheduler with .spec() "
                    "(FactorScheduler, MultiFactorScheduler)"
                )
            params["lr_scheduler"] = self.lr_scheduler.spec()
        return {"name": self.name, "params": params}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()['params']})"


class SGD(Optimizer):
    """SGD with momentum, as MXNet's ``sgd_update`` / ``sgd_mom_update``.

    ``g = clip(rescale_grad * grad) + wd * w``; without momentum ``w -= lr * g``; with it
    ``mom = momentum * mom - lr * g``, ``w += mom``.
    """

    name = "sgd"
    _extra = ("momentum",)

    def __init__(self, momentum: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.momentum = float(momentum)

    def create_state(self, weight):
        return (namespace(weight).zeros_like(weight),) if self.momentum else ()

    def update(self, weight, grad, state, lr, t):
        g = self.prepare_grad(grad, weight, with_wd=True)
        if not self.momentum:
            weight -= weight.dtype.type(lr) * g
            return
        (mom,) = state
        mom *= mom.dtype.type(self.momentum)
        mom -= mom.dtype.type(lr) * g
        weight += mom


class NAG(SGD):
    """Nesterov accelerated SGD, as MXNet's NAG.

    ``g = clip(rescale_grad * grad) + wd * w``; ``mom = momentum * mom + g``;
    ``w -= lr * (g + momentum * mom)``; without momentum, plain SGD.
    """

    name = "nag"

    def update(self, weight, grad, state, lr, t):
        if not self.momentum:
            return super().update(weight, grad, state, lr, t)
        g = self.prepare_grad(grad, weight, with_wd=True)
        (mom,) = state
        mom *= mom.dtype.type(self.momentum)
        mom += g
        g += mom.dtype.type(self.momentum) * mom
        weight -= weight.dtype.type(lr) * g


class Adam(Optimizer):
    """Adam, as MXNet's Adam with bias correction folded into the rate.

    ``g = clip(rescale_grad * grad) + wd * w``; ``m = beta1 m + (1 - beta1) g``;
    ``v = beta2 v + (1 - beta2) g**2``; ``lr_t = lr sqrt(1 - beta2**t) / (1 - beta1**t)``;
    ``w -= lr_t m / (sqrt(v) + epsilon)``.
    """

    name = "adam"
    _extra = ("beta1", "beta2", "epsilon")

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)

    def create_state(self, weight):
        xp = namespace(weight)
        return (xp.zeros_like(weight), xp.zeros_like(weight))

    def update(self, weight, grad, state, lr, t):
        xp, f = namespace(weight), weight.dtype.type
        g = self.prepare_grad(grad, weight, with_wd=True)
        mean, var = state
        mean *= f(self.beta1)
        mean += f(1 - self.beta1) * g
        var *= f(self.beta2)
        var += f(1 - self.beta2) * g * g
        lr_t = lr * math.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)
        weight -= f(lr_t) * mean / (xp.sqrt(var) + f(self.epsilon))


class AdaGrad(Optimizer):
    """AdaGrad, as MXNet's AdaGrad.

    ``g = clip(rescale_grad * grad)``; ``h += g**2``; ``w -= lr (g / sqrt(h + eps) + wd w)``.
    """

    name = "adagrad"
    _extra = ("eps",)

    def __init__(self, eps: float = 1e-7, **kwargs):
        super().__init__(**kwargs)
        self.eps = float(eps)

    def create_state(self, weight):
        return (namespace(weight).zeros_like(weight),)

    def update(self, weight, grad, state, lr, t):
        xp, f = namespace(weight), weight.dtype.type
        g = self.prepare_grad(grad, weight, with_wd=False)
        (history,) = state
        history += g * g
        step = g / xp.sqrt(history + f(self.eps))
        if self.wd:
            step += f(self.wd) * weight
        weight -= f(lr) * step


class RMSProp(Optimizer):
    """RMSProp, as MXNet's ``rmsprop_update`` (Tieleman & Hinton) and, with ``centered=True``,
    ``rmspropalex_update`` (Graves).

    ``g = clip(rescale_grad * grad) + wd * w``; ``n = gamma1 n + (1 - gamma1) g**2``;
    plain: ``w -= lr g / sqrt(n + epsilon)``; centered: ``gbar = gamma1 gbar + (1 - gamma1) g``,
    ``delta = gamma2 delta - lr g / sqrt(n - gbar**2 + epsilon)``, ``w += delta``.
    """

    name = "rmsprop"
    _extra = ("gamma1", "gamma2", "epsilon", "centered")

    def __init__(
        self,
        learning_rate: float = 0.001,
        gamma1: float = 0.9,
        gamma2: float = 0.9,
        epsilon: float = 1e-8,
        centered: bool = False,
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.gamma1, self.gamma2, self.epsilon = float(gamma1), float(gamma2), float(epsilon)
        self.centered = bool(centered)

    def create_state(self, weight):
        xp = namespace(weight)
        if self.centered:
            return (xp.zeros_like(weight), xp.zeros_like(weight), xp.zeros_like(weight))
        return (xp.zeros_like(weight),)

    def update(self, weight, grad, state, lr, t):
        xp, f = namespace(weight), weight.dtype.type
        g = self.prepare_grad(grad, weight, with_wd=True)
        n = state[0]
        n *= f(self.gamma1)
        n += f(1 - self.gamma1) * g * g
        if not self.centered:
            weight -= f(lr) * g / xp.sqrt(n + f(self.epsilon))
            return
        _, gbar, delta = state
        gbar *= f(self.gamma1)
        gbar += f(1 - self.gamma1) * g
        delta *= f(self.gamma2)
        delta -= f(lr) * g / xp.sqrt(n - gbar * gbar + f(self.epsilon))
        weight += delta


class BlockMomentum(Optimizer):
    """The outer step of block momentum (BMUF, Chen & Huo 2016; CNTK's block momentum).

    The workers push block pseudo-gradients ``w_start - w_local`` (see :mod:`kvstore.block`);
    with ``rescale_grad = 1 / num_workers``, ``G = -(clip(rescale_grad * sum) + wd * w)`` is
    the mean of the workers' deltas ``w_local - w_start``. Then ``delta = momentum * delta +
    lr * G`` and ``w += delta``. The stored value, which the workers pull and start their
    next block from, is the Nesterov look-ahead ``w + momentum * delta`` with ``nesterov``
    (state ``(delta, w)``), else ``w`` itself (state ``(delta,)``).

    The server keeps ``w`` and ``delta`` and hands out the look-ahead it computed, so every
    worker starts from the same bytes and the optimizer states carry all of it. Without
    ``nesterov`` this is :class:`SGD` with ``momentum``, formula for formula.

    >>> opt = BlockMomentum(learning_rate=1.0, momentum=0.5, rescale_grad=0.5)
    >>> w = np.zeros(1, np.float32); up = Updater(opt)
    >>> up(0, np.full(1, -2.0, np.float32), w); w  # G = 1: delta = 1, w = 1, look-ahead 1.5
    array([1.5], dtype=float32)
    """

    name = "block_momentum"
    _extra = ("momentum", "nesterov")

    def __init__(
        self, learning_rate: float = 1.0, momentum: float = 0.0, nesterov: bool = True, **kwargs
    ):
        super().__init__(learning_rate=learning_rate, **kwargs)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"BlockMomentum: momentum must be in [0, 1), got {momentum}")
        self.momentum, self.nesterov = float(momentum), bool(nesterov)

    def create_state(self, weight):
        delta = namespace(weight).zeros_like(weight)
        # the first stored value is w itself: delta is 0, so the look-ahead is w
        return (delta, weight.copy()) if self.nesterov else (delta,)

    def update(self, weight, grad, state, lr, t):
        f = weight.dtype.type
        delta = state[0]
        model = state[1] if self.nesterov else weight
        g = self.prepare_grad(grad, model, with_wd=True)  # -G: the mean pseudo-gradient
        delta *= f(self.momentum)
        delta -= f(lr) * g
        model += delta
        if self.nesterov:
            weight[...] = model + f(self.momentum) * delta


_OPTIMIZERS = {cls.name: cls for cls in (SGD, NAG, Adam, AdaGrad, RMSProp, BlockMomentum)}


def create(name: str, **params) -> Optimizer:
    """``create('sgd', learning_rate=0.1, momentum=0.9)``, as ``mx.optimizer.create``."""
    return from_spec({"name": name, "params": params})


def from_spec(spec: dict) -> Optimizer:
    """Rebuild an optimizer from :meth:`Optimizer.spec`; a bad spec is a ``ValueError``."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(f"optimizer spec must be {{'name': str, 'params': dict}}, got {spec!r}")
    name = spec["name"].lower()
    if name not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {sorted(_OPTIMIZERS)}")
    params = dict(spec.get("params") or {})
    sched = params.pop("lr_scheduler", None)
    if sched is not None:
        if sched.get("name") not in _SCHEDULERS:
            raise ValueError(f"unknown lr_scheduler {sched!r}; valid: {sorted(_SCHEDULERS)}")
        params["lr_scheduler"] = _SCHEDULERS[sched["name"]](**sched.get("params", {}))
    try:
        return _OPTIMIZERS[name](**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for optimizer {name!r}: {exc}") from None


class Updater:
    """Applies an optimizer per key and keeps its state: ``updater(key, grad, weight)``.

    The update count per key drives the schedule and Adam's bias correction; the schedule
    sees the largest count over all keys, as MXNet's ``num_update``.
    """

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self.states: dict = {}
        self.counts: dict = {}
        self.num_update = 0

    def __call__(self, key, grad, weight) -> None:
        if key not in self.states:
            self.states[key] = self.optimizer.create_state(weight)
        t = self.counts[key] = self.counts.get(key, 0) + 1
        self.num_update = max(self.num_update, t)
        lr = self.optimizer.learning_rate(self.num_update)
        self.optimizer.update(weight, grad, self.states[key], lr, t)

    def dumps(self) -> bytes:
        """The state as bytes (msgpack; arrays as raw little-endian buffers)."""
        entries = [
            [_wire_key(k), self.counts.get(k, 0), [_pack(a) for a in state]]
            for k, state in self.states.items()
        ]
        return msgpack.packb(
            {"optimizer": self.optimizer.spec(), "num_update": self.num_update, "entries": entries}
        )

    def loads(self, blob: bytes, like: dict | None = None) -> None:
        """Load :meth:`dumps` output. ``like`` maps a key to a weight, whose array module and
        device the loaded state takes (so a CuPy store gets CuPy state)."""
        data = _unpack_states(blob)
        for key, count, arrays in data["entries"]:
            ref = (like or {}).get(key)
            if ref is not None:
                xp = namespace(ref)
                arrays = [xp.asarray(a) for a in arrays]
            self.states[key] = tuple(arrays)
            self.counts[key] = count
        self.num_update = max(self.num_update, data["num_update"])


def _unpack_states(blob: bytes) -> dict:
    try:
        data = msgpack.unpackb(blob, strict_map_key=False)
        data["entries"] = [
            (_from_wire_key(k), c, [_unpack(a) for a in arrs]) for k, c, arrs in data["entries"]
        ]
        return data
    except Exception as exc:
        raise ValueError(f"not an optimizer state file written by kvstore: {exc}") from None


def _wire_key(key):
    return list(key) if isinstance(key, tuple) else key


def _from_wire_key(key):
    return tuple(key) if isinstance(key, list) else key


def _pack(array) -> list:
    host = np.ascontiguousarray(to_host(array))
    return [host.dtype.str, list(host.shape), host.tobytes()]


def _unpack(item) -> np.ndarray:
    dtype, shape, raw = item
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
