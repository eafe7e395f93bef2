"""Scripts as users write them: the habits MXNet and Horovod users bring, run the way they
run them (through launch.py where it is about the launcher), reading what they read."""

import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvstore

from .cluster import ROOT, poll_until, started_pids


def launch(*args, cwd=ROOT, env=None, timeout=60):
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().split(") ")[1][0] != "Z"


# ---------------------------------------------------------------- 5: no distributed store


def test_job_without_a_distributed_store_ends_at_once():
    # The classic slip: the script's default is a local store, the user forgot --kv-store.
    code = "import kvstore\nkv = kvstore.create('local')\nprint('trained alone')\n"
    started = time.monotonic()
    done = launch("-n", "2", "-s", "2", sys.executable, "-c", code, timeout=60)
    took = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert took < 20, f"took {took:.1f}s:\n{out}"  # not the 60 s start-up timeout
    assert "[worker 0] trained alone" in out and "[worker 1] trained alone" in out
    assert "no worker created a distributed store" in out
    assert "did you pass --kv-store dist_sync?" in out
    pids = started_pids(done.stdout)
    assert {"scheduler", "server 0", "server 1", "worker 0", "worker 1"} <= set(pids), out
    for name in ("scheduler", "server 0", "server 1"):  # stopped by the launcher, not left
        pid = pids[name]
        assert poll_until(lambda pid=pid: not _alive(pid), 5), f"{name} (pid {pid}) still running"


def test_normal_job_gives_no_store_warning():
    code = (
        "import numpy as np, kvstore\nkv = kvstore.create('dist_sync')\n"
        "kv.init(0, np.zeros(2))\nkv.pushpull(0, np.ones(2))\nprint('rank', kv.rank)\n"
    )
    done = launch("-n", "2", "-s", "1", "--timeout", "50", sys.executable, "-c", code)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[worker 1] rank 1" in done.stdout
    assert "no worker created a distributed store" not in done.stdout


# ---------------------------------------------------------------- 6: live output


def test_worker_output_arrives_while_it_runs(tmp_path):
    # The worker prints (no flush, as users write it), then waits for a file that this test
    # creates only once it has read that line through the launcher.
    go = tmp_path / "go"
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, sys, time\n"
        "print('epoch 1 done')\n"
        "deadline = time.monotonic() + 20\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    if time.monotonic() > deadline:\n"
        "        print('never told to go on'); sys.exit(5)\n"
        "    time.sleep(0.05)\n"
        "print('finished')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "-n", "1", "-s", "1"]
        + [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True)
    reader.start()
    seen = []
    try:
        deadline = time.monotonic() + 15
        while "[worker 0] epoch 1 done\n" not in seen:
            left = deadline - time.monotonic()
            assert left > 0, "the worker's line did not arrive while it ran:\n" + "".join(seen)
            try:
                seen.append(lines.get(timeout=left))
            except queue.Empty:
                continue
        go.touch()
        assert proc.wait(timeout=30) == 0
        reader.join(5)
        while not lines.empty():
            seen.append(lines.get())
        assert "[worker 0] finished\n" in seen, "".join(seen)
    finally:
        if proc.poll() is None:  # SIGTERM: the launcher stops everything it started
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def test_user_pythonunbuffered_is_kept():
    code = "import os; print('PYTHONUNBUFFERED=' + repr(os.environ.get('PYTHONUNBUFFERED')))"
    done = launch("-n", "1", "-s", "1", "--env", "PYTHONUNBUFFERED=", sys.executable, "-c", code)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[worker 0] PYTHONUNBUFFERED=''" in done.stdout
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = launch("-n", "1", "-s", "1", sys.executable, "-c", code, env=env)
    assert "[worker 0] PYTHONUNBUFFERED='1'" in done.stdout, done.stdout


# ---------------------------------------------------------------- 7: MXNet's launcher habits


def test_hostfile_without_launcher_means_ssh(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:1\n")  # nothing listens on port 1: ssh is refused at once
    done = launch("-n", "1", "-s", "1", "-H", hosts, sys.executable, "-c", "print('here')")
    out = done.stdout + done.stderr
    assert "-H given without --launcher: starting the processes through ssh" in out
    assert "[worker 0] here" not in out  # it did not run locally
    assert done.returncode != 0, out
    assert "(ssh)" in out or "via ssh" in out, out


def test_hostfile_with_launcher_local_stays_local(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:1\n")
    code = "print('here')"
    done = launch(
        "-n", "1", "-s", "1", "-H", hosts, "--launcher", "local", sys.executable, "-c", code
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[worker 0] here" in done.stdout and "via local" in done.stdout


def test_hostfile_without_launcher_runs_over_ssh(sshd, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2\n")
    code = "import os; print('on', os.environ['DMLC_NODE_HOST'])"
    done = launch(
        "-n", "1", "-s", "1", "-H", hosts, *sshd.ssh_options(), sys.executable, "-c", code
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[worker 0] on 127.0.0.2" in done.stdout and "via ssh" in done.stdout


def test_help_says_hostfile_implies_ssh():
    out = " ".join(launch("-h").stdout.split())
    assert "without --launcher, -H means --launcher ssh" in out
    assert "NAME:VALUE" in out


def test_env_in_mxnet_syntax():
    code = "import os; print(*(os.environ[n] for n in ('OMP_NUM_THREADS', 'A', 'B', 'C')))"
    done = launch(
        "-n",
        "1",
        "-s",
        "1",
        "--env",
        "OMP_NUM_THREADS:3",  # MXNet's syntax
        "--env",
        "A=x:y",  # '=' first: the value keeps its ':'
        "--env",
        "B:/usr/bin:/bin",  # ':' first: a path list as the value
        "--env",
        "C:k=v",
        sys.executable,
        "-c",
        code,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[worker 0] 3 x:y /usr/bin:/bin k=v" in done.stdout


@pytest.mark.parametrize("item", ["1X:2", ":3", "=3", "A-B=1"])
def test_env_bad_name(item):
    done = launch("-n", "1", "--env", item, "python", "x.py")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "expected NAME, NAME=VALUE or NAME:VALUE" in done.stderr
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------- 9: None as a value


@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda kv: kv.init(3, None),
            "init(key=3): expected a NumPy or CuPy array (or a list of them, one per device), "
            "got None",
        ),
        (
            lambda kv: kv.push(0, None),
            "push(key=0): expected a NumPy or CuPy array (or a list of them, one per device), "
            "got None",
        ),
        (
            lambda kv: kv.pushpull(0, None),
            "pushpull(key=0): expected a NumPy or CuPy array",
        ),
        (
            lambda kv: kv.pushpull(0, None, out=np.zeros(2, np.float32)),
            "pushpull(key=0): expected a NumPy or CuPy array",
        ),
        (lambda kv: kv.push(0, [np.ones(2), None]), "push(key=0): expected a NumPy"),
        (lambda kv: kv.init([7, 8], [np.ones(2), None]), "init(key=8): expected a NumPy"),
        (lambda kv: kv.init([7, 8], None), "init(key=[7, 8]): expected one array"),
        (lambda kv: kv.pull(0, out=[np.ones(2), None]), "pull(key=0): out: expected a NumPy"),
    ],
)
def test_none_value_is_a_clear_type_error(call, message):
    kv = kvstore.create("local")
    kv.init(0, np.zeros(2, np.float32))
    with pytest.raises(TypeError) as info:
        call(kv)
    assert message in str(info.value)
    out = np.empty(2, np.float32)
    kv.pull(0, out=out)  # nothing changed
    assert (out == 0).all()
