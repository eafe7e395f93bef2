"""launch.py through the real things: subprocesses, a private sshd, mpirun; generated command
lines for the schedulers that cannot run here (slurm, sge, yarn)."""

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.launch import mpi, sge, slurm, yarn
from kvstore.launch.hostfile import Host, parse_hostfile, place
from kvstore.launch.spec import JobSpec

from .cluster import ROOT, poll_until

LOOP = ROOT / "tests" / "workers" / "loop.py"


def launch(*args, cwd=ROOT, timeout=120):
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---------------------------------------------------------------- hostfiles


def test_hostfile_formats(tmp_path):
    path = tmp_path / "hosts"
    path.write_text(
        "# cluster\nnode1\n\nnode2:2222   # ssh port\nnode3 slots=2\nnode4:22 slots=3\n"
    )
    assert parse_hostfile(str(path)) == [
        Host("node1"),
        Host("node2", 2222),
        Host("node3", None, 2),
        Host("node4", 22, 3),
    ]


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "lists no hosts"),
        ("# only a comment\n\n", "lists no hosts"),
        ("node1:notaport\n", "bad port"),
        ("node1 cpus=4\n", "cannot read 'cpus=4'"),
    ],
)
def test_hostfile_errors(tmp_path, text, match):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        parse_hostfile(str(path))
    with pytest.raises(ValueError, match="No such file"):
        parse_hostfile(str(tmp_path / "missing"))


def test_placement_round_robin_with_slots():
    a, b, c = Host("a", slots=2), Host("b"), Host("c", slots=3)
    assert [h.name for h in place([a, b, c], 6)] == ["a", "b", "c", "a", "c", "c"]
    assert [h.name for h in place([a, b], 5)] == ["a", "b", "a", "a", "b"]  # wraps around


# ---------------------------------------------------------------- command line


def test_help_documents_each_option():
    out = launch("-h").stdout
    for option in (
        "--num-workers",
        "--num-servers",
        "--launcher",
        "--hostfile",
        "--sync-dst-dir",
        "--env",
        "--interface",
        "--port",
        "--ssh-port",
        "--ssh-option",
        "--finish-grace",
    ):
        assert option in out


def test_unknown_option_gives_usage_not_traceback():
    done = launch("-n", "2", "--bogus", "python", "x.py")
    assert done.returncode == 2 and "usage:" in done.stderr and "--bogus" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args,match",
    [
        (["-n", "1", "--launcher", "ssh", "python", "x.py"], "needs a hostfile"),
        (
            ["-n", "1", "--launcher", "ssh", "-H", "/nonexistent/hosts", "python", "x.py"],
            "No such file",
        ),
        (["-n", "0", "python", "x.py"], "must be >= 1"),
        (["-n", "1"], "no worker command"),
        (["-n", "1", "--env", "KVSTORE_NOT_SET_ANYWHERE", "python", "x.py"], "is not set"),
        (["-n", "1:2", "--finish-grace", "-1", "python", "x.py"], "seconds >= 0, got '-1'"),
        (["-n", "1:2", "--finish-grace", "soon", "python", "x.py"], "seconds >= 0, got 'soon'"),
    ],
)
def test_bad_invocations(args, match):
    done = launch(*args)
    assert done.returncode == 2 and match in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------- local


def test_local_job_prefixes_output_and_passes_env():
    done = launch(
        "-n", "2", "-s", "2", "--env", "KVSTORE_HEARTBEAT_INTERVAL=0.5", sys.executable, LOOP, 3
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"[worker {rank}] done" in done.stdout


def test_failing_worker_brings_job_down():
    code = (
        "import os, sys, kvstore, numpy as np\nkv = kvstore.create('dist_sync')\n"
        "kv.init(0, np.zeros(2))\nif kv.rank == 1:\n    print('giving up'); sys.exit(1)\n"
        "kv.pushpull(0, np.ones(2))\n"
    )
    done = launch("-n", "2", "-s", "1", "--timeout", "60", sys.executable, "-c", code)
    assert done.returncode == 1, done.stdout
    assert "worker 1 on localhost exited with status 1 (last output: 'giving up')" in done.stdout


def _pids(text):
    return [int(line.split("pid ")[1]) for line in text.splitlines() if "] pid " in line]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not yet reaped by its parent) is not running; one reaped meanwhile is gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _interrupt_after_rounds(args, cwd=ROOT, sig=signal.SIGINT, times=1):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), *map(str, args)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:  # bounded: the workers run at most 60 s
        lines.append(line)
        if "round 10" in line:
            break
    proc.send_signal(sig)
    if times > 1:  # again, once it says it stops the processes (Ctrl-C pressed again)
        for line in proc.stdout:  # bounded: it stops within its stop_grace
            lines.append(line)
            if "stopping every process" in line:
                for _ in range(times - 1):
                    proc.send_signal(sig)
                break
    try:
        rest, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # it never heard the signal: stop its job, by its PID
        proc.terminate()  # (SIGTERM: the launcher stops every process it started)
        rest, _ = proc.communicate(timeout=30)
        raise AssertionError(f"launch.py ignored {sig!r}:\n{''.join(lines)}{rest}") from None
    return proc.returncode, "".join(lines) + rest


@pytest.mark.parametrize(
    "sig,code_said",
    [(signal.SIGINT, (130, "interrupted")), (signal.SIGTERM, (143, "terminated"))],
)
def test_ctrl_c_stops_every_process(sig, code_said):
    """Ctrl-C exits 130, a SIGTERM (a scheduler's stop) 143, as a shell would say."""
    code, out = _interrupt_after_rounds(
        ["-n", "2", "-s", "1", sys.executable, LOOP, 100000], sig=sig
    )
    assert code == code_said[0], out
    assert f"{code_said[1]}; stopping every process" in out, out
    pids = _pids(out)
    assert len(pids) == 2 and not any(_alive(p) for p in pids), out


def test_ctrl_c_twice_stops_every_process_without_a_traceback():
    """(From a user trial.) A second Ctrl-C while the launcher stops the job printed its
    KeyboardInterrupt traceback; the stop goes on, quietly, exit status 130."""
    code, out = _interrupt_after_rounds(
        ["-n", "2", "-s", "1", sys.executable, LOOP, 100000], times=3
    )
    assert code == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    pids = _pids(out)
    assert len(pids) == 2 and not any(_alive(p) for p in pids), out


QUIET = """
import time, numpy as np, kvstore
kv = kvstore.create("dist_sync")
kv.init("w", np.zeros(4, np.float32))
out, started = np.empty(4, np.float32), time.monotonic()
for rnd in range(100000):  # bounded: 60 s at most
    kv.pushpull("w", np.ones(4, np.float32), out=out)
    if rnd == 10:
        print("round 10", flush=True)  # then silent: no write fails when the launcher is gone
    if time.monotonic() - started > 60:
        break
    time.sleep(0.01)
"""


def test_a_killed_launcher_leaves_nothing_running(tmp_path):
    """launch.py killed (SIGKILL: no chance to stop its job, as the OOM killer or a CI
    runner's timeout does): the scheduler sees its pipe from the launcher close and ends the
    job, so its servers and workers stop too instead of running on unwatched."""
    script = tmp_path / "quiet.py"
    script.write_text(QUIET)
    _, out = _interrupt_after_rounds(
        ["-n", "2", "-s", "1", sys.executable, script], sig=signal.SIGKILL
    )
    started = [int(x) for x in re.findall(r"launch: started \w+ ?\d* on \S+ \(pid (\d+)\)", out)]
    assert len(started) == 4, out  # the scheduler, a server, two workers
    try:
        assert poll_until(lambda: not any(_alive(p) for p in started), 15), [
            p for p in started if _alive(p)
        ]
    finally:
        for pid in started:  # by PID, whatever happened
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- ssh


def test_ssh_two_hosts_with_sync(sshd, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(LOOP, job / "loop.py")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n127.0.0.2 slots=2\n")
    dst = tmp_path / "synced"
    done = launch(
        "-n",
        "2",
        "-s",
        "2",
        "--launcher",
        "ssh",
        "-H",
        hosts,
        *sshd.ssh_options(),
        "--sync-dst-dir",
        dst,
        "--env",
        "KVSTORE_HEARTBEAT_INTERVAL=0.5",
        sys.executable,
        "loop.py",
        3,
        cwd=job,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (dst / "loop.py").exists()
    assert "[worker 0] done" in done.stdout and "[worker 1] done" in done.stdout


def test_ssh_unreachable_host_fails_fast(sshd, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1:1\n")  # nothing listens on port 1
    done = launch(
        "-n",
        "1",
        "-s",
        "1",
        "--launcher",
        "ssh",
        "-H",
        hosts,
        *sshd.ssh_options(),
        sys.executable,
        LOOP,
        3,
        timeout=60,
    )
    assert done.returncode == 255, done.stdout
    assert "on 127.0.0.1 exited with status 255" in done.stdout
    assert "Connection refused" in done.stdout


def test_ssh_a_remote_process_killed_is_said_in_one_line(sshd, tmp_path):
    """(From a two-host user trial.) A worker killed on its host (SIGKILL, the OOM killer's
    signal) came back as status 137 and bash's job notice, twice: "bash: line 1: N Killed
    ( cd ... && exec env DMLC_... ) < /dev/null", every setting of the job in it. Now one
    line says which signal."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import os, signal\n"
        "import numpy as np\n"
        "import kvstore\n"
        "kv = kvstore.create('dist_sync')\n"
        "kv.init('w', np.zeros(1, np.float32))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = launch(
        *("-n", "1", "-s", "1", "--launcher", "ssh", "-H", hosts),
        *sshd.ssh_options(),
        sys.executable,
        script,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 137, done.stdout
    said = "worker 0 on 127.0.0.2 exited with status 137 (last output: 'killed by SIGKILL"
    assert said in done.stdout, done.stdout
    assert "Killed" not in done.stdout and "DMLC_" not in done.stdout, done.stdout


def test_ssh_ctrl_c_stops_remote_processes(sshd, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2\n")
    code, out = _interrupt_after_rounds(
        [
            "-n",
            "2",
            "-s",
            "1",
            "--launcher",
            "ssh",
            "-H",
            hosts,
            *sshd.ssh_options(),
            sys.executable,
            LOOP,
            100000,
        ]
    )
    assert code == 130, out
    pids = _pids(out)
    assert len(pids) == 2, out
    for pid in pids:  # the "remote" processes are on this machine: look them up
        assert poll_until(lambda pid=pid: not _alive(pid), 10), f"worker {pid} still running"


# ---------------------------------------------------------------- mpi


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_mpi_job():
    assert mpi.flavour() == "openmpi"
    done = launch(
        "-n",
        "2",
        "-s",
        "1",
        "--launcher",
        "mpi",
        "--env",
        "KVSTORE_HEARTBEAT_INTERVAL=0.5",
        sys.executable,
        LOOP,
        3,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[worker 0] done" in done.stdout and "[worker 1] done" in done.stdout


# ---------------------------------------------------------------- command lines


def spec(**kw):
    base = dict(
        num_workers=2,
        num_servers=1,
        command=["python", "train.py"],
        root_uri="10.0.0.1",
        port=9000,
        env={"DMLC_NUM_WORKER": "2"},
        cwd="/job",
        python="/usr/bin/python3",
    )
    base.update(kw)
    return JobSpec(**base)


CHILD = [
    "/usr/bin/python3",
    "-m",
    "kvstore.launch.child",
    "--num-servers",
    "1",
    "--",
    "python",
    "train.py",
]


def test_mpi_command_lines():
    assert mpi.command(spec(), "openmpi", "/tmp/h", True) == [
        "mpirun",
        "-n",
        "3",
        "--allow-run-as-root",
        "--oversubscribe",
        "--hostfile",
        "/tmp/h",
        "-x",
        "DMLC_NUM_WORKER=2",
        *CHILD,
    ]
    assert mpi.command(spec(), "mpich", None, False) == [
        "mpirun",
        "-n",
        "3",
        "-genv",
        "DMLC_NUM_WORKER",
        "2",
        *CHILD,
    ]


def test_slurm_command_line():
    assert slurm.command(spec(hosts=[Host("a"), Host("b"), Host("a")])) == [
        "srun",
        "--ntasks=3",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--nodelist=a,b",
        *CHILD,
    ]


def test_sge_command_line_and_script():
    assert sge.command(spec(), "/tmp/job.sh", "all.q") == [
        "qsub",
        "-cwd",
        "-sync",
        "y",
        "-t",
        "1-3",
        "-S",
        "/bin/bash",
        "-N",
        "kvstore",
        "-j",
        "y",
        "-v",
        "DMLC_NUM_WORKER=2",
        "-q",
        "all.q",
        "/tmp/job.sh",
    ]
    assert sge.script(spec()) == (
        "#!/bin/bash\ncd /job\nexec /usr/bin/python3 -m "
        "kvstore.launch.child --num-servers 1 -- python train.py\n"
    )


def test_yarn_command_line_and_missing_client(monkeypatch):
    assert yarn.command(spec(), "/opt/dmlc-yarn.jar") == [
        "hadoop",
        "jar",
        "/opt/dmlc-yarn.jar",
        "org.apache.hadoop.yarn.dmlc.Client",
        "-jobname",
        "kvstore",
        "-tempdir",
        "/tmp",
        "-queue",
        "default",
        "-env",
        "DMLC_NUM_WORKER=2",
        *CHILD,
    ]
    done = launch("-n", "1", "--launcher", "yarn", "python", "x.py")
    assert done.returncode == 2 and "the yarn launcher needs the Hadoop client" in done.stderr


def test_yarn_and_sge_never_put_the_secret_on_a_command_line(monkeypatch, tmp_path):
    """The secret's value is nowhere in an argv (``ps`` shows argv to every user): SGE names
    it for ``qsub -v`` to take from its environment; YARN passes it as DMLC_KVSTORE_SECRET,
    the prefix dmlc's Client and ApplicationMaster carry into the containers."""
    secret = "s3cr3t" * 8
    job = spec(env={"DMLC_NUM_WORKER": "2", "KVSTORE_SECRET": secret})
    jar = tmp_path / "dmlc-yarn.jar"
    jar.write_text("")
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setenv("HADOOP_HOME", "/opt/hadoop")
    monkeypatch.setenv("DMLC_YARN_JAR", str(jar))
    monkeypatch.delenv("KVSTORE_SECRET", raising=False)
    (submit,) = yarn.processes(job)
    assert not any(secret in arg for arg in submit.argv), submit.argv
    assert submit.env["DMLC_KVSTORE_SECRET"] == secret
    (qsub,) = sge.processes(job)
    os.unlink(qsub.argv[-1])
    assert not any(secret in arg for arg in qsub.argv), qsub.argv
    assert "DMLC_NUM_WORKER=2,KVSTORE_SECRET" in qsub.argv
    assert qsub.env["KVSTORE_SECRET"] == secret  # where `qsub -v KVSTORE_SECRET` reads it


def test_child_takes_the_secret_yarn_carried(tmp_path):
    show = "import os; print(os.environ.get('KVSTORE_SECRET'), 'DMLC_KVSTORE_SECRET' in os.environ)"
    env = dict(os.environ, DMLC_ROLE="worker", DMLC_TASK_ID="0", DMLC_KVSTORE_SECRET="abc")
    env.pop("KVSTORE_SECRET", None)
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.launch.child", "--num-servers", "1", "--"]
        + [sys.executable, "-c", show],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout == "[worker 0] abc False\n", done


@pytest.mark.skipif(shutil.which("srun") is not None, reason="srun is installed here")
def test_slurm_missing_srun():
    done = launch("-n", "1", "--launcher", "slurm", "python", "x.py")
    assert done.returncode == 2 and "needs srun on PATH" in done.stderr


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"OMPI_COMM_WORLD_RANK": "0"}, ("server", 0)),
        ({"OMPI_COMM_WORLD_RANK": "2"}, ("worker", 1)),
        ({"PMI_RANK": "1"}, ("worker", 0)),
        ({"SLURM_PROCID": "0"}, ("server", 0)),
        ({"SGE_TASK_ID": "3"}, ("worker", 1)),
        ({"DMLC_ROLE": "worker", "DMLC_TASK_ID": "4"}, ("worker", 4)),
    ],
)
def test_child_role_from_task_index(env, expected):
    from kvstore.launch.child import task_role

    assert task_role(env, 1) == expected


def test_entry_points():
    for argv in (
        [sys.executable, "-m", "kvstore.launch", "-h"],
        [str(Path(sys.executable).with_name("kvstore-launch")), "-h"],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "--num-workers" in done.stdout, argv


def test_ssh_colocated_servers_one_per_host(sshd, tmp_path):
    """--colocate: a server on each host, beside that host's workers (-s from the hosts)."""
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(LOOP, job / "loop.py")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\n127.0.0.2\n")
    done = launch(
        "-n",
        "2",
        "--colocate",
        "--launcher",
        "ssh",
        "-H",
        hosts,
        *sshd.ssh_options(),
        "--env",
        "KVSTORE_HEARTBEAT_INTERVAL=0.5",
        sys.executable,
        "loop.py",
        3,
        cwd=job,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for name, host in (
        ("server 0", "127.0.0.1"),
        ("server 1", "127.0.0.2"),
        ("worker 0", "127.0.0.1"),
        ("worker 1", "127.0.0.2"),
    ):
        assert f"launch: started {name} on {host} " in done.stdout, done.stdout
    assert "1 servers" not in done.stdout and "[worker 1] done" in done.stdout


@pytest.mark.parametrize(
    "ends,alike",
    [
        ([(1, "ValueError: bug"), (1, "ValueError: bug")], "ValueError: bug"),
        ([(1, "ValueError: bug"), (1, "ValueError: other")], None),
        ([(1, "ValueError: bug"), (2, "ValueError: bug")], None),
        ([(1, "ValueError: bug"), (None, "step 3")], None),  # one still runs
        ([(1, "ValueError: bug")], None),  # one worker: its slot's three tries
        # killed over ssh: 128 + 9, said alike by the remote wrapper: a signal, not a bug
        ([(137, "killed by SIGKILL (status 137)")] * 2, None),
        ([(-9, "step 3")] * 2, None),  # killed here
    ],
)
def test_every_worker_failed_alike_only_for_one_status_and_line(ends, alike):
    """``Supervisor._failed_alike`` (review findings): the same failing exit and last line
    in every slot; never a signal's end (a whole job OOM-killed over ssh reads alike)."""
    from kvstore.launch.job import Proc, Supervisor

    class Ended:  # a process's popen, ended with ``code`` (None: running)
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

    sup = Supervisor(out=open(os.devnull, "w"))
    for rank, (code, line) in enumerate(ends):
        proc = Proc(f"worker {rank}", [], role="worker", last_lines=[line])
        proc.popen = Ended(code)
        sup.procs.append(proc)
    assert sup._failed_alike() == alike


def test_a_failure_passed_on_is_said_with_the_cause_it_names():
    """With two causes (workers 1 and 2), a server whose last line names worker 2 passes on
    worker 2's failure, not the first cause's (review finding); a line naming none, none."""
    from kvstore.launch.job import Proc, _named_by_others, _named_cause

    w1, w2 = Proc("worker 1", []), Proc("worker 2", [])
    server = Proc("server 0", [], last_lines=["server 0 (h:1): worker 2 (h pid 9) failed: x"])
    other = Proc("server 1", [], last_lines=["server 1 (h:2): no route to worker-1"])
    assert _named_cause(server, [w1, w2]) is w2
    assert _named_cause(other, [w1, w2]) is None
    assert _named_by_others(w2, [w1, w2, server]) and not _named_by_others(w1, [w1, w2, server])


def _elastic_supervisor(after_job_grace: float, stop_grace: float):
    """A launcher's Supervisor of an elastic job with short graces, and what it says."""
    import io

    from kvstore.launch.job import Supervisor

    out = io.StringIO()
    sup = Supervisor(out=out)
    sup.elastic = True
    sup.after_job_grace, sup.stop_grace = after_job_grace, stop_grace
    return sup, out


def _kill_groups(sup) -> None:
    """Every process group ``sup`` started, by its leader's PID, whatever happened."""
    for p in sup.procs:
        try:
            os.killpg(p.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("who", ["itself", "its child"])
def test_a_frozen_worker_is_killed_when_sigterm_cannot_stop_it(who, tmp_path):
    """An elastic job ended (its scheduler exited 0) while a worker is frozen (SIGSTOP, or a
    hung syscall: SIGTERM does nothing), or a child of it is (the worker itself exits on
    SIGTERM, the frozen child keeps its output open): the launcher kills the worker's whole
    group once its stop grace has passed and ends, instead of waiting forever."""
    from kvstore.launch.job import Proc

    sup, out = _elastic_supervisor(after_job_grace=0.3, stop_grace=0.5)
    py = sys.executable
    mark = tmp_path / "frozen"  # the scheduler ends the job once the worker is about to freeze
    wait = (  # (bounded: 30 s)
        "import os, time\nt = time.monotonic() + 30\n"
        f"while not os.path.exists({str(mark)!r}) and time.monotonic() < t:\n"
        "    time.sleep(0.01)"
    )
    sup.start(Proc("scheduler", [py, "-c", wait], role="scheduler"))
    freeze = (
        f"import os, signal; open({str(mark)!r}, 'w').close(); print('freezing', flush=True); "
        "os.kill(os.getpid(), signal.SIGSTOP)"
    )
    if who == "its child":  # (bounded: the test's timeout)
        freeze = (
            "import subprocess, sys, time; "
            f"subprocess.Popen([sys.executable, '-c', {freeze!r}]); time.sleep(60)"
        )
    sup.start(Proc("worker 0", [py, "-c", freeze], role="worker"))
    try:
        assert sup.wait(timeout=20) == 0, out.getvalue()
    finally:
        _kill_groups(sup)
    said = out.getvalue()
    assert "stopping worker 0, still running 0.3s later" in said, said
    if who == "itself":
        assert "worker 0 on localhost did not stop within 0.5s of SIGTERM (frozen?)" in said


def _bounded_wait_for(*marks) -> str:
    """Python source: wait until every file ``marks`` exists (bounded: 30 s)."""
    return (
        "import os, time\nt = time.monotonic() + 30\n"
        f"while not all(os.path.exists(m) for m in {[str(m) for m in marks]!r}) "
        "and time.monotonic() < t:\n    time.sleep(0.01)\n"
    )


def test_an_elastic_job_whose_every_worker_failed_fails_though_newcomers_were_stopped(tmp_path):
    """Both workers of an elastic job fail (each told the scheduler it finished, as
    ``hvd.shutdown()`` in a ``finally`` does); newcomers take their slots, the scheduler ends
    the job as done, and the launcher stops the newcomers, which never joined. The job
    failed: every process that ran it failed (the launcher judged each slot by its newest
    process, the stopped newcomer, and ended 0)."""
    from kvstore.launch.job import Proc

    sup, out = _elastic_supervisor(after_job_grace=0.5, stop_grace=0.5)
    py = sys.executable
    marks = [tmp_path / "w0", tmp_path / "w1"]
    # the scheduler ends the job (done) 2 s after both workers failed: newcomers came by then
    sched = _bounded_wait_for(*marks) + "time.sleep(2.0)"
    sup.start(Proc("scheduler", [py, "-c", sched], role="scheduler"))
    for rank, mark in enumerate(marks):
        # the first process of a slot fails; a newcomer waits for a job that has ended
        worker = (
            "import os, sys, time\n"
            f"if not os.path.exists({str(mark)!r}):\n"
            f"    time.sleep({0.5 * rank}); open({str(mark)!r}, 'w').close(); sys.exit(3)\n"
            + _bounded_wait_for(tmp_path / "never")
        )
        sup.start(Proc(f"worker {rank}", [py, "-c", worker], role="worker"))
    try:
        status = sup.wait(timeout=30)
    finally:
        _kill_groups(sup)
    said = out.getvalue()
    assert said.count("a new one takes its slot") == 2, said  # (the case this test is for)
    assert status == 3, said
    assert "every worker's last process failed: the job failed" in said, said


def test_a_stopped_worker_s_frozen_child_is_killed_when_the_launcher_ends(tmp_path):
    """A worker stopped while the job goes on exits, leaving a frozen child that holds its
    output; the launcher then ends (here its --timeout) before that worker's stop grace is
    up. Its stop kills that group too: it stopped only processes still running, and the
    frozen child stayed behind."""
    from kvstore.launch.job import Proc

    sup, out = _elastic_supervisor(after_job_grace=0.2, stop_grace=3.0)
    py = sys.executable
    mark = tmp_path / "child"  # the child's pid, once it is about to freeze
    sup.start(Proc("scheduler", [py, "-c", _bounded_wait_for(mark)], role="scheduler"))
    child = (
        f"import os, signal; open({str(mark) + '.tmp'!r}, 'w').write(str(os.getpid())); "
        f"os.rename({str(mark) + '.tmp'!r}, {str(mark)!r}); os.kill(os.getpid(), signal.SIGSTOP)"
    )
    worker = (  # (bounded: 60 s)
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "time.sleep(60)"
    )
    sup.start(Proc("worker 0", [py, "-c", worker], role="worker"))
    pid = None
    try:
        status = sup.wait(timeout=2.5)  # ends within the worker's stop grace (3 s)
        pid = int(mark.read_text())
        assert poll_until(lambda: not _alive(pid), 10), f"its frozen child {pid} still runs"
    finally:
        _kill_groups(sup)
    said = out.getvalue()
    assert status == 124 and "stopping worker 0, still running 0.2s later" in said, said
