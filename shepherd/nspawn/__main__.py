"""``python -m shepherd.nspawn up --machines N``: a fleet of nspawn machines
for an operator to try, until Ctrl-C.

Prints one JSON line per machine once every machine's sshd answers
(``name``, ``address``, ``ssh``: the command to log in, ``bmc``: its Redfish
system URL), then one line with the BMC's credentials and ``ready``. Ctrl-C
(or SIGTERM) stops every machine and removes what the fleet made (loop
devices, bridge, namespaces); the folder with the machines' disks and roots
stays. Needs root.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

import trio

from common.cli import run_main
from shepherd.errors import ShepherdError
from shepherd.nspawn.fleet import DEFAULT_DISK_SIZE, open_fleet
from shepherd.ssh_key import SSHKey, load_or_create_ssh_key


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shepherd.nspawn")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="bring up a fleet until Ctrl-C")
    up.add_argument("--machines", type=int, default=3, help="how many (default 3)")
    up.add_argument(
        "--folder",
        type=Path,
        default=None,
        help="the machines' disks and roots (default: a new temp folder)",
    )
    up.add_argument(
        "--key",
        type=Path,
        default=None,
        help="an SSH private key whose public half the machines accept "
        "(created if missing; default: FOLDER/id_ed25519)",
    )
    up.add_argument("--disk-size", type=int, default=DEFAULT_DISK_SIZE, help="bytes per disk")
    return parser


async def _up(args: argparse.Namespace, folder: Path, key_path: Path, key: SSHKey) -> int:
    async with open_fleet(
        folder,
        count=args.machines,
        authorized_keys=[key.authorized_key],
        disk_size=args.disk_size,
    ) as fleet:
        for index, machine in enumerate(fleet.machines):
            line = {
                "name": machine.spec.hostname,
                "address": fleet.address(index),
                "ssh": f"ssh -i {key_path} root@{fleet.address(index)}",
                "bmc": fleet.system_url(index),
            }
            print(json.dumps(line), flush=True)
        print(
            json.dumps(
                {
                    "bmc_username": fleet.bmc_username,
                    "bmc_password": fleet.bmc_password,
                    "host_address": fleet.host_address,
                    "folder": str(folder),
                }
            ),
            flush=True,
        )
        print("ready", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"), stream=sys.stderr)
    if os.geteuid() != 0:
        print("python -m shepherd.nspawn: error: needs root", file=sys.stderr)
        return 1

    def body() -> int:
        folder: Path = args.folder or Path(tempfile.mkdtemp(prefix="nspawn-fleet-"))
        folder.mkdir(parents=True, exist_ok=True)
        key_path: Path = args.key or folder / "id_ed25519"
        key = load_or_create_ssh_key(key_path)
        return trio.run(_up, args, folder, key_path, key)

    return run_main("python -m shepherd.nspawn", body, known=(ShepherdError,))


if __name__ == "__main__":
    sys.exit(main())
