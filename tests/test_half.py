"""kvstore.half.add: the same bits as NumPy's float16 add, whatever the values.

The reference is the definition, written with casts: ``float16(float32(a) + float32(b))``,
rounded to nearest even (what NumPy's float16 add computes, one element at a time). Pieces
and the small-array cut are shrunk so that hypothesis's arrays cross piece boundaries and
mix fast pieces with pieces NumPy adds (infinities, NaNs, magnitudes of 2**15 and more).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import half


def reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)


def same(got: np.ndarray, expected: np.ndarray) -> bool:
    """Bit for bit, but for a NaN's payload (casts and NumPy's add make different ones)."""
    nan = np.isnan(expected)
    return np.array_equal(np.isnan(got), nan) and got[~nan].tobytes() == expected[~nan].tobytes()


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(half, "_PIECE", 64)
    monkeypatch.setattr(half, "_SMALL", 1)


# float16 bit patterns by kind: zeros, subnormals, normals below 2**15 (the fast path),
# large ones, infinities and NaNs, each of either sign
KINDS = {
    "zero": (0x0000, 0x0000),
    "subnormal": (0x0001, 0x03FF),
    "normal": (0x0400, 0x77FF),
    "large": (0x7800, 0x7BFF),
    "inf": (0x7C00, 0x7C00),
    "nan": (0x7C01, 0x7FFF),
}


@st.composite
def halves(draw, size: int, special: bool):
    kinds = [k for k in KINDS if special or k not in ("large", "inf", "nan")]
    chosen = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=3, unique=True))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    which = rng.integers(0, len(chosen), size)
    lo = np.array([KINDS[k][0] for k in chosen])[which]
    hi = np.array([KINDS[k][1] for k in chosen])[which]
    bits = rng.integers(lo, hi + 1).astype(np.uint16) | (rng.integers(0, 2, size) << 15).astype(
        np.uint16
    )
    return bits.view(np.float16)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data(), st.integers(1, 300), st.booleans(), st.sampled_from(["new", "a", "b"]))
def test_add_is_the_float32_sum_rounded_to_float16(small_pieces, data, size, special, into):
    a = data.draw(halves(size, special), label="a")
    b = data.draw(halves(size, special), label="b")
    expected = reference(a, b)
    with np.errstate(all="ignore"):
        numpy_sum = a + b
    out = {"new": np.empty_like(a), "a": a, "b": b}[into]  # a server sums into a push's buffer
    with np.errstate(all="ignore"):
        assert half.add(a, b, out) is out
    assert same(out, expected)
    assert out.tobytes() == numpy_sum.tobytes()  # NaNs too: pairwise_sum's a + b


def test_every_half_below_2_to_the_15_against_a_sample():
    """The fast path alone, at the real piece size: every finite float16 below 2**15 (and its
    negative) plus each of 64 others, and the boundaries (zeros, subnormals, 32767)."""
    bits = np.r_[0:0x7800, 0x8000:0xF800].astype(np.uint16)
    a = bits.view(np.float16)
    rng = np.random.default_rng(5)
    picks = np.r_[rng.choice(bits, 64), [0, 0x8000, 1, 0x8001, 0x3FF, 0x400, 0x77FF, 0xF7FF]]
    out = np.empty_like(a)
    for pick in picks.astype(np.uint16):
        b = np.full(a.size, pick, np.uint16).view(np.float16)
        assert not half._large(a.view(np.int16)) and not half._large(b.view(np.int16))
        half.add(a, b, out)
        assert out.tobytes() == reference(a, b).tobytes(), hex(pick)


def test_overflow_infinities_and_nans_are_numpys():
    a = np.array([65504, 32768, np.inf, -np.inf, np.nan, 1, -0.0] * 1000, np.float16)
    b = np.array([65504, 32768, -np.inf, 1, 2, np.nan, -0.0] * 1000, np.float16)
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        half.add(a, b, out)
        assert out.tobytes() == (a + b).tobytes()
    assert same(out, reference(a, b))
    assert list(out[:7]) == pytest.approx(
        [np.inf, np.inf, np.nan, -np.inf, np.nan, np.nan, 0.0], nan_ok=True
    )
    assert np.signbit(out[6])


def test_other_dtypes_and_shapes_are_numpys_add():
    a = np.arange(10000, dtype=np.float32).reshape(100, 100)
    out = np.empty_like(a)
    assert half.add(a, a, out) is out and np.array_equal(out, a * 2)
    h = np.linspace(-3, 3, 10000).astype(np.float16).reshape(100, 100)
    strided = h[:, ::2]  # not contiguous: NumPy's add
    got = half.add(strided, strided, np.empty_like(strided))
    assert got.tobytes() == (strided + strided).tobytes()
    square = np.empty_like(h)
    assert half.add(h, h, square).tobytes() == reference(h, h).tobytes()
