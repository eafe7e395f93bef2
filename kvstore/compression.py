"""Gradient compression with error feedback: MXNet's 2-bit and CNTK's 1-bit SGD.

The worker adds the gradient to a residual it keeps per key (and per device), quantises the
residual, sends the packed codes, and keeps what quantisation lost for the next push:

- ``2bit`` (MXNet): each element becomes ``+threshold``, ``-threshold`` or ``0``
  (``r >= t``, ``r <= -t``, else), four elements per byte, 16x smaller than float32.
- ``1bit`` (CNTK's 1-bit SGD): each element becomes its sign, reconstructed as the mean of the
  residual's non-negative elements or of its negative ones (two floats of header), eight
  elements per byte, 32x smaller than float32.

Both halves are written against the array module, so they run on NumPy and CuPy, and cost a
few passes over the gradient (``benchmarks/codec.py`` measures them against ``np.copyto``):
the worker quantises in pieces that fit the L2 cache (on the host, with scratch buffers kept
per thread from call to call), and the server decodes with one table lookup per byte (4 or 8
values), the same floats the worker subtracted. A small key (up to :data:`_SMALL` elements,
a training step's many 1 KiB keys) costs the number of NumPy calls, not its bytes: it is
quantised in whole-array passes without the scratch buffers, with the 2-bit table made once
per dtype and threshold, and a 1-bit one is decoded without a table.

>>> import numpy as np
>>> c = Compression.from_params({'type': '2bit', 'threshold': 0.5})
>>> res = {}
>>> packed, header = c.encode(res, 'w', np.array([0.7, -0.2, -0.6, 0.1], np.float32))
>>> c.decode(packed, header, 4, np.float32)
array([ 0.5,  0. , -0.5,  0. ], dtype=float32)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .arrays import namespace

_KINDS = ("2bit", "1bit")


@dataclass(frozen=True)
class Compression:
    kind: str
    threshold: float = 0.5
    pull: bool = False  # the servers' replies are compressed too (see PullCodes)

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
        extra = set(params) - {"type", "threshold", "pull"}
        if extra or (kind == "1bit" and "threshold" in params):
            raise ValueError(
                f"unknown gradient compression parameters for {kind}: "
                f"{sorted(extra) or ['threshold']}"
            )
        threshold = params.get("threshold", 0.5)
        if kind == "2bit" and (not isinstance(threshold, (int, float)) or not threshold > 0):
            raise ValueError(f"2bit compression: threshold must be a number > 0, got {threshold!r}")
        pull = params.get("pull", False)
        if type(pull) is not bool:
            raise ValueError(f"gradient compression: 'pull' must be True or False, got {pull!r}")
        return cls(kind, float(threshold), pull)

    def params(self) -> dict:
        """What :meth:`from_params` takes back (sent to the servers with each push)."""
        params = (
            {"type": self.kind, "threshold": self.threshold}
            if self.kind == "2bit"
            else {"type": self.kind}
        )
        if self.pull:
            params["pull"] = True
        return params

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
        new = xp.empty(flat.size, grad.dtype)
        if self.kind == "2bit":
            packed = _quantize2(xp, residual, flat, new, new.dtype.type(self.threshold))
            return packed, [self.threshold], new
        packed, hi, lo = _quantize1(xp, residual, flat, new)
        return packed, [hi, lo], new

    def decode(self, packed, header, size: int, dtype, out=None):
        """The dequantised flat array of ``size`` elements (written into the flat host array
        ``out`` when given, and returned)."""
        xp = namespace(packed)
        if self.kind == "1bit" and xp is np and size <= _SMALL:  # no table for a few bytes
            signs = np.unpackbits(packed, count=size).view(bool)
            values = np.where(signs, dtype(header[0]), dtype(header[1]))
            if out is None:
                return values
            np.copyto(out, values)
            return out
        table = (
            _table2(xp, dtype, header[0]) if self.kind == "2bit" else _table1(xp, dtype, *header)
        )
        per = table.shape[1]
        if out is not None and size == packed.size * per:  # straight into out, no temporary
            _take_into(xp, table, packed, out.reshape(-1, per))
            return out
        values = xp.take(table, packed, axis=0).reshape(-1)[:size]
        if out is None:
            return values
        xp.copyto(out, values)
        return out

    def for_sums_of(self, count: int) -> Compression:
        """The codec for the sum of ``count`` pushes: 2-bit's threshold times ``count``, so
        that a sum can move as far in a round as its pushes did (a sum of W pushes of
        ``+threshold`` is sent as such, not capped at one push's worth); 1-bit's means
        scale by themselves."""
        if self.kind != "2bit" or count <= 1:
            return self
        return Compression(self.kind, self.threshold * count, self.pull)

    def check_header(self, header) -> bool:
        """Whether ``header`` (off the wire) is one this codec's :meth:`decode` takes."""
        return (
            isinstance(header, list)
            and len(header) == (1 if self.kind == "2bit" else 2)
            and all(type(v) in (int, float) for v in header)
        )

    def roundtrip(self, residuals: dict, rkey, grad):
        """What the servers will see of ``grad``: encode then decode (for in-process stores)."""
        packed, header = self.encode(residuals, rkey, grad)
        return self.decode(packed, header, grad.size, grad.dtype.type).reshape(grad.shape)


class PullCodes:
    """The servers' side of compressed pulls (``{'pull': True}``).

    The value a round's sum leaves in a key part is quantised once, at the first reply that
    asks for it, with error feedback kept per key part (what quantising one round's sum lost
    is added to the next round's before it is quantised), and every reply of that round
    carries the same codes: every worker reads the same floats. 2-bit quantises the sum of
    W workers' pushes with W times their threshold (:meth:`Compression.for_sums_of`; the
    threshold travels in each reply's header). Only a round's sum is sent as codes; a value
    that init, an optimizer or an async push left goes exact.

    >>> codes, c = PullCodes(), Compression.from_params({'type': '2bit', 'pull': True})
    >>> codes.codes('w', np.array([0.7, 0.2], np.float32), c) is None  # not a round's sum
    True
    >>> codes.summed('w')
    >>> packed, header = codes.codes('w', np.array([0.7, 0.2], np.float32), c)
    >>> c.decode(packed, header, 2, np.float32)
    array([0.5, 0. ], dtype=float32)
    """

    def __init__(self):
        self.active = False  # a request asked for compressed pulls: exact replies are noted
        self._rounds: dict = {}  # key -> rounds summed, while its value is a round's sum
        self._codes: dict = {}  # key -> (rounds summed, codec, packed, header)
        self._residuals: dict = {}  # key -> what quantising its last sum lost
        self._exact: dict = {}  # key -> the round last answered exact (once active)

    def summed(self, key) -> None:
        """A round's sum is now the value of ``key``."""
        self._rounds[key] = self._rounds.get(key, 0) + 1

    def changed(self, key) -> None:
        """Something other than a round's sum wrote ``key`` (an optimizer, an async push)."""
        if self._rounds.pop(key, None) is not None:
            self._codes.pop(key, None)
            self._residuals.pop(key, None)
            self._exact.pop(key, None)

    def exact(self, key) -> None:
        """A reply carries the round's sum of ``key`` exact: refused (ValueError) when a reply
        of the same round carried codes, since the workers would read different values."""
        n = self._rounds.get(key)
        if n is None:
            return
        made = self._codes.get(key)
        if made is not None and made[0] == n:
            raise _mixed(key)
        self._exact[key] = n

    def codes(self, key, value, codec: Compression, workers: int = 1):
        """``(packed, header)`` of the round's sum ``value`` of ``key`` (over ``workers``
        pushes), the same for every reply of that round; None when the value is not a round's
        sum."""
        n = self._rounds.get(key)
        if n is None:
            return None
        if self._exact.get(key) == n:
            raise _mixed(key)
        made = self._codes.get(key)
        if made is not None and made[0] == n:
            if made[1] != codec:
                raise ValueError(
                    f"workers pulled one round with different gradient compressions "
                    f"({made[1].params()} and {codec.params()}): every worker of a job must "
                    "call set_gradient_compression with the same parameters"
                )
            return made[2], made[3]
        packed, header, self._residuals[key] = codec.for_sums_of(workers).quantize(
            self._residuals.get(key), value
        )
        self._codes[key] = (n, codec, packed, header)
        return packed, header


def _mixed(key) -> ValueError:
    return ValueError(
        f"one round of key {key!r} was pulled both compressed and exact: every worker of a "
        "job must call set_gradient_compression with the same parameters (some workers asked "
        "for compressed pulls, 'pull': True, and some did not)"
    )


def packed_size(kind: str, size: int) -> int:
    """Bytes of the codes of ``size`` elements (the one place that says it)."""
    return (size + 3) // 4 if kind == "2bit" else (size + 7) // 8


# Elements quantised per pass on the host: the temporaries of one piece (comparisons, codes,
# the values sent) stay in the L2 cache instead of streaming through memory once per step.
_PIECE = 1 << 17

# Byte b of a 2-bit frame holds the codes of four elements, the first in the low bits
# (MXNet's order): code 1 is +threshold, 2 is -threshold, 0 is zero.
_CODES2 = (np.arange(256)[:, None] >> np.arange(0, 8, 2)) & 3
# Byte b of a 1-bit frame holds eight signs, the first in the high bit (np.packbits' order).
_SIGNS1 = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).astype(bool)
# Four codes, one per byte of a little-endian uint32 (c0 | c1 << 8 | c2 << 16 | c3 << 24),
# times this have c0 | c1 << 2 | c2 << 4 | c3 << 6 in their top byte: the other partial
# products land in distinct bits below it, so nothing carries into it.
_GATHER2 = np.uint32(1 << 24 | 1 << 18 | 1 << 12 | 1 << 6)

# Scratch buffers up to this many bytes are kept (per thread) for the next call; bigger ones
# (a whole array quantised at once, not in the planner's pieces) are allocated per call.
_KEEP_SCRATCH = 16 << 20
_scratch = threading.local()


def _buffer(xp, name: str, size: int, dtype):
    """A scratch array of ``size`` elements, reused across calls on the host: its contents
    are whatever the last user left."""
    if xp is not np:
        return xp.empty(size, dtype)
    dtype = np.dtype(dtype)
    kept = getattr(_scratch, "buffers", None)
    if kept is None:
        kept = _scratch.buffers = {}
    buf = kept.get((name, dtype))
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype)
        if size * dtype.itemsize <= _KEEP_SCRATCH:
            kept[(name, dtype)] = buf
    return buf[:size]


def _take_into(xp, table, codes, out):
    """``table[codes]`` row by row into ``out``. On the host with ``mode='clip'`` (a uint8
    code is always one of the 256 rows): NumPy's default mode writes to a temporary first,
    so that a bad index leaves ``out`` untouched, then copies it (1.6x slower in the cache,
    3x out of it)."""
    if xp is np:
        return np.take(table, codes, axis=0, out=out, mode="clip")
    return xp.take(table, codes, axis=0, out=out)


def _table2(xp, dtype, threshold):
    """256 x 4: the values of the four elements that each 2-bit byte codes (on the host made
    once per dtype and threshold: building it cost as much as quantising a 1 KiB key)."""
    if xp is np:
        key = (dtype, float(threshold))
        table = _tables2.get(key)
        if table is None:
            if len(_tables2) >= 64:
                _tables2.clear()
            table = _tables2[key] = _make_table2(np, dtype, threshold)
            table.flags.writeable = False
        return table
    return _make_table2(xp, dtype, threshold)


def _make_table2(xp, dtype, threshold):
    t = dtype(threshold)
    return xp.asarray([0, t, -t, 0], dtype=dtype)[xp.asarray(_CODES2)]


_tables2: dict = {}  # (dtype, threshold) -> the host's table


def _table1(xp, dtype, hi, lo):
    """256 x 8: the values of the eight elements that each 1-bit byte codes."""
    return xp.where(xp.asarray(_SIGNS1), dtype(hi), dtype(lo)).astype(dtype, copy=False)


def _pieces(xp, size: int, multiple: int):
    """``(start, stop)`` of the pieces to quantise, and the (rounded up) piece length."""
    step = _PIECE if xp is np else max(size, 1)
    step = -(-step // multiple) * multiple
    return [(lo, min(lo + step, size)) for lo in range(0, size, step)], step


def _sum_into(xp, residual, flat, out) -> None:
    if residual is None:
        xp.copyto(out, flat)
    else:
        xp.add(residual, flat, out=out)


def _quantize2(xp, residual, flat, new, t):
    """Write ``residual + flat``, less what the codes send, into ``new``; return the codes.

    Each piece: two comparisons into bool buffers, read four at a time as uint32 words,
    combined into codes and gathered into bytes by one multiply; the values sent are one
    table lookup per byte, subtracted from the piece (r - t, r - (-t) = r + t or r - 0:
    the same floats as the decoder's)."""
    table = _table2(xp, new.dtype.type, t)
    if xp is np and flat.size <= _SMALL:
        return _quantize2_small(residual, flat, new, t, table)
    packed = xp.empty(-(-flat.size // 4), xp.uint8)
    pieces, step = _pieces(xp, flat.size, 4)
    above, below = _buffer(xp, "above", step, bool), _buffer(xp, "below", step, bool)
    words = _buffer(xp, "words", step // 4, xp.uint32)
    values = _buffer(xp, "values", step, new.dtype).reshape(-1, 4)
    for lo, hi in pieces:
        r = new[lo:hi]
        _sum_into(xp, None if residual is None else residual[lo:hi], flat[lo:hi], r)
        n, nbytes = hi - lo, -(-(hi - lo) // 4)
        pos, neg = above[: 4 * nbytes], below[: 4 * nbytes]
        pos[n:] = False  # the padding of the last byte codes zeros
        neg[n:] = False
        xp.greater_equal(r, t, out=pos[:n])
        xp.less_equal(r, -t, out=neg[:n])
        codes = words[:nbytes]
        xp.left_shift(neg.view(xp.uint32), 1, out=codes)
        xp.bitwise_or(codes, pos.view(xp.uint32), out=codes)
        xp.multiply(codes, _GATHER2, out=codes)
        xp.right_shift(codes, 24, out=codes)
        out = packed[lo // 4 : lo // 4 + nbytes]
        xp.copyto(out, codes, casting="unsafe")
        sent = _take_into(xp, table, out, values[:nbytes])
        xp.subtract(r, sent.reshape(-1)[:n], out=r)
    return packed


# Host arrays up to this many elements are quantised in one piece, without the scratch
# buffers: a small key's cost is the number of NumPy calls, not its bytes.
_SMALL = 4096


def _quantize2_small(residual, flat, new, t, table):
    """:func:`_quantize2` for a small host array: the same steps and floats, one piece, in
    fresh small buffers (looking up the kept scratch buffers cost more than making these)."""
    n = flat.size
    nbytes = -(-n // 4)
    _sum_into(np, residual, flat, new)
    pos, neg = np.zeros(4 * nbytes, bool), np.zeros(4 * nbytes, bool)
    np.greater_equal(new, t, out=pos[:n])
    np.less_equal(new, -t, out=neg[:n])
    codes = np.left_shift(neg.view(np.uint32), 1)
    np.bitwise_or(codes, pos.view(np.uint32), out=codes)
    np.multiply(codes, _GATHER2, out=codes)
    np.right_shift(codes, 24, out=codes)
    packed = codes.astype(np.uint8)
    sent = np.take(table, packed, axis=0, mode="clip")
    np.subtract(new, sent.reshape(-1)[:n], out=new)
    return packed


def _quantize1(xp, residual, flat, new):
    """Write ``residual + flat``, less what the signs send, into ``new``; return the packed
    signs and the two means (of the non-negative elements, of the negative ones).

    Each piece (in the L2 cache) adds its non-negative elements and its negative ones to two
    float64 totals: its values times its signs, then times the signs' complement, each
    summed pairwise by NumPy (each sign's own sum: a difference of totals loses a small
    mean beside a big one). An infinity times a zero sign is NaN, so a piece whose sum comes
    out NaN is summed again by gathering its elements. A second pass subtracts what the
    signs send. (Gathering every piece, ``flatnonzero`` + ``take``, gave the bits of a
    whole-array ``new[signs].sum()`` at twice the cost.)"""
    if xp is not np:
        return _quantize1_whole(xp, residual, flat, new)
    if flat.size <= _SMALL:
        return _quantize1_small(residual, flat, new)
    size = flat.size
    packed = np.empty(-(-size // 8), np.uint8)
    pieces, step = _pieces(np, size, 8)
    signs = _buffer(np, "signs", step, bool)
    kept = _buffer(np, "kept", step, new.dtype)
    npos, positive, negative = 0, 0.0, 0.0
    wide = np.float32 if new.dtype.itemsize < 4 else None  # float16 sums overflow at 65504
    for lo, hi in pieces:
        r, s, k = new[lo:hi], signs[: hi - lo], kept[: hi - lo]
        _sum_into(np, None if residual is None else residual[lo:hi], flat[lo:hi], r)
        np.greater_equal(r, 0, out=s)
        packed[lo // 8 : -(-hi // 8)] = np.packbits(s)
        npos += int(np.count_nonzero(s))
        positive += _signed_sum(r, s, k, wide)
        np.logical_not(s, out=s)
        negative += _signed_sum(r, s, k, wide)
    nneg = size - npos
    hi_mean = positive / npos if npos else 0.0
    lo_mean = negative / nneg if nneg else 0.0
    _subtract_sent1(np, packed, new, pieces, step, hi_mean, lo_mean)
    return packed, hi_mean, lo_mean


def _signed_sum(r, s, k, wide) -> float:
    """The sum of the elements of ``r`` where ``s``, through the scratch ``k``."""
    with np.errstate(invalid="ignore"):
        np.multiply(r, s, out=k)
    total = float(k.sum(dtype=wide))
    if total != total:  # NaN: an infinity met a zero sign (or r holds a NaN): gather
        total = float(r[s].sum(dtype=wide))
    return total


def _quantize1_small(residual, flat, new):
    """:func:`_quantize1` for a small host array, in whole-array passes without the scratch
    buffers (each mean the sum of its gathered elements)."""
    n = flat.size
    _sum_into(np, residual, flat, new)
    signs = np.greater_equal(new, 0)
    packed = np.packbits(signs)
    npos = int(np.count_nonzero(signs))
    hi = float(new[signs].sum()) / npos if npos else 0.0
    lo = float(new[~signs].sum()) / (n - npos) if n - npos else 0.0
    sent = np.take(_table1(np, new.dtype.type, hi, lo), packed, axis=0, mode="clip")
    np.subtract(new, sent.reshape(-1)[:n], out=new)
    return packed, hi, lo


def _quantize1_whole(xp, residual, flat, new):
    """:func:`_quantize1` on a device: whole-array passes."""
    signs = xp.empty(flat.size, bool)
    pieces, step = _pieces(xp, flat.size, 8)
    _sum_into(xp, residual, flat, new)
    xp.greater_equal(new, 0, out=signs)
    packed = xp.packbits(signs)
    npos = int(xp.count_nonzero(signs))
    nneg = flat.size - npos
    hi = float(xp.compress(signs, new).sum()) / npos if npos else 0.0
    lo = float(xp.compress(~signs, new).sum()) / nneg if nneg else 0.0
    _subtract_sent1(xp, packed, new, pieces, step, hi, lo)
    return packed, hi, lo


def _subtract_sent1(xp, packed, new, pieces, step, hi, lo) -> None:
    """``new`` less the values the signs send (one table lookup per byte of signs)."""
    table = _table1(xp, new.dtype.type, hi, lo)
    values = _buffer(xp, "values", step, new.dtype).reshape(-1, 8)
    for start, stop in pieces:
        nbytes = -(-(stop - start) // 8)
        codes = packed[start // 8 : start // 8 + nbytes]
        sent = _take_into(xp, table, codes, values[:nbytes])
        xp.subtract(new[start:stop], sent.reshape(-1)[: stop - start], out=new[start:stop])
