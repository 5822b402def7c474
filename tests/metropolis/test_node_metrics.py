"""``node ... --metrics-listen``: three node processes with real etcd, scraped
before and after the leading curator's node is killed.

Before: the leader says it leads, with its term; the others name it as
their leader; etcd, the RPC servers, the role server, the supervisor and
the status push have their samples. After SIGKILL of the leader's node: a
survivor leads, both survivors name it and count a leader change, and the
exposition still parses.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from common.net import free_loopback_port
from metropolis import pki
from metropolis.owner import open_owner
from metropolis.roleserve import disk
from tests.metropolis.test_cluster import ADDRESSES, _curators, _form, _until, three_nodes

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _parse(text: str) -> Samples:
    """Every sample by (name, labels); raises if the text is not valid exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _leader(samples: Samples) -> str | None:
    """The node ID of the leading curator this node's curator names."""
    named = [
        dict(labels)["node_id"]
        for (name, labels), v in samples.items()
        if name == "metropolis_curator_leader" and v == 1
    ]
    assert len(named) <= 1, named
    return named[0] if named else None


async def _scrape(client: httpx.AsyncClient, address: str, port: int) -> Samples:
    response = await client.get(f"http://{address}:{port}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return _parse(response.text)


async def test_a_scrape_during_a_leader_failover_shows_the_leader_change(tmp_path: Path) -> None:
    port = free_loopback_port()
    with trio.fail_after(150):
        async with (
            three_nodes(tmp_path, metrics_port=port) as (procs, roots, owner_key),
            httpx.AsyncClient() as http,
        ):
            key = pki.decode_private_key(owner_key.read_bytes())
            async with open_owner(roots[0], key) as owner:
                await _form(owner, roots[0])
                await _until(lambda: _curators(owner, 3))
            ids = [disk.load(root).credentials.node_id for root in roots]  # type: ignore[union-attr]

            async def everyone_names_n1() -> bool:
                for address in ADDRESSES:
                    if _leader(await _scrape(http, address, port)) != ids[0]:
                        return False
                return True

            await _until(everyone_names_n1)
            before = [await _scrape(http, address, port) for address in ADDRESSES]
            n1, n2, n3 = before
            assert _value(n1, "metropolis_curator_is_leader") == 1
            term = _value(n1, "metropolis_curator_term")
            assert term is not None and term > 0
            for follower in (n2, n3):
                assert _value(follower, "metropolis_curator_is_leader") == 0
                assert _value(follower, "metropolis_curator_term") is None
                # Granting ConsensusMember started their control planes.
                assert (
                    _value(follower, "metropolis_control_plane_decisions_total", decision="start")
                    == 1
                )
            for samples in before:
                assert _value(samples, "metropolis_etcd_up") == 1
                assert _value(samples, "metropolis_etcd_has_leader") == 1
                assert _value(samples, "metropolis_etcd_is_learner") == 0
                assert _value(samples, "metropolis_etcd_apply_lag_entries") is not None
                assert (_value(samples, "metropolis_etcd_raft_term") or 0) > 0
                assert (_value(samples, "metropolis_etcd_leader_changes_seen_total") or 0) >= 1
                assert _value(samples, "metropolis_curator_running") == 1
                assert _value(samples, "metropolis_control_plane_running") == 1
                assert _value(samples, "metropolis_curator_leader_changes_total") == 0
                age = _value(samples, "metropolis_status_push_age_seconds")
                assert age is not None and 0 <= age < 10
                assert (_value(samples, "metropolis_status_pushes_total", outcome="ok") or 0) >= 1
            # Exactly one etcd leader among the three.
            assert sum(_value(s, "metropolis_etcd_is_leader") or 0 for s in before) == 1
            # The leader's API answered the nodes' status pushes.
            calls = {
                dict(labels)["method"]
                for (name, labels), _ in n1.items()
                if name == "metropolis_rpc_calls_total" and dict(labels)["server"] == "curator"
            }
            assert any(m.endswith("/UpdateNodeStatus") for m in calls), calls
            method = next(m for m in calls if m.endswith("/UpdateNodeStatus"))
            assert (
                _value(n1, "metropolis_rpc_calls_total", server="curator", method=method, code="OK")
                or 0
            ) >= 3
            assert (
                _value(
                    n1,
                    "metropolis_rpc_call_duration_seconds_count",
                    server="curator",
                    method=method,
                )
                or 0
            ) >= 3
            # Granting ConsensusMember restarted their launchers on request.
            launcher = "root.role.controlplane.launcher"
            for follower in (n2, n3):
                restarts = _value(
                    follower,
                    "metropolis_supervisor_restarts_total",
                    runnable=launcher,
                    reason="request",
                )
                assert (restarts or 0) >= 1
            etcd_changes = [_value(s, "metropolis_etcd_leader_changes_seen_total") for s in before]

            # Kill the leader's node: a survivor takes over.
            procs[0].process.send_signal(signal.SIGKILL)

            async def failed_over() -> bool:
                seen = []
                for address in ADDRESSES[1:]:
                    samples = await _scrape(http, address, port)
                    seen.append(samples)
                leaders = {_leader(s) for s in seen}
                if len(leaders) != 1 or None in leaders or ids[0] in leaders:
                    return False
                return all(
                    (_value(s, "metropolis_curator_leader_changes_total") or 0) >= 1
                    and _value(s, "metropolis_etcd_has_leader") == 1
                    for s in seen
                )

            await _until(failed_over)
            after = [await _scrape(http, address, port) for address in ADDRESSES[1:]]
            [new_leader] = {_leader(s) for s in after}
            assert new_leader in ids[1:]
            leading = after[ids.index(new_leader) - 1]
            assert _value(leading, "metropolis_curator_is_leader") == 1
            new_term = _value(leading, "metropolis_curator_term")
            assert new_term is not None and new_term > term
            assert _value(leading, "metropolis_curator_elections_won_total") == 1
            for i, samples in enumerate(after, 1):
                assert _value(samples, "metropolis_curator_leader_changes_total") == 1
                assert _value(samples, "metropolis_etcd_up") == 1
                if _value(n1, "metropolis_etcd_is_leader") == 1:
                    # etcd's leader died with the node: its members elected another.
                    seen = _value(samples, "metropolis_etcd_leader_changes_seen_total") or 0
                    assert seen > (etcd_changes[i] or 0)
