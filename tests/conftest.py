import pytest

from .cluster import Cluster


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
