"""Messages and their encoding, without I/O: frames in, :class:`Message` out, and back.

A message is a list of frames: one msgpack header, then one raw frame per array. The header
holds the protocol version, the kind, a request id, the sender, kind-specific fields and the
dtype and shape of every array frame::

    {"v": 1, "k": "push", "id": 7, "from": "worker-0", "b": {"keys": [[3, 0]]},
     "a": [["<f4", [6]]]}

:func:`decode` validates everything and raises :class:`ProtocolError` with a message that
says what was wrong; arrays come back as read-only ``np.frombuffer`` views of the frames.

>>> import numpy as np
>>> frames = encode(Message("push", 7, "worker-0", {"keys": [[3, 0]]}, [np.ones(2, 'f4')]))
>>> decode(frames).arrays[0]
array([1., 1.], dtype=float32)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np

VERSION = 1

_KEY = (int, str)
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
    "node_failed": {"node": (str,), "reason": (str,)},
    "shutdown": {},
    # worker <-> server
    "init": {"keys": (list,)},
    "push": {"keys": (list,)},
    "pull": {"keys": (list,)},
    "pushpull": {"keys": (list,)},
    "data": {"keys": (list,)},
    "optimizer": {"spec": (dict,)},
    "command": {"name": (str,)},
    # both
    "ack": {},
    "error": {"message": (str,)},
}
# kinds whose arrays are one per key
_KEYED_ARRAYS = {"init", "push", "pushpull", "data"}
_DTYPE_KINDS = "biufc"  # numbers only: never an object dtype off the wire


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
    """Frames for ``msg``: the header, then each array's buffer (not copied)."""
    if msg.kind not in SCHEMA:
        raise ProtocolError(f"unknown message kind {msg.kind!r}")
    arrays = [np.ascontiguousarray(a) for a in msg.arrays]
    header = {
        "v": VERSION,
        "k": msg.kind,
        "id": msg.id,
        "from": msg.sender,
        "b": msg.body,
        "a": [[a.dtype.str, list(a.shape)] for a in arrays],
    }
    return [
        msgpack.packb(header),
        *(memoryview(a).cast("B") if a.ndim else a.tobytes() for a in arrays),
    ]


def decode(frames: list) -> Message:
    """Parse and validate a frame list (bytes, memoryviews or ``zmq.Frame`` objects)."""
    if not frames:
        raise ProtocolError("empty message: expected a header frame")
    buffers = [getattr(f, "buffer", f) for f in frames]
    try:
        header = msgpack.unpackb(buffers[0], strict_map_key=False)
    except Exception as exc:
        raise ProtocolError(f"header is not valid msgpack ({exc})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    version = header.get("v")
    if version != VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this node speaks "
            f"{VERSION}); run the same kvstore version on every node"
        )
    kind = header.get("k")
    if kind not in SCHEMA:
        raise ProtocolError(f"unknown message kind {kind!r}")
    msg_id, sender, body, specs = (header.get(f) for f in ("id", "from", "b", "a"))
    if not isinstance(msg_id, int) or not isinstance(sender, str) or not isinstance(body, dict):
        raise ProtocolError(f"{kind}: header needs int 'id', str 'from' and map 'b'")
    for name, types in SCHEMA[kind].items():
        if not isinstance(body.get(name), types):
            raise ProtocolError(
                f"{kind}: field {name!r} missing or not {'/'.join(t.__name__ for t in types)}"
            )
    if "keys" in SCHEMA[kind]:
        _check_keys(kind, body["keys"])
    if not isinstance(specs, list) or len(specs) != len(buffers) - 1:
        raise ProtocolError(
            f"{kind}: header describes "
            f"{len(specs) if isinstance(specs, list) else '?'} arrays but "
            f"{len(buffers) - 1} array frames arrived (truncated message?)"
        )
    if kind in _KEYED_ARRAYS and len(specs) != len(body["keys"]):
        raise ProtocolError(f"{kind}: {len(body['keys'])} keys but {len(specs)} arrays")
    arrays = [_array(kind, spec, buf) for spec, buf in zip(specs, buffers[1:], strict=True)]
    return Message(kind, msg_id, sender, body, arrays)


def _check_keys(kind: str, keys: list) -> None:
    for key in keys:
        if (
            not isinstance(key, list)
            or len(key) != 2
            or not isinstance(key[0], _KEY)
            or isinstance(key[0], bool)
            or not isinstance(key[1], int)
        ):
            raise ProtocolError(f"{kind}: each key must be [int or str, part index], got {key!r}")


def _array(kind: str, spec, buf) -> np.ndarray:
    try:
        dtype_str, shape = spec
        dtype = np.dtype(dtype_str)
        shape = tuple(int(n) for n in shape)
    except Exception:
        raise ProtocolError(f"{kind}: bad array description {spec!r}") from None
    if dtype.kind not in _DTYPE_KINDS or any(n < 0 for n in shape):
        raise ProtocolError(f"{kind}: bad array description {spec!r}")
    expected = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    got = memoryview(buf).nbytes
    if got != expected:
        raise ProtocolError(
            f"{kind}: array frame of {got} bytes, expected {expected} for "
            f"dtype {dtype} shape {shape} (truncated frame?)"
        )
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def error_reply(request: Message, sender: str, text: str) -> Message:
    return Message("error", request.id, sender, {"message": text})
