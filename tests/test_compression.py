"""2-bit and 1-bit gradient compression with error feedback."""

import os
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

import kvstore
from kvstore import compression
from kvstore.compression import Compression, packed_size
from kvstore.protocol import Message, encode

from .test_examples import final_accuracy, run_launch

rng = np.random.default_rng(3)


def ref_2bit(residual, grad, t):
    """Hand-written MXNet 2-bit: codes 1 (+t), 2 (-t), 0; four per byte, first in low bits
    (Python floats: float64 arithmetic)."""
    return typed_ref_2bit(residual, grad, t, float)


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


def previous_quantize(kind, t, residual, grad):
    """The implementation before the codec was made fast (52e999a), kept as the model the
    fast one must match to the bit: whole-array passes, boolean indexing."""
    flat = grad.reshape(-1)
    residual = flat.astype(grad.dtype, copy=True) if residual is None else residual + flat
    if kind == "2bit":
        header, t = [t], residual.dtype.type(t)
        pos, neg = residual >= t, residual <= -t
        residual -= t * pos
        residual += t * neg
        codes = pos.astype(np.uint8) | (neg.astype(np.uint8) << 1)
        codes = np.concatenate([codes, np.zeros(-codes.size % 4, np.uint8)]).reshape(-1, 4)
        packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)
        sent = (pos.astype(grad.dtype) - neg.astype(grad.dtype)) * t
        return packed, header, sent, residual
    signs = residual >= 0
    npos = int(signs.sum())
    nneg = flat.size - npos
    hi = float(residual[signs].sum()) / npos if npos else 0.0
    lo = float(residual[~signs].sum()) / nneg if nneg else 0.0
    sent = np.where(signs, residual.dtype.type(hi), residual.dtype.type(lo))
    residual -= sent
    return np.packbits(signs), [hi, lo], sent, residual


def typed_ref_2bit(residual, grad, t, dtype):
    """``ref_2bit`` in the arithmetic of ``dtype`` (each sum and difference rounded to it);
    ``residual`` None: the first push, whose residual is the gradient itself (a copy, so a
    -0.0 stays -0.0, as in the codec)."""
    t = dtype(t)
    if residual is None:
        residual = [dtype(g) for g in grad]
    else:
        residual = [dtype(r) + dtype(g) for r, g in zip(residual, grad, strict=True)]
    codes, sent = [], []
    for i, r in enumerate(residual):
        code = 1 if r >= t else 2 if r <= -t else 0
        q = t if code == 1 else -t if code == 2 else dtype(0)
        residual[i] = r - q
        codes.append(code)
        sent.append(q)
    codes += [0] * (-len(codes) % 4)
    packed = bytes(
        codes[i] | codes[i + 1] << 2 | codes[i + 2] << 4 | codes[i + 3] << 6
        for i in range(0, len(codes), 4)
    )
    return packed, sent, residual


THRESHOLDS = [0.5, 0.25, 1.0, 0.1]


def assert_same_bits(got, want):
    """Equal to the bit: dtype, shape, and every element's bits (-0.0 is not 0.0)."""
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    unsigned = f"u{got.dtype.itemsize}"
    np.testing.assert_array_equal(got.view(unsigned), want.view(unsigned))


def poison_scratch():
    """Fill every scratch buffer the codec keeps with garbage: no call may depend on what
    an earlier one left there."""
    for buf in getattr(compression._scratch, "buffers", {}).values():
        if buf.dtype == bool:
            buf.fill(True)
        elif buf.dtype.kind == "f":
            buf.fill(np.nan)
        else:
            buf.fill(np.iinfo(buf.dtype).max)


@st.composite
def pushes(draw):
    """A dtype, a shape (any size, most not a multiple of 4, 8 or 16), a few gradients of it
    (with values on the thresholds and signed zeros among them), a threshold, and the piece
    length the quantiser works in (small ones make small arrays span several pieces; 24 is
    no power of two; the last is the default)."""
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    shape = draw(array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=11))
    width = np.dtype(dtype).itemsize * 8
    elements = st.one_of(
        st.floats(-3, 3, width=width),
        st.sampled_from([0.0, -0.0, *THRESHOLDS, *(-t for t in THRESHOLDS)]),
    )
    grads = draw(st.lists(arrays(dtype, shape, elements=elements), min_size=1, max_size=4))
    piece = draw(st.sampled_from([8, 16, 24, compression._PIECE]))
    return grads, draw(st.sampled_from(THRESHOLDS)), piece


def codec_setting(piece):
    """The piece length, and scratch buffers never kept when the piece is 16 (each call
    allocates its own), kept otherwise; the small-array path (one piece, fresh buffers) only
    with the default piece, so that the others take the piecewise path at every size."""
    keep = 0 if piece == 16 else compression._KEEP_SCRATCH
    small = compression._SMALL if piece == compression._PIECE else 0
    return mock.patch.multiple(compression, _PIECE=piece, _KEEP_SCRATCH=keep, _SMALL=small)


@settings(max_examples=200, deadline=None)
@given(pushes())
def test_2bit_property_matches_references(case):
    """To the bit against the plain model (codes, values sent, residual carried over from
    push to push), and in value against the whole-array codec of 52e999a (which turned a
    residual's -0.0 into 0.0)."""
    grads, t, piece = case
    codec = Compression.from_params({"type": "2bit", "threshold": t})
    dtype = grads[0].dtype.type
    residual = previous = typed = None
    with codec_setting(piece):
        for grad in grads:
            poison_scratch()
            packed, header, residual = codec.quantize(residual, grad)
            old_packed, old_header, old_sent, previous = previous_quantize(
                "2bit", t, previous, grad
            )
            want_packed, want_sent, typed = typed_ref_2bit(typed, grad.reshape(-1), t, dtype)
            poison_scratch()
            sent = codec.decode(packed, header, grad.size, dtype)
            assert packed.tobytes() == old_packed.tobytes() == want_packed
            assert len(want_packed) == packed_size("2bit", grad.size)
            assert header == old_header and packed.dtype == np.uint8
            assert_same_bits(sent, np.array(want_sent, dtype))
            assert_same_bits(residual, np.array(typed, dtype))
            np.testing.assert_array_equal(sent, old_sent)
            np.testing.assert_array_equal(residual, previous)


@settings(max_examples=200, deadline=None)
@given(pushes())
def test_1bit_property_matches_references(case):
    grads, _, piece = case
    codec = Compression.from_params({"type": "1bit"})
    dtype = grads[0].dtype.type
    rtol = {np.float16: 1e-2, np.float32: 1e-4, np.float64: 1e-9}[dtype]
    residual, typed = None, [dtype(0)] * grads[0].size
    with codec_setting(piece):
        for grad in grads:
            poison_scratch()
            packed, header, residual = codec.quantize(residual, grad)
            poison_scratch()
            sent = codec.decode(packed, header, grad.size, dtype)
            assert len(packed) == packed_size("1bit", grad.size)
            # the plain model, element by element in the dtype's arithmetic: signs, means
            # (summed in float64 here, so close, not equal), the values sent, the residual
            typed = [r + g for r, g in zip(typed, grad.reshape(-1), strict=True)]
            want_packed, _, _ = ref_1bit([0.0] * len(typed), [float(r) for r in typed])
            assert packed.tobytes() == want_packed
            pos, neg = [r for r in typed if r >= 0], [r for r in typed if r < 0]
            for got, part in zip(header, (pos, neg), strict=True):
                want = sum(float(r) for r in part) / len(part) if part else 0.0
                assert got == pytest.approx(want, rel=rtol, abs=rtol)
            want_sent = [dtype(header[0]) if r >= 0 else dtype(header[1]) for r in typed]
            np.testing.assert_array_equal(sent, np.array(want_sent, dtype))
            typed = [r - q for r, q in zip(typed, want_sent, strict=True)]
            np.testing.assert_array_equal(residual, np.array(typed, dtype))


@settings(max_examples=100, deadline=None)
@given(pushes(), st.sampled_from(["2bit", "1bit"]))
def test_error_feedback_property(case, scheme):
    """Whatever the dtype, shape and pieces: sent plus kept equals everything pushed."""
    grads, t, piece = case
    params = {"type": scheme, "threshold": t} if scheme == "2bit" else {"type": scheme}
    codec = Compression.from_params(params)
    dtype = grads[0].dtype.type
    residual, sent_total = None, np.zeros(grads[0].size)
    with codec_setting(piece):
        for grad in grads:
            packed, header, new = codec.quantize(residual, grad)
            assert residual is None or new is not residual
            sent = codec.decode(packed, header, grad.size, dtype)
            # exactly: the new residual is the sum, less what was sent, in the dtype
            summed = grad.reshape(-1) if residual is None else residual + grad.reshape(-1)
            np.testing.assert_array_equal(new, summed - sent)
            sent_total += sent
            residual = new
    pushed = np.sum([g.reshape(-1).astype(np.float64) for g in grads], axis=0)
    tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(sent_total + residual, pushed, rtol=tol, atol=tol * 8)


def test_quantize_leaves_its_inputs_alone():
    grad = rng.standard_normal(1001).astype(np.float32)
    for params in ({"type": "2bit", "threshold": 0.5}, {"type": "1bit"}):
        codec = Compression.from_params(params)
        _, _, residual = codec.quantize(None, grad)
        keep_grad, keep_residual = grad.copy(), residual.copy()
        codec.quantize(residual, grad)
        np.testing.assert_array_equal(grad, keep_grad)
        np.testing.assert_array_equal(residual, keep_residual)


@pytest.mark.parametrize("scheme", ["2bit", "1bit"])
@pytest.mark.parametrize("size", [(1 << 18) - 1, (1 << 19) + 5])
def test_big_arrays_match_the_previous_codec(scheme, size):
    """Several default-sized pieces, the last one short. 2-bit: the same bits. 1-bit: the
    same signs; its means, summed per piece, within a float32 rounding of the whole-array
    sums; the values sent and the residual exactly what those means make."""
    codec = Compression.from_params({"type": scheme})
    residual = None
    for _ in range(2):
        grad = rng.standard_normal(size).astype(np.float32)
        summed = grad if residual is None else residual + grad
        packed, header, residual = codec.quantize(residual, grad)
        old_packed, old_header, old_sent, _ = previous_quantize(scheme, 0.5, None, summed)
        assert packed.tobytes() == old_packed.tobytes()
        if scheme == "1bit":
            np.testing.assert_allclose(header, old_header, rtol=1e-6)
            old_sent = np.where(summed >= 0, np.float32(header[0]), np.float32(header[1]))
        else:
            assert header == old_header
        sent = codec.decode(packed, header, size, np.float32)
        np.testing.assert_array_equal(sent, old_sent)
        np.testing.assert_array_equal(residual, summed - sent)


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


@pytest.mark.parametrize("scheme", ["2bit", "1bit"])
@pytest.mark.parametrize(("workers", "servers", "piece"), [(2, 2, 4 << 20), (3, 1, 65536)])
def test_compressed_pulls_read_the_servers_quantised_sums(cluster, scheme, workers, servers, piece):
    """``'pull': True``: each value pulled is the round's sum quantised once by its server,
    with the server's error feedback; the same floats on every worker, exactly."""
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"seed {seed}")
    c = cluster(servers, workers, KVSTORE_BIGARRAY_BOUND=3000, KVSTORE_PIECE_BYTES=piece)
    c.run_workers("compressed_pulls.py", [scheme, seed])


@pytest.mark.parametrize("kind", ["local", "device"])
def test_local_stores_quantise_the_sum_for_compressed_pulls(kind):
    """What a pull through the servers reads: the sum of the dequantised pushes, quantised
    again with the store's own error feedback (two pushes: twice the threshold)."""
    params = {"type": "2bit", "threshold": 0.5, "pull": True}
    kv = kvstore.create(kind)
    kv.init("w", np.zeros(6, np.float32))
    kv.set_gradient_compression(params)
    replay, residuals = Compression.from_params(params), {}
    out = np.empty(6, np.float32)
    for _ in range(3):
        grads = [rng.standard_normal(6).astype(np.float32) for _ in range(2)]
        kv.pushpull("w", grads, out=out)
        total = sum(replay.roundtrip(residuals, ("w", i), g) for i, g in enumerate(grads))
        pulled = replay.for_sums_of(2).roundtrip(residuals, "pulled", total)
        np.testing.assert_array_equal(out, pulled)


def test_compressed_pulls_refuse_an_optimizer():
    kv = kvstore.create("local")
    kv.set_gradient_compression({"type": "1bit", "pull": True})
    with pytest.raises(ValueError, match="compressed pulls carry sums of gradients"):
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))
    kv = kvstore.create("local")
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match="with an optimizer in the store"):
        kv.set_gradient_compression({"type": "1bit", "pull": True})
    kv.set_gradient_compression({"type": "1bit"})  # pushes alone: as before


@pytest.mark.parametrize("pull", [1, "yes", None])
def test_compressed_pulls_flag_is_a_bool(pull):
    with pytest.raises(ValueError, match="'pull' must be True or False"):
        Compression.from_params({"type": "2bit", "pull": pull})


@pytest.mark.parametrize(
    ("kind", "servers", "replicas"),
    [("dist_sync", 1, 1), ("dist_async", 1, 1), ("dist_sync", 2, 2)],
)
def test_compressed_pulls_refused_where_pulls_read_no_rounds_sum(cluster, kind, servers, replicas):
    c = cluster(servers, 1, KVSTORE_REPLICAS=replicas)
    c.run_workers("compressed_pulls_refused.py", [kind])


def test_1bit_negative_mean_survives_large_positives():
    """Each sign's own sum: a difference of totals lost the small negative mean (0.0)."""
    codec = Compression.from_params({"type": "1bit"})
    x = np.random.default_rng(0).uniform(1e4, 3e4, 1 << 18).astype(np.float32)
    x[1::2] = -np.random.default_rng(1).uniform(0, 1e-3, 1 << 17).astype(np.float32)
    _, header, _ = codec.quantize(None, x)
    want = float(x[x < 0].astype(np.float64).mean())
    assert header[1] == pytest.approx(want, rel=1e-3), (header, want)


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract")  # inf - inf
@pytest.mark.parametrize("bad", [-np.inf, np.inf])
def test_1bit_an_infinity_leaves_the_other_mean_finite(bad):
    codec = Compression.from_params({"type": "1bit"})
    x = np.ones(1 << 13, np.float32)
    x[1::2] = -1
    x[5] = bad
    _, header, _ = codec.quantize(None, x)
    assert header == ([1.0, -np.inf] if bad < 0 else [np.inf, -1.0]), header


@pytest.mark.parametrize(
    ("scheme", "servers", "sequence"),
    [("2bit", 1, "pushpull"), ("2bit", 2, "push-push-pull"), ("1bit", 1, "push-push-pull")],
)
def test_local_store_reads_what_the_servers_send(cluster, scheme, servers, sequence):
    """The local store quantises a round's sum when it is pulled, as the servers do (a round
    nobody pulls moves no residual). 1-bit on one server: its means are per key part."""
    c = cluster(servers, 2, KVSTORE_BIGARRAY_BOUND=3000)
    c.run_workers("compressed_pulls_local.py", [scheme, sequence])


@pytest.mark.parametrize("other", ["push-only", "none"])
def test_a_round_pulled_both_compressed_and_exact_is_refused(cluster, other):
    """Workers set different compressions: one round would be read two ways; the second
    reply of that round is refused instead, and every worker stops with an error."""
    c = cluster(1, 2)
    outputs = c.run_workers("compressed_pulls_mixed.py", [other])
    assert all("refused" in o for o in outputs), outputs
    assert any("pulled both compressed and exact" in o for o in outputs), outputs


@st.composite
def pull_events(draw):
    """Events a server's PullCodes sees for two keys: a round's sum applied (with its
    value), another write, a compressed reply (with a threshold), an exact reply."""
    kinds = st.sampled_from(["summed", "changed", "codes", "codes", "exact"])
    events = []
    for _ in range(draw(st.integers(1, 30))):
        kind, key = draw(kinds), draw(st.sampled_from("ab"))
        value = draw(arrays(np.float32, 6, elements=st.floats(-2, 2, width=32)))
        events.append((kind, key, value, draw(st.sampled_from([0.5, 0.25]))))
    return events, draw(st.sampled_from(["2bit", "1bit"])), draw(st.integers(1, 3))


@settings(max_examples=300, deadline=None)
@given(pull_events())
def test_pull_codes_against_a_model(case):
    """Every reply of one round carries the same codes; a round is never answered both as
    codes and exact, nor with two codecs; codes come only for a round's sum; what was sent
    plus the residual kept is every sum that was quantised (error feedback loses nothing)."""
    events, scheme, workers = case
    codes = compression.PullCodes()
    model = {k: {"sum": None, "round": 0, "how": None, "sent": None} for k in "ab"}
    quantised = {k: np.zeros(6) for k in "ab"}  # the sums quantised since the last write
    decoded = {k: np.zeros(6) for k in "ab"}
    for kind, key, value, t in events:
        m = model[key]
        params = {"type": scheme, "pull": True} | ({"threshold": t} if scheme == "2bit" else {})
        codec = Compression.from_params(params)
        if kind == "summed":
            codes.summed(key)
            m.update(sum=value, round=m["round"] + 1, how=None, sent=None)
        elif kind == "changed":
            codes.changed(key)
            m.update(sum=None, how=None, sent=None)
            quantised[key][:] = decoded[key][:] = 0
        elif kind == "exact":
            if m["sum"] is not None and m["how"] not in (None, "exact"):
                with pytest.raises(ValueError, match="both compressed and exact"):
                    codes.exact(key)
            else:
                codes.exact(key)
                m["how"] = "exact" if m["sum"] is not None else None
        else:
            if m["sum"] is None:
                assert codes.codes(key, value, codec, workers) is None
            elif m["how"] == "exact":
                with pytest.raises(ValueError, match="both compressed and exact"):
                    codes.codes(key, m["sum"], codec, workers)
            elif m["how"] not in (None, codec):
                with pytest.raises(ValueError, match="different gradient compressions"):
                    codes.codes(key, m["sum"], codec, workers)
            else:
                packed, header = codes.codes(key, m["sum"], codec, workers)
                if m["how"] is None:  # the round's first: quantised now
                    m.update(how=codec, sent=(packed, header))
                    quantised[key] += m["sum"]
                    decoded[key] += codec.decode(packed, header, 6, np.float32)
                    if scheme == "2bit":
                        assert header == [t * workers]
                else:  # the same codes, not quantised again
                    assert packed is m["sent"][0] and header is m["sent"][1]
    for key in "ab":
        residual = codes._residuals.get(key)
        kept = np.zeros(6) if residual is None else residual
        np.testing.assert_allclose(decoded[key] + kept, quantised[key], rtol=1e-5, atol=1e-5)
