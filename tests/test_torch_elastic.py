"""Horovod's elastic API (hvd.elastic): TorchState and ElasticSampler against plain
expectations in one process, and Horovod's elastic MNIST example through ``launch.py -n 2:3``
with a worker killed and replaced: the survivors never start over, the newcomer starts where
rank 0 is."""

import os
import random
import re
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

import kvstore.torch as hvd  # noqa: E402

from .cluster import ROOT, started_pids  # noqa: E402


@pytest.fixture
def local():
    hvd.init("local")
    yield
    hvd.shutdown()


def test_the_elastic_api_has_horovod_s_names():
    import kvstore.torch.elastic as elastic

    assert elastic is hvd.elastic
    for name in ("run", "TorchState", "ElasticSampler"):
        assert callable(getattr(hvd.elastic, name))


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def _step(model, opt):
    opt.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    opt.step()


def test_restore_goes_back_to_the_last_commit(local):
    model, opt = _model_and_optimizer()
    state = hvd.elastic.TorchState(model, opt, epoch=1, batch=0)
    _step(model, opt)
    state.batch = 5
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    _step(model, opt)
    state.epoch, state.batch = 2, 7
    state.restore()
    assert (state.epoch, state.batch) == (1, 5)
    for k, v in model.state_dict().items():
        assert torch.equal(v, committed[k]), k
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)
    state.restore()  # twice: the same commit
    assert (state.epoch, state.batch) == (1, 5)


def test_sync_keeps_rank_0_s_state_and_commit_finds_no_change_outside_elastic_jobs(local):
    model, opt = _model_and_optimizer()
    state = hvd.elastic.TorchState(model, opt, epoch=3, batch=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state.sync()
    assert (state.epoch, state.batch) == (3, 2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    state.commit()  # no HostsUpdatedInterrupt: the job's workers never change


def test_run_resets_and_syncs_on_hosts_updated_and_restores_on_internal_error(local, monkeypatch):
    model, opt = _model_and_optimizer()
    state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0)
    calls, resets, changed = [], [], []
    state.register_reset_callbacks([lambda: resets.append(state.epoch)])
    monkeypatch.setattr(hvd, "_workers_changed", lambda: bool(changed and changed.pop()))

    @hvd.elastic.run
    def train(state, events):
        calls.append(state.epoch)
        while events:
            event = events.pop(0)
            state.epoch += 1
            if event == "change":  # workers came or left: the next commit raises
                changed.append(True)
                state.commit()
            elif event == "commit":
                state.commit()
            elif event == "error":  # back to the last commit
                raise hvd.HorovodInternalError("a collective failed")
        return state.epoch

    assert train(state, ["commit", "change", "commit", "error"]) == 3
    assert calls == [0, 2, 3]  # after a change, on from the commit that raised (no rollback)
    assert resets == [2, 3]


def test_elastic_sampler_splits_what_is_left_of_the_epoch(local):
    data = list(range(10))
    sampler = hvd.elastic.ElasticSampler(data, shuffle=False)
    assert list(sampler) == data and len(sampler) == 10
    sampler.record_batch(0, 4)
    sampler.reset()
    assert list(sampler) == data[4:]
    sampler.set_epoch(1)  # a new epoch: nothing processed
    assert list(sampler) == data

    shuffled = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    shuffled.set_epoch(2)
    order = list(shuffled)
    expected = list(range(10))
    random.Random(3 + 2).shuffle(expected)  # Horovod's order: seed + epoch
    assert order == expected
    shuffled.record_indices(order[:3])
    state = shuffled.state_dict()
    assert state == {"epoch": 2, "processed_num": 3}
    other = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    other.load_state_dict(state)
    assert list(other) == expected[3:]


def test_elastic_sampler_partitions_by_rank_and_size(local, monkeypatch):
    data = list(range(10))
    seen = []
    for r in range(3):
        monkeypatch.setattr(hvd, "rank", lambda r=r: r)
        monkeypatch.setattr(hvd, "size", lambda: 3)
        sampler = hvd.elastic.ElasticSampler(data, shuffle=False)
        sampler.processed_num = 1
        sampler.reset()
        assert len(sampler) == 3
        seen.append(list(sampler))
    assert seen == [[1, 4, 7], [2, 5, 8], [3, 6, 9]]


def test_torch_state_syncs_a_sampler_and_saves_a_new_model(local):
    model, opt = _model_and_optimizer()
    sampler = hvd.elastic.ElasticSampler(list(range(8)), shuffle=False)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0)
    sampler.record_batch(0, 2)
    state.commit()
    sampler.set_epoch(1)
    state.restore()
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 2}
    state.sync()
    assert list(sampler) == list(range(2, 8))
    other = torch.nn.Linear(3, 2)
    state.model = other  # saved at once, as Horovod's
    with torch.no_grad():
        other.weight.zero_()
    state.restore()
    assert other.weight.abs().sum() > 0


# ---------------------------------------------------------------- through the launcher

EPOCHS = 150


def _train_epochs(out: str, worker: int) -> list:
    return [int(e) for e in re.findall(rf"\[worker {worker}\] Train Epoch: (\d+) ", out)]


@pytest.mark.timeout(120)
def test_horovod_s_elastic_mnist_goes_on_when_a_worker_is_killed_and_replaced(tmp_path):
    env = dict(os.environ, KVSTORE_HEARTBEAT_TIMEOUT="2", PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    script = ROOT / "examples" / "horovod" / "pytorch_mnist_elastic.py"
    # 224 images in batches of 64: two batches per epoch for 2 or 3 workers alike
    command = [sys.executable, str(script), "--epochs", str(EPOCHS), "--train-size", "224"]
    command += ["--test-size", "64", "--batch-size", "64", "--log-interval", "1"]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "-n", "2:3", "-s", "1", *command],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    killed = False
    start = time.monotonic()
    try:
        for line in proc.stdout:  # bounded: the test's timeout, and the launcher's end
            seen.append(line)
            if not killed and line.startswith("[worker 1] Train Epoch: 5 "):
                os.kill(started_pids("".join(seen))["worker 1"], 9)
                killed = True
        assert proc.wait(timeout=60) == 0, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = "".join(seen)
    print(f"took {time.monotonic() - start:.1f}s")
    assert killed and "worker 1 on localhost was killed by SIGKILL" in out, out
    assert out.count("launch: started worker 1 ") == 2, out
    for worker in (0, 2):  # the survivors: from epoch 1 to the end, never back
        epochs = _train_epochs(out, worker)
        assert epochs[0] == 1 and epochs[-1] == EPOCHS, (worker, epochs)
        assert epochs == sorted(epochs), (worker, epochs)
    # the newcomer: its first lines come after the replacement started, at rank 0's epoch
    after = out.rsplit("launch: started worker 1 ", 1)[1]
    first = _train_epochs(after, 1)
    assert first and first[0] >= 5 and first[-1] == EPOCHS, first  # not 1: rank 0's state
    assert "Test set: Average loss" in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_row_sparse_gradients_go_on_through_a_reset(tmp_path, fault):
    """hvd.row_sparse in an elastic job: its gradient keys follow each reset (a process
    set's keys, of the reset's workers), so the survivors neither wait for a dead worker nor
    lose a step (``kill``: worker 1 killed and replaced); a reset with the same workers
    (``raise``: every worker raises HorovodInternalError once) keeps its keys. Every worker
    ends with the same weights."""
    env = dict(os.environ, KVSTORE_HEARTBEAT_TIMEOUT="2", PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    script = ROOT / "tests" / "workers" / "torch_rows_elastic.py"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "-n",
            "2:3",
            "-s",
            "2",
            sys.executable,
            str(script),
            "40",
            *(["raise"] if fault == "raise" else []),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    killed = False
    try:
        for line in proc.stdout:  # bounded: the test's timeout, and the launcher's end
            seen.append(line)
            if fault == "kill" and not killed and line.startswith("[worker 1] step 10 "):
                os.kill(started_pids("".join(seen))["worker 1"], 9)
                killed = True
        assert proc.wait(timeout=60) == 0, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = "".join(seen)
    starts = out.count("launch: started worker 1 ")
    assert (killed and starts == 2) if fault == "kill" else starts == 1, out
    finals = re.findall(r"\[worker (\d)\] FINAL (\w+) at step 40", out)
    assert sorted(w for w, _ in finals) == ["0", "1", "2"], out
    assert len({digest for _, digest in finals}) == 1, finals
    assert "Traceback" not in out, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["fail", "fail-shutdown"])
def test_an_elastic_job_whose_every_worker_raises_fails(tmp_path, mode):
    """Every worker of an elastic kvstore.torch job raises the same error (uncaught): the
    launcher ends the job with the workers' status once the last of them failed (their
    replacements would fail alike). (Before, each closed its store at exit as finished,
    so the scheduler, then launch.py, ended the job with status 0.) With ``hvd.shutdown()``
    in a ``finally`` the stores do say finished (the error is not seen yet): the launcher
    still fails the job."""
    env = dict(os.environ, KVSTORE_HEARTBEAT_TIMEOUT="2", PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    script = ROOT / "tests" / "workers" / "torch_rows_elastic.py"
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "-n", "2:3", "-s", "1"]
        + [sys.executable, str(script), "40", mode],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    if mode == "fail":
        assert "left (failed: it raised ValueError: the user's own error)" in out, out
    assert 'every worker failed the same way ("ValueError: the user\'s own error")' in out, out
