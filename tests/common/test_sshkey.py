"""`common.sshkey.fingerprint` is what the real ``ssh-keygen -l`` prints."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import pytest

from common.sshkey import fingerprint


@pytest.mark.parametrize("kind", ["ed25519", "rsa", "ecdsa"])
def test_fingerprint_is_ssh_keygens(tmp_path: Path, kind: str) -> None:
    keygen = shutil.which("ssh-keygen")
    assert keygen, "ssh-keygen (openssh-client) is needed"
    key = tmp_path / "key"
    subprocess.run([keygen, "-q", "-t", kind, "-N", "", "-f", str(key)], check=True)
    wire = base64.b64decode(key.with_suffix(".pub").read_text().split()[1])
    printed = subprocess.run(
        [keygen, "-l", "-E", "sha256", "-f", str(key.with_suffix(".pub"))],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[1]
    assert printed.startswith("SHA256:")
    assert fingerprint(wire) == printed
    assert fingerprint(wire + b"x") != printed
