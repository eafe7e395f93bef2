"""hvd.row_sparse in an elastic PyTorch job while workers die: each run launches
``launch.py -n 2:3 -s 2`` with ``tests/workers/torch_rows_elastic.py`` (an
``nn.Embedding(sparse=True)`` trained through ``hvd.elastic.run``), kills a random worker
(SIGKILL, or SIGSTOP past the heartbeat timeout with ``--fault freeze``) at a random step,
and checks that the job ends 0 and every worker prints the same digest of its weights (the
survivors stepped on the same averaged row gradients as the newcomer, synced from rank 0). A
killed slot is started again (three workers finish, or two when the others finish before
its newcomer joins: the launcher then stops it); a frozen one is left out by the others
at the heartbeat timeout and killed by the launcher once the job is done (two finish). The
seed is printed; ``--seed`` repeats a run.

    python scripts/torch_rows_soak.py --runs 10
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.cluster import started_pids  # noqa: E402

STEPS = 40


def one_run(rng: random.Random, fault: str, workdir: Path) -> str:
    slot, at = rng.randrange(3), rng.randrange(2, STEPS - 20)  # (room for the newcomer)
    env = dict(os.environ, KVSTORE_HEARTBEAT_TIMEOUT="2", PYTHONPATH=str(ROOT), HOME=str(workdir))
    script = ROOT / "tests" / "workers" / "torch_rows_elastic.py"
    command = [sys.executable, str(ROOT / "launch.py"), "-n", "2:3", "-s", "2"]
    proc = subprocess.Popen(
        [*command, sys.executable, str(script), str(STEPS)],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    seen: list[str] = []
    hit, deadline, rc = None, time.monotonic() + 180, None
    try:
        while rc is None and time.monotonic() < deadline:  # bounded by the deadline
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                rc = proc.poll()
                continue
            seen.append(line)
            if hit is None and line.startswith(f"[worker {slot}] step {at} "):
                hit = started_pids("".join(seen))[f"worker {slot}"]
                # frozen: past the heartbeat timeout the others go on without it
                os.kill(hit, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        if rc is not None:
            while not lines.empty():
                seen.append(lines.get())
    finally:
        if proc.poll() is None:
            proc.kill()  # the launcher, by its PID; its children below
            proc.wait(10)
        for pid in started_pids("".join(seen)).values():
            try:
                os.kill(pid, signal.SIGKILL)  # (by PID: whatever the launcher left)
            except ProcessLookupError:
                pass
    out = "".join(seen)
    finals = re.findall(rf"\[worker (\d)\] FINAL (\w+) at step {STEPS}", out)
    digests = {d for _, d in finals}
    problems = []
    if rc != 0:
        problems.append(f"rc {rc}")
    if hit is None:
        problems.append("the fault never happened")
    want = ["0", "1", "2"] if fault == "kill" else sorted({"0", "1", "2"} - {str(slot)})
    late = f"the job has finished (every worker in it finished): stopping worker {slot},"
    if fault == "kill" and late in out:  # the others finished before its newcomer came
        want = sorted({"0", "1", "2"} - {str(slot)})
    if sorted(w for w, _ in finals) != want:
        problems.append(f"finished: {sorted(w for w, _ in finals)}, expected {want}")
    if fault == "freeze" and "(frozen?): killing it" not in out:
        problems.append("the launcher did not kill the frozen worker")
    if len(digests) != 1:
        problems.append(f"{len(digests)} different weights")
    what = f"{fault} worker {slot} at step {at}"
    if problems:
        (workdir / "out.txt").write_text(out)
        return f"FAILED {what}: {'; '.join(problems)} (output: {workdir / 'out.txt'})"
    return f"ok {what}: {len(finals)} workers, weights {digests.pop()}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--fault", choices=["kill", "freeze"], default="kill")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed {seed}", flush=True)
    rng = random.Random(seed)
    failed = 0
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.monotonic()
            said = one_run(rng, args.fault, Path(d))
            failed += said.startswith("FAILED")
            print(f"run {i + 1}/{args.runs} ({time.monotonic() - t0:.1f}s): {said}", flush=True)
            if said.startswith("FAILED"):
                print(Path(d, "out.txt").read_text()[-3000:], flush=True)
    print(f"{args.runs - failed} of {args.runs} runs exact (seed {seed})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
