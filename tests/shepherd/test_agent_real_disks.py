"""How the agent names a machine's real disks, and what it puts in its unit."""

from __future__ import annotations

import os
import stat

import pytest

from shepherd.agent.disks import RealDisk, real_disks, resolve_real
from shepherd.agent.errors import AgentError
from shepherd.agent.unit import unit_text


def test_a_disk_is_named_by_its_serial_or_else_its_kernel_name() -> None:
    disks = [RealDisk("sda", "S3Z9", "S3Z9"), RealDisk("loop3", "loop3", "")]
    assert resolve_real("S3Z9", disks) == "sda"
    assert resolve_real("loop3", disks) == "loop3"
    assert resolve_real("sda", disks) is None  # named by its serial, not its kernel name
    with pytest.raises(ValueError, match="names 2 disks: sda, sdb"):
        resolve_real("S3Z9", [*disks, RealDisk("sdb", "S3Z9", "S3Z9")])


def test_real_disks_are_whole_devices_this_system_can_open() -> None:
    for disk in real_disks():
        st = os.stat(f"/dev/{disk.kernel_name}")
        assert stat.S_ISBLK(st.st_mode)
        assert not os.path.exists(f"/sys/class/block/{disk.kernel_name}/partition")
        assert disk.name == (disk.serial or disk.kernel_name)


def test_the_unit_refuses_what_systemd_would_read_otherwise() -> None:
    text = unit_text("/root/agent", ["--heartbeat-interval", "0.5", "--install-layout", "4,24,160"])
    assert "ExecStart=/root/agent --init-file /root/agent.init --heartbeat-interval 0.5 " in text
    for bad in ("/root/my agent", "/root/100%", "/root/$HOME", '/root/"x"'):
        with pytest.raises(AgentError, match="cannot put"):
            unit_text(bad, [])


def test_without_systemd_the_unit_is_refused_so_the_agent_runs_detached(tmp_path: object) -> None:
    from shepherd.agent.unit import install_unit

    if os.path.isdir("/run/systemd/system"):
        pytest.skip("this host runs systemd: the unit would be installed for real")
    with pytest.raises(AgentError, match="systemd does not run this machine"):
        install_unit("/root/agent", b"init", [], "/nonexistent")
