"""The machines' root cache: reused when asked the same, never half-built."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shepherd.nspawn.rootfs import PACKAGES, RootBuildError, ensure_root, root_key
from tests.shepherd.nspawn.fleet_thread import skip_unless_possible


def test_the_second_build_reuses_the_cache_without_mmdebstrap(tmp_path: Path) -> None:
    skip_unless_possible()
    first = ensure_root()  # builds here only on a cold cache (about 30 to 95 s)
    # An mmdebstrap that would fail if run: the second call must not run it.
    second = ensure_root(mmdebstrap=str(tmp_path / "no-such-mmdebstrap"))
    assert second.built is False
    assert (second.tarball, second.tree) == (first.tarball, first.tree)
    assert (second.tree / "usr/lib/systemd/systemd").exists()
    assert (second.tree / "usr/sbin/sshd").exists()
    # Every machine gets its own host keys: the image has none.
    assert not list((second.tree / "etc/ssh").glob("ssh_host_*"))
    listed = subprocess.run(
        ["tar", "-tf", str(second.tarball)], capture_output=True, text=True, check=True
    ).stdout
    assert {"./usr/bin/python3", "./usr/sbin/sshd", "./usr/sbin/sfdisk"} <= set(listed.split("\n"))


def test_the_key_changes_with_the_package_list() -> None:
    assert root_key(PACKAGES) == root_key(tuple(reversed(PACKAGES)))
    assert root_key(PACKAGES) != root_key((*PACKAGES, "curl"))


def test_a_failed_build_leaves_no_entry_and_a_half_built_one_is_not_used(
    tmp_path: Path,
) -> None:
    failing = tmp_path / "mmdebstrap"
    # Writes half a tarball, as a build cut short does, and fails.
    failing.write_text(
        '#!/bin/sh\nfor last; do :; done\necho half > "$last"\necho boom >&2\nexit 3\n'
    )
    failing.chmod(0o755)
    cache = tmp_path / "cache"
    with pytest.raises(RootBuildError, match="exited with 3:\nboom"):
        ensure_root(cache, mmdebstrap=str(failing))
    entry = cache / root_key(PACKAGES)
    assert not (entry / "root.tar").exists() and not (entry / "root").exists()
    assert not list(entry.glob(".*"))
    # A leftover of a build killed before it could clean up is not taken for a root.
    (entry / ".root.tar.partial").write_text("half")
    with pytest.raises(RootBuildError):
        ensure_root(cache, mmdebstrap=str(failing))
