"""``bin/demo --real-machines``: Ctrl-C in the middle of an install stops every
machine and detaches every loop device; with ``--upgrade`` the demo's
cluster moves to a second image and its table shows each node's slot and
image.

The demo runs as an operator runs it, in a session of its own (as a
terminal's foreground job), and gets SIGINT in its process group once its
machine is asked to install. It ends with its one line and exit status
130, and leaves nothing: no process under its folder, no loop device of
its disks, no namespace or bridge, no mount, the folder itself removed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from metropolis.image.variant import release_variant
from shepherd.demo_real import SECOND_RELEASE
from tests.fixtures.image import IMAGE_CACHE
from tests.fixtures.install_rig import processes_under
from tests.shepherd.nspawn.fleet_thread import skip_unless_possible
from tests.shepherd.nspawn.netids import link_id, namespaces

BOUND = 300


def _slot_network(slot: str) -> set[tuple[str, int]]:
    """Slot ``slot``'s bridge and network namespaces now, by name and identity
    (another run may claim the slot, and its names, once it is free)."""
    bridge = f"mtbr{slot}"
    found = {(bridge, index)} if (index := link_id(bridge)) is not None else set()
    return found | set(namespaces(f"mt{slot}-").items())


def _loop_files() -> set[str]:
    found = set()
    for backing in Path("/sys/class/block").glob("loop*/loop/backing_file"):
        found.add(backing.read_text().strip())
    return found


def test_ctrl_c_during_an_install_stops_every_machine_and_detaches_every_loop_device(
    node_image: Path,
) -> None:
    skip_unless_possible()
    assert node_image.parent.parent == IMAGE_CACHE  # the demo reuses this build
    base = Path(tempfile.mkdtemp(prefix="rd-", dir="/tmp"))
    base.chmod(0o711)  # PostgreSQL runs as its own user below it
    workdir = base / "w"
    demo = subprocess.Popen(
        [
            sys.executable, "-m", "shepherd.demo", "--real-machines", "--machines", "1",
            "--workdir", str(workdir), "--image-cache", str(IMAGE_CACHE),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    asked = threading.Event()

    def read() -> None:
        assert demo.stderr is not None
        for line in demo.stderr:
            lines.append(line)
            if "progress: install requested" in line:
                asked.set()
        asked.set()  # it ended: the test fails below, with its output

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert asked.wait(BOUND) and demo.poll() is None, "".join(lines[-30:])
        during = [f for f in _loop_files() if f.startswith(str(workdir))]
        assert len(during) == 1, "".join(lines[-30:])  # its machine's disk, attached
        slot = next(m for m in map(re.compile(r"network slot (\d+):").search, lines) if m)[1]
        network = _slot_network(slot)
        assert f"mtbr{slot}" in {name for name, _ in network}  # its bridge
        os.killpg(demo.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        assert demo.wait(BOUND) == 130, "".join(lines[-30:])
        reader.join(10)
        assert re.search(
            r"interrupted; the nodes, the fleet, the Shepherd and PostgreSQL", lines[-1]
        )
        assert not [f for f in _loop_files() if f.startswith(str(workdir))]
        # Its bridge and namespaces are gone (those of the slot now, if
        # any, are another run's).
        assert not network & _slot_network(slot)
        assert processes_under(workdir) == []
        mounts = Path("/proc/mounts").read_text()
        assert str(workdir) not in mounts
        assert not workdir.exists()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_real_machines_take_none_of_the_loopback_demos_knobs() -> None:
    for knob in (["--broken", "1"], ["--takeover-only"], ["--stay"]):
        done = subprocess.run(
            [sys.executable, "-m", "shepherd.demo", "--real-machines", *knob],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "--real-machines takes no --broken, --takeover-only, --web or --stay" in done.stderr


def test_the_demo_upgrades_its_cluster_and_shows_each_node_s_slot_and_image(
    node_image: Path, tmp_path: Path
) -> None:
    skip_unless_possible()
    second = release_variant(node_image, SECOND_RELEASE, tmp_path).name.removesuffix(".pyz")
    base = Path(tempfile.mkdtemp(prefix="rd-", dir="/tmp"))
    base.chmod(0o711)  # PostgreSQL runs as its own user below it
    try:
        done = subprocess.run(
            [
                sys.executable, "-m", "shepherd.demo", "--real-machines", "--upgrade",
                "--workdir", str(base / "w"), "--image-cache", str(IMAGE_CACHE),
            ],
            capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)
    said = done.stderr
    assert done.returncode == 0, said[-3000:]
    # The worker first, then the two consensus members, each to slot B.
    upgraded = re.findall(r"progress: (machine-\d): upgraded: slot B runs sha256:(\w+)", said)
    assert [m for m, _ in upgraded][:1] == ["machine-2"], said[-3000:]
    assert sorted(m for m, _ in upgraded) == ["machine-0", "machine-1", "machine-2"]
    assert {d for _, d in upgraded} == {second}
    assert f"every node runs sha256:{second[:12]} from its slot B, permanent" in said
    table = done.stdout.splitlines()
    assert table[0].split()[-2:] == ["IMAGE", "SLOT"]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    for machine in ("machine-0", "machine-1"):  # machine-2 is decommissioned after
        assert rows[machine][-2:] == [second[:12], "B"], table
