"""``bin/demo --stay``: what a person can type against the demo while it stays up.

After the final table a staying demo prints these lines and keeps every
server running (PostgreSQL, the fleet, the first node and the installed
nodes, the web UI) until Ctrl-C or SIGTERM. The commands are the README's,
with the run's BMDB URL, owner key and cluster file filled in, so that
they can be pasted as they are; what they change shows on the web UI's
pages.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path


def look_around(
    *,
    bmdb_url: str,
    machine: str,
    web_urls: Sequence[str],
    cluster_file: Path | None = None,
    owner_key: Path | None = None,
    node: str | None = None,
) -> str:
    """The lines a staying demo prints: the web UI's URLs, then ready-to-paste
    commands on the BMDB at ``bmdb_url`` (``machine`` is the one they act
    on) and, given ``cluster_file`` and ``owner_key``, on the cluster
    (``node`` is the node ``set-roles`` names). Pure: it runs nothing."""
    python = shlex.quote(sys.executable)
    bmdb = f"{python} -m bmdb --url {shlex.quote(bmdb_url)}"
    lines = ["", "The demo stays up until Ctrl-C (or SIGTERM). Look around:"]
    for url in web_urls:
        lines.append(f"  web UI:  {url}")
    lines += [
        f"  {bmdb} machines",
        f"  {bmdb} machine {machine}",
        f'  {bmdb} hold {machine} --reason "a look around"',
        f'  {bmdb} release {machine} --reason "done looking"',
        f'  {bmdb} decommission {machine} --reason "end of the demo"',
    ]
    if cluster_file is not None and owner_key is not None:
        owner = (
            f"{python} -m metropolis owner --cluster {shlex.quote(str(cluster_file))}"
            f" --owner-key {shlex.quote(str(owner_key))}"
        )
        lines.append(f"  {owner} nodes")
        if node is not None:
            lines.append(f"  {owner} set-roles {node} --kubernetes-controller on")
    return "\n".join(lines) + "\n"
