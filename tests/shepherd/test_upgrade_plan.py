"""The rolling upgrade's order and gate over node tables as the owner reads them."""

from __future__ import annotations

from metropolis.owner import NodeRow
from shepherd.upgrade_plan import Verdict, gate, phase, upgraded, went_back

NEW = "sha256:" + "e" * 64
OLD = "sha256:" + "0" * 64


def node(
    n: int,
    *,
    voter: bool = False,
    leader: bool = False,
    health: str = "HEALTHY",
    image: str = OLD,
    trial: bool = False,
) -> NodeRow:
    return NodeRow(
        node_id=f"metropolis-{n:032x}",
        public_key=bytes([n]) * 32,
        address=f"10.0.0.{n}",
        state="UP",
        roles=("ConsensusMember",) if voter else (),
        curator=voter,
        leader=leader,
        health=health,
        etcd="voter" if voter else "none",
        image=image,
        slot="A",
        trial=trial,
    )


def _gate(target: NodeRow, rows: list[NodeRow], **kw: object) -> tuple[Verdict, str]:
    args: dict[str, object] = {
        "in_flight": (),
        "max_unavailable": 1,
        "earlier_not_done": 0,
        "consensus_not_done": 0,
    }
    args.update(kw)
    d = gate(target, rows, **args)  # type: ignore[arg-type]
    return d.verdict, d.why


def test_phases_workers_then_members_then_the_leader() -> None:
    assert [
        phase(node(1)),
        phase(node(2, voter=True)),
        phase(node(3, voter=True, leader=True)),
    ] == [
        0,
        1,
        2,
    ]


def test_a_worker_goes_while_nothing_else_is_down() -> None:
    rows = [node(1, voter=True, leader=True), node(2, voter=True), node(3, voter=True), node(4)]
    assert _gate(rows[3], rows)[0] is Verdict.GO


def test_never_more_nodes_down_than_allowed() -> None:
    rows = [node(1, voter=True, leader=True), node(2), node(3), node(4, health="HEARTBEAT_TIMEOUT")]
    verdict, why = _gate(rows[1], rows)
    assert verdict is Verdict.WAIT and "metropolis-" in why and "at most 1" in why
    assert _gate(rows[1], rows, max_unavailable=2)[0] is Verdict.GO
    # One being upgraded counts as down too.
    verdict, _ = _gate(rows[1], rows, max_unavailable=2, in_flight=[rows[2].node_id])
    assert verdict is Verdict.WAIT


def test_a_member_waits_for_the_workers_and_any_sick_member() -> None:
    rows = [node(1, voter=True, leader=True), node(2, voter=True), node(3, voter=True), node(4)]
    assert _gate(rows[1], rows, earlier_not_done=1)[0] is Verdict.WAIT
    sick = [*rows[:2], node(3, voter=True, health="HEARTBEAT_TIMEOUT"), rows[3]]
    verdict, why = _gate(sick[1], sick, max_unavailable=2)
    assert verdict is Verdict.WAIT and "not healthy" in why
    assert _gate(rows[1], rows)[0] is Verdict.GO


def test_a_member_is_refused_when_etcd_would_lose_its_quorum() -> None:
    two = [node(1, voter=True, leader=True), node(2, voter=True)]
    verdict, why = _gate(two[1], two)
    assert verdict is Verdict.REFUSE and "quorum" in why
    assert _gate(node(1, voter=True, leader=True), [node(1, voter=True, leader=True)])[0] is (
        Verdict.REFUSE
    )


def test_the_leader_goes_last() -> None:
    rows = [node(1, voter=True, leader=True), node(2, voter=True), node(3, voter=True)]
    verdict, why = _gate(rows[0], rows, consensus_not_done=1)
    assert verdict is Verdict.WAIT and "leads" in why
    assert _gate(rows[0], rows)[0] is Verdict.GO


def test_upgraded_means_the_image_healthy_permanent_and_voting() -> None:
    assert upgraded(node(2, voter=True, image=NEW), NEW, was_voter=True)
    assert not upgraded(node(2, voter=True, image=NEW, trial=True), NEW, was_voter=True)
    assert not upgraded(node(2, image=NEW), NEW, was_voter=True)  # not a voter again yet
    assert not upgraded(node(2, voter=True, image=NEW, health="UNKNOWN"), NEW, was_voter=True)
    assert not upgraded(node(2, voter=True), NEW, was_voter=True)


def test_went_back_reads_the_node_s_own_report() -> None:
    row = node(2)
    back = NodeRow(**{**row.__dict__, "rolled_back": NEW, "rollback_cause": "no healthy node"})
    assert went_back(back, NEW) == "no healthy node"
    assert went_back(row, NEW) is None
