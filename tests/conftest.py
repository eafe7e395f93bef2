import signal

import pytest

from .cluster import Cluster
from .sshd import PrivateSshd, available

# A suite started in the background by a shell without job control (`cmd &` in a script)
# inherits SIGINT ignored, and so would every process a test starts: a launcher or worker
# that a test interrupts (Ctrl-C) would never hear it. Caught here, it is default again in
# the processes the tests start (an exec resets a caught signal, not an ignored one).
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def cluster(tmp_path):
    """``cluster(num_server, num_worker, **env)`` starts a real cluster; always torn down."""
    started: list[Cluster] = []

    def start(num_server: int, num_worker: int, **env) -> Cluster:
        path = tmp_path / f"cluster{len(started)}"
        path.mkdir()
        started.append(Cluster(num_server, num_worker, path, **env))
        return started[-1]

    yield start
    for c in started:
        c.stop()


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A private sshd on 127.0.0.1 and 127.0.0.2 (skips where one cannot run)."""
    why = available()
    if why:
        pytest.skip(why)
    server = PrivateSshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()
