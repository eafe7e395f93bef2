"""The distribution a user installs: its name, metadata, typed marker, commands, extras, and a
library that leaves logging to the application."""

import email
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kvstore

from .cluster import can_build_c

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Names that pull a multi-GB CUDA build (or a source build needing nvcc) when left to the index
CUDA_PULLERS = ("torch", "nvidia-", "cupy", "tensorflow", "jax[cuda")


def test_distribution_name_is_not_the_taken_one():
    project = PYPROJECT["project"]
    assert project["name"] == "kvstore-ps"  # `kvstore` on PyPI is an unrelated 2016 package
    readme_head = (ROOT / "README.md").read_text().splitlines()[:6]
    assert any("pip install kvstore-ps" in line for line in readme_head)


def test_metadata_is_complete():
    project = PYPROJECT["project"]
    assert project["requires-python"] == ">=3.10"
    assert project["authors"] and project["license"] and project["keywords"]
    classifiers = project["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert {"Programming Language :: Python :: 3.10", "Programming Language :: Python :: 3.11"} <= (
        set(classifiers)
    )
    assert project["scripts"]["kvstore"] == "kvstore.__main__:main"
    assert project["scripts"]["kvstore-launch"] == "kvstore.launch.cli:main"
    assert (ROOT / "kvstore" / "py.typed").exists()


def test_no_extra_pulls_a_cuda_build_by_accident():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"cuda", "examples", "torch", "bench", "test"} <= set(extras)  # old names still work
    assert {"hypothesis", "pytest-timeout"} <= set(extras["test"])
    for name, requirements in extras.items():
        if name == "cuda":  # the one explicit GPU choice: a prebuilt CuPy wheel, no toolkit
            assert requirements == ["cupy-cuda12x>=12"]
            continue
        for req in requirements:
            assert not req.lower().startswith(CUDA_PULLERS), f"extra {name!r} pulls {req!r}"
    for req in PYPROJECT["project"]["dependencies"]:
        assert not req.lower().startswith(CUDA_PULLERS)


def test_version_commands():
    expected = f"kvstore-ps {kvstore.__version__}"
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == expected
    script = Path(sys.executable).with_name("kvstore")
    if not script.exists():
        pytest.skip("the `kvstore` command is installed by `pip install -e .` (scripts/test.sh)")
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == expected


def test_python_m_kvstore_explains_roles_and_finds_settings():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "KVSTORE_"))}
    env.update(
        DMLC_ROLE="worker",
        DMLC_PS_ROOT_URI="10.0.0.1",
        DMLC_PS_ROOT_PORT="9091",
        DMLC_NUM_SERVER="2",
        DMLC_NUM_WORKER="4",
        KVSTORE_SECRET="s" * 32,
    )
    out = subprocess.run(
        [sys.executable, "-m", "kvstore"], capture_output=True, text=True, env=env, timeout=60
    ).stdout
    assert "DMLC_PS_ROOT_URI=10.0.0.1" in out
    assert "valid: worker, scheduler 10.0.0.1:9091, 2 servers, 4 workers" in out
    assert "s" * 32 not in out and "KVSTORE_SECRET=<set, hidden>" in out
    for role in ("scheduler", "server", "worker"):
        assert f"  {role} " in out
    env.pop("DMLC_PS_ROOT_PORT")
    out = subprocess.run(
        [sys.executable, "-m", "kvstore"], capture_output=True, text=True, env=env, timeout=60
    ).stdout
    assert "not a valid cluster configuration: DMLC_PS_ROOT_PORT is not set" in out


@pytest.mark.slow
def test_wheel_metadata(tmp_path):
    if shutil.which("pip", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("no pip in this environment")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvstore_ps-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(meta_name))
    assert meta["Name"] == "kvstore-ps" and meta["Version"] == kvstore.__version__
    assert "kvstore/py.typed" in names and "kvstore/__main__.py" in names
    assert not any(n.startswith("tests/") for n in names)
    if can_build_c():  # the C module (optional)
        assert [n for n in names if n.startswith("kvstore/_rowsearch.") and n.endswith(".so")]
    requires = meta.get_all("Requires-Dist")
    assert not [r for r in requires if "torch" in r]
    assert any(r.startswith("cupy-cuda12x") and 'extra == "cuda"' in r for r in requires)


LOGGING_PROBE = """
import logging, sys
import kvstore
from kvstore.config import setup_logging
log = logging.getLogger("kvstore")
assert [type(h).__name__ for h in log.handlers] == ["NullHandler"], log.handlers
if sys.argv[1] == "configured":
    logging.basicConfig(stream=sys.stdout, format="USER %(name)s %(levelname)s %(message)s")
setup_logging(0, "worker")  # what kvstore.create does in a worker
logging.getLogger("kvstore.worker").warning("a warning")
logging.getLogger("kvstore.worker").info("not shown at the default level")
"""


def test_library_leaves_logging_to_the_application():
    configured = subprocess.run(
        [sys.executable, "-c", LOGGING_PROBE, "configured"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert configured.returncode == 0, configured.stderr
    assert configured.stdout == "USER kvstore.worker WARNING a warning\n"  # the user's format
    assert configured.stderr == ""  # and no second copy of our own
    plain = subprocess.run(
        [sys.executable, "-c", LOGGING_PROBE, "plain"], capture_output=True, text=True, timeout=60
    )
    assert plain.returncode == 0 and plain.stdout == ""
    assert plain.stderr.count("a warning") == 1 and " worker] a warning" in plain.stderr
