"""``python -m shepherd.nspawn up``: prints the machines, stops everything on Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from tests.shepherd.nspawn.fleet_thread import skip_unless_possible


def test_up_prints_reachable_machines_and_ctrl_c_removes_them(tmp_path: Path) -> None:
    skip_unless_possible()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shepherd.nspawn",
            "up",
            "--machines",
            "1",
            "--folder",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            if line.strip() == "ready":
                break
            lines.append(json.loads(line))
        machine, fleet = lines
        assert machine["name"] == "machine-0"
        assert machine["bmc"].endswith("/redfish/v1/Systems/machine-0")
        login = subprocess.run(
            [*machine["ssh"].split(), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
             "-o", "UserKnownHostsFile=/dev/null", "cat /proc/1/comm"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert login.stdout.strip() == "systemd", login.stderr
    finally:
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=120)
    assert status == 0, process.stderr.read() if process.stderr else ""
    losetup = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in losetup
    prefix = fleet["host_address"].rsplit(".", 1)[0] + "."
    addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert prefix not in addresses
