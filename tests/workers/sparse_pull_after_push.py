"""row_sparse_pull right after a push, every way MXNet allows, checked bit for bit against a
NumPy model of the rounds (no optimizer; zeros init). Each pattern runs three steps in a row
(a key learns from its first that its pushes should bring their rows back); under
``dist_sync`` the last step of a pattern whose pull asks only for pushed rows must send no
``sparse_pull`` (it reads the push's reply), and one that asks for other rows, or follows a
barrier, must send one; a push no pull follows makes the next push not ask. Under
``dist_async`` every pull is a message, and each worker pushes rows no other worker pushes
(so that its pulls are exact: its own pushes, added up).

argv: kv type.
"""

import sys

import numpy as np

import kvstore
from kvstore.sparse import RowSparse

kind = sys.argv[1]
sharding = sys.argv[2] if len(sys.argv) > 2 else None
kv = kvstore.create(kind)
rank, W = kv.rank, kv.num_workers
sync = kind == "dist_sync"
shape = (3000, 8)
kv.init(["e", "f"], [RowSparse.empty(shape, np.float32, sharding=sharding)] * 2)
want = {"e": np.zeros(shape, np.float32), "f": np.zeros(shape, np.float32)}

sent: list = []
transmit = kv._transmit


def counting(server, msg):
    sent.append(msg.kind if msg.body.get("pull") is not True else f"{msg.kind} asking")
    return transmit(server, msg)


kv._transmit = counting


def pushes(step, key):
    """Every worker's (ids, rows) of a step; the last worker pushes no rows every 4th step."""
    out = []
    for r in range(W):
        rng = np.random.default_rng([r, step, ord(key)])
        n = 0 if (r == W - 1 and step % 4 == 3) else int(rng.integers(1, 400))
        n = 2000 if step % 5 == 2 else n  # rows of more than 16 KiB: their own frames
        ids = np.unique(rng.integers(0, shape[0] // W, n))
        ids = ids if sync else ids * W + r  # dist_async: rows of this worker's only
        out.append((ids, rng.standard_normal((ids.size, shape[1]), dtype=np.float32)))
    return out


def push(step, keys, call=None):
    grads = []
    for key in keys:
        every = pushes(step, key)
        if sync:  # a round's touched rows become 0 + the pushes in rank order
            total = np.zeros(shape, np.float32)
            for ids, rows in every:
                total[ids] += rows
            touched = np.unique(np.concatenate([ids for ids, _ in every]))
            want[key][touched] = total[touched]
        else:
            ids, rows = every[rank]
            want[key][ids] += rows
        grads.append(RowSparse(*every[rank], shape))
    call = call or kv.push
    call(keys if len(keys) > 1 else keys[0], grads if len(keys) > 1 else grads[0])
    for g in grads:  # the caller's rows are its own again once push returns
        g.data[...] = np.nan
    return [g.indices for g in grads]


def check(key, out, ids, what):
    asked = np.unique(np.asarray(ids).reshape(-1))
    if isinstance(out, RowSparse):
        assert np.array_equal(out.indices, asked), (what, out.indices[:5], asked[:5])
        got = out.data
    else:
        dense = np.zeros(shape, np.float32)
        dense[asked] = want[key][asked]
        assert np.array_equal(out, dense), what
        got = out[asked]
    if not np.array_equal(got, want[key][asked]):
        raise AssertionError(f"rank {rank} {what}: rows differ")


def others(pushed, rng):
    """Ids of rows this worker may pull that it did not push (and some it did)."""
    pool = np.arange(shape[0]) if sync else np.arange(rank, shape[0], W)
    return np.concatenate([pushed[:3], rng.choice(pool, 20)])


step, served, asking = 0, {}, {}
patterns = ["same", "subset", "outs", "other", "two keys", "twice", "barrier", "same", "pushes"]
patterns += ["reused", "pushpull"]
for name in patterns:
    for n in range(3):
        rng = np.random.default_rng([rank, step, 7])
        before = len(sent)
        if name == "two keys":
            ids_e, ids_f = push(step, ["e", "f"])
            out_e, out_f = RowSparse.empty(shape, np.float32), np.ones(shape, np.float32)
            kv.row_sparse_pull("e", out=out_e, row_ids=ids_e)
            kv.row_sparse_pull("f", out=out_f, row_ids=ids_f[::-1])
            check("e", out_e, ids_e, name)
            check("f", out_f, ids_f, name)
        else:
            (ids,) = push(step, ["e"])
            if name == "pushes":  # no pull: the key stops asking for its rows back
                asking[n] = "sparse_push asking" in sent[before:]
            if name == "barrier":
                kv.barrier()
                before = len(sent)
            if name == "pushes":
                pass
            elif name in ("same", "barrier"):
                out = RowSparse.empty(shape, np.float32)
                kv.row_sparse_pull("e", out=out, row_ids=ids)
                check("e", out, ids, name)
            elif name == "subset":  # repeats, any order, a 2-D id array
                sub = rng.permutation(np.concatenate([ids, ids[: ids.size // 2]]))
                sub = sub[: sub.size // 2 * 2].reshape(2, -1)
                out = RowSparse.empty(shape, np.float32)
                kv.row_sparse_pull("e", out=out, row_ids=sub)
                check("e", out, sub, name)
            elif name == "outs":  # two outputs, one id set each
                a, b = rng.permutation(ids)[: ids.size // 2], ids[::2]
                outs = [RowSparse.empty(shape, np.float32), np.zeros(shape, np.float32)]
                kv.row_sparse_pull("e", out=outs, row_ids=[a, b])
                check("e", outs[0], a, name)
                check("e", outs[1], b, name)
            elif name == "other":
                ask = others(ids, rng)
                out = np.zeros(shape, np.float32)
                kv.row_sparse_pull("e", out=out, row_ids=ask)
                check("e", out, ask, name)
            elif name == "pushpull":  # another round of the key, then a pull of the push's
                push(step + 1000, ["e"], call=kv.pushpull)  # (its rows, not the push's reply)
                out = RowSparse.empty(shape, np.float32)
                kv.row_sparse_pull("e", out=out, row_ids=ids)
                check("e", out, ids, name)
            elif name == "reused":  # the pushed id array, rewritten in place: other rows
                new = np.sort(rng.choice(shape[0] // W, ids.size, replace=False))
                ids[:] = new if sync else new * W + rank  # (dist_async: this worker's rows)
                out = RowSparse.empty(shape, np.float32)
                kv.row_sparse_pull("e", out=out, row_ids=ids)
                check("e", out, ids, name)
            elif name == "twice":  # the second pull leaves the first's output alone
                first, second = RowSparse.empty(shape, np.float32), np.zeros(shape, np.float32)
                kv.row_sparse_pull("e", out=first, row_ids=ids)
                check("e", first, ids, name)
                first.data[...] = -7
                kv.row_sparse_pull("e", out=second, row_ids=ids[1:])
                check("e", second, ids[1:], name)
                assert (first.data == -7).all(), "the first output was written again"
        pulls = sent[before:].count("sparse_pull")
        # (a pull of no rows is no message either: such a step tells nothing)
        pulled = name != "pushes" and pushes(step, "e")[rank][0].size
        served[(name, n)] = pulls == 0 if pulled else None
        step += 1
kv.close()
if sync:
    for name in ("same", "subset", "outs", "two keys"):
        assert served[(name, 2)] is not False, f"rank {rank}: {name}: a sparse_pull was sent"
    assert asking == {0: True, 1: False, 2: False}, asking
    # twice: the second pull is a message; pushpull: the push's reply is not the rows now
    for name in ("other", "barrier", "twice", "reused", "pushpull"):
        assert served[(name, 2)] is not True, f"rank {rank}: {name}: no sparse_pull was sent"
else:
    assert True not in served.values(), f"rank {rank}: {kind}: a pull read a push's reply"
    assert True not in asking.values(), f"rank {rank}: {kind}: a push asked for its rows"
print(f"rank {rank} OK {step} pulls after pushes ({kind})", flush=True)
