"""A job member that tries to act as another rank (W=3). Everyone pushes once; rank 2 then
closes its store (its routing identity at the server becomes free); rank 1, a real worker with
the job secret and its own credential, opens connections to the server claiming other ranks
and pushes huge values. Ranks 0 and 1 then check the value is exact.

Prints one line per attempt: "<attempt>: refused (<how>)" or "<attempt>: ACCEPTED".
"""

import time

import numpy as np
import zmq

import kvstore
from kvstore.protocol import Message, decode, encode

kv = kvstore.create("dist_sync")
rank = kv.rank
kv.init("w", np.zeros(4, np.float32))
out = np.empty(4, np.float32)
kv.pushpull("w", np.ones(4, np.float32), out=out)
assert (out == 3).all(), out
kv.barrier()
if rank == 2:
    kv.close()
    raise SystemExit(0)


def attempt(ctx, identity, user, password, patience):
    """Push as someone else; the reply (an error), or None if the connection never opened."""
    deadline = time.monotonic() + patience
    while True:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = identity
        if user is not None:
            sock.plain_username, sock.plain_password = user, password.encode()
        sock.connect(f"tcp://{host}:{port}")
        push = Message("push", 99, "x", {"keys": [["w", 0]]}, [np.full(4, 1e6, np.float32)])
        sock.send_multipart(encode(push))
        got = decode(sock.recv_multipart()) if sock.poll(1000) else None
        sock.close()
        if got is not None or time.monotonic() > deadline:
            return got


if rank == 1:
    host, port = kv._servers[0]
    token = kv._cred.public
    attempts = {
        # the identity of rank 2 (gone), the credential of rank 1: the handshake passes
        "identity worker-2 with rank 1's credential": (b"worker-2", b"worker-1", token, 10),
        # rank 0's name with rank 1's token: the handshake fails
        "username worker-0 with rank 1's token": (b"worker-0", b"worker-0", token, 2),
        # aliases of rank 0, with rank 1's own credential
        "identity worker-00": (b"worker-00", b"worker-1", token, 2),
        "identity worker-<Arabic-Indic zero>": ("worker-\u0660".encode(), b"worker-1", token, 2),
        "no credential at all": (b"worker-0", None, None, 2),
    }
    ctx = zmq.Context()
    for what, args in attempts.items():
        reply = attempt(ctx, *args)
        if reply is None:
            print(f"{what}: refused (no connection)", flush=True)
        else:
            text = reply.body.get("message", reply.kind)
            print(f"{what}: {'refused' if reply.kind == 'error' else 'ACCEPTED'} ({text})")
    ctx.term()

kv.pull("w", out=out)
print(f"rank {rank} after: {out.tolist()}", flush=True)
assert (out == 3).all(), out  # no impostor's push reached the value
kv.close()
print(f"rank {rank} OK", flush=True)
