"""2-bit and 1-bit gradient compression with error feedback."""

import numpy as np
import pytest

import kvstore
from kvstore.compression import Compression, packed_size
from kvstore.protocol import Message, encode

from .test_examples import final_accuracy, run_launch

rng = np.random.default_rng(3)


def ref_2bit(residual, grad, t):
    """Hand-written MXNet 2-bit: codes 1 (+t), 2 (-t), 0; four per byte, first in low bits."""
    residual = [r + g for r, g in zip(residual, grad, strict=True)]
    codes, sent = [], []
    for i, r in enumerate(residual):
        code = 1 if r >= t else 2 if r <= -t else 0
        q = t if code == 1 else -t if code == 2 else 0.0
        residual[i] = r - q
        codes.append(code)
        sent.append(q)
    codes += [0] * (-len(codes) % 4)
    packed = bytes(
        codes[i] | codes[i + 1] << 2 | codes[i + 2] << 4 | codes[i + 3] << 6
        for i in range(0, len(codes), 4)
    )
    return packed, sent, residual


def ref_1bit(residual, grad):
    """Hand-written 1-bit SGD: sign bits (first element in the high bit), two means."""
    residual = [r + g for r, g in zip(residual, grad, strict=True)]
    pos = [r for r in residual if r >= 0]
    neg = [r for r in residual if r < 0]
    hi = sum(pos) / len(pos) if pos else 0.0
    lo = sum(neg) / len(neg) if neg else 0.0
    bits = [1 if r >= 0 else 0 for r in residual] + [0] * (-len(residual) % 8)
    packed = bytes(
        sum(b << (7 - j) for j, b in enumerate(bits[i : i + 8])) for i in range(0, len(bits), 8)
    )
    sent = [hi if r >= 0 else lo for r in residual]
    return packed, sent, [r - s for r, s in zip(residual, sent, strict=True)]


@pytest.mark.parametrize("size", [1, 7, 64, 1001])
def test_2bit_matches_reference_over_steps(size):
    codec = Compression.from_params({"type": "2bit", "threshold": 0.5})
    residuals, ref_residual = {}, [0.0] * size
    for _ in range(5):
        grad = (rng.standard_normal(size) * 0.6).astype(np.float32)
        packed, header = codec.encode(residuals, "k", grad)
        want_packed, want_sent, ref_residual = ref_2bit(ref_residual, grad.tolist(), 0.5)
        assert packed.tobytes() == want_packed and len(want_packed) == packed_size("2bit", size)
        sent = codec.decode(packed, header, size, np.float32)
        np.testing.assert_array_equal(sent, np.array(want_sent, np.float32))
        np.testing.assert_allclose(residuals["k"], ref_residual, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("size", [1, 9, 64, 1001])
def test_1bit_matches_reference_over_steps(size):
    codec = Compression.from_params({"type": "1bit"})
    residuals, ref_residual = {}, [0.0] * size
    for _ in range(5):
        grad = rng.standard_normal(size).astype(np.float32)
        packed, header = codec.encode(residuals, "k", grad)
        want_packed, want_sent, ref_residual = ref_1bit(ref_residual, grad.tolist())
        assert packed.tobytes() == want_packed
        sent = codec.decode(packed, header, size, np.float32)
        np.testing.assert_allclose(sent, want_sent, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(residuals["k"], ref_residual, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scheme", ["2bit", "1bit"])
def test_error_feedback_loses_nothing(scheme):
    """What was sent plus what is kept equals everything pushed."""
    codec = Compression.from_params({"type": scheme})
    residuals, sent_total, pushed = {}, np.zeros(100), np.zeros(100)
    for _ in range(20):
        grad = rng.standard_normal(100).astype(np.float32)
        pushed += grad
        sent_total += codec.roundtrip(residuals, 0, grad)
    np.testing.assert_allclose(sent_total + residuals[0], pushed, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme,ratio", [("2bit", 16), ("1bit", 32)])
def test_bytes_on_the_wire(scheme, ratio):
    grad = rng.standard_normal(1_000_000).astype(np.float32)
    codec = Compression.from_params({"type": scheme})
    packed, header = codec.encode({}, 0, grad)
    body = {"keys": [[0, 0]], "sync": True, "compression": codec.params(), "headers": [header]}
    wire = sum(
        len(memoryview(f).cast("B")) for f in encode(Message("push", 1, "worker-0", body, [packed]))
    )
    plain = sum(
        len(memoryview(f).cast("B"))
        for f in encode(Message("push", 1, "worker-0", {"keys": [[0, 0]]}, [grad]))
    )
    assert plain / wire > ratio * 0.999, (plain, wire)


@pytest.mark.parametrize(
    "params,match",
    [
        ({"type": "3bit"}, "unknown gradient compression type"),
        ({"type": "2bit", "threshold": 0}, "threshold must be a number > 0"),
        ({"type": "2bit", "threshold": "big"}, "threshold must be a number > 0"),
        ({"type": "1bit", "threshold": 0.5}, "unknown gradient compression parameters"),
        ({"type": "2bit", "ratio": 2}, "unknown gradient compression parameters"),
        ("2bit", "takes a dict"),
    ],
)
def test_bad_parameters(params, match):
    kv = kvstore.create("local")
    with pytest.raises(ValueError, match=match):
        kv.set_gradient_compression(params)


@pytest.mark.parametrize("kind", ["local", "device"])
def test_after_push_applies_to_later_pushes(kind):
    """As MXNet (its nightly test sets compression after other keys were pushed)."""
    kv = kvstore.create(kind)
    kv.init(0, np.zeros(3, np.float32))
    kv.push(0, np.ones(3, np.float32))
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    out = np.empty(3, np.float32)
    kv.pushpull(0, np.full(3, 0.7, np.float32), out=out)
    np.testing.assert_array_equal(out, np.full(3, 0.5, np.float32))  # quantised to threshold


@pytest.mark.parametrize("kind", ["local", "device"])
def test_local_stores_sum_the_dequantised_pushes(kind):
    kv = kvstore.create(kind)
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init("w", np.zeros(6, np.float32))
    replay, residuals = Compression.from_params({"type": "2bit", "threshold": 0.5}), {}
    out = np.empty(6, np.float32)
    for _ in range(3):
        grads = [rng.standard_normal(6).astype(np.float32) for _ in range(2)]
        kv.pushpull("w", grads, out=out)
        expected = sum(replay.roundtrip(residuals, ("w", i), g) for i, g in enumerate(grads))
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("kind", ["dist_sync", "dist_async"])
@pytest.mark.parametrize("scheme", ["2bit", "1bit"])
def test_distributed_compressed_sums(cluster, kind, scheme):
    c = cluster(2, 2, KVSTORE_BIGARRAY_BOUND=3000)
    c.run_workers("compressed.py", [kind, scheme])


# Both schemes train the example's MLP to within this much test accuracy of the uncompressed
# run (SGD, momentum 0.5; 1-bit SGD needs a gentler momentum than 0.9 here).
ACCURACY_MARGIN = 0.05


def _accuracy(tmp_path, kind, *extra):
    _, out = run_launch(
        tmp_path,
        2,
        2,
        "--kv-store",
        kind,
        "--batch-size",
        16,
        "--epochs",
        8,
        "--momentum",
        0.5,
        *extra,
    )
    return final_accuracy(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dist_sync", "dist_async"])
def test_training_accuracy_with_compression(tmp_path, kind):
    plain = _accuracy(tmp_path, kind)
    for scheme in ("2bit", "1bit"):
        compressed = _accuracy(tmp_path, kind, "--gradient-compression", scheme)
        assert compressed > plain - ACCURACY_MARGIN, (scheme, compressed, plain)
