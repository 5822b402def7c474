"""The demo's final tables: each machine's takeover outcome
(``--takeover-only``), or each machine's (and the first node's) address,
node id, roles and health as the cluster reports them.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from metropolis.owner import NodeRow
from shepherd.demo_cluster import FIRST_NODE_ADDRESS, Seen
from shepherd.demo_takeover import Outcome
from shepherd.localfleet import FleetMachine


def render(results: Sequence[Outcome], ports: dict[str, int]) -> str:
    """One line per machine: its SSH address and its takeover outcome."""
    rows = [("MACHINE", "ADDRESS", "OUTCOME")]
    now = datetime.datetime.now(datetime.UTC)
    for o in results:
        if o.agent_key is not None:
            what = f"agent started, key {o.agent_key.hex()[:16]}..."
            if o.heartbeat_at is not None:
                what += f", heartbeat {(now - o.heartbeat_at).total_seconds():.1f}s ago"
            if o.hardware_report:
                what += ", hardware report stored"
        elif o.failure is not None:
            what = f"failed, retrying after backoff: {o.failure}"
        else:
            what = "pending"
        rows.append((o.provider_id, f"{o.address}:{ports.get(o.provider_id, 22)}", what))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    return "\n".join(f"{a.ljust(widths[0])}  {b.ljust(widths[1])}  {c}" for a, b, c in rows)


def final_table(seen: Seen, by_id: dict[str, FleetMachine], expected: dict[str, bool]) -> str:
    """One line per machine (and the first node): address, node id, roles, health."""
    rows = [("MACHINE", "ADDRESS", "NODE", "ROLES", "HEALTH")]

    def node_columns(row: NodeRow | None) -> tuple[str, str, str]:
        if row is None:
            return "-", "-", "-"
        health = row.health if row.state == "UP" else f"{row.health} ({row.state})"
        return row.node_id, ",".join(row.roles) or "-", health

    by_address = {row.address: row for row in seen.nodes.values()}
    rows.append(
        ("first-node", FIRST_NODE_ADDRESS, *node_columns(by_address.get(FIRST_NODE_ADDRESS)))
    )
    outcome = {o.provider_id: o for o in seen.results}
    for provider_id, machine in by_id.items():
        row = by_address.get(machine.host)
        node, roles, health = node_columns(row)
        if row is None:
            o = outcome.get(provider_id)
            if not expected[provider_id]:
                cause = o.failure if o is not None and o.failure else "not tried yet"
                health = f"no node: not taken over ({cause})"
            elif o is None or o.agent_key is None:
                health = "no node: not taken over yet"
            else:
                health = f"no node: {seen.installs.get(provider_id, 'not installed')}"
        rows.append((provider_id, machine.host, node, roles, health))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(r[:4], widths, strict=True))
        + "  "
        + r[4]
        for r in rows
    )
