"""What a node runs: its image's digest and its disk slot, in its status and the owner's table.

The unit tests pin the boot info file's strict parse and what the status
carries. The real test runs a node from the session's built image (the
digest then comes from the file the node runs from) with ``--boot-info``
and ``--announce-healthy``, reads ``owner nodes``, and sees a try turn
permanent when the boot info is rewritten, as the boot check does.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from metropolis.proto import curator_api as c
from metropolis.proto.common import (
    NodeRoles,
    NodeRolesConsensusMember,
    NodeStatus,
    NodeStatusRunningCurator,
    NodeStatusRunningImage,
    NodeStatusRunningImageSlot,
)
from metropolis.roleserve import bootinfo
from metropolis.roleserve.bootcheck import announcement, healthy
from metropolis.roleserve.bootinfo import BootInfoError, RunningImageSource, parse_boot_info
from tests.metropolis.test_node_cli import BOUND, LEADS, NodeProcess, bootstrap_args

HEX = "ab" * 32
OTHER = "cd" * 32


def test_the_parser_names_the_node_s_environment_variables() -> None:
    """The command line's copies (it imports no node module) are the node's names."""
    from metropolis import __main__ as cli

    assert cli.BOOT_INFO_ENV == bootinfo.BOOT_INFO_ENV
    assert cli.ANNOUNCE_HEALTHY_ENV == bootinfo.ANNOUNCE_HEALTHY_ENV


def _info(**fields: object) -> bytes:
    base: dict[str, object] = {"slot": "b", "image_sha256": HEX, "trial": True}
    base.update(fields)
    return json.dumps(base).encode()


def test_a_boot_info_parses_to_its_fields() -> None:
    info = parse_boot_info(_info(rolled_back_sha256=OTHER, rollback_cause="no\x1bpe"))
    assert (info.slot, info.image_sha256, info.trial) == ("b", HEX, True)
    assert info.rolled_back_sha256 == OTHER
    assert info.rollback_cause == "no?pe"  # a control character is not carried


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"{", "not JSON"),
        (b"[]", "not a JSON object"),
        (_info(slot="c"), "slot 'c'"),
        (_info(slot=None), "slot None"),
        (_info(image_sha256=HEX.upper()), "image_sha256"),
        (_info(image_sha256=HEX[:-1]), "image_sha256"),
        (_info(trial="yes"), "trial"),
        (_info(rolled_back_sha256="x"), "rolled_back_sha256"),
        (_info(rollback_cause=3), "rollback_cause"),
        (b" " * 20000, "over the bound"),
    ],
)
def test_a_boot_info_that_is_not_what_the_boot_writes_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(BootInfoError, match=why):
        parse_boot_info(data)


def test_the_image_file_is_the_truth_and_a_bad_boot_info_is_slot_none(tmp_path: Path) -> None:
    image = tmp_path / "image.pyz"
    image.write_bytes(b"the node image")
    digest = hashlib.sha256(b"the node image").hexdigest()
    info = tmp_path / "boot.json"
    source = RunningImageSource(info, image=str(image))
    # No boot info yet: the digest, slot none.
    assert source.read_sync() == NodeStatusRunningImage(digest=f"sha256:{digest}")
    info.write_bytes(_info(image_sha256=digest))
    got = source.read_sync()
    assert (got.digest, got.slot, got.trial) == (
        f"sha256:{digest}",
        NodeStatusRunningImageSlot.B,
        True,
    )
    # A boot info naming another image: the file's own digest is reported.
    info.write_bytes(_info(slot="a", trial=False))
    got = source.read_sync()
    assert got.digest == f"sha256:{digest}" and got.slot == NodeStatusRunningImageSlot.A
    info.write_bytes(b"garbage")
    assert source.read_sync() == NodeStatusRunningImage(digest=f"sha256:{digest}")
    # From source, no image: the digest is the boot info's.
    info.write_bytes(_info())
    assert RunningImageSource(info, image=None).read_sync().digest == f"sha256:{HEX}"


def test_an_unpacked_image_is_known_by_its_folder_s_name(tmp_path: Path) -> None:
    """A node run from the image unpacked (``python3 /run/metropolis/node``,
    a link to the folder named by the image's SHA-256) reports that digest,
    not a boot info's; a folder of another name reports none of its own."""
    digest = hashlib.sha256(b"the node image").hexdigest()
    folder = tmp_path / "images" / digest
    folder.mkdir(parents=True)
    (folder / "__main__.py").write_text("")
    link = tmp_path / "node"
    link.symlink_to(folder)
    info = tmp_path / "boot.json"
    info.write_bytes(_info(slot="a", trial=False))  # names HEX, another image
    got = RunningImageSource(info, image=str(link)).read_sync()
    assert (got.digest, got.slot) == (f"sha256:{digest}", NodeStatusRunningImageSlot.A)
    other = tmp_path / "not-a-digest"
    other.mkdir()
    assert RunningImageSource(info, image=str(other)).read_sync().digest == f"sha256:{HEX}"
    assert RunningImageSource(None, image=str(other)).read_sync().digest == ""


def _accepted(*, curator: bool, image: bool = True) -> c.UpdateNodeStatusRequest:
    return c.UpdateNodeStatusRequest(
        node_id="metropolis-x",
        status=NodeStatus(
            external_address="10.0.0.1",
            running_curator=NodeStatusRunningCurator(port=1) if curator else None,
            image=NodeStatusRunningImage(digest=f"sha256:{HEX}", slot=NodeStatusRunningImageSlot.B)
            if image
            else None,
        ),
    )


def test_a_consensus_member_is_healthy_only_with_its_curator_running() -> None:
    member = NodeRoles(consensus_member=NodeRolesConsensusMember())
    assert not healthy(_accepted(curator=False), member)
    assert healthy(_accepted(curator=True), member)
    assert healthy(_accepted(curator=False), NodeRoles())
    assert healthy(_accepted(curator=False), None)
    assert not healthy(_accepted(curator=True, image=False), member)
    assert json.loads(announcement(_accepted(curator=True))) == {
        "node_id": "metropolis-x",
        "image_sha256": HEX,
        "slot": "b",
        "trial": False,
    }


async def _owner_table(tmp_path: Path) -> list[list[str]]:
    result = await trio.run_process(
        [
            *(sys.executable, "-m", "metropolis", "owner", "--root", str(tmp_path / "n")),
            *("--owner-key", str(tmp_path / "owner.pem"), "nodes"),
        ],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stdout.decode().splitlines()
    assert lines[0].split()[-3:] == ["IMAGE", "SLOT", "ROLES"], lines[0]
    return [
        line.replace(" ago", "_ago").split() for line in lines[1:] if line.startswith("metropolis-")
    ]


@pytest.mark.parametrize("unpacked", [False, True], ids=["zipapp", "unpacked"])
async def test_a_node_from_the_image_reports_its_digest_and_slot(
    node_image: Path, tmp_path: Path, unpacked: bool
) -> None:
    digest = node_image.name.removesuffix(".pyz")
    info = tmp_path / "run" / "boot.json"
    info.parent.mkdir()
    runs = str(node_image)
    if unpacked:  # as an installed node runs it: the boot helper's link
        from shepherd.agent import unpack

        folder = unpack.ensure(str(node_image), digest, str(tmp_path / "run" / "images"))
        (tmp_path / "run" / "node").symlink_to(folder)
        runs = str(tmp_path / "run" / "node")
    info.write_bytes(_info(image_sha256=digest))
    healthy_file = tmp_path / "run" / "healthy.json"
    process = await trio.lowlevel.open_process(
        [
            *(sys.executable, runs, "node", *bootstrap_args(tmp_path)),
            *("--status-interval", "0.3", "--boot-info", str(info)),
            *("--announce-healthy", str(healthy_file)),
        ],
        stderr=subprocess.PIPE,
        env={**os.environ, "SHIV_ROOT": str(tmp_path / "shiv")},
    )
    proc = NodeProcess(process)
    try:
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(proc.pump)
                await proc.wait_for(LEADS)
                await proc.wait_for("announced healthy")
                said = json.loads(healthy_file.read_bytes())
                assert said["image_sha256"] == digest and said["slot"] == "b", said
                assert said["trial"] is True and said["node_id"].startswith("metropolis-")
                [row] = await _owner_table(tmp_path)
                assert row[7:9] == [digest[:12], "B:trial"], row
                # The try made permanent (the boot check rewrites the file):
                # the next pushes say so, without a restart.
                info.write_bytes(_info(image_sha256=digest, trial=False))
                while (row := (await _owner_table(tmp_path))[0])[8] != "B":  # noqa: ASYNC110
                    await trio.sleep(0.2)  # another process's state: polled
                assert row[7] == digest[:12]
                process.terminate()
                await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
