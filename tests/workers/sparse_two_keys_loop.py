"""MXNet's trainer loop over two row-sparse keys: push every key, then pull every key.
Counts the messages: a push that asks for its rows back that no pull reads sends every row
twice (in the push's reply and in the pull's)."""

import numpy as np

import kvstore
from kvstore.sparse import RowSparse

kv = kvstore.create("dist_sync")
shape = (100, 4)
kv.init(["a", "b"], [RowSparse.empty(shape, np.float32)] * 2)
sent = []
transmit = kv._transmit


def counting(server, msg):
    sent.append(f"{msg.kind} asking" if msg.body.get("pull") is True else msg.kind)
    return transmit(server, msg)


kv._transmit = counting
ids = np.array([1, 5, 9])
out = RowSparse.empty(shape, np.float32)
for step in range(4):
    sent.clear()
    for key in "ab":
        kv.push(key, RowSparse(ids, np.ones((3, 4), np.float32), shape))
    for key in "ab":
        kv.row_sparse_pull(key, out=out, row_ids=ids)
        assert out.indices.tolist() == ids.tolist(), out.indices
        np.testing.assert_array_equal(out.data, np.ones((3, 4), np.float32))
    print(step, sent)
asking, pulls = sent.count("sparse_push asking"), sent.count("sparse_pull")
# once learned, both pushes ask for their rows back and both pulls read them from there
assert asking == 2 and pulls == 0, (
    f"last step: {asking} pushes asked for rows and {pulls} pulls sent"
)
print("OK two keys loop", flush=True)
