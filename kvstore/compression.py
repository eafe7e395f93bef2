"""Gradient compression with error feedback: MXNet's 2-bit and CNTK's 1-bit SGD.

The worker adds the gradient to a residual it keeps per key (and per device), quantises the
residual, sends the packed codes, and keeps what quantisation lost for the next push:

- ``2bit`` (MXNet): each element becomes ``+threshold``, ``-threshold`` or ``0``
  (``r >= t``, ``r <= -t``, else), four elements per byte, 16x smaller than float32.
- ``1bit`` (CNTK's 1-bit SGD): each element becomes its sign, reconstructed as the mean of the
  residual's non-negative elements or of its negative ones (two floats of header), eight
  elements per byte, 32x smaller than float32.

Pack and unpack are vectorised against the array module, so they run on NumPy and CuPy.

>>> import numpy as np
>>> c = Compression.from_params({'type': '2bit', 'threshold': 0.5})
>>> res = {}
>>> packed, header = c.encode(res, 'w', np.array([0.7, -0.2, -0.6, 0.1], np.float32))
>>> c.decode(packed, header, 4, np.float32)
array([ 0.5,  0. , -0.5,  0. ], dtype=float32)
"""

from __future__ import annotations

from dataclasses import dataclass

from .arrays import namespace

_KINDS = ("2bit", "1bit")


@dataclass(frozen=True)
class Compression:
    kind: str
    threshold: float = 0.5

    @classmethod
    def from_params(cls, params: dict) -> Compression:
        if not isinstance(params, dict) or "type" not in params:
            raise ValueError(
                "gradient compression takes a dict such as "
                f"{{'type': '2bit', 'threshold': 0.5}}; got {params!r}"
            )
        kind = params["type"]
        if kind not in _KINDS:
            raise ValueError(f"unknown gradient compression type {kind!r}; valid: {_KINDS}")
        extra = set(params) - {"type", "threshold"}
        if extra or (kind == "1bit" and "threshold" in params):
            raise ValueError(
                f"unknown gradient compression parameters for {kind}: "
                f"{sorted(extra) or ['threshold']}"
            )
        threshold = params.get("threshold", 0.5)
        if kind == "2bit" and (not isinstance(threshold, (int, float)) or not threshold > 0):
            raise ValueError(f"2bit compression: threshold must be a number > 0, got {threshold!r}")
        return cls(kind, float(threshold))

    def params(self) -> dict:
        """What :meth:`from_params` takes back (sent to the servers with each push)."""
        return (
            {"type": self.kind, "threshold": self.threshold}
            if self.kind == "2bit"
            else {"type": self.kind}
        )

    def encode(self, residuals: dict, rkey, grad):
        """Add ``grad`` to the residual of ``rkey``, quantise it, keep the error.

        Returns ``(packed uint8 array, header list)``; the header is what :meth:`decode` needs
        besides the element count and dtype.
        """
        packed, header, residuals[rkey] = self.quantize(residuals.get(rkey), grad)
        return packed, header

    def quantize(self, residual, grad):
        """``(packed, header, new residual)`` for ``grad`` added to ``residual`` (None: zeros),
        leaving ``residual`` untouched: the caller keeps the new one once the codes are sent."""
        xp = namespace(grad)
        flat = grad.reshape(-1)
        residual = flat.astype(grad.dtype, copy=True) if residual is None else residual + flat
        if self.kind == "2bit":
            t = residual.dtype.type(self.threshold)
            pos, neg = residual >= t, residual <= -t
            residual -= t * pos
            residual += t * neg
            codes = pos.astype(xp.uint8) | (neg.astype(xp.uint8) << 1)
            return _pack2(xp, codes), [self.threshold], residual
        signs = residual >= 0
        npos = int(signs.sum())
        nneg = flat.size - npos
        hi = float(residual[signs].sum()) / npos if npos else 0.0
        lo = float(residual[~signs].sum()) / nneg if nneg else 0.0
        residual -= xp.where(signs, residual.dtype.type(hi), residual.dtype.type(lo))
        return xp.packbits(signs), [hi, lo], residual

    def decode(self, packed, header, size: int, dtype):
        """The dequantised flat array of ``size`` elements."""
        xp = namespace(packed)
        if self.kind == "2bit":
            codes = _unpack2(xp, packed, size)
            t = header[0]
            return ((codes == 1).astype(dtype) - (codes == 2).astype(dtype)) * dtype(t)
        signs = xp.unpackbits(packed)[:size].astype(bool)
        hi, lo = header
        return xp.where(signs, dtype(hi), dtype(lo)).astype(dtype)

    def roundtrip(self, residuals: dict, rkey, grad):
        """What the servers will see of ``grad``: encode then decode (for in-process stores)."""
        packed, header = self.encode(residuals, rkey, grad)
        return self.decode(packed, header, grad.size, grad.dtype.type).reshape(grad.shape)


def packed_size(kind: str, size: int) -> int:
    return (size + 3) // 4 if kind == "2bit" else (size + 7) // 8


def _pack2(xp, codes):
    pad = (-codes.size) % 4
    if pad:
        codes = xp.concatenate([codes, xp.zeros(pad, xp.uint8)])
    q = codes.reshape(-1, 4)
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def _unpack2(xp, packed, size):
    shifts = xp.asarray([0, 2, 4, 6], dtype=xp.uint8)
    return ((packed[:, None] >> shifts) & 3).reshape(-1)[:size]
