"""``python -m shepherd install``'s command line: its parser, and the checks of
single values (a machine id, a count, a ticket, an owner key, a device name).

Apart from :mod:`shepherd.install` (which checks the options together,
then asks the image server and the BMDB) so that ``install --help`` and a
usage error import neither (``tests/test_cli_imports.py``).
"""

from __future__ import annotations

import argparse
import re
import uuid
from pathlib import Path

from bmdb.model.rows import STATE_FILTERS
from common.exitcodes import show_in_help

__all__ = [
    "EXAMPLES",
    "MAX_KEY_FILE",
    "MAX_TICKET",
    "build_parser",
    "owner_public_key",
    "valid_device_name",
]

#: Largest owner key file read.
MAX_KEY_FILE = 1 << 16

#: Longest register ticket accepted, bytes (ours are 32).
MAX_TICKET = 1024

_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def owner_public_key(data: bytes, source: str) -> bytes:
    """The raw Ed25519 public key of the owner from a key file's bytes: a
    PEM private key (``owner.pem``, whose public half is taken), a PEM
    public key, 32 raw bytes, or 64 hex digits. ValueError otherwise."""
    # Imported here, when a key is read: --help needs no cryptography.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    if data.lstrip().startswith(b"-----BEGIN"):
        if b"PRIVATE KEY" in data:
            try:
                private = serialization.load_pem_private_key(data, password=None)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{source}: not a usable private key: {e}") from e
            if not isinstance(private, Ed25519PrivateKey):
                raise ValueError(f"{source}: not an Ed25519 key ({type(private).__name__})")
            public = private.public_key()
        else:
            try:
                loaded = serialization.load_pem_public_key(data)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{source}: not a usable public key: {e}") from e
            if not isinstance(loaded, Ed25519PublicKey):
                raise ValueError(f"{source}: not an Ed25519 key ({type(loaded).__name__})")
            public = loaded
        return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if len(data) == 32:
        return data
    text = data.strip()
    if re.fullmatch(rb"[0-9a-fA-F]{64}", text):
        return bytes.fromhex(text.decode())
    raise ValueError(
        f"{source}: not an owner key (want a PEM Ed25519 private or public key, "
        "32 raw bytes or 64 hex digits)"
    )


def valid_device_name(name: str) -> bool:
    """Whether ``name`` can name a root device: a plain name, never a path."""
    return _DEVICE.fullmatch(name) is not None and ".." not in name


EXAMPLES = """\
examples:
  # the cluster's side, as its owner
  python -m metropolis owner --root NODE_ROOT --owner-key owner.pem info --out cluster.pb
  TICKET=$(python -m metropolis owner --root NODE_ROOT --owner-key owner.pem ticket)

  # what would be asked of two machines, without writing anything
  python -m shepherd install --bmdb-url postgresql:///bmdb \\
      --machine 6f1c2a3e-0000-4000-8000-000000000001 \\
      --machine 6f1c2a3e-0000-4000-8000-000000000002 \\
      --cluster-info cluster.pb --ticket "$TICKET" --owner-public-key owner.pem \\
      --image-url https://127.0.0.1:7443/images/sha256/<64 hex> \\
      --image-server-ca ca.pem --root-device disk0 --dry-run

  # three heartbeating machines, the image given by server and digest
  python -m shepherd install --bmdb-url postgresql:///bmdb \\
      --state heartbeating --count 3 \\
      --cluster-info cluster.pb --ticket "$TICKET" --owner-public-key owner.pem \\
      --image-server https://bmaas.example:7443 --image-digest sha256:<64 hex> \\
      --root-device disk0

The cluster info file is what 'python -m metropolis owner info --out FILE'
writes; the ticket what 'python -m metropolis owner ticket' prints. Exit
status: 0 if every chosen machine got its request, 1 if any was refused
(the others are still written) or the run was refused as a whole, 2 for a
bad option.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shepherd install",
        description="Ask machines' agents to install the Metropolis node image and register\n"
        "the node into a cluster: writes one OS installation request per machine, with\n"
        "the generation after its last, into the BMDB, in one transaction.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show_in_help(parser)
    parser.add_argument(
        "--bmdb-url", required=True, metavar="URL", help="libpq URL of the BMDB (migrated)"
    )
    choose = parser.add_argument_group("machines (either --machine, or --state with --count)")
    choose.add_argument(
        "--machine",
        action="append",
        default=[],
        type=_uuid,
        metavar="ID",
        help="a machine id (as 'python -m bmdb machines' lists); repeat for more",
    )
    choose.add_argument(
        "--state",
        choices=STATE_FILTERS,
        metavar="STATE",
        help="choose machines in this state, as 'python -m bmdb machines --state' takes "
        f"({', '.join(STATE_FILTERS)}), oldest first",
    )
    choose.add_argument(
        "--count", type=_positive, metavar="N", help="how many machines in --state, at most"
    )
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument(
        "--cluster-info",
        required=True,
        type=Path,
        metavar="FILE",
        help="the cluster's CA and directory, as 'python -m metropolis owner info --out FILE' "
        "writes them",
    )
    cluster.add_argument(
        "--ticket",
        required=True,
        type=_ticket,
        metavar="HEX",
        help="the register ticket, as 'python -m metropolis owner ticket' prints it",
    )
    cluster.add_argument(
        "--owner-public-key",
        required=True,
        type=_owner_key,
        metavar="FILE",
        help="the cluster owner's key: the owner's private key file (owner.pem; only its "
        "public half is used), a PEM public key, 32 raw bytes or 64 hex digits",
    )
    image = parser.add_argument_group(
        "image (either --image-url, or --image-server with --image-digest)"
    )
    image.add_argument(
        "--image-url",
        metavar="URL",
        help="https://HOST:PORT/images/sha256/<64 hex>: the node image "
        "('python -m metropolis image build' names it by its SHA-256)",
    )
    image.add_argument(
        "--image-server", metavar="URL", help="https://HOST:PORT of the image server"
    )
    image.add_argument("--image-digest", metavar="sha256:HEX", help="the image's SHA-256")
    image.add_argument(
        "--image-server-ca",
        type=Path,
        metavar="FILE",
        help="PEM CA certificate(s) the image server's certificate is checked against "
        "(default: the system's CAs); the agents check it against their endpoint's CA",
    )
    image.add_argument(
        "--insecure-plain-http",
        action="store_true",
        help="allow an http:// image server (the digest still guards the image)",
    )
    parser.add_argument(
        "--root-device",
        required=True,
        type=_device,
        metavar="NAME",
        help="the disk to install on, one the machine's hardware report lists (a block "
        "device's serial number; a loopback disk's folder name), e.g. disk0",
    )
    parser.add_argument(
        "--reinstall",
        action="store_true",
        help="also machines installed at their current generation, or still installing it",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="say what would be written; write nothing"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def _uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a machine id (UUID): {text[:100]!r}") from None


def _positive(text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 0 < int(text) <= 1_000_000:
        raise argparse.ArgumentTypeError(f"want a count from 1 to 1000000, got {text[:100]!r}")
    return int(text)


def _ticket(text: str) -> bytes:
    text = text.strip()
    if not re.fullmatch(r"(?:[0-9a-fA-F]{2})+", text) or len(text) > 2 * MAX_TICKET:
        raise argparse.ArgumentTypeError(
            f"want the ticket as hex (from 'metropolis owner ticket'), at most {MAX_TICKET} bytes"
        )
    return bytes.fromhex(text)


def _owner_key(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror or e}") from e
    if len(data) > MAX_KEY_FILE:
        raise argparse.ArgumentTypeError(f"{path}: over {MAX_KEY_FILE} bytes, not a key")
    try:
        return owner_public_key(data, path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _device(name: str) -> str:
    if not valid_device_name(name):
        raise argparse.ArgumentTypeError(
            f"{name[:100]!r} is not a device name (letters, digits, '.', '_', '-'; no path)"
        )
    return name
