"""Speed of gradient compression's two CPU halves against memory bandwidth.

For each scheme it times, on one float32 array (64 MiB by default):

- ``quantize``: what a worker does per push, ``Compression.quantize(residual, grad)``;
- ``decode+sum``: what a server does per push, ``decode`` then ``np.add`` into the round's
  sum (as ``rounds._add``);

beside NumPy's ``np.copyto(a, b)`` and ``np.add(a, b, out=a)`` of the same array in the same
run, the bounds any pass over the gradient meets (memory bandwidth, once the array outgrows
the caches). Rates are gradient bytes (float32) per second. Prints one JSON line per
measurement, then a table. The process takes the allocator settings kvstore's workers and
servers take (``kvstore.memory.tune_allocator``). A distributed store quantises each piece
of ``KVSTORE_PIECE_BYTES`` (4 MiB) apart, so the 4M rows are what a big key costs there.

    python benchmarks/codec.py --sizes 4M,64M --reps 10
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from zmq_bound import human, parse_sizes, summary, timed  # noqa: E402

from kvstore.compression import Compression  # noqa: E402
from kvstore.memory import tune_allocator  # noqa: E402

SCHEMES = {"2bit": {"type": "2bit", "threshold": 0.5}, "1bit": {"type": "1bit"}}


def measure(name: str, nbytes: int, reps: int, budget: float) -> list[dict]:
    rng = np.random.default_rng(0)
    grad = rng.standard_normal(nbytes // 4).astype(np.float32)
    acc = np.zeros_like(grad)
    copy = timed(lambda: np.copyto(acc, grad), reps, budget)
    add = timed(lambda: np.add(acc, grad, out=acc), reps, budget)
    results = [
        summary("numpy copyto", name, "B/s", [nbytes / t for t in copy]),
        summary("numpy add", name, "B/s", [nbytes / t for t in add]),
    ]
    for scheme, params in SCHEMES.items():
        codec = Compression.from_params(params)
        # a residual from an earlier push, as in training (not all zeros)
        _, _, residual = codec.quantize(None, grad * 0.3)
        packed, header, _ = codec.quantize(residual, grad)

        def decode_sum(codec=codec, packed=packed, header=header):
            np.add(acc, codec.decode(packed, header, grad.size, np.float32), out=acc)

        quantize = timed(lambda codec=codec, r=residual: codec.quantize(r, grad), reps, budget)
        decode = timed(decode_sum, reps, budget)
        results.append(summary(f"{scheme} quantize", name, "B/s", [nbytes / t for t in quantize]))
        results.append(summary(f"{scheme} decode+sum", name, "B/s", [nbytes / t for t in decode]))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64M")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--budget", type=float, default=10.0)
    args = p.parse_args(argv)
    tune_allocator()
    rows = []
    for name, nbytes in parse_sizes(args.sizes).items():
        rows += measure(name, nbytes, args.reps, args.budget)
    for r in rows:
        print(json.dumps(r))
    bound = {r["size"]: r["median"] for r in rows if r["config"] == "numpy copyto"}
    print(f"\n{'config':20} {'size':>6} {'median':>14} {'vs copy':>8}")
    for r in rows:
        ratio = r["median"] / bound[r["size"]]
        print(f"{r['config']:20} {r['size']:>6} {human(r['median'], r['unit']):>14} {ratio:>7.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
