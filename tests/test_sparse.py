"""Row-sparse values, the row store and row sharding, without processes: examples, MXNet
1.9.1's lazy updates, and hypothesis against a dense NumPy model."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import optimizer as opt
from kvstore import sparse
from kvstore.sharding import row_server
from kvstore.sparse import RowSparse, RowTable

DATA = Path(__file__).parent / "data" / "mxnet_lazy.json"


def lazy_cases():
    recorded = json.loads(DATA.read_text())
    return [(recorded, case) for case in recorded["cases"]]


@pytest.mark.parametrize(
    "recorded,case", lazy_cases(), ids=lambda c: json.dumps(c.get("params", ""))[:60]
)
def test_lazy_updates_match_mxnet(recorded, case):
    """The weights after each step of row-sparse gradients equal MXNet 1.9.1's updater's."""
    w0 = np.array(recorded["w0"], np.float32)
    table = RowTable(w0.shape[1], np.float32)
    table.assign(np.arange(w0.shape[0]), w0)  # MXNet's server holds the full table
    optimizer = opt.create(case["name"], **case["params"])
    for t, (rows, grad, want) in enumerate(
        zip(recorded["row_sets"], recorded["grads"], case["weights"], strict=True), 1
    ):
        g = np.array(grad, np.float32).reshape(len(rows), w0.shape[1])
        table.apply(np.array(rows, np.int64), g, optimizer, t, optimizer.learning_rate(t))
        got = table.read(np.arange(w0.shape[0]))
        np.testing.assert_allclose(got, np.array(want, np.float32), rtol=1e-5, atol=1e-6)
