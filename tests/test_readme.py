"""Run every ```python block of README.md as a user would paste it, so the README cannot drift.

A block runs alone (``python block.py`` in a fresh directory) unless its first line is the
command that runs it, ``# $ python launch.py ARGS python NAME.py ...``: then it is saved as
NAME.py and run through launch.py with that command line, on a real local cluster.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

from .cluster import ROOT

README = ROOT / "README.md"
MARKER = "# $ "


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of each ```python block."""
    text = README.read_text()
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(1))
        for m in re.finditer(r"(?ms)^```python\n(.*?)^```", text)
    ]


BLOCKS = python_blocks()


def test_readme_has_python_blocks():
    assert BLOCKS, "no ```python block found in README.md"
    assert any(code.startswith(MARKER) for _, code in BLOCKS), "no block runs under launch.py"


def launch_command(code: str, tmp_path) -> list[str]:
    """The block's first-line command, with this interpreter and the repository's launch.py."""
    argv = shlex.split(code.splitlines()[0][len(MARKER) :])
    assert argv[:2] == ["python", "launch.py"], f"expected '{MARKER}python launch.py ...'"
    script = next(a for a in argv[2:] if a.endswith(".py"))
    (tmp_path / script).write_text(code)
    argv = [sys.executable if a == "python" else a for a in argv]
    return [argv[0], str(ROOT / "launch.py"), "--timeout", "60", *argv[2:]]


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_readme_block_runs(line, code, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if code.startswith(MARKER):
        argv = launch_command(code, tmp_path)
    else:
        (tmp_path / "block.py").write_text(code)
        argv = [sys.executable, "block.py"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"README.md line {line}: {shlex.join(argv)}\n{out}"
    if code.startswith(MARKER):  # every worker ran it, on a distributed store
        assert "[worker 0] " in out and "no worker created a distributed store" not in out, out
