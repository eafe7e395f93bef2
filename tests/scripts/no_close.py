"""Written as MXNet and Horovod users write scripts: the store is local to main() and never
closed. At the middle step one rank may misbehave:

--crash-rank R     raises RuntimeError
--interrupt-rank R is interrupted (SIGINT to itself: a Ctrl-C in its terminal)
--slow-rank R      sleeps --slow-seconds (a long validation or checkpoint)
--barrier-rank R   calls barrier() where the others push (a deadlock)
--stop-rank R      stops training (returns from main: its store is collected); with
                   --barrier-after-stop the others call barrier() there
"""

import argparse
import os
import signal
import time

import numpy as np

import kvstore


def main():
    p = argparse.ArgumentParser()
    for name in ("crash", "interrupt", "slow", "barrier", "stop"):
        p.add_argument(f"--{name}-rank", type=int, default=-1)
    p.add_argument("--slow-seconds", type=float, default=0)
    p.add_argument("--barrier-after-stop", action="store_true")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    kv = kvstore.create("dist_sync")
    kv.init("w", np.zeros(1000, np.float32))
    out = np.empty(1000, np.float32)
    for step in range(args.rounds):
        if step == args.rounds // 2:
            if kv.rank == args.crash_rank:
                raise RuntimeError(f"boom at step {step}")
            if kv.rank == args.interrupt_rank:
                os.kill(os.getpid(), signal.SIGINT)
            if kv.rank == args.slow_rank:
                print(f"rank {kv.rank} validating for {args.slow_seconds:g}s", flush=True)
                time.sleep(args.slow_seconds)
            if kv.rank == args.barrier_rank:
                kv.barrier()
            if kv.rank == args.stop_rank:
                print(f"rank {kv.rank} stops early", flush=True)
                return
            if args.barrier_after_stop:
                kv.barrier()
        kv.pushpull("w", np.ones(1000, np.float32), out=out)
    print(f"rank {kv.rank} trained: w[0] = {out[0]:g}", flush=True)


if __name__ == "__main__":
    main()
