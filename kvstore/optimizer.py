"""Optimizers with MXNet's update formulas, on NumPy and CuPy arrays alike.

An optimizer is described by a plain spec, ``{"name": "sgd", "params": {...}}``, so that a
worker can send it to the servers without pickle (:func:`from_spec` rebuilds it). The state an
optimizer keeps per key lives in an :class:`Updater`, which can save and load it.

Every update first forms the gradient as MXNet's kernel for it does: ``g = rescale_grad *
grad``, clipped to ``[-clip_gradient, clip_gradient]`` when ``clip_gradient`` is set, and
(where the formula says so) ``+ wd * weight``. The order differs between MXNet's kernels, and
each optimizer here follows its own: SGD, NAG, AdaGrad, FTRL and LAMB clip before adding
``wd``; Adam and RMSProp clip ``rescale_grad * grad + wd * weight`` (after adding it).
``tests/test_mxnet_optimizers.py`` checks every optimizer against trajectories recorded from
MXNet 1.9.1's own updaters.

``multi_precision=True`` (any optimizer, as MXNet's): a float16 weight is updated through a
float32 master copy kept in the optimizer state; the float16 value is its rounding.

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
        multi_precision: bool = False,
        lazy_update: bool = True,
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
        self.multi_precision = bool(multi_precision)
        # row-sparse keys (kvstore.sparse): update only the rows pushed in a round (MXNet's
        # default), or every stored row with False
        self.lazy_update = bool(lazy_update)

    def learning_rate(self, num_update: int) -> float:
        return self.lr if self.lr_scheduler is None else float(self.lr_scheduler(num_update))

    def prepare_grad(self, grad, weight, with_wd: bool, clip_after_wd: bool = False):
        """``rescale_grad * grad``, clipped, ``+ wd * weight`` if ``with_wd`` (a new array);
        with ``clip_after_wd`` the clip comes last: ``clip(rescale_grad * grad + wd * w)``."""
        xp = namespace(grad)
        g = grad * grad.dtype.type(self.rescale_grad)
        if self.clip_gradient is not None and not clip_after_wd:
            xp.clip(g, -self.clip_gradient, self.clip_gradient, out=g)
        if with_wd and self.wd:
            g += weight.dtype.type(self.wd) * weight
        if self.clip_gradient is not None and clip_after_wd:
            xp.clip(g, -self.clip_gradient, self.clip_gradient, out=g)
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
        if self.multi_precision:  # only when set: specs of earlier versions stay the same
            params["multi_precision"] = True
        if not self.lazy_update:
            params["lazy_update"] = False
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

    This is MXNet's documented formula. MXNet 1.9's in-place ``nag_mom_update`` kernel departs
    from it: it writes the new weight before it reads ``w`` for the ``wd * w`` of the second
    term, so with ``wd > 0`` its trajectory differs slightly; kvstore keeps the documented one.
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

    ``g = clip(rescale_grad * grad + wd * w)`` (MXNet's ``adam_update`` clips after adding the
    weight decay); ``m = beta1 m + (1 - beta1) g``;
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
        g = self.prepare_grad(grad, weight, with_wd=True, clip_after_wd=True)
        mean, var = _moments(state, g, self.beta1, self.beta2, f)
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

    ``g = clip(rescale_grad * grad + wd * w)`` (clipped after adding the weight decay, as
    MXNet's kernels); ``n = gamma1 n + (1 - gamma1) g**2``; plain: ``w -= lr g / sqrt(n +
    epsilon)``; centered: ``gbar = gamma1 gbar + (1 - gamma1) g``, ``delta = gamma2 delta - lr
    g / sqrt(n - gbar**2 + epsilon)``, ``w += delta``. ``clip_weights`` then clips ``w`` to
    ``[-clip_weights, clip_weights]``.
    """

    name = "rmsprop"
    _extra = ("gamma1", "gamma2", "epsilon", "centered", "clip_weights")

    def __init__(
        self,
        learning_rate: float = 0.001,
        gamma1: float = 0.9,
        gamma2: float = 0.9,
        epsilon: float = 1e-8,
        centered: bool = False,
        clip_weights: float | None = None,
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.gamma1, self.gamma2, self.epsilon = float(gamma1), float(gamma2), float(epsilon)
        self.centered = bool(centered)
        if clip_weights is not None and clip_weights <= 0:
            raise ValueError("RMSProp: clip_weights must be > 0 or None")
        self.clip_weights = None if clip_weights is None else float(clip_weights)

    def create_state(self, weight):
        xp = namespace(weight)
        if self.centered:
            return (xp.zeros_like(weight), xp.zeros_like(weight), xp.zeros_like(weight))
        return (xp.zeros_like(weight),)

    def update(self, weight, grad, state, lr, t):
        xp, f = namespace(weight), weight.dtype.type
        g = self.prepare_grad(grad, weight, with_wd=True, clip_after_wd=True)
        n = state[0]
        n *= f(self.gamma1)
        n += f(1 - self.gamma1) * g * g
        if not self.centered:
            weight -= f(lr) * g / xp.sqrt(n + f(self.epsilon))
        else:
            _, gbar, delta = state
            gbar *= f(self.gamma1)
            gbar += f(1 - self.gamma1) * g
            delta *= f(self.gamma2)
            delta -= f(lr) * g / xp.sqrt(n - gbar * gbar + f(self.epsilon))
            weight += delta
        if self.clip_weights is not None:
            xp.clip(weight, -self.clip_weights, self.clip_weights, out=weight)


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


class Signum(Optimizer):
    """Signum (Bernstein et al. 2018), as MXNet's ``signum_update``; with ``momentum=0``,
    signSGD as MXNet's ``signsgd_update``.

    ``mom = momentum * mom - (1 - momentum) * (wd * w + clip(rescale_grad * grad))``;
    ``w = (1 - lr * wd_lh) * w + lr * sign(mom)``. signSGD: ``w = (1 - lr * wd) * w - lr *
    sign(grad)`` (MXNet's kernel: ``rescale_grad`` and ``clip_gradient`` cannot change a sign).
    """

    name = "signum"
    _extra = ("momentum", "wd_lh")

    def __init__(
        self, learning_rate: float = 0.01, momentum: float = 0.9, wd_lh: float = 0.0, **kwargs
    ):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum, self.wd_lh = float(momentum), float(wd_lh)

    def create_state(self, weight):
        return (namespace(weight).zeros_like(weight),) if self.momentum else ()

    def update(self, weight, grad, state, lr, t):
        xp, f = namespace(weight), weight.dtype.type
        if not self.momentum:
            weight *= f(1 - lr * self.wd)
            weight -= f(lr) * xp.sign(grad).astype(weight.dtype)
            return
        (mom,) = state
        g = self.prepare_grad(grad, weight, with_wd=True)  # clip(rescale * grad) + wd * w
        mom *= f(self.momentum)
        mom -= f(1 - self.momentum) * g
        weight *= f(1 - lr * self.wd_lh)
        weight += f(lr) * xp.sign(mom)


class FTRL(Optimizer):
    """FTRL-Proximal (McMahan et al. 2013), as MXNet's ``Ftrl`` / ``ftrl_update``.

    ``g = clip(rescale_grad * grad)``; ``z += g - (sqrt(n + g**2) - sqrt(n)) * w / lr``;
    ``n += g**2``; ``w = (sign(z) * lamda1 - z) / ((beta + sqrt(n)) / lr + wd)`` where
    ``|z| > lamda1``, else 0. MXNet's argument names and defaults (``lamda1`` as spelt there).
    """

    name = "ftrl"
    _extra = ("lamda1", "beta")

    def __init__(
        self, lamda1: float = 0.01, learning_rate: float = 0.1, beta: float = 1.0, **kwargs
    ):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.lamda1, self.beta = float(lamda1), float(beta)

    def create_state(self, weight):
        xp = namespace(weight)
        return (xp.zeros_like(weight), xp.zeros_like(weight))  # z, n

    def update(self, weight, grad, state, lr, t):
        xp, f = namespace(weight), weight.dtype.type
        g = self.prepare_grad(grad, weight, with_wd=False)
        z, n = state
        z += g - (xp.sqrt(n + g * g) - xp.sqrt(n)) * weight / f(lr)
        n += g * g
        weight[...] = (
            (xp.sign(z) * f(self.lamda1) - z)
            / ((f(self.beta) + xp.sqrt(n)) / f(lr) + f(self.wd))
            * (xp.abs(z) > f(self.lamda1))
        )


class AdamW(Optimizer):
    """AdamW (Loshchilov & Hutter, decoupled weight decay), as MXNet's ``AdamW`` (its fused
    ``adamw_update`` kernel with ``eta`` the bias-corrected rate).

    ``g = clip(rescale_grad * grad)``; ``m = beta1 m + (1 - beta1) g``; ``v = beta2 v + (1 -
    beta2) g**2``; ``lr_t = lr sqrt(1 - beta2**t) / (1 - beta1**t)`` (``lr`` itself with
    ``correct_bias=False``); ``w -= lr_t (m / (sqrt(v) + epsilon) + wd w)``.
    """

    name = "adamw"
    _extra = ("beta1", "beta2", "epsilon", "correct_bias")

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-6,
        correct_bias: bool = True,
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        self.correct_bias = bool(correct_bias)

    def create_state(self, weight):
        xp = namespace(weight)
        return (xp.zeros_like(weight), xp.zeros_like(weight))

    def update(self, weight, grad, state, lr, t):
        xp, f = namespace(weight), weight.dtype.type
        g = self.prepare_grad(grad, weight, with_wd=False)
        mean, var = _moments(state, g, self.beta1, self.beta2, f)
        if self.correct_bias:
            lr = lr * math.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)
        step = mean / (xp.sqrt(var) + f(self.epsilon))
        if self.wd:
            step += f(self.wd) * weight
        weight -= f(lr) * step


class LAMB(Optimizer):
    """LAMB (You et al. 2019), as MXNet's ``LAMB`` (``lamb_update_phase1`` and ``phase2``).

    ``g = clip(rescale_grad * grad)``; ``m = beta1 m + (1 - beta1) g``; ``v = beta2 v + (1 -
    beta2) g**2``; ``u = m_hat / (sqrt(v_hat) + epsilon) + wd w`` (``m_hat = m / (1 -
    beta1**t)``, ``v_hat = v / (1 - beta2**t)``; ``m`` and ``v`` themselves with
    ``bias_correction=False``); ``r1 = ||w||`` limited to ``[lower_bound, upper_bound]`` when
    given, ``r2 = ||u||``; ``w -= lr (r1 / r2) u``, or ``lr u`` when ``r1`` or ``r2`` is 0.
    The norms are over the whole key (on a server, the key's part it holds).
    """

    name = "lamb"
    _extra = ("beta1", "beta2", "epsilon", "lower_bound", "upper_bound", "bias_correction")

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-6,
        lower_bound: float | None = None,
        upper_bound: float | None = None,
        bias_correction: bool = True,
        **kwargs,
    ):
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        self.upper_bound = None if upper_bound is None else float(upper_bound)
        self.bias_correction = bool(bias_correction)

    def create_state(self, weight):
        xp = namespace(weight)
        return (xp.zeros_like(weight), xp.zeros_like(weight))

    def update(self, weight, grad, state, lr, t):
        xp, f = namespace(weight), weight.dtype.type
        g = self.prepare_grad(grad, weight, with_wd=False)
        mean, var = _moments(state, g, self.beta1, self.beta2, f)
        if self.bias_correction:
            m = mean / (f(1) - f(self.beta1) ** t)
            v = var / (f(1) - f(self.beta2) ** t)
        else:
            m, v = mean, var
        u = m / (xp.sqrt(v) + f(self.epsilon))
        if self.wd:
            u += f(self.wd) * weight
        r1 = float(xp.linalg.norm(weight.ravel()))
        if self.lower_bound:  # MXNet passes a bound only when it is set and non-zero
            r1 = max(r1, self.lower_bound)
        if self.upper_bound:
            r1 = min(r1, self.upper_bound)
        r2 = float(xp.linalg.norm(u.ravel()))
        ratio = 1.0 if r1 == 0 or r2 == 0 else r1 / r2
        weight -= f(lr * ratio) * u


Ftrl = FTRL  # MXNet's class name


_OPTIMIZERS = {
    cls.name: cls
    for cls in (SGD, NAG, Adam, AdaGrad, RMSProp, BlockMomentum, Signum, FTRL, AdamW, LAMB)
}


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
        opt = self.optimizer
        mixed = opt.multi_precision and weight.dtype == np.float16
        if key not in self.states:
            # multi_precision: (float32 master copy, *the optimizer's state for it), as MXNet
            master = (weight.astype(np.float32),) if mixed else ()
            self.states[key] = master + tuple(opt.create_state(master[0] if mixed else weight))
        t = self.counts[key] = self.counts.get(key, 0) + 1
        self.num_update = max(self.num_update, t)
        lr = opt.learning_rate(self.num_update)
        if not mixed:
            opt.update(weight, grad, self.states[key], lr, t)
            return
        master, *state = self.states[key]
        opt.update(master, grad.astype(np.float32), tuple(state), lr, t)
        weight[...] = master.astype(weight.dtype)

    def dumps(self) -> bytes:
        """The state as bytes (msgpack; arrays as raw little-endian buffers)."""
        entries = [
            [_wire_key(k), self.counts.get(k, 0), [pack_array(a) for a in state]]
            for k, state in self.states.items()
        ]
        return msgpack.packb(
            {"optimizer": self.optimizer.spec(), "num_update": self.num_update, "entries": entries}
        )

    def loads(self, blob: bytes, like: dict | None = None) -> None:
        """Load :meth:`dumps` output. ``like`` maps a key to a weight, whose array module and
        device the loaded state takes (so a CuPy store gets CuPy state)."""
        data = _unpack_states(blob)  # (checked whole, converted, then loaded)
        loaded = []
        for key, count, arrays in data["entries"]:
            ref = (like or {}).get(key)
            if ref is not None:
                xp = namespace(ref)
                arrays = [xp.asarray(a) for a in arrays]
            loaded.append((key, count, tuple(arrays)))
        for key, count, arrays in loaded:
            self.states[key] = arrays
            self.counts[key] = count
        self.num_update = max(self.num_update, data["num_update"])


def _unpack_states(blob: bytes) -> dict:
    """:meth:`Updater.dumps` output, parsed and checked (a ``ValueError`` if it is not)."""
    try:
        data = msgpack.unpackb(blob, strict_map_key=False)
        data["entries"] = [
            (_from_wire_key(k), c, [unpack_array(a) for a in arrs])
            for k, c, arrs in data["entries"]
        ]
        if type(data["num_update"]) is not int or not all(
            type(c) is int for _, c, _ in data["entries"]
        ):
            raise ValueError("update counts must be ints")
        return data
    except Exception as exc:
        raise ValueError(f"not an optimizer state file written by kvstore: {exc}") from None


def _wire_key(key):
    return list(key) if isinstance(key, tuple) else key


def _from_wire_key(key):
    return tuple(key) if isinstance(key, list) else key


def _moments(state, g, beta1: float, beta2: float, f):
    """Adam's running moments, in place: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g²``."""
    mean, var = state
    mean *= f(beta1)
    mean += f(1 - beta1) * g
    var *= f(beta2)
    var += f(1 - beta2) * g * g
    return mean, var


def pack_array(array) -> list:
    """An array as msgpack-able ``[dtype, shape, bytes]`` (host memory; never pickle)."""
    host = np.ascontiguousarray(to_host(array))
    return [host.dtype.str, list(host.shape), host.tobytes()]


def unpack_array(item) -> np.ndarray:
    """The writable array :func:`pack_array` packed."""
    dtype, shape, raw = item
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
