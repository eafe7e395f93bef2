"""The server's cost of a round's sum, reproducible (the pairwise tree) against arrival order.

Drives :class:`kvstore.rounds.Rounds` alone, as a server does (pushes in a random order, each
sum applied and the replaced value given back), with no sockets: what is left is the sum and
its bookkeeping, the part of a server's work that ``KVSTORE_REPRODUCIBLE`` changes. Runs the
two modes alternately, round after round, and prints per W and size the median time of a
round in each and their ratio (reproducible / arrival). With ``--rounds N --mode on|off`` it
runs one mode only, N rounds, printing nothing: for ``valgrind --tool=callgrind``, whose
instruction counts do not depend on the machine's load. ``--dtype float16`` pushes float16
(the servers sum it with ``kvstore.half``): the same bytes, twice the elements.

    python benchmarks/sum_order.py
    python benchmarks/sum_order.py -w 2 --sizes 4M,64M --dtype float16
    valgrind --tool=callgrind python benchmarks/sum_order.py --mode on --rounds 2000 -w 4 --sizes 4K
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvstore.rounds import Apply, Rounds  # noqa: E402

SIZES = {"4K": 4 << 10, "256K": 256 << 10, "4M": 4 << 20, "64M": 64 << 20}


class Server:
    """One key's rounds, the server's side of an Apply (the sum becomes the value)."""

    def __init__(
        self, workers: int, nbytes: int, reproducible: bool, dtype=np.float32, seed: int = 0
    ):
        self.rounds = Rounds(workers, round_timeout=0, reproducible=reproducible)
        self.rounds.add_key("k")
        rng = np.random.default_rng(seed)
        n = nbytes // np.dtype(dtype).itemsize
        self.pushes = [rng.standard_normal(n).astype(dtype) for _ in range(workers)]
        for p in self.pushes:
            p.flags.writeable = False  # as a received frame
        self.stored = np.zeros(n, dtype)
        self.orders = [rng.permutation(workers) for _ in range(64)]
        self.n = 0

    def round(self) -> None:
        order = self.orders[self.n % len(self.orders)]
        self.n += 1
        for rank in order:
            for action in self.rounds.push(None, int(rank), [("k", self.pushes[rank])], True, 0.0):
                if type(action) is Apply:
                    old, self.stored = self.stored, action.value
                    self.rounds.give_back("k", old)


def measure(workers: int, nbytes: int, budget: float, dtype=np.float32) -> tuple[float, float]:
    servers = {mode: Server(workers, nbytes, mode, dtype) for mode in (True, False)}
    for s in servers.values():  # warm: buffers made, pages touched
        for _ in range(3):
            s.round()
    batch = max(1, int(2e6 // max(nbytes, 1)))  # about 2 MB of pushes per timing
    times: dict = {True: [], False: []}
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline or len(times[False]) < 5:
        for mode in (True, False) if len(times[True]) % 2 else (False, True):
            t = time.perf_counter()
            for _ in range(batch):
                servers[mode].round()
            times[mode].append((time.perf_counter() - t) / batch)
    return statistics.median(times[True]), statistics.median(times[False])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-w", "--workers", default="2,4,8", help="W values, comma-separated")
    p.add_argument("--sizes", default="4K,4M,64M")
    p.add_argument("--budget", type=float, default=3.0, help="seconds per W and size")
    p.add_argument("--mode", choices=["on", "off"], help="one mode only (for callgrind)")
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    args = p.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    sizes = {s: SIZES[s] for s in args.sizes.split(",")}
    if args.mode:
        for w in workers:
            for nbytes in sizes.values():
                server = Server(w, nbytes, args.mode == "on", args.dtype)
                for _ in range(args.rounds):
                    server.round()
        return 0
    print(f"{'W':>2} {'size':>5} {'reproducible':>14} {'arrival':>14} {'ratio':>6}")
    for w in workers:
        for name, nbytes in sizes.items():
            on, off = measure(w, nbytes, args.budget, args.dtype)
            print(f"{w:>2} {name:>5} {on * 1e6:>11.1f} us {off * 1e6:>11.1f} us {on / off:>6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
