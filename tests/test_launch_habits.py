"""Scripts as users write them: the habits MXNet and Horovod users bring, run the way they
run them (through launch.py where it is about the launcher), reading what they read."""

import os
import subprocess
import sys

import numpy as np
import pytest

import kvstore

from .cluster import ROOT


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


def _started_pids(out: str) -> dict:
    """{'scheduler': pid, 'server 0': pid, ...} from the launcher's 'started' lines."""
    pids = {}
    for line in out.splitlines():
        if line.startswith("launch: started ") and " (pid " in line:
            name = line[len("launch: started ") :].split(" on ")[0]
            pids[name] = int(line.rsplit("(pid ", 1)[1].rstrip(")"))
    return pids


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
