"""Kill or freeze a random server at a random moment, many times, and count the exact runs.

Each run is a W=4, S=3, KVSTORE_REPLICAS=2 ``dist_sync`` job (``tests/workers/replicated.py``:
fixed per-rank gradients, random delays, SGD momentum or Adam) on 127.0.0.1. A first run with
no failure gives the reference hash of the final weights; every later run kills (SIGKILL) or
freezes (SIGSTOP, thawed once replaced) a random server at a random step, and is exact when
every worker ends with the reference hash. Prints each run's seed, what was done, whether it
was exact, and the pause the workers saw: from the fault to the first round every worker
completed after it. Ends with the count of exact runs. With ``--rows`` the job trains
row-sparse keys beside a dense one (``tests/workers/replicated_rows.py``: the hash covers every
stored row and the optimizer state).

    python scripts/failover_soak.py --runs 100
    python scripts/failover_soak.py --runs 30 --rows
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.cluster import Cluster, poll_until  # noqa: E402

W, S = 4, 3


def run(steps: int, opt: str, fault: str | None, seed: int, heartbeat: float, script: str) -> tuple:
    """(hashes, pause in seconds or None, what was done)."""
    rng = random.Random(seed)
    # keys "b" and "big" are split over every server, so every server holds parts
    env = {
        "KVSTORE_REPLICAS": 2,
        "KVSTORE_HEARTBEAT_TIMEOUT": heartbeat,
        "KVSTORE_BIGARRAY_BOUND": 1000,
    }
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(S, W, Path(tmp), **env)
        try:
            call = rng.choice(["pushpull", "push"])
            procs = cluster.start_workers(script, [steps, opt, call])
            what, struck = f"{opt} {call}, no fault", None
            if fault:
                victim, at = rng.randrange(S), rng.randrange(1, steps - 3)
                what = f"{opt} {call}, {fault} server{victim} at step {at}"
                cluster.wait_for_output(f"worker{rng.randrange(W)}", f"step {at} at", 120)
                time.sleep(rng.random() * 0.05)  # anywhere within a round
                proc = cluster.procs[f"server{victim}"]
                proc.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                struck = time.time()
                if fault == "freeze":
                    poll_until(  # or the job ended first: it was frozen in the last round
                        lambda: (
                            "failover" in cluster.output("scheduler")
                            or all(p.poll() is not None for p in procs)
                        ),
                        60,
                    )
                    proc.send_signal(signal.SIGCONT)
            codes = cluster.wait(procs, 300)
            hashes, pause = set(), 0.0
            for i in range(W):
                out = cluster.output(f"worker{i}")
                found = re.search(r"weights (\w+)", out)
                hashes.add(found[1] if found and codes[i] == 0 else None)
                if struck is not None:
                    after = [float(t) for t in re.findall(r"step \d+ at ([\d.]+)", out)]
                    later = [t for t in after if t > struck]
                    pause = max(pause, later[0] - struck) if later else float("nan")
            return hashes, (pause if struck is not None else None), what
        finally:
            cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fault", choices=["kill", "freeze", "both"], default="both")
    parser.add_argument("--opt", choices=["sgd", "adam", "none", "both"], default="both")
    parser.add_argument("--rows", action="store_true", help="row-sparse keys too")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed0 = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"seed {seed0}", flush=True)
    opts = ["sgd", "adam"] if args.opt == "both" else [args.opt]
    script = "replicated_rows.py" if args.rows else "replicated.py"
    faults = ["kill", "freeze"] if args.fault == "both" else [args.fault]
    reference = {}
    for opt in opts:
        hashes, _, _ = run(args.steps, opt, None, seed0, args.heartbeat_timeout, script)
        if len(hashes) != 1 or None in hashes:
            print(f"the run without a fault failed or disagreed: {hashes}")
            return 1
        reference[opt] = hashes
    exact, pauses = 0, []
    for i in range(args.runs):
        seed = seed0 + 1 + i
        opt, fault = opts[i % len(opts)], faults[(i // len(opts)) % len(faults)]
        started = time.monotonic()
        hashes, pause, what = run(args.steps, opt, fault, seed, args.heartbeat_timeout, script)
        ok = hashes == reference[opt]
        exact += ok
        pauses.append(pause)
        print(
            f"run {i + 1} seed {seed}: {what}: {'exact' if ok else f'DIFFERENT {hashes}'}, "
            f"pause {pause:.2f}s, {time.monotonic() - started:.1f}s",
            flush=True,
        )
    good = [p for p in pauses if p == p]
    print(
        f"{exact} of {args.runs} runs exact; pause after the fault: median "
        f"{statistics.median(good):.2f}s, max {max(good):.2f}s (heartbeat timeout "
        f"{args.heartbeat_timeout:g}s)"
    )
    return 0 if exact == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
