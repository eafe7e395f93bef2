"""A job of three workers where rank 2 turns hostile, while ranks 0 and 1 train (dist_async)
and check their sums exactly.

- ``fuzz``: rank 2 sends N messages built from valid ones (truncated, bytes flipped, fields of
  the wrong type, huge or negative sizes, garbage) to every server through its own
  connections, and to the scheduler through a connection of its own with the job's key.
- ``flood``: rank 2 sends pulls to server 0 as fast as it can and never reads the replies;
  ranks 0 and 1 print their rounds per second before, during and after the flood.

argv: mode, count, seed.
"""

import os
import random
import sys
import time

import msgpack
import numpy as np
import zmq

import kvstore
from kvstore import auth, channel
from kvstore.protocol import Message, ProtocolError, decode, encode

mode, count, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kv = kvstore.create("dist_async")
rank = kv.rank
shapes = {"w": (10,), "b": (3000,), "fuzz": (4,)}
names = sorted(shapes)
kv.init(names, [np.ones(shapes[k], np.float32) for k in names])


def grad(r, i, key):
    return np.random.default_rng([seed, r, i, names.index(key)]).integers(-4, 5, shapes[key])


def train(rounds):
    for i in range(rounds):
        kv.push(["w", "b"], [grad(rank, i, k).astype(np.float32) for k in ("w", "b")])


def check(rounds):
    for key in ("w", "b"):
        out = np.empty(shapes[key], np.float32)
        kv.pull(key, out=out)
        want = 1 + sum(grad(r, i, key) for r in (0, 1) for i in range(rounds))
        assert np.array_equal(out, want.astype(np.float32)), (rank, key)


# ---------------------------------------------------------------- mutations
rng = random.Random(seed)
WRONG = [None, True, 1.5, -1, 2**63, "x" * 300, [], [1, [2]], {}, {"a": [None]}, b"\xff" * 9]


def base_messages():
    one = [np.ones(4, np.float32)]
    # ids far from the store's own: a refusal must never answer one of its requests
    return [
        Message("push", 1000000001, "w", {"keys": [["fuzz", 0]], "sync": False}, one),
        Message("pushpull", 1000000002, "w", {"keys": [["fuzz", 0]], "sync": False}, one),
        Message("pull", 1000000003, "w", {"keys": [["fuzz", 0]]}),
        Message("init", 1000000004, "w", {"keys": [["fuzz-new", 0]]}, one),
        Message("command", 1000000005, "w", {"name": "get_states"}),
        Message("heartbeat", 1000000006, "w"),
        Message("barrier", 1000000007, "w", {"group": "worker"}),
        Message(
            "register",
            8,
            "w",
            {
                "role": "worker",
                "host": "h",
                "port": 1,
                "num_server": 2,
                "num_worker": 3,
                "pid": 1,
                "cred": "c" * 64,
            },
        ),
        Message("join", 1000000009, "w"),
        Message("finalize", 1000000010, "w"),
    ]


def mutate(msg):
    frames = [bytes(f) for f in encode(msg)]
    try:  # small arrays follow the header in frame 0
        header, tail = msgpack.unpackb(frames[0], strict_map_key=False), b""
    except msgpack.ExtraData as extra:
        header, tail = extra.unpacked, extra.extra
    how = rng.randrange(8)
    if how == 0:  # a field of the header, of the wrong type
        header[rng.choice(["v", "k", "id", "from", "b", "a"])] = rng.choice(WRONG)
    elif how == 1 and header["b"]:  # a body field of the wrong type
        header["b"][rng.choice(list(header["b"]))] = rng.choice(WRONG)
    elif how == 2 and header["a"]:  # an array description gone wrong
        spec = header["a"][0]
        spec[rng.randrange(len(spec))] = rng.choice(  # [dtype, shape, frame, offset] or a run
            [*WRONG, [0, 2**62, 2**62], [1] * 70, 10**12, "|O", "V8", "<U4", [-3], 99]
        )
    elif how == 3:
        header = rng.choice(WRONG)
    packed = msgpack.packb(header)
    frames[0] = packed + bytes(-len(packed) % 8) + tail.lstrip(b"\0") if tail else packed
    if how == 4:  # truncated
        frames = frames[: rng.randrange(len(frames) + 1)]
        if frames:
            frames[-1] = frames[-1][: rng.randrange(len(frames[-1]) + 1)]
    elif how == 5:  # bytes flipped
        i = rng.randrange(len(frames))
        raw = bytearray(frames[i])
        for _ in range(rng.randint(1, 4)):
            if raw:
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        frames[i] = bytes(raw)
    elif how == 6:  # extra frames
        frames += [os.urandom(rng.randrange(64)) for _ in range(rng.randint(1, 3))]
    elif how == 7:  # garbage
        frames = [os.urandom(rng.randrange(1, 200)) for _ in range(rng.randint(1, 3))]
    return frames


def harmless(frames):
    """Skip what a real worker may legitimately send and that would change the job: an
    optimizer, a sync push (its round would wait for the others), a valid push to the real
    keys (mutations rarely make one)."""
    try:
        msg = decode(frames)
    except ProtocolError:
        return True
    if msg.kind in ("push", "pushpull") and msg.body.get("sync") is not False:
        return False
    keys = {k[0] for k in msg.body.get("keys", []) if isinstance(k, list) and k}
    return msg.kind not in ("optimizer", "command", "finalize", "join") and keys <= {
        "fuzz",
        "fuzz-new",
    }


def send(sock, frames, sent):
    if not frames:
        return  # ZeroMQ sends no empty message
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
        sent[0] += 1
    except zmq.Again:
        pass
    while sock.poll(0):  # read what comes back, so that only the flood test floods
        sock.recv_multipart()


if rank == 2 and mode == "fuzz":
    ctx = zmq.Context()
    sched = ctx.socket(zmq.DEALER)
    sched.linger = 0
    keys = auth.JobKeys.from_secret(os.environ["KVSTORE_SECRET"].encode())
    sched.curve_serverkey = keys.scheduler_public
    sched.curve_publickey, sched.curve_secretkey = keys.node_public, keys.node_secret
    sched.connect(kv.cfg.scheduler_address)
    bases = base_messages()
    sent = [0]
    deadline = time.monotonic() + 120
    while sent[0] < count and time.monotonic() < deadline:
        frames = mutate(rng.choice(bases))
        if not harmless(frames):
            continue
        target = rng.choice([sched, *kv._sockets])
        send(target, frames, sent)
    print(f"rank 2 sent {sent[0]} fuzzed messages", flush=True)
    for sock in kv._sockets:  # the last refusals, before the store uses the sockets again
        while sock.poll(500):
            sock.recv_multipart()
    out = np.empty(4, np.float32)
    kv.pull("fuzz", out=out)  # every server still answers
    sched.close()
    ctx.term()
elif rank == 2 and mode == "flood":
    kv.barrier()
    kv.barrier()  # the others have measured their rate without a flood
    sock = kv._sockets[0]
    pull = encode(Message("pull", 1, "worker-2", {"keys": [["fuzz", 0]]}))
    grams = [b"".join(g) for g in channel.datagrams(pull)]
    chan = kv._channels.get(0) if os.environ.get("FLOOD_VIA") == "channel" else None
    sent = 0
    end = time.monotonic() + 3
    while time.monotonic() < end and sent < count:  # flood, never read a reply
        try:
            if chan is None:
                sock.send_multipart(pull, zmq.NOBLOCK)
            else:  # by the same-host channel (kvstore.channel), raw
                for gram in grams:
                    chan.sock.send(gram)
            sent += 1
        except (zmq.Again, BlockingIOError):
            time.sleep(0.001)
    print(f"rank 2 flooded {sent} pulls without reading", flush=True)
    kv.barrier()  # the flood is over
elif mode == "fuzz":
    train(200)
else:

    def rate():
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 2:
            train(1)
            kv.pull("w", out=np.empty(10, np.float32))
            n += 1
        return n / 2

    kv.barrier()
    before = rate()
    kv.barrier()
    during = rate()  # rank 2 floods for 3s from the barrier on
    kv.barrier()
    after = max(rate(), rate())  # the servers may still drain the flood's queue at first
    print(f"rank {rank} rounds/s before {before:.0f} during {during:.0f} after {after:.0f}")
kv.barrier()
if rank < 2 and mode == "fuzz":
    check(200)
    print(f"rank {rank} sums exact", flush=True)
kv.close()
print(f"rank {rank} OK", flush=True)
