"""An SSH public key as operators compare it: its ``SHA256:`` fingerprint.

The BMDB keeps a machine's host key in SSH wire format (RFC 4253 section
6.6, what ``ssh -v`` and ``ssh-keygen -l`` hash); `fingerprint` is the text
``ssh-keygen -l`` prints for it, so an operator can compare the two by eye.
"""

from __future__ import annotations

import base64
import hashlib

__all__ = ["fingerprint"]


def fingerprint(wire_key: bytes) -> str:
    """``SHA256:`` and the unpadded base64 of the SHA-256 of ``wire_key``
    (OpenSSH's default fingerprint). Any bytes are hashed: a key that is
    not well formed still gets a fingerprint to compare, never an error."""
    digest = hashlib.sha256(wire_key).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")
