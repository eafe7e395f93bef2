"""A private sshd on a high port of 127.0.0.1 and 127.0.0.2, with a throwaway key."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from .cluster import free_port

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def available() -> str | None:
    """None when a private sshd can run here, else why not."""
    if not os.path.exists(SSHD) or not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "sshd/ssh not installed (scripts/test.sh installs them as root)"
    if os.geteuid() != 0:
        return "a private sshd that logs in as this user needs root here"
    return None


class PrivateSshd:
    def __init__(self, tmp: Path):
        self.dir = tmp
        self.port = free_port()
        key, host_key = tmp / "id_ed25519", tmp / "host_ed25519"
        for path in (key, host_key):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True
            )
        auth = tmp / "authorized_keys"
        auth.write_text((tmp / "id_ed25519.pub").read_text())
        auth.chmod(0o600)
        config = tmp / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nListenAddress 127.0.0.2\n"
            f"HostKey {host_key}\nAuthorizedKeysFile {auth}\nPidFile {tmp / 'sshd.pid'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "PermitRootLogin prohibit-password\nStrictModes no\nAcceptEnv *\n"
            "Subsystem sftp internal-sftp\n"
        )
        self.client_config = tmp / "ssh_config"
        self.client_config.write_text(
            f"Host *\n  Port {self.port}\n  IdentityFile {key}\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
            # the code under test on the far side too (a checkout beside an installed
            # kvstore would otherwise run the installed one there): sshd accepts any variable
            "  SendEnv PYTHONPATH\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory
        self.proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        self._wait_ready()

    def ssh_options(self) -> list[str]:
        return ["--ssh-option=-F", f"--ssh-option={self.client_config}"]

    def _wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {self.proc.stdout.read().decode()}")
            probe = subprocess.run(
                ["ssh", "-F", str(self.client_config), "-o", "BatchMode=yes", "127.0.0.1", "true"],
                capture_output=True,
                timeout=20,
            )
            if probe.returncode == 0:
                return
        raise RuntimeError("private sshd did not accept a login in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
