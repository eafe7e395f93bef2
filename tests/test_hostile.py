"""A member of the job that sends garbage or floods: nobody dies, every sum stays exact, and
the others keep their pace."""

from __future__ import annotations

import re
import threading

import pytest


class PeakRss:
    """The largest resident size of some processes, sampled while a test runs (KiB)."""

    def __init__(self, procs):
        self.procs, self.peak, self.samples = procs, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.1):
            for proc in self.procs:
                try:
                    with open(f"/proc/{proc.pid}/status") as f:
                        rss = int(re.search(r"VmRSS:\s+(\d+)", f.read())[1])
                except (OSError, TypeError):
                    continue
                self.peak, self.samples = max(self.peak, rss), self.samples + 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        assert self.samples > 10, "the processes were never measured"
        return self.peak


def test_fuzzed_messages_kill_nobody_and_change_no_sum(cluster):
    c = cluster(2, 3, KVSTORE_BIGARRAY_BOUND=2000)
    servers = [c.procs["server0"], c.procs["server1"], c.procs["scheduler"]]
    rss = PeakRss(servers)
    outs = c.run_workers("hostile.py", ["fuzz", 20000, 7], timeout=240)
    assert rss.stop() < 300_000  # KiB: bounded (a server holds these keys in a few MB)
    assert "sent 20000 fuzzed messages" in outs[2], outs[2]
    assert all("sums exact" in o for o in outs[:2]), outs
    assert c.wait(servers, 30) == [0, 0, 0], c.dump()  # and they ended normally
    for name in ("server0", "server1", "scheduler"):
        log = c.output(name)
        assert "refused" in log or "bad message" in log, log[-2000:]
        assert "Traceback" not in log, log[-3000:]


@pytest.mark.parametrize("via", ["tcp", "channel"])
def test_a_flood_without_reading_stalls_nobody(cluster, via):
    """A worker floods a server with pulls and never reads the replies, by ZeroMQ or by its
    same-host channel (kvstore.channel): the server's queue to it is bounded either way."""
    c = cluster(1, 3, KVSTORE_BIGARRAY_BOUND=2000, FLOOD_VIA=via)
    rss = PeakRss([c.procs["server0"]])
    outs = c.run_workers("hostile.py", ["flood", 200000, 1], timeout=120)
    peak = rss.stop()
    flooded = int(re.search(r"flooded (\d+) pulls", outs[2])[1])
    assert flooded > 1000, outs[2]
    for out in outs[:2]:
        before, during, after = map(
            float, re.search(r"before (\d+) during (\d+) after (\d+)", out).groups()
        )
        # the flood costs its share of two shared cores, never the whole job (a stall is
        # about 0 rounds a second), and the job goes on once it ends; the bounds leave room
        # for a machine whose speed moves 2-4x while other jobs share it (after 760 rounds/s
        # against 2172 before was seen with another benchmark running)
        assert during >= 0.1 * before and after >= 0.2 * before, out
    assert "does not read its replies" in c.output("server0")
    assert peak < 300_000, peak  # KiB: the replies it never read are not kept without bound
