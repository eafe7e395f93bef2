#!/usr/bin/env bash
# Set up and run lint + every test, on a fresh machine or an old one.
#   - the launcher tests need sshd, mpirun and rsync: installed with apt when missing (as root)
#   - a virtual environment .venv with the package and its test extras
#   - torch 2.14.1 and torchvision 0.29.1 for the PyTorch adapter tests and Horovod's ImageNet
#     example (else torch 2.13.0's CPU build alone, else none: those tests skip, saying so)
#   - Debian's chromium for the status page's browser test (as root)
#   - Debian's slurm-wlm and munge for the real Slurm test (as root; tests/test_slurm.py starts
#     its own slurmctld, slurmd and munged on private ports, so none need to be running)
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k dist`.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=""
for tool in sshd:openssh-server ssh:openssh-client mpirun:openmpi-bin rsync:rsync; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${tool%%:*}" ] || missing="$missing ${tool#*:}"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    echo "note: $missing not installed (needs root); their launcher tests will skip" >&2
  fi
fi

# Headless Chromium for the status page's browser test (tests/test_status_page.py skips,
# saying so, without it).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
      || echo "note: chromium could not be installed; the status page's browser test will skip" >&2
  else
    echo "note: chromium not installed (needs root); the status page's browser test will skip" >&2
  fi
fi

# A real Slurm for tests/test_slurm.py (it skips, saying so, without one).
if ! command -v slurmctld >/dev/null 2>&1 && ! [ -x /usr/sbin/slurmctld ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null \
      || echo "note: slurm-wlm could not be installed; the real Slurm test will skip" >&2
  else
    echo "note: slurm-wlm not installed (needs root); the real Slurm test will skip" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# The distribution was renamed kvstore -> kvstore-ps: drop the old editable install's metadata.
if .venv/bin/pip show kvstore >/dev/null 2>&1; then .venv/bin/pip uninstall -y -q kvstore; fi
.venv/bin/pip install -q -e '.[test,examples]'
# PyTorch, pinned (an unpinned `torch` pulls the index's newest CUDA build, several GB). Horovod's
# ImageNet example needs torchvision, which imports only beside the torch it was built for:
# torch 2.14.1 with torchvision 0.29.1, which pip on Python 3.11 takes from this project's
# machines' disk (a CUDA build that runs on the CPU, about 5.5 GB in .venv, about 35 s).
# Where they are not to be had, torch 2.13.0's CPU build alone (the example's test skips);
# where neither is, the PyTorch tests skip.
if ! .venv/bin/python -c 'import torch, torchvision' 2>/dev/null; then
  if ! .venv/bin/pip install -q 'torch==2.14.1' 'torchvision==0.29.1'; then
    echo "note: torch 2.14.1 with torchvision 0.29.1 not available; Horovod's ImageNet example's test will skip" >&2
    .venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/pip install -q 'torch==2.13.0' \
      || echo "note: torch's CPU wheel is not available; the PyTorch adapter tests will skip" >&2
  fi
fi

.venv/bin/ruff check .
.venv/bin/ruff format --check .
# One test at a time. `-n 2 --dist loadgroup` (pytest-xdist) runs two at a time: about 11
# minutes on 2 cores instead of 16.5, but a few tests that time their processes still fail
# under that load now and then (README: The two commands).
.venv/bin/python -m pytest "$@"
