"""A job member that tries to act as another rank (W=3). Everyone pushes once; rank 2 then
closes its store (its routing identity at the server becomes free); rank 1, a real worker with
the job secret and its own credential, opens connections to the server claiming other ranks,
proves what it can on them (hello, then auth with a proof made with its own token), and
pushes huge values. Ranks 0 and 1 then check the value is exact.

Prints one line per attempt: "<attempt>: refused (<how>)" or "<attempt>: ACCEPTED".
"""

import time

import numpy as np
import zmq

import kvstore
from kvstore import auth
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


def ask(sock, msg):
    sock.send_multipart(encode(msg))
    return decode(sock.recv_multipart()) if sock.poll(1000) else None


def attempt(ctx, identity, prove_as, patience):
    """Push as someone else, after proving rank ``prove_as``'s claim with this worker's own
    token (None: no proof); the push's reply (an error), or None if no reply ever came."""
    deadline = time.monotonic() + patience
    while True:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = identity
        sock.connect(f"tcp://{host}:{port}")
        got = ask(sock, Message("hello", 97, "x", {"host": ""}))
        if got is not None and prove_as is not None:
            challenge = got.body.get("challenge", "")
            proof = auth.proof(token, challenge, prove_as)
            ask(sock, Message("auth", 98, "x", {"proof": proof}))
        if got is not None:
            push = Message("push", 99, "x", {"keys": [["w", 0]]}, [np.full(4, 1e6, np.float32)])
            got = ask(sock, push)
        sock.close()
        if got is not None or time.monotonic() > deadline:
            return got


if rank == 1:
    host, port = kv._servers[0]
    token = kv._cred.public
    attempts = {
        # the identity of rank 2 (gone), the proof of rank 1's token: the proof is wrong
        "identity worker-2 with rank 1's token": (b"worker-2", 2, 10),
        # rank 0's identity, taken by rank 0's own connection: the server never reads it
        "identity worker-0 with rank 1's token": (b"worker-0", 0, 2),
        # aliases of rank 0, with rank 1's own credential
        "identity worker-00": (b"worker-00", 1, 2),
        "identity worker-<Arabic-Indic zero>": ("worker-\u0660".encode(), 1, 2),
        # rank 2's identity, no proof at all
        "identity worker-2 with no proof": (b"worker-2", None, 10),
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
