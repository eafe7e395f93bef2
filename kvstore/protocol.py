"""Messages and their encoding, without I/O: frames in, :class:`Message` out, and back.

A message is a list of frames: one msgpack header, then the array frames. The header holds
the protocol version, the kind, a request id, the sender, kind-specific fields and the
arrays' descriptions::

    {"v": 3, "k": "push", "id": 7, "from": "worker-0", "b": {"keys": [[3, 0]]},
     "a": [["<f4", [6], 0]]}

An array of at least :data:`PACK_BELOW` bytes travels alone in its own frame, without a copy,
described as ``[dtype, shape, frame, 0]``. Smaller ones are packed into frame 0, right after
the header (offsets count from the first multiple of 8 after it): consecutive 1-D arrays of
one dtype as one *run*, ``[dtype, [size, ...], offset]``, back to back (each aligned for
its dtype, as the run starts 8-byte aligned); any other small array as ``[dtype, shape,
0, offset]``, 8-byte aligned. A message of small arrays is one frame, and a thousand small
keys of one dtype are one run: one description to write and check, one ``np.frombuffer``
whose slices are the arrays.

:func:`decode` validates everything and raises :class:`ProtocolError` with a message that
says what was wrong; arrays come back as read-only ``np.frombuffer`` views of the frames.

>>> import numpy as np
>>> frames = encode(Message("push", 7, "worker-0", {"keys": [[3, 0]]}, [np.ones(2, 'f4')]))
>>> decode(frames).arrays[0]
array([1., 1.], dtype=float32)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate, count, pairwise

import msgpack
import numpy as np

VERSION = 3
PACK_BELOW = 16384  # bytes: smaller arrays share the header's frame

_KEY = (int, str)

# Keys the library makes for itself (kvstore.elastic's rendezvous) start with this: they may
# sit in a store of int keys, and the servers store their sums (no optimizer touches them).
INTERNAL_PREFIX = "kvstore."


def internal(key) -> bool:
    return isinstance(key, str) and key.startswith(INTERNAL_PREFIX)


# kind -> required body fields and their types. Replies carry the request's id.
SCHEMA: dict[str, dict[str, tuple]] = {
    # node <-> scheduler
    "register": {
        "role": (str,),
        "host": (str,),
        "port": (int,),
        "num_server": (int,),
        "num_worker": (int,),
        "pid": (int,),
    },
    "book": {"rank": (int,), "servers": (list,), "num_server": (int,), "num_worker": (int,)},
    "heartbeat": {},
    "barrier": {"group": (str,)},
    "barrier_done": {"group": (str,)},
    "finalize": {},
    "failed": {"reason": (str,)},
    "node_failed": {"node": (str,), "reason": (str,)},
    "shutdown": {},
    "worker_done": {"rank": (int,)},
    "join": {},
    "stalled": {
        "key": (str,),
        "round": (int,),
        "age": (float, int),
        "missing": (list,),
        "silent": (list,),
        "present": (list,),
        "waiting": (list,),
    },
    "fail_round": {"key": (str,), "message": (str,)},
    "stall": {"message": (str,)},
    "worker_joined": {"rank": (int,)},
    "joined_ack": {"rank": (int,)},
    "join_done": {"last": (int,)},
    # KVSTORE_REPLICAS > 1: a server is failed over (scheduler -> nodes); a failed-over one
    # that speaks again is fenced
    "failover": {"epoch": (int,), "dead": (list,), "reason": (str,)},
    "fenced": {"reason": (str,)},
    "replica_lost": {"server": (int,), "reason": (str,)},  # server -> scheduler
    # elastic workers: who holds the worker slots now (scheduler -> nodes)
    "members": {"epoch": (int,), "present": (list,)},
    # worker <-> server
    "init": {"keys": (list,)},
    "push": {"keys": (list,)},
    "pull": {"keys": (list,)},
    "pushpull": {"keys": (list,)},
    "data": {"keys": (list,)},
    "optimizer": {"spec": (dict,)},
    "command": {"name": (str,)},
    "hello": {"host": (str,)},
    "auth": {"proof": (str,)},  # the proof of a hello's challenge (kvstore.auth)
    # row-sparse keys (kvstore.sparse): part = the server; arrays are (ids, rows) per key
    "sparse_init": {"keys": (list,), "meta": (list,)},  # meta: [rows, dim, dtype, init]
    "sparse_push": {"keys": (list,)},
    "sparse_pull": {"keys": (list,)},  # arrays: the row ids wanted, per key
    "sparse_rows": {"keys": (list,), "since": (int,)},  # rows changed after a step
    "sparse_load": {"keys": (list,)},
    # server -> server: a primary's applied rounds, to its backups (one array per entry)
    "replica": {"home": (int,), "entries": (list,)},
    # both
    "ack": {},
    "error": {"message": (str,)},
}
# kinds whose arrays are one per key
_KEYED_ARRAYS = {"init", "push", "pushpull", "data"}
_DTYPE_KINDS = "biufc"  # numbers only: never an object dtype off the wire


HOLDER_BITS = 40  # a request id is (the holder's arrival epoch << 40) + its count


def request_ids(arrival: int) -> Iterator[int]:
    """A worker's request ids, unique across the holders of a slot: a newcomer (``arrival``:
    the membership epoch it took its slot in) starts past any id its predecessors could have
    used, so the servers' records of the requests of each slot they hold (with replicas:
    ``Backup.duplicate``, ``Backup.duplicate_load``) never take a newcomer's re-sent request
    for one of its predecessor's. 2**40 requests a holder; ids stay below 2**62.

    >>> arrival_of(next(request_ids(3)))
    3
    """
    return count((arrival << HOLDER_BITS) + 1)


def arrival_of(request_id: int) -> int:
    """The arrival epoch of the slot holder that sent ``request_id`` (0: a first holder)."""
    return request_id >> HOLDER_BITS


class ProtocolError(ValueError):
    """A frame list that is not a valid kvstore message."""


@dataclass
class Message:
    kind: str
    id: int = 0
    sender: str = ""
    body: dict = field(default_factory=dict)
    arrays: list = field(default_factory=list)


def encode(msg: Message) -> list:
    """Frames for ``msg``: the header, the packed small arrays, then each big array's own
    buffer (not copied)."""
    return encode_frames(msg)[0]


def encode_frames(msg: Message) -> tuple[list, dict[int, int]]:
    """Frames for ``msg``, and the frame map: ``{frame index: array index}`` for every frame
    that is an array's own memory, not a copy. A sender ties each zero-copy tracker to the
    array it names, so it knows which arrays ZeroMQ still reads."""
    if msg.kind not in SCHEMA:
        raise ProtocolError(f"unknown message kind {msg.kind!r}")
    specs, small, big = [], [], []
    carried: dict[int, int] = {}
    packed_at = 0
    run: list = []  # the open run's arrays (consecutive small 1-D arrays of one dtype)
    sizes: list = []  # and its spec's sizes
    for index, a in enumerate(msg.arrays):
        if type(a) is not np.ndarray:
            a = np.asarray(a)
        nbytes = a.nbytes
        if nbytes < PACK_BELOW and a.ndim == 1:
            if run and a.dtype != run[0].dtype:
                small.append(_run_bytes(run))
                run = []
            if not run:
                pad = -packed_at % 8
                if pad:
                    small.append(bytes(pad))
                packed_at += pad
                sizes = []
                specs.append([a.dtype.str, sizes, packed_at])
            run.append(a)
            sizes.append(a.shape[0])
            packed_at += nbytes
            continue
        if run:  # a run holds consecutive arrays
            small.append(_run_bytes(run))
            run = []
        a = _contiguous(a)
        if nbytes >= PACK_BELOW:
            frame = 1 + len(big)
            specs.append([a.dtype.str, list(a.shape), frame, 0])
            big.append(memoryview(a).cast("B"))
            carried[frame] = index
            continue
        pad = -packed_at % 8
        if pad:
            small.append(bytes(pad))
        packed_at += pad
        specs.append([a.dtype.str, list(a.shape), 0, packed_at])
        # a 0-d or an empty N-d array has no byte view to cast (empty row sets do travel)
        small.append(a.tobytes() if a.ndim == 0 or a.size == 0 else memoryview(a).cast("B"))
        packed_at += nbytes
    if run:
        small.append(_run_bytes(run))
    header = msgpack.packb(
        {"v": VERSION, "k": msg.kind, "id": msg.id, "from": msg.sender, "b": msg.body, "a": specs}
    )
    if packed_at:  # after the header, 8-byte aligned: one frame for a message of small
        # arrays. With none but empty ones, the header alone: msgpack then decodes it without
        # raising ExtraData (which costs every such message an exception), and their offset
        # 0 is the frame's end
        header = b"".join([header, bytes(-len(header) % 8), *small])
    return [header, *big], carried


def _run_bytes(run: list):
    """A run's arrays back to back: one copy by NumPy (whatever their strides), not a
    buffer view per array."""
    if len(run) == 1:
        a = run[0]
        return memoryview(_contiguous(a)).cast("B") if a.size else b""
    # the run's own dtype: NumPy would give another byte order its native one
    return memoryview(np.concatenate(run, dtype=run[0].dtype)).cast("B")


def _contiguous(array) -> np.ndarray:
    array = np.asarray(array)
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def decode(frames: list) -> Message:
    """Parse and validate a frame list (bytes, memoryviews or ``zmq.Frame`` objects).

    Whatever the frames hold, the only exception is :class:`ProtocolError`."""
    try:
        return _decode(frames)
    except ProtocolError:
        raise
    except Exception as exc:  # a case the checks below missed: still the peer's fault
        raise ProtocolError(f"malformed message ({type(exc).__name__}: {exc})") from None


def request_id(frames: list) -> int:
    """The request id of a message that may not decode, so a refusal can name it (0 if none)."""
    try:
        header = msgpack.unpackb(getattr(frames[0], "buffer", frames[0]), strict_map_key=False)
        msg_id = header.get("id") if isinstance(header, dict) else None
        return msg_id if type(msg_id) is int and 0 <= msg_id < 2**63 else 0
    except Exception:
        return 0


def _decode(frames: list) -> Message:
    if not frames:
        raise ProtocolError("empty message: expected a header frame")
    buffers = [getattr(f, "buffer", f) for f in frames]
    tail = memoryview(buffers[0]).nbytes  # where small arrays start in frame 0 (none: empty)
    try:
        header = msgpack.unpackb(buffers[0], strict_map_key=False)
    except msgpack.ExtraData as extra:
        header = extra.unpacked
        end = memoryview(buffers[0]).nbytes - len(extra.extra)
        tail = end + (-end % 8)
    except Exception as exc:
        raise ProtocolError(f"header is not valid msgpack ({exc})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    version = header.get("v")
    if type(version) is not int or version != VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this node speaks "
            f"{VERSION}); run the same kvstore version on every node"
        )
    kind = header.get("k")
    if type(kind) is not str or kind not in SCHEMA:
        raise ProtocolError(f"unknown message kind {kind!r}")
    msg_id, sender, body, specs = (header.get(f) for f in ("id", "from", "b", "a"))
    if (
        type(msg_id) is not int
        or not 0 <= msg_id < 2**63
        or not isinstance(sender, str)
        or not isinstance(body, dict)
    ):
        raise ProtocolError(f"{kind}: header needs int 'id', str 'from' and map 'b'")
    for name, types in SCHEMA[kind].items():
        value = body.get(name)
        if not isinstance(value, types) or isinstance(value, bool):
            raise ProtocolError(
                f"{kind}: field {name!r} missing or not {'/'.join(t.__name__ for t in types)}"
            )
    if "keys" in SCHEMA[kind]:
        _check_keys(kind, body["keys"])
    if not isinstance(specs, list):
        raise ProtocolError(f"{kind}: header field 'a' must be a list of arrays")
    frames = len(buffers)
    used = {0}
    for spec in specs:
        if type(spec) is list and len(spec) == 3:
            _check_run(kind, spec)
            continue
        if type(spec) is not list or len(spec) != 4 or _spec_checked(*spec, frames) is not True:
            _check_spec(kind, spec, frames)  # raises, saying what is wrong
        used.add(spec[2])
    if used - {0} != set(range(1, len(buffers))):
        raise ProtocolError(
            f"{kind}: header describes arrays in {len(used - {0})} frames but "
            f"{len(buffers) - 1} array frames arrived (truncated message?)"
        )
    sizes = [memoryview(b).nbytes for b in buffers]
    arrays: list = []
    for spec in specs:
        if len(spec) == 3:
            arrays.extend(_run(kind, spec, buffers[0], sizes[0], tail))
        else:
            arrays.append(_array(kind, spec, buffers, sizes, tail))
    if kind in _KEYED_ARRAYS and len(arrays) != len(body["keys"]):
        raise ProtocolError(f"{kind}: {len(body['keys'])} keys but {len(arrays)} arrays")
    return Message(kind, msg_id, sender, body, arrays)


MAX_DIMS = 32  # NumPy's limit before 2.0
MAX_DIM = 2**48  # elements along one axis: more than any frame can hold


def _spec_checked(dtype, shape, frame, offset, frames) -> bool:
    """The common case of :func:`_check_spec`, quickly: True when the spec is certainly
    fine (a small shape of plain ints, a frame that arrived); else the full check decides."""
    return (
        type(dtype) is str
        and len(dtype) <= 16
        and type(shape) is list
        and len(shape) <= 2
        and all(type(n) is int and 0 <= n <= MAX_DIM for n in shape)
        and type(frame) is int
        and 0 <= frame < frames
        and type(offset) is int
        and offset >= 0
    )


def _check_spec(kind: str, spec, frames: int) -> None:
    if (
        not isinstance(spec, list)
        or len(spec) != 4
        or not isinstance(spec[0], str)
        or len(spec[0]) > 16
        or not isinstance(spec[1], list)
        or len(spec[1]) > MAX_DIMS
        or not all(type(n) is int and 0 <= n <= MAX_DIM for n in spec[1])
        or type(spec[2]) is not int
        or spec[2] < 0
        or type(spec[3]) is not int
        or spec[3] < 0
    ):
        raise ProtocolError(
            f"{kind}: bad array description {spec!r:.200}: expected [dtype, shape "
            f"(at most {MAX_DIMS} sizes), frame index, byte offset]"
        )
    if spec[2] >= frames:
        raise ProtocolError(
            f"{kind}: an array in frame {spec[2]} but {frames - 1} array frames arrived "
            "(truncated message?)"
        )


def _check_run(kind: str, spec: list) -> None:
    """A run ``[dtype, [size, ...], offset]``: consecutive 1-D arrays of one dtype, back to
    back in frame 0 (the first at ``offset``)."""
    dtype, sizes, offset = spec
    if (
        type(dtype) is not str
        or len(dtype) > 16
        or type(sizes) is not list
        or not set(map(type, sizes)) <= {int}
        or (sizes and (min(sizes) < 0 or max(sizes) > MAX_DIM))
        or type(offset) is not int
        or offset < 0
    ):
        raise ProtocolError(
            f"{kind}: bad array run {spec!r:.200}: expected [dtype, [size, ...], byte offset]"
        )


def _run(kind: str, spec: list, buffer, size: int, tail: int) -> list:
    """The arrays of a run (checked by :func:`_check_run`): views of one ``np.frombuffer``."""
    dtype_str, sizes, offset = spec
    dtype = _plain_dtypes.get(dtype_str)
    if dtype is None:
        dtype = _plain_dtype(kind, dtype_str)
    bounds = list(accumulate(sizes, initial=0))
    count, offset = bounds[-1], offset + tail
    if offset + dtype.itemsize * count > size:
        raise ProtocolError(
            f"{kind}: a run of {dtype.itemsize * count} bytes at offset {offset} does not fit "
            f"its frame of {size} bytes (truncated frame?)"
        )
    flat = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
    return [flat[lo:hi] for lo, hi in pairwise(bounds)]


def _check_keys(kind: str, keys: list) -> None:
    for key in keys:
        if (
            not isinstance(key, list)
            or len(key) != 2
            or not isinstance(key[0], _KEY)
            or isinstance(key[0], bool)
            or type(key[1]) is not int
            or key[1] < 0
        ):
            raise ProtocolError(
                f"{kind}: each key must be [int or str, part index], got {key!r:.200}"
            )


def _array(kind: str, spec, buffers, sizes, tail: int) -> np.ndarray:
    dtype_str, shape, frame, offset = spec
    if frame == 0:
        offset += tail
    dtype = _plain_dtypes.get(dtype_str)
    if dtype is None:
        dtype = _plain_dtype(kind, dtype_str)
    if len(shape) == 1:
        count = shape[0]  # checked <= MAX_DIM
    else:
        count = math.prod(shape)
        if math.prod(n for n in shape if n) > MAX_DIM:
            raise ProtocolError(f"{kind}: shape {shape!r:.200} is too big")
    size = sizes[frame]
    if offset + dtype.itemsize * count > size:
        raise ProtocolError(
            f"{kind}: array of {dtype.itemsize * count} bytes at offset {offset} does not fit "
            f"its frame of {size} bytes (truncated frame?)"
        )
    array = np.frombuffer(buffers[frame], dtype=dtype, count=count, offset=offset)
    return array if len(shape) == 1 else array.reshape(shape)


_plain_dtypes: dict[str, np.dtype] = {}  # dtype strings already checked: plain numbers


def _plain_dtype(kind: str, name: str) -> np.dtype:
    try:
        dtype = np.dtype(name)
    except Exception:
        raise ProtocolError(f"{kind}: bad dtype {name!r}") from None
    if dtype.kind not in _DTYPE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise ProtocolError(f"{kind}: dtype {name!r} is not a plain number type")
    if len(_plain_dtypes) < 64:
        _plain_dtypes[name] = dtype
    return dtype


def error_reply(request: Message, sender: str, text: str, unchanged: bool = False) -> Message:
    """``unchanged``: every server refuses this request alike, before it changes anything (no
    optimizer to load states into): the refusal leaves the servers in step."""
    body = {"message": text, "unchanged": True} if unchanged else {"message": text}
    return Message("error", request.id, sender, body)
