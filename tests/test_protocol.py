"""The protocol on bytes alone: round trips, and every way a frame list can be wrong."""

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.protocol import PACK_BELOW, SCHEMA, VERSION, Message, ProtocolError, decode, encode


def header(**fields):
    base = {
        "v": VERSION,
        "k": "push",
        "id": 1,
        "from": "w",
        "b": {"keys": [[1, 0]]},
        "a": [["<f4", [2], 1, 0]],
    }
    base.update(fields)
    return msgpack.packb(base)


ARRAY = np.ones(2, np.float32).tobytes()


def test_round_trip_small_packed_big_zero_copy():
    big = np.arange(8192, dtype=np.float32)  # 32 KiB: its own frame
    arrays = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        big,
        np.arange(3, dtype=np.int64),
        np.array(2.5),
    ]
    frames = encode(
        Message("data", 5, "server 0", {"keys": [["a", 0], [7, 1], [8, 0], [9, 0]]}, arrays)
    )
    assert len(frames) == 2  # the header with the small arrays packed after it, the big one
    assert isinstance(frames[1], memoryview) and frames[1].obj is big  # not a copy
    msg = decode([bytes(f) for f in frames])
    assert (msg.kind, msg.id, msg.sender) == ("data", 5, "server 0")
    assert msg.body["keys"] == [["a", 0], [7, 1], [8, 0], [9, 0]]
    for got, want in zip(msg.arrays, arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    assert msg.arrays[2].ctypes.data % 8 == 0  # packed arrays stay aligned


@pytest.mark.parametrize("kind", sorted(SCHEMA))
def test_every_kind_round_trips(kind):
    samples = {list: [], dict: {}, str: "x", int: 0, float: 0.5}
    body = {name: samples[types[0]] for name, types in SCHEMA[kind].items()}
    assert decode(encode(Message(kind, 3, "n", body))).body == body


@pytest.mark.parametrize(
    "frames,match",
    [
        ([], "empty message"),
        ([b"\xc1"], "not valid msgpack"),
        ([msgpack.packb([1, 2])], "header must be a map"),
        ([header(v=1), ARRAY], "protocol version 1 is not supported"),
        ([header(k="launch_missiles"), ARRAY], "unknown message kind"),
        ([header(id="1"), ARRAY], "needs int 'id'"),
        ([header(b={}), ARRAY], "field 'keys' missing"),
        ([header(b={"keys": [[1.5, 0]]}), ARRAY], "each key must be"),
        ([header(b={"keys": [[True, 0]]}), ARRAY], "each key must be"),
        ([header(b={"keys": [1]}), ARRAY], "each key must be"),
        ([header()], "an array in frame 1 but 0 array frames arrived"),
        ([header(), ARRAY, ARRAY], "arrays in 1 frames but 2 array frames"),
        ([header(), ARRAY[:5]], "array of 8 bytes at offset 0 does not fit its frame of 5"),
        ([header(a=[["<f4", [2], 1, 4]]), ARRAY], "does not fit its frame of 8 bytes"),
        ([header(a=[["<f4", [2], 0, 0]])], "does not fit its frame"),
        ([header(a=[["<f4", [4], 0, 0]]) + bytes(9)], "does not fit its frame"),  # a short tail
        ([header(a=[["<f4", [2], 2, 0]]), ARRAY], "in frame 2 but 1 array frames arrived"),
        ([header(a=[["<f4", [2]]]), ARRAY], "bad array description"),
        ([header(a=[]), ARRAY], "arrays in 0 frames but 1 array frames"),
        # single messages that used to kill a server or the scheduler (TypeError, ValueError)
        ([header(k="heartbeat", b={}, a=[["<f4", [1], [1], 0]]), ARRAY[:4]], "bad array"),
        ([header(a=[["<f4", [2], 1.0, 0]]), ARRAY], "bad array description"),
        ([header(a=[["<f4", [1] * 70, 1, 0]]), ARRAY], "at most 32 sizes"),
        ([header(a=[["<f4", [0, 2**40, 2**40], 1, 0]]), ARRAY], "too big"),
        ([header(a=[[["<f4"], [2], 1, 0]]), ARRAY], "bad array description"),
        ([header(id=True), ARRAY], "needs int 'id'"),
        ([header(v=True), ARRAY], "version True is not supported"),
        ([header(k=["push"]), ARRAY], "unknown message kind"),
        ([header(b={"keys": [[1, -1]]}), ARRAY], "each key must be"),
        ([header(a={"x": 1}), ARRAY], "must be a list"),
        ([header(a=[["|O", [2], 1, 0]]), ARRAY], "not a plain number type"),
        ([header(a=[["V8", [1], 1, 0]]), ARRAY], "not a plain number type"),
        ([header(a=[["nonsense", [2], 1, 0]]), ARRAY], "bad dtype"),
        ([header(a=[["<f4", [-2], 1, 0]]), ARRAY], "bad array description"),
        ([header(a=[["<f4", [2], 1, -8]]), ARRAY], "bad array description"),
        ([header(b={"keys": [[1, 0], [2, 0]]}), ARRAY], "2 keys but 1 arrays"),
    ],
)
def test_bad_frames(frames, match):
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def test_an_empty_array_alone_rides_in_the_header_frame():
    """With no bytes but the header's, frame 0 is the header alone (no padding after it, which
    msgpack would read as extra data): an empty array's offset is the frame's end."""
    run, block = ["<f4", [0], 0], ["<f4", [0, 16], 0, 0]  # (a 1-D array: a run's spec)
    for array, spec in ((np.ones(0, np.float32), run), (np.ones((0, 16), np.float32), block)):
        msg = Message("push", 1, "w", {"keys": [[1, 0]]}, [array])
        for size in range(8):  # every header length modulo 8
            msg.sender = "w" * size
            frames = encode(msg)
            header = {"v": VERSION, "k": "push", "id": 1, "from": msg.sender, "b": msg.body}
            assert len(frames) == 1 and bytes(frames[0]) == msgpack.packb({**header, "a": [spec]})
            assert decode(frames).arrays[0].shape == array.shape


def test_encode_unknown_kind():
    with pytest.raises(ProtocolError, match="unknown message kind"):
        encode(Message("nope"))


def test_truncated_random_prefixes_never_crash():
    frames = [
        bytes(f)
        for f in encode(Message("push", 1, "w", {"keys": [[1, 0]]}, [np.ones(16, np.float32)]))
    ]
    rng = np.random.default_rng(0)
    rejected = 0
    for _ in range(200):
        cut = [f[: rng.integers(0, len(f) + 1)] for f in frames]
        noisy = [
            bytes(rng.integers(0, 256, len(f), dtype=np.uint8)) if rng.random() < 0.3 else f
            for f in cut
        ]
        try:
            msg = decode(noisy)
        except ProtocolError:
            rejected += 1
            continue
        if noisy == frames:  # untouched: it must decode to the original
            assert msg.body == {"keys": [[1, 0]]} and (msg.arrays[0] == 1).all()
        else:  # a changed message that decodes must still describe arrays inside its frames
            assert all(a.nbytes <= sum(len(f) for f in noisy) for a in msg.arrays)
    assert rejected > 150, rejected  # nearly every cut or noisy message is refused


# ---- runs: consecutive small 1-D arrays of one dtype share one description

DTYPES = ["<f4", "<f8", "<f2", "|i1", "|u1", "<i2", "<i4", "<i8", "<u8", "|b1", "<c8", "<c16"]
DTYPES += [">f4", ">i8"]  # another byte order: a run of its own


@st.composite
def array_lists(draw):
    """Arrays of every kind a message carries: runs of small 1-D ones of a dtype (broken by
    another dtype, an N-d or 0-d array, an empty one, a big one) in any mix."""
    arrays = []
    for _ in range(draw(st.integers(0, 12))):
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        shape = draw(
            st.one_of(
                st.tuples(st.integers(0, 40)),  # 1-D, run material
                st.tuples(st.integers(0, 40)),
                st.just(()),  # 0-d
                st.tuples(st.integers(0, 4), st.integers(0, 4)),  # 2-D
                st.just((PACK_BELOW // dtype.itemsize + draw(st.integers(0, 3)),)),  # own frame
            )
        )
        seed = draw(st.integers(0, 2**32 - 1))
        raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dtype.itemsize)
        arrays.append(np.frombuffer(raw.astype(np.uint8).tobytes(), dtype).reshape(shape))
    return arrays


@settings(max_examples=300, deadline=None)
@given(array_lists(), st.text(max_size=9))
def test_runs_round_trip_exactly(arrays, sender):
    """Every array comes back with its dtype, shape and bytes, whatever runs it was packed
    in and whatever the header's length modulo 8; packed ones aligned for their dtype."""
    keys = [[i, 0] for i in range(len(arrays))]
    frames = encode(Message("data", 9, sender, {"keys": keys}, arrays))
    msg = decode([bytes(f) for f in frames])
    assert len(msg.arrays) == len(arrays)
    for got, want in zip(msg.arrays, arrays, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
        assert got.size == 0 or got.ctypes.data % want.dtype.alignment == 0
        assert not got.flags.writeable  # views of the frames, as every decoded array
    big = sum(a.nbytes >= PACK_BELOW for a in arrays)
    assert len(frames) == 1 + big


def test_regression_a_run_of_another_byte_order_keeps_it():
    """Shrunk by hypothesis: np.concatenate gives big-endian arrays native byte order, so
    the run's bytes were not what its spec's '>f4' said."""
    arrays = [np.array([], ">f4"), np.array([-5.752957e15], ">f4")]
    msg = decode(encode(Message("data", 1, "", {"keys": [[0, 0], [1, 0]]}, arrays)))
    assert [a.tobytes() for a in msg.arrays] == [a.tobytes() for a in arrays]
    assert msg.arrays[1].dtype == np.dtype(">f4")


def test_a_thousand_small_keys_are_one_run():
    arrays = [np.full(256, i, np.float32) for i in range(1000)]
    frames = encode(Message("push", 1, "w", {"keys": [[i, 0] for i in range(1000)]}, arrays))
    try:
        msgpack.unpackb(frames[0])
    except msgpack.ExtraData as extra:
        header = extra.unpacked
    assert len(header["a"]) == 1 and header["a"][0][1] == [256] * 1000
    assert [a[0] for a in decode(frames).arrays] == list(range(1000))


@pytest.mark.parametrize(
    "spec,match",
    [
        (["<f4", [1.0], 0], "bad array run"),
        (["<f4", [True], 0], "bad array run"),
        (["<f4", [-1], 0], "bad array run"),
        (["<f4", [2**49], 0], "bad array run"),
        (["<f4", "2", 0], "bad array run"),
        (["<f4", [2], -8], "bad array run"),
        ([4, [2], 0], "bad array run"),
        (["|O", [2], 0], "not a plain number type"),
        (["<f4", [2, 1], 0], r"run of 12 bytes at offset \d+ does not fit"),
        (["<f4", [1], 8], r"run of 4 bytes at offset \d+ does not fit"),
    ],
)
def test_bad_runs(spec, match):
    frame = header(a=[spec])
    frame += bytes(-len(frame) % 8) + bytes(8)  # room for 2 float32 after the header
    with pytest.raises(ProtocolError, match=match):
        decode([frame])
