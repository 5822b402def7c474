"""A/B slots: the state machine, its two stores, and real boots of real loop devices.

The pure tests pin each transition and the store's torn-write rule on a
plain file. The device tests install onto a loop device, stage upgrades
with the agent's `upgradedevice.stage_device`, and boot the disk with the very
``bootprep.py`` the installer copies (in a child process, its run folder
moved to a temporary one), then run the boot check as its unit would
(its reboot a recorded call: never this host's). Crash points
(``METROPOLIS_TEST_CRASH_AT``) kill a staging, a boot or a check at each
write, and the next boot must do what the invariant in `abslots` says.
The data partition is read back unchanged at the end of every scenario.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shepherd.agent import abslots, blockdev, realdisk, unpack, upgrade, upgradedevice
from shepherd.agent.abslots import SlotError, SlotImage, SlotState
from shepherd.agent.bootentry import Target
from shepherd.agent.errors import UpgradeFailed
from shepherd.agent.gpt import Layout
from tests.shepherd.agent_install import stand_in_image

A, B, C = "a" * 64, "b" * 64, "c" * 64
SMALL = Layout(boot_mib=1, system_mib=4, data_min_mib=8)
TOOLS = ("losetup", "sfdisk", "partx", "mkfs.ext4", "wipefs", "blkid")
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t) is None for t in TOOLS),
    reason=f"needs root and {', '.join(TOOLS)}",
)


# --- the transitions


def _installed() -> SlotState:
    return abslots.initial(SlotImage(A, 100))


def test_a_staged_slot_is_tried_once_then_kept_when_confirmed() -> None:
    staged = abslots.stage(_installed(), SlotImage(B, 200), 60)
    assert (staged.next, staged.tries, staged.active) == ("b", 1, "a")
    boot, after = abslots.choose(staged)
    assert boot == abslots.Boot("b", SlotImage(B, 200), True)
    assert after is not None and (after.tries, after.trying) == (0, "b")
    kept = abslots.confirm(after, "b", B)
    assert kept is not None and (kept.active, kept.next, kept.trying) == ("b", None, None)
    assert abslots.choose(kept) == (abslots.Boot("b", SlotImage(B, 200), False), None)
    # Another image is not confirmed, nor a slot that is not on trial.
    assert abslots.confirm(after, "b", C) is None
    assert abslots.confirm(kept, "b", B) is None


def test_a_try_not_confirmed_goes_back_at_the_next_boot() -> None:
    staged = abslots.stage(_installed(), SlotImage(B, 200), 60)
    _, trying = abslots.choose(staged)
    assert trying is not None
    boot, back = abslots.choose(trying)
    assert boot == abslots.Boot("a", SlotImage(A, 100), False)
    assert back is not None and back.next is None and back.active == "a"
    assert back.rolled_back is not None and back.rolled_back.sha256 == B
    assert "not confirmed healthy" in back.rolled_back.cause
    # The next upgrade clears the rollback and may use slot b again.
    again = abslots.stage(back, SlotImage(C, 300), 60)
    assert again.rolled_back is None and again.next == "b"


def test_a_second_try_is_refused_while_one_is_under_way() -> None:
    staged = abslots.stage(_installed(), SlotImage(B, 200), 60)
    with pytest.raises(SlotError, match="under way"):
        abslots.stage(staged, SlotImage(C, 300), 60)


def test_the_state_round_trips_and_a_bad_one_is_refused() -> None:
    staged = abslots.stage(_installed(), SlotImage(B, 200), 60)
    assert abslots.decode(abslots.encode(staged)) == staged
    for bad in (
        b"{",
        b'{"slots": {}}',
        abslots.encode(staged).replace(b'"active": "a"', b'"active": "c"'),
        abslots.encode(staged).replace(b'"tries": 1', b'"tries": -1'),
        abslots.encode(abslots.initial(SlotImage(A, 100))).replace(
            b'"next": null', b'"next": "b"'
        ),  # next names an empty slot
    ):
        with pytest.raises(SlotError):
            abslots.decode(bad)


def test_the_device_store_keeps_the_older_state_when_the_newer_copy_is_torn(
    tmp_path: Path,
) -> None:
    part = tmp_path / "boot"
    part.write_bytes(b"\0" * (64 * 1024))
    store = abslots.DeviceStore(str(part), record_end=1000)
    assert store.read() is None
    first = store.write(_installed())
    second = store.write(abslots.stage(first, SlotImage(B, 200), 60))
    assert (first.seq, second.seq) == (1, 2)
    assert store.read() == second
    # Seq 3 goes to the copy holding seq 1; cut it halfway: seq 2 is read.
    third = abslots.stage(_installed(), SlotImage(C, 300), 60)
    with open(part, "r+b") as f:
        f.seek(store.offsets[1])  # 3 % 2
        f.write(b"\xff" * 10)  # over the magic: not a copy
    assert store.read() == second
    store.write(third)
    raw = part.read_bytes()
    cut = raw[: store.offsets[1] + 100] + b"\0" * (len(raw) - store.offsets[1] - 100)
    part.write_bytes(cut)  # the write of seq 3 torn after 100 bytes
    assert store.read() == second
    # Both gone: no state (the boot falls back to the boot record's).
    part.write_bytes(b"\0" * (64 * 1024))
    assert store.read() is None
    with pytest.raises(SlotError, match="no room"):
        abslots.DeviceStore(str(part), record_end=60 * 1024)


# --- real boots of a loop device


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[Callable[[int], str]]:
    attached: list[str] = []

    def make(mib: int) -> str:
        path = tmp_path / f"disk{len(attached)}.img"
        with open(path, "wb") as f:
            f.truncate(mib * blockdev.MIB)
        device = subprocess.run(
            ["losetup", "-f", "--show", "-P", str(path)], capture_output=True, text=True, check=True
        ).stdout.strip()
        attached.append(device)
        return device

    try:
        yield make
    finally:
        for device in attached:
            subprocess.run(["losetup", "-d", device], check=False)


class Disk:
    """An installed loop device, booted and upgraded as a machine would be."""

    def __init__(self, device: str, folder: Path) -> None:
        self.device = device
        self.folder = folder
        self.run = folder / "run"
        self.target = Target(
            systemd_root=str(folder / "systemd"),
            helper_dir=str(folder / "lib"),
            cache_dir=str(folder / "run" / "images"),
        )
        (folder / "systemd").mkdir()
        self.images: dict[str, bytes] = {}
        image = self.image("installed")
        done = realdisk.install_device(
            device,
            str(image),
            self.sha(image),
            b"params",
            "198.18.0.7",
            layout=SMALL,
            target=self.target,
        )
        self.partuuids = done.partitions.partuuids
        self.data_before = self.data()

    def image(self, name: str, size: int = 0, *, unpackable: bool = True) -> Path:
        data = stand_in_image(
            payload=name.encode(), size=size or 300_000 + len(self.images), unpackable=unpackable
        )
        path = self.folder / f"{name}.pyz"
        path.write_bytes(data)
        self.images[hashlib.sha256(data).hexdigest()] = data
        return path

    @staticmethod
    def sha(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    def data(self) -> str:
        with open(f"{self.device}p4", "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def stage(self, image: Path, *, crash: str = "") -> subprocess.CompletedProcess[bytes]:
        """`upgradedevice.stage_device` in a child process (a crash point kills it)."""
        code = (
            "import sys\n"
            "from shepherd.agent import bootentry, upgradedevice\n"
            "t = bootentry.Target(systemd_root=sys.argv[3], helper_dir=sys.argv[4])\n"
            "print(upgradedevice.stage_device(upgradedevice.open_device(sys.argv[1]), sys.argv[2],"
            " sys.argv[5], 5, t))\n"
        )
        return subprocess.run(
            [
                *(sys.executable, "-c", code, self.device, str(image)),
                *(self.target.systemd_root, self.target.helper_dir, self.sha(image)),
            ],
            env={**os.environ, abslots.CRASH_ENV: crash},
            capture_output=True,
            check=False,
        )

    def boot(self, *, crash: str = "") -> subprocess.CompletedProcess[bytes]:
        """The installed bootprep.py, as metropolis-prepare.service runs it."""
        shutil.rmtree(self.run, ignore_errors=True)  # /run is empty at every boot
        script = (
            "import sys\n"
            f"sys.path.insert(0, {self.target.helper_dir!r})\n"
            "import bootprep\n"
            f"bootprep.RUN = {str(self.run)!r}\n"
            "sys.exit(bootprep.main(sys.argv[1], sys.argv[2]))\n"
        )
        return subprocess.run(
            [sys.executable, "-c", script, self.partuuids[0], self.target.cache_dir],
            env={**os.environ, abslots.CRASH_ENV: crash},
            capture_output=True,
            check=False,
        )

    def booted(self) -> dict[str, object]:
        info = json.loads((self.run / abslots.BOOT_INFO).read_bytes())
        assert isinstance(info, dict)
        # The node runs the booted image unpacked: the link names its folder,
        # whose files are the image's; no other image's folder is left.
        cache = Path(self.target.cache_dir)
        folder = cache / str(info["image_sha256"])
        assert os.readlink(self.run / "node") == str(folder)
        assert unpack.complete(str(folder))
        payload = self.images[str(info["image_sha256"])]
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            assert (folder / "site-packages" / "payload").read_bytes() == archive.read("payload")
        assert [p.name for p in cache.iterdir()] == [folder.name]
        assert not (self.run / "image.pyz.tmp").exists()
        return info

    def healthy(self, info: dict[str, object]) -> None:
        """What the node writes once the cluster took its status."""
        (self.run / abslots.HEALTHY).write_text(
            json.dumps({"slot": info["slot"], "image_sha256": info["image_sha256"]})
        )

    def check(self, *, crash: str = "") -> tuple[str, bool]:
        """The boot check in a child process; (outcome, whether it asked for a reboot)."""
        script = (
            "import sys\n"
            f"sys.path.insert(0, {self.target.helper_dir!r})\n"
            "import abslots, bootprep\n"
            "asked = []\n"
            "store = abslots.DeviceStore(bootprep.by_partuuid(sys.argv[1]))\n"
            f"out = abslots.check(store, {str(self.run)!r}, lambda: asked.append(1), poll=0.05)\n"
            "print(out, bool(asked), sep='|')\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, self.partuuids[0]],
            env={**os.environ, abslots.CRASH_ENV: crash},
            capture_output=True,
            check=False,
        )
        if done.returncode:
            return f"killed {done.returncode}", False
        outcome, asked = done.stdout.decode().strip().split("|")
        return outcome, asked == "True"

    def state(self) -> SlotState | None:
        return abslots.DeviceStore(f"{self.device}p1").read()


def _ok(done: subprocess.CompletedProcess[bytes]) -> None:
    assert done.returncode == 0, done.stderr.decode()


@needs_root
def test_an_upgrade_is_tried_kept_and_a_bad_one_goes_back(
    loop: Callable[[int], str], tmp_path: Path
) -> None:
    disk = Disk(loop(40), tmp_path)
    installed = next(iter(disk.images))
    _ok(disk.boot())
    assert disk.booted() == {
        "slot": "a",
        "image_sha256": installed,
        "trial": False,
        "rolled_back_sha256": "",
        "rollback_cause": "",
    }
    assert disk.check() == ("no try", False)
    # An upgrade: slot b written, read back, tried at the next boot only.
    second = disk.image("second")
    staged = disk.stage(second)
    assert staged.stdout.decode().strip() == "b", staged.stderr.decode()
    assert realdisk.sha256_of(f"{disk.device}p3", second.stat().st_size) == disk.sha(second)
    assert (
        Path(disk.target.systemd_root) / "multi-user.target.wants" / abslots.CHECK_UNIT
    ).exists()
    _ok(disk.boot())
    info = disk.booted()
    assert (info["slot"], info["image_sha256"], info["trial"]) == ("b", disk.sha(second), True)
    disk.healthy(info)
    assert disk.check() == ("confirmed", False)
    assert disk.booted()["trial"] is False  # rewritten: the node reports it permanent
    _ok(disk.boot())
    assert (disk.booted()["slot"], disk.booted()["trial"]) == ("b", False)
    # A third image that never comes up healthy: the check asks for a
    # reboot, and the boot after it goes back to b.
    third = disk.image("third")
    assert disk.stage(third).stdout.decode().strip() == "a"
    _ok(disk.boot())
    assert (disk.booted()["slot"], disk.booted()["trial"]) == ("a", True)
    assert disk.check() == ("rebooted", True)
    _ok(disk.boot())
    info = disk.booted()
    assert (info["slot"], info["trial"], info["image_sha256"]) == ("b", False, disk.sha(second))
    assert info["rolled_back_sha256"] == disk.sha(third)
    assert "not confirmed healthy" in str(info["rollback_cause"])
    # A try whose slot reads back wrong at boot: given up at once.
    fourth = disk.image("fourth")
    assert disk.stage(fourth).stdout.decode().strip() == "a"
    with open(f"{disk.device}p2", "r+b") as f:
        f.seek(1000)
        f.write(b"\xde\xad")
    _ok(disk.boot())
    info = disk.booted()
    assert (info["slot"], info["trial"]) == ("b", False)
    assert info["rolled_back_sha256"] == disk.sha(fourth)
    assert "does not match its SHA-256" in str(info["rollback_cause"])
    # A try whose image reads back whole but does not unpack (no entry
    # point): given up at once too, the old slot's folder linked.
    fifth = disk.image("fifth", unpackable=False)
    assert disk.stage(fifth).stdout.decode().strip() == "a"
    _ok(disk.boot())
    info = disk.booted()
    assert (info["slot"], info["trial"]) == ("b", False)
    assert info["rolled_back_sha256"] == disk.sha(fifth)
    assert "not a shiv zipapp" in str(info["rollback_cause"]), info
    assert disk.data() == disk.data_before


@needs_root
@pytest.mark.parametrize(
    ("crash", "tried"),
    [
        ("upgrade-image", False),  # during the slot's write: never pointed at
        ("upgrade-helpers", False),
        ("upgrade-state", False),  # before the state write
        ("upgrade-staged", True),  # after it: the next boot tries the slot
    ],
)
def test_a_staging_cut_anywhere_boots_the_old_slot_or_tries_the_whole_new_one(
    loop: Callable[[int], str], tmp_path: Path, crash: str, tried: bool
) -> None:
    disk = Disk(loop(40), tmp_path)
    installed = next(iter(disk.images))
    second = disk.image("second")
    assert disk.stage(second, crash=crash).returncode == -9
    _ok(disk.boot())
    info = disk.booted()
    want = ("b", disk.sha(second), True) if tried else ("a", installed, False)
    assert (info["slot"], info["image_sha256"], info["trial"]) == want
    assert info["rolled_back_sha256"] == ""  # no half-written slot was ever tried
    # Not tried: a later upgrade writes the slot again and it boots.
    if not tried:
        _ok(disk.stage(second))
        _ok(disk.boot())
        assert (disk.booted()["slot"], disk.booted()["image_sha256"]) == ("b", disk.sha(second))
    assert disk.data() == disk.data_before


@needs_root
@pytest.mark.parametrize(
    ("crash", "next_boot"),
    [
        ("slots-boot-write", ("b", True)),  # the try not consumed yet: tried again
        ("slots-boot-written", ("a", False)),  # consumed, never confirmed: back
    ],
)
def test_a_boot_cut_at_its_write_tries_once_at_most(
    loop: Callable[[int], str], tmp_path: Path, crash: str, next_boot: tuple[str, bool]
) -> None:
    disk = Disk(loop(40), tmp_path)
    _ok(disk.stage(disk.image("second")))
    assert disk.boot(crash=crash).returncode == -9
    _ok(disk.boot())
    info = disk.booted()
    assert (info["slot"], info["trial"]) == next_boot
    assert disk.data() == disk.data_before


@needs_root
@pytest.mark.parametrize(
    ("crash", "healthy"), [("slots-confirm-write", True), ("slots-give-up-write", False)]
)
def test_a_check_cut_at_its_write_goes_back_at_the_next_boot(
    loop: Callable[[int], str], tmp_path: Path, crash: str, healthy: bool
) -> None:
    disk = Disk(loop(40), tmp_path)
    second = disk.image("second")
    _ok(disk.stage(second))
    _ok(disk.boot())
    if healthy:
        disk.healthy(disk.booted())
    assert disk.check(crash=crash)[0] == "killed -9"
    state = disk.state()
    assert state is not None and state.trying == "b" and state.next == "b"
    _ok(disk.boot())
    info = disk.booted()
    assert (info["slot"], info["rolled_back_sha256"]) == ("a", disk.sha(second))
    assert disk.data() == disk.data_before


@needs_root
def test_a_reinstall_forgets_the_slot_state(loop: Callable[[int], str], tmp_path: Path) -> None:
    disk = Disk(loop(40), tmp_path)
    _ok(disk.stage(disk.image("second")))
    assert disk.state() is not None
    image = disk.image("again")
    done = realdisk.install_device(
        disk.device,
        str(image),
        disk.sha(image),
        b"p",
        "198.18.0.7",
        layout=SMALL,
        target=disk.target,
    )
    assert disk.state() is None
    disk.partuuids = done.partitions.partuuids  # a new table
    _ok(disk.boot())
    assert (disk.booted()["slot"], disk.booted()["image_sha256"]) == ("a", disk.sha(image))


@needs_root
def test_staging_refuses_a_second_try_and_a_disk_it_did_not_install(
    loop: Callable[[int], str], tmp_path: Path
) -> None:
    disk = Disk(loop(40), tmp_path)
    _ok(disk.stage(disk.image("second")))
    third = disk.image("third")
    with pytest.raises(UpgradeFailed, match="under way"):
        upgradedevice.stage_device(
            upgradedevice.open_device(disk.device), str(third), disk.sha(third), 30, disk.target
        )
    blank = loop(40)
    with pytest.raises(UpgradeFailed, match=r"holds no installed node|partitions"):
        upgradedevice.open_device(blank)


@needs_root
def test_the_agent_stages_a_request_and_reads_the_outcome_off_the_disk(
    loop: Callable[[int], str], tmp_path: Path
) -> None:
    """The agent's Upgrader on a real disk: the request's image downloaded
    (TLS, digest checked) and written to the inactive slot, reported WRITTEN,
    and not booted (a boot now runs slot A); an agent started anew (a
    restart between the two) activates it when the request says so,
    reported STAGED; after the boots, an agent started anew reports what the
    slot state says (COMMITTED)."""
    from shepherd.agent import wire
    from shepherd.agent.install import Settings
    from tests.shepherd.agent_install import serve_images
    from tests.shepherd.agents import make_tls

    disk = Disk(loop(40), tmp_path)
    agent = tmp_path / "root" / "agent"
    agent.parent.mkdir()
    installed = {"generation": 1, "status": "done", "device": disk.device}
    (agent.parent / "agent.install.json").write_text(json.dumps(installed))
    tls = make_tls(tmp_path / "tls")
    settings = Settings(read_timeout=5.0, download_deadline=30.0, layout=SMALL, target=disk.target)

    def upgrader() -> upgrade.Upgrader:
        return upgrade.Upgrader(
            str(agent),
            endpoint_scheme="https",
            ca_certificate=tls.ca_der,
            settings=settings,
            after_stage="none",
        )

    with serve_images((tls.certfile, tls.keyfile)) as server:
        data = stand_in_image(payload=b"second", size=250_000, unpackable=True)
        digest = server.add(data)
        disk.images[digest] = data  # what booting it must unpack
        image = wire.OSImageRef("https", f"127.0.0.1:{server.port}", "metropolis-node", "",
                                f"sha256:{digest}")  # fmt: skip
        name = os.path.basename(disk.device)
        refused = wire.UpgradeRequest(1, image, 5, "sdz9")
        first = upgrader()
        first.on_answer(refused)
        first.join(60)
        first.on_answer(refused)
        report = first.pending_report()
        assert report is not None and report.state == wire.UPGRADE_FAILED
        assert "not the device this agent installed" in report.detail
        assert server.ranges == []  # refused before any download
        write = wire.UpgradeRequest(2, image, 5, name)
        first.on_answer(write)
        first.join(60)
        first.on_answer(write)
        report = first.pending_report()
    assert report is not None
    assert (report.generation, report.state, report.slot) == (2, wire.UPGRADE_WRITTEN, "b")
    assert realdisk.sha256_of(f"{disk.device}p3", len(data)) == digest
    _ok(disk.boot())  # written, not pointed at: the old slot boots, no try
    assert (disk.booted()["slot"], disk.booted()["trial"]) == ("a", False)
    request = wire.UpgradeRequest(2, image, 5, name, activate=True)
    restarted = upgrader()
    restarted.join(60)
    restarted.on_answer(request)
    restarted.join(60)
    restarted.on_answer(request)
    report = restarted.pending_report()
    assert report is not None
    assert (report.generation, report.state, report.slot) == (2, wire.UPGRADE_STAGED, "b")
    assert len(server.ranges) == 1  # one download: the activation wrote nothing again
    _ok(disk.boot())
    info = disk.booted()
    assert (info["slot"], info["trial"]) == ("b", True)
    disk.healthy(info)
    assert disk.check() == ("confirmed", False)
    again = upgrader()  # the agent after the reboot
    again.on_answer(request)
    report = again.pending_report()
    assert report is not None and report.state == wire.UPGRADE_COMMITTED, report
    assert report.slot == "b"
    assert json.loads((agent.parent / "agent.upgrade.json").read_text())["status"] == "done"
