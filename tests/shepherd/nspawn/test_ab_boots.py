"""A/B slots on a real machine: systemd boots, reboots and a power cut through the BMC.

One systemd-nspawn machine (`shepherd.nspawn`) with a loop-device disk. The
agent's own modules, uploaded as the agent zipapp, install onto the disk
(GPT, slot A, boot record, the units) and stage upgrades into the other
slot; the machine's systemd runs ``bootprep`` and the node unit at every
boot, and the boot check unit keeps a tried slot or reboots the machine
(``systemctl reboot``: nspawn's exit 133, started again by the BMC's
supervisor). The node is a stand-in image: it reads the boot info its unit
names and, when its payload says "good", announces itself healthy at once
(what a real node does once its cluster took its status: that half is
tested with real nodes in tests/test_upgrade_e2e.py and
tests/metropolis/test_running_image.py); when "bad" it exits, as a node
that cannot start. In order, on one disk:

    install A, reboot           slot A boots, no try
    stage B, reboot             B tried, confirmed healthy: permanent
    stage C (bad), reboot       C tried, never healthy: the check gives up
                                after its bound, reboots; B boots again, and
                                says it went back from C and why
    stage D, SIGSTOP before     the power cut through the BMC (ForceOff, On):
    its state write, power cut  B boots, no try (D was never pointed at)
    stage D again, reboot       D tried, confirmed: the upgrade after a cut
                                writes the slot again cleanly

Each reboot is seen as a new nspawn boot of the machine; the data
partition's marker file, written at the first boot, is read at the last.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import time
import zipfile
from collections.abc import Callable, Iterator

import pytest
import trio

from shepherd.agent_bundle import agent_zipapp
from shepherd.providers.base import PowerState
from shepherd.providers.redfish import Credentials, RedfishClient
from tests.shepherd.nspawn.fleet_thread import FleetThread, skip_unless_possible

#: The stand-in node: announce healthy from the boot info (or exit, if
#: bad). Its entry point, which the image unpacked into /run runs (as
#: shiv's would): `image` packs it as a shiv zipapp's site-packages.
STAND_IN = b"""\
import json, os, sys, time


def main():
    with open(os.path.join(os.path.dirname(__file__), "payload"), "rb") as f:
        payload = f.read()
    if payload.startswith(b"bad"):
        sys.stderr.write("stand-in node: this image cannot start\\n")
        return 3
    info = json.load(open(os.environ["METROPOLIS_BOOT_INFO"]))
    out = os.environ["METROPOLIS_ANNOUNCE_HEALTHY"]
    with open(out + ".tmp", "w") as f:
        json.dump({"slot": info["slot"], "image_sha256": info["image_sha256"]}, f)
    os.replace(out + ".tmp", out)
    while True:
        time.sleep(60)
"""

LAYOUT = "gpt.Layout(boot_mib=8, system_mib=24, data_min_mib=64)"


def image(payload: bytes) -> bytes:
    """A stand-in node image laid out as a shiv zipapp (what the boot
    unpacks): the entry point and the payload in its site-packages."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("environment.json", json.dumps({"entry_point": "standin:main"}))
        archive.writestr("site-packages/standin.py", STAND_IN)
        archive.writestr("site-packages/payload", payload + b"\0" * 200_000)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetThread]:
    skip_unless_possible()
    rig = FleetThread(tmp_path_factory.mktemp("nspawn-ab"), count=1)
    rig.start()
    try:
        yield rig
    finally:
        rig.stop()


def _put(rig: FleetThread, path: str, data: bytes) -> None:
    assert rig.fleet is not None
    subprocess.run(
        [
            *("ssh", "-i", str(rig.key_file), "-o", "BatchMode=yes"),
            *("-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"),
            *("-o", "LogLevel=ERROR", f"root@{rig.fleet.address(0)}", f"cat > {path}"),
        ],
        input=data,
        check=True,
        timeout=60,
    )


def _python(rig: FleetThread, code: str, env: str = "") -> subprocess.CompletedProcess[str]:
    """``code`` in the machine's python3 with the uploaded agent's modules."""
    script = "import sys; sys.path.insert(0, '/root/agent.pyz')\n" + code
    _put(rig, "/root/step.py", script.encode())
    return rig.ssh(0, f"{env} python3 /root/step.py", check=False)


def _wait_boot(rig: FleetThread, boots: int, timeout: float = 180) -> None:
    """Until the machine booted more than ``boots`` times and sshd answers."""
    assert rig.fleet is not None
    machine = rig.fleet.machines[0]
    deadline = time.monotonic() + timeout
    while machine.boots <= boots:
        assert time.monotonic() < deadline, "the machine did not boot again"
        time.sleep(0.3)
    while True:
        try:
            if rig.ssh(0, "true", check=False).returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass
        assert time.monotonic() < deadline, "no sshd after the boot"
        time.sleep(0.3)


def _boot_info(
    rig: FleetThread,
    *,
    until: Callable[[dict[str, object]], bool] = lambda _: True,
    timeout: float = 120,
) -> dict[str, object]:
    """The boot info of the boot now, once ``until`` holds of it."""
    deadline = time.monotonic() + timeout
    while True:
        done = rig.ssh(0, "cat /run/metropolis/boot.json", check=False)
        if done.returncode == 0:
            info = json.loads(done.stdout)
            assert isinstance(info, dict)
            if until(info):
                return info
        assert time.monotonic() < deadline, (done.stdout, _journal(rig))
        time.sleep(0.5)


def _journal(rig: FleetThread) -> str:
    return rig.ssh(
        0,
        "journalctl -b -u metropolis-prepare -u metropolis-node -u metropolis-boot-check "
        "--no-pager | tail -n 30",
        check=False,
    ).stdout


def _reboot(rig: FleetThread) -> None:
    assert rig.fleet is not None
    boots = rig.fleet.machines[0].boots
    rig.ssh(0, "systemctl reboot", check=False)
    _wait_boot(rig, boots)


def _stage(rig: FleetThread, name: str, sha: str, timeout: int, env: str = "") -> str:
    done = _python(
        rig,
        "from shepherd.agent import bootentry, upgradedevice\n"
        f"disk = upgradedevice.open_device({str(rig.fleet.disks[0].device)!r})\n"  # type: ignore[union-attr]
        f"print(upgradedevice.stage_device(disk, '/root/{name}.pyz', {sha!r}, {timeout},"
        " bootentry.Target()))\n",
        env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_slots_boot_try_keep_go_back_and_survive_a_power_cut(machine: FleetThread) -> None:
    rig = machine
    assert rig.fleet is not None
    device = str(rig.fleet.disks[0].device)
    images = {name: image(name.encode()) for name in ("good-a", "good-b", "bad-c", "good-d")}
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in images.items()}
    _put(rig, "/root/agent.pyz", agent_zipapp())
    for name, data in images.items():
        _put(rig, f"/root/{name}.pyz", data)

    # Install A (the boot entry last), then boot it.
    done = _python(
        rig,
        "from shepherd.agent import blockdev, bootentry, gpt, realdisk\n"
        f"path = blockdev.check_device({device!r}, {LAYOUT})\n"
        f"realdisk.install_device(path, '/root/good-a.pyz', {sha['good-a']!r}, b'params',"
        f" '198.18.0.9', layout={LAYOUT}, target=bootentry.Target())\n",
    )
    assert done.returncode == 0, done.stderr
    _reboot(rig)
    info = _boot_info(rig)
    assert (info["slot"], info["image_sha256"], info["trial"]) == ("a", sha["good-a"], False)
    assert rig.ssh(0, "test -s /run/metropolis/healthy.json", check=False).returncode == 0
    rig.ssh(0, "echo kept > /var/lib/metropolis/marker")

    # B: tried, confirmed by the boot check, permanent.
    assert _stage(rig, "good-b", sha["good-b"], 60) == "b"
    _reboot(rig)
    info = _boot_info(rig, until=lambda info: not info["trial"])
    assert (info["slot"], info["image_sha256"]) == ("b", sha["good-b"]), _journal(rig)

    # C cannot start: the check gives up after 10 s and reboots; B again.
    assert _stage(rig, "bad-c", sha["bad-c"], 10) == "a"
    boots = rig.fleet.machines[0].boots
    _reboot(rig)  # into C
    _wait_boot(rig, boots + 1)  # the check's own reboot, back to B
    info = _boot_info(rig)
    assert (info["slot"], info["trial"], info["image_sha256"]) == ("b", False, sha["good-b"])
    assert info["rolled_back_sha256"] == sha["bad-c"]
    assert "not confirmed healthy within 10 s" in str(info["rollback_cause"])

    # A power cut through the BMC while D is being staged (after its image
    # was written, before the slot state points at it).
    _put(
        rig,
        "/root/stage-d.py",
        (
            "import sys; sys.path.insert(0, '/root/agent.pyz')\n"
            "from shepherd.agent import bootentry, upgradedevice\n"
            f"disk = upgradedevice.open_device({device!r})\n"
            f"upgradedevice.stage_device(disk, '/root/good-d.pyz', {sha['good-d']!r}, 60,"
            " bootentry.Target())\n"
        ).encode(),
    )
    rig.ssh(
        0,
        "METROPOLIS_TEST_STOP_AT=upgrade-state nohup python3 /root/stage-d.py "
        ">/root/stage-d.log 2>&1 &",
        check=False,
    )
    deadline = time.monotonic() + 60
    while "T" not in rig.ssh(0, "ps -o stat= -C python3 | tr -d ' '", check=False).stdout:
        assert time.monotonic() < deadline, "the staging did not reach its stop"
        time.sleep(0.3)
    boots = rig.fleet.machines[0].boots
    trio.run(_power_cut, rig)
    _wait_boot(rig, boots)
    info = _boot_info(rig)
    assert (info["slot"], info["trial"], info["image_sha256"]) == ("b", False, sha["good-b"])

    # The next upgrade writes D again, cleanly, and it is kept.
    assert _stage(rig, "good-d", sha["good-d"], 60) == "a"
    _reboot(rig)
    info = _boot_info(rig, until=lambda info: not info["trial"])
    assert (info["slot"], info["image_sha256"]) == ("a", sha["good-d"]), _journal(rig)
    assert info["rolled_back_sha256"] == ""
    assert rig.ssh(0, "cat /var/lib/metropolis/marker").stdout.strip() == "kept"


async def _power_cut(rig: FleetThread) -> None:
    assert rig.fleet is not None
    url = rig.fleet.system_url(0)
    good = Credentials(rig.fleet.bmc_username, rig.fleet.bmc_password)
    async with RedfishClient() as client:
        await client.reset(url, good, "ForceOff")
        with trio.fail_after(60):
            while await client.power_state(url, good) != PowerState.OFF:  # noqa: ASYNC110
                await trio.sleep(0.2)
        await client.reset(url, good, "On")
