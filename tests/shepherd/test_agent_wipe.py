"""``agent --wipe`` on its own: what it stops, what it removes, what it
leaves alone, and that a second run wipes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shepherd.agent.wipe import wipe
from shepherd.agent_bundle import agent_zipapp


def _sleeper(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)", *argv], start_new_session=True
    )


def test_wipe_stops_only_its_own_processes_and_is_idempotent(tmp_path: Path) -> None:
    agent = tmp_path / "agent"
    agent.write_bytes(agent_zipapp())
    agent.chmod(0o755)
    disk = tmp_path / "disks" / "disk0"
    disk.mkdir(parents=True)
    (disk / "image.pyz").write_bytes(b"image")
    (disk / "metropolis").mkdir()
    (disk / "metropolis" / "secret").write_bytes(b"s")
    (tmp_path / "agent.key").write_bytes(b"k" * 32)
    (tmp_path / "agent.log").write_text("what happened\n")
    # A node from the disk's image, and the agent's pid file naming a
    # process that is NOT this agent (a recycled pid): only the node stops.
    node = _sleeper(str(disk / "image.pyz"))
    stranger = _sleeper("not-the-agent")
    (disk / "node.pid").write_text(f"{node.pid}\n")
    (tmp_path / "agent.pid").write_text(f"{stranger.pid}\n")
    try:
        result = subprocess.run(
            [sys.executable, str(agent), "--wipe"], capture_output=True, check=False, timeout=60
        )
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["stopped"] == [node.pid] and report["errors"] == []
        assert sorted(report["wiped"]) == sorted(
            str(p)
            for p in (
                disk / "image.pyz",
                disk / "metropolis",
                disk / "node.pid",
                tmp_path / "agent.key",
                tmp_path / "agent.pid",
            )
        )
        assert node.wait(timeout=10) != 0
        assert stranger.poll() is None
        assert disk.is_dir() and list(disk.iterdir()) == []
        assert (tmp_path / "agent.log").read_text() == "what happened\n"
        assert agent.exists()
        # Nothing left to wipe: an empty report, and success.
        assert wipe(str(agent)) == {"wiped": [], "stopped": [], "errors": [], "steps": []}
    finally:
        for p in (node, stranger):
            if p.poll() is None:
                p.kill()
            p.wait()
