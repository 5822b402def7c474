"""Control-plane start and membership changes against bare etcd, measured in one run.

    python -m bench.controlplane [--startup-runs 40] [--runs 5] [--only startup|membership]
                                 [--etcd-client gateway|grpc] [--smoke]

Start-up. Each on a fresh directory, ``--startup-runs`` times, each node
start right after its baseline (interleaved: the machine's load drifts).
More runs than for membership changes, because both sides of each pair
wait for etcd's first election, which is random: a fresh single member
advances its clock by 9 of the 10-19 ticks of its randomized election
timeout, so it waits 1-10 ticks (20-200 ms here), independently on either
side of a pair. Over 5 pairs the median ratio mostly measures that draw (from about
0.8 to 2.3 for the same code); over 15 it still ranged from 1.05 to 1.99
(and 1.20 to 1.85 for one later version, run after run on a quiet
machine); over 40 pairs (under a minute), six runs of one version gave
1.02 to 1.30.

- baseline: a bare ``etcd`` (plain peers, new data dir) until it answers on
  its UNIX socket; and the same etcd restarted on its own data;
- bootstrap to home: a role server on a root holding only a bootstrap
  intent (reading the root included), until its membership is home with
  local consensus and curator (etcd started with peer TLS, cluster created
  in etcd, credentials, directory, sealed configuration and roles
  fsynced); and until the curator leads;
- run to home: the same role server restarted on what the bootstrap left
  (ratio against the bare restart).

Membership changes (issue 11). A two-node cluster: n1 bootstraps on
127.0.0.1 as an in-process role server, n2 registers on 127.0.0.2 with the
owner's ticket and is approved. First n2 runs in-process too (one Trio
thread for both nodes and the owner: conservative, their Python work cannot
overlap) for ``--runs`` grants and revokes; then, on the same root, in its
own OS process as a real node does (``python -m metropolis node run``,
logging at INFO as that command does), for ``--runs`` more grants and
revokes (see "grant, n2 in its own process" below). Each time:

- baseline: bare etcds with peer TLS (the same cost of TLS as the
  nodes' etcds), in a cluster that lives as long as the nodes' cluster and
  whose membership history grows the same way: each run, member add
  (learner "b", always at the same peer URL, as n2 always rejoins at its
  own), the learner's etcd started on a fresh data directory, promote
  retried every heartbeat until etcd accepts it; then, untimed, 5.5 s
  later, member remove, before the grant it is paired with. Each side is
  measured while the other cluster has one member, and after a revoke's
  aftermath has settled (:func:`paired_join`, :func:`quiet_after_revoke`).
  Earlier versions let the bare learner run on through the grant, and
  started the next join right after the revoke; schedstat showed both
  skewing the pair, one each way.

  Why not a fresh one-member cluster each time: a joining etcd replays
  the whole raft log (etcd 3.4 sends a snapshot only once 5000
  entries are compacted away), and a learner only answers once it has
  applied every configuration change in it. The k-th grant's etcd replays
  k-1 earlier joins and leaves (each add, promote and remove starts or
  stops a peer); measured: +20-30 ms per earlier join for bare etcd alike.
  So the baseline replays the same membership changes, and the ratio
  measures what the role server adds, not how many runs came before.
  (Though not all of it alike: n2's etcd replays them more slowly on these
  shared cores, its "now serving" to "published" growing from 23 to 194 ms
  over 12 grants where the bare learner's grew from 11 to 80-95 ms, so
  later grants weigh more in the ratio; see ``bench.grant_trace``.) (The
  nodes' log also holds the curator's dozen small writes per run, which
  the baseline's does not: that difference counts against the grant, and
  costs it nothing measurable: padding the baseline's log with as many
  writes left its join at 63-64 ms, median of 8; padded to the nodes'
  raft index before each join, a second bare cluster beside this one
  joined in 0.97 of its time, median of 10 pairs.) Where a grant's time
  goes, milestone by milestone: ``python -m bench.grant_trace``.
  For comparison the old baseline, a fresh one-member cluster per run
  (member add, learner start, promote; then, 5.5 s later, see
  ``_HEALTHY_AFTER``, member remove), is still measured and printed;
- grant: from the owner's ``UpdateNodeRoles`` (ConsensusMember on) until
  n2 runs etcd as a voter and its curator serves (the curator leader adds
  the learner and stores the join data, n2's role fetch sees it, its
  launcher starts etcd, the promoter on n1 promotes it). "Serves": its
  API is loaded from etcd and listening; its campaign may still be in
  flight (as it always was: the port never waited for the campaign's
  outcome), and until then the API answers as a follower of an unknown
  leader;
- grant, n2 in its own process: the same window, from the owner's
  ``UpdateNodeRoles`` until n2 votes and its curator serves, but seen
  from outside n2 (its state is in another process): a TLS connection to
  n2's curator port (known beforehand: the cluster's one curator port at
  n2's address) with the owner's certificate completes its handshake and
  receives the server's HTTP/2 SETTINGS (its first frame, sent once it
  accepted our certificate); then n1's etcd must list n2's peer URL as a
  voter. n2's curator starts only once its etcd is a voter (its launcher
  waits for the promotion), so that holds at once; it is looked at after
  the curator answered, not polled beside it, so that no polling of n1's
  etcd runs in this thread (n1's) on the grant's critical path (it made
  no difference measurable over the run-to-run spread).
  (Were it not yet a voter, the end would be when a member list, looked
  at every 5 ms, first shows it.) A refused connection is retried every
  5 ms (``_GRANT_POLL``); once the port is bound (while the API loads)
  the connection waits in its backlog, so the handshake ends as soon as
  the API serves, with no polling delay. This end is stricter than the
  in-process one, the curator publishing its port before its serving
  task has run: it includes n2 accepting and handshaking the connection
  (seen: 40-70 ms after n2 logs that it serves, on this loaded 2-core
  machine; n2's own Python work after its curator starts). The
  handshake alone (without SETTINGS) is printed for information. n2
  lives in one process for all these grants (as a node lives), so its
  first grant also pays that process's lazy import of httpcore (the etcd
  client's first request, in the curator's first etcd read: 60-100 ms);
  that grant is printed on its own line too. Each grant is paired with a
  baseline join just before it (the ``next`` baseline row, in the same
  way as above), which replays the same membership history;
- revoke (5.5 s after the grant): from ``UpdateNodeRoles`` (ConsensusMember off) until n2 is no
  member in n1's etcd any more; and, for information, until n2's control
  plane has stopped. Measured with n2 in-process only (with n2 in its own
  process the revoke runs, untimed, to make way for the next grant).

Both membership figures are given as ratios to the add + start + promote
baseline (the issue's measure); the fresh-cluster join, the grant against
it, and the bare member remove are printed too.

All etcds use the loopback raft timing (heartbeat 20 ms, election 200 ms).
Prints one table; figures are medians, ratios the median of per-pair ratios,
with the first and third quartile of those ratios beside them.
Goal: <= 1.5x. Where a bootstrap's time goes, phase by phase:
``python -m bench.startup_trace``. On a two-core machine a grant is
CPU-bound, and its wall-time ratio follows its CPU ratio (measured: 1.75
against 1.8, the learner's etcd at 1.5x etcd's own join, the leader's at
1.8x, the Python process at 3.1x); ``python -m bench.grant_trace`` prints
that account.
"""

from __future__ import annotations

import argparse
import logging
import ssl
import statistics
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import trio

from bench import etcdswitch
from bench.consensus_start import bare_etcd_start
from bench.ratios import report
from bench.smoke import parse_args
from common.durable import atomic_write
from common.net import free_loopback_port
from metropolis import pki
from metropolis.consensus import peerpki
from metropolis.consensus.client import Client, EndpointStatus, EtcdAPIError
from metropolis.consensus.localetcd import LOOPBACK_TUNING
from metropolis.consensus.process import SOCKET_NAME, EtcdExited, PeerTLS, ProcessConfig, run_etcd
from metropolis.curator.election import Leader
from metropolis.identity import node_id
from metropolis.localstorage import Root
from metropolis.owner import Owner, OwnerAccess, OwnerError, load_owner
from metropolis.proto import management as m
from metropolis.roleserve import disk
from metropolis.roleserve.loopback import loopback_settings, prepare_loopback_bootstrap
from metropolis.roleserve.register import register
from metropolis.roleserve.server import RoleServer
from metropolis.roleserve.values import ClusterMembership, RegisterIntent
from metropolis.rpc import RPCError, methods
from metropolis.supervisor import open_supervisor

logger = logging.getLogger("bench.controlplane")

#: How often the baseline retries promoting its learner: etcd's heartbeat,
#: the soonest the leader can know the learner caught up.
_PROMOTE_RETRY = LOOPBACK_TUNING.heartbeat_ms / 1000
#: etcd refuses to remove a member until the others have been connected to
#: it for 5 s (its --strict-reconfig-check, HealthInterval): both the bare
#: remove and the revoke wait that long after the join, untimed, so that
#: neither measures etcd's own wait.
_HEALTHY_AFTER = 5.5
#: How long a revoke's aftermath (the node's callers moving to a remote
#: curator) is given before the next measurement; see quiet_after_revoke.
_AFTERMATH = 1.0
#: How often the revoke measurement looks at n1's member list.
_MEMBER_POLL = 0.005


def _local(m: ClusterMembership) -> bool:
    return m.home and m.local_consensus is not None and m.local_curator is not None


async def node_start(root: Root) -> tuple[float, float]:
    """Seconds until home with a running local control plane, and until the curator leads."""
    start = trio.current_time()
    # Reading the root is part of the node's start, as for `node run`.
    server = RoleServer(root, disk.load(root))
    async with open_supervisor(server.run, name="role"):
        with server.membership.watch() as w:
            membership = await w.get(_local)
        assert membership.local_consensus is not None and membership.local_curator is not None
        await membership.local_consensus.wait_running()
        home = trio.current_time() - start
        with membership.local_curator.election.watch() as e:
            await e.get(lambda s: isinstance(s, Leader))
        leads = trio.current_time() - start
    return home, leads


# --- bare etcd: member add + learner start + promote, and member remove ---------


def _bare_member(directory: Path, ca: peerpki.PeerCA, crl_pem: bytes) -> PeerTLS:
    """Peer TLS files for one bare member under ``directory``."""
    key = pki.generate_key()
    certificate = peerpki.issue_local_certificate(ca, pki.public_key_bytes(key), ["127.0.0.1"])
    tls = PeerTLS(
        ca_certificate=directory / "ca.pem",
        certificate=directory / "cert.pem",
        key=directory / "key.pem",
        crl=directory / "crl.pem",
    )
    directory.mkdir(parents=True)
    atomic_write(tls.ca_certificate, pki.encode_certificate(ca.certificate), durable=False)
    atomic_write(tls.certificate, pki.encode_certificate(certificate), durable=False)
    atomic_write(tls.key, pki.encode_private_key(key), durable=False)
    atomic_write(tls.crl, crl_pem, durable=False)
    return tls


async def _run_learner(
    config: ProcessConfig, *, task_status: trio.TaskStatus[EndpointStatus]
) -> None:
    # A removed member's etcd exits on its own: that is the expected end.
    with suppress(EtcdExited):
        await run_etcd(config, logger, task_status=task_status)


async def _promote_until_accepted(client: Client, member_id: int) -> None:
    """etcd's own procedure: promote, retried every heartbeat while etcd refuses."""
    while True:
        try:
            await client.member_promote(member_id)
            return
        except EtcdAPIError as e:
            if not e.transient:
                raise
        await trio.sleep(_PROMOTE_RETRY)


def _bare_config(
    directory: Path, name: str, urls: dict[str, str], ca: peerpki.PeerCA, crl_pem: bytes
) -> ProcessConfig:
    """A bare member ``name`` under ``directory``: a fresh data directory."""
    member = directory / name
    first = name == "a"
    return ProcessConfig(
        name=name,
        data_dir=member / "data",
        working_dir=member / "run",
        peer_address=urls[name].removeprefix("https://"),
        peer_tls=_bare_member(member / "pki", ca, crl_pem),
        initial_cluster={"a": urls["a"]} if first else urls,
        cluster_state="new" if first else "existing",
        tuning=LOOPBACK_TUNING,
    )


async def bare_join(directory: Path) -> tuple[float, float]:
    """etcd's own join (member add, learner start, promote) and member remove, in seconds.

    On a fresh one-member cluster, made for this call.
    """
    ca, crl = peerpki.new_ca()
    crl_pem = pki.encode_crl(crl)
    urls = {name: f"https://127.0.0.1:{free_loopback_port()}" for name in ("a", "b")}
    first = _bare_config(directory, "a", urls, ca, crl_pem)
    learner = _bare_config(directory, "b", urls, ca, crl_pem)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_etcd, first, logger)
        async with Client(first.socket_path) as client:
            start = trio.current_time()
            member = await client.member_add([urls["b"]], learner=True)
            await nursery.start(_run_learner, learner)
            await _promote_until_accepted(client, member.id)
            join = trio.current_time() - start
            await trio.sleep(_HEALTHY_AFTER)
            start = trio.current_time()
            await client.member_remove(member.id)
            remove = trio.current_time() - start
        nursery.cancel_scope.cancel()
    return join, remove


class BareCluster:
    """Bare etcds with peer TLS whose history grows as the nodes' cluster's does.

    Member "a" runs for the whole benchmark; each :meth:`join` adds a
    learner "b" at the same peer URL each time (as n2 rejoins at its own),
    starts it on a fresh data directory, and promotes it; :meth:`remove`
    removes it again and waits until its etcd has left. So the learner of
    the k-th join replays the same membership history (k-1 learners added,
    promoted, removed) that n2's etcd replays on its k-th grant.
    """

    def __init__(self, directory: Path, nursery: trio.Nursery) -> None:
        self._directory = directory
        self._nursery = nursery
        self._ca, crl = peerpki.new_ca()
        self._crl_pem = pki.encode_crl(crl)
        self._urls = {name: f"https://127.0.0.1:{free_loopback_port()}" for name in ("a", "b")}
        self._runs = 0
        self._first = _bare_config(directory, "a", self._urls, self._ca, self._crl_pem)
        #: The data directories of member "a" and of the latest learner "b".
        self.first_data_dir = self._first.data_dir
        self.learner_data_dir: Path | None = None
        self._member: int | None = None
        self._left = trio.Event()
        self._client: Client | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, directory: Path) -> AsyncIterator[BareCluster]:
        async with trio.open_nursery() as nursery:
            cluster = cls(directory, nursery)
            await nursery.start(run_etcd, cluster._first, logger)
            async with Client(cluster._first.socket_path) as client:
                cluster._client = client
                yield cluster
            nursery.cancel_scope.cancel()

    async def _run_learner(
        self, config: ProcessConfig, *, task_status: trio.TaskStatus[EndpointStatus]
    ) -> None:
        try:
            await _run_learner(config, task_status=task_status)
        finally:
            self._left.set()

    async def join(self) -> float:
        """Seconds for member add + learner start + promote."""
        assert self._client is not None and self._member is None
        self._runs += 1
        directory = self._directory / f"join{self._runs}"
        learner = _bare_config(directory, "b", self._urls, self._ca, self._crl_pem)
        self.learner_data_dir = learner.data_dir
        self._left = trio.Event()
        start = trio.current_time()
        member = await self._client.member_add([self._urls["b"]], learner=True)
        await self._nursery.start(self._run_learner, learner)
        await _promote_until_accepted(self._client, member.id)
        self._member = member.id
        return trio.current_time() - start

    async def remove(self) -> None:
        """Remove the last joined member (untimed) and wait until its etcd has exited."""
        assert self._client is not None and self._member is not None
        await self._client.member_remove(self._member)
        self._member = None
        await self._left.wait()


# --- a two-node cluster: granting and revoking ConsensusMember ---------------------


@dataclass
class Pair:
    """n1 (bootstrapped, leads), n2's root (registered, approved; not running), the owner.

    n2 runs either in this process (:func:`in_process`) or in its own
    (:func:`own_process`), never both at once: they share its root.
    """

    n1: RoleServer
    n2_root: Root
    n2_settings: disk.NodeSettings
    owner: Owner
    owner_access: OwnerAccess
    n2_key: bytes


@asynccontextmanager
async def two_nodes(base: Path) -> AsyncIterator[Pair]:
    owner_key = pki.generate_key()
    s1 = loopback_settings("127.0.0.1")
    # One peer port and one curator port for the cluster (as in Monogon).
    s2 = loopback_settings("127.0.0.2", peer_port=s1.peer_port, curator_port=s1.curator_port)
    r1, r2 = Root(base / "c1"), Root(base / "c2")
    prepare_loopback_bootstrap(r1, owner_key=owner_key, settings=s1)
    n1 = RoleServer(r1, disk.load(r1))
    async with open_supervisor(n1.run, name="n1") as sup1:
        await sup1.wait_healthy("n1.statuspush")  # its curator serves, leads
        access = load_owner(r1, owner_key)
        async with access.open() as owner:
            intent = RegisterIntent.generate(await owner.ticket(), await owner.info())
            disk.save_register_intent(r2, s2, intent)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: register(r2, s2, intent, poll=0.05))
                # Another process's state (over RPC): polling is all there is.
                while not (new := [r for r in await owner.nodes() if r.state == "NEW"]):  # noqa: ASYNC110
                    await trio.sleep(0.05)
                await owner.approve(new[0].node_id)
            yield Pair(n1, r2, s2, owner, access, new[0].public_key)


@asynccontextmanager
async def in_process(pair: Pair) -> AsyncIterator[RoleServer]:
    """n2 as a role server in this process (and Trio thread), ready to be granted roles."""
    n2 = RoleServer(pair.n2_root, disk.load(pair.n2_root))
    async with open_supervisor(n2.run, name="n2") as sup2:
        await sup2.wait_healthy("n2.statuspush")  # its address is known: grantable
        yield n2


#: Runnables of n2 that must be healthy before a grant: its status is
#: pushed (its address known) and its role fetch watches its node.
_READY = ("root.role.statuspush", "root.role.rolefetch")
#: Seconds a node process gets to stop on SIGTERM (it stops etcd first)
#: before it is killed.
_STOP_BOUND = 30.0


async def _process_ready(pair: Pair, process: trio.Process, log: Path) -> None:
    """Wait until the node process ``process`` (n2) is ready to be granted roles."""
    name = node_id(pair.n2_key)
    with trio.fail_after(60):
        while True:
            if process.returncode is not None:
                text = await trio.Path(log).read_text()
                raise RuntimeError(f"n2 exited ({process.returncode}):\n{text}")
            # Another process's state (over RPC): polling is all there is.
            rows = [r for r in await pair.owner.nodes() if r.node_id == name]
            with suppress(RPCError, OwnerError):
                tree = await pair.owner.supervision_tree(rows[0])
                healthy = {
                    r.name for r in tree.runnables if r.state == m.SupervisedRunnableState.HEALTHY
                }
                if all(n in healthy for n in _READY):
                    return
            await trio.sleep(0.05)


#: The nodes' etcd client (``--etcd-client``).
_ETCD_CLIENT = "gateway"


@asynccontextmanager
async def own_process(pair: Pair, log: Path) -> AsyncIterator[trio.Process]:
    """n2 as a node runs: ``python -m metropolis node run --root`` in its own OS process.

    Ready to be granted roles when the block starts. On leaving (also on
    error or Ctrl-C) the process gets SIGTERM (it stops its etcd, which
    runs in a session of its own, and exits) and is killed if it has not
    exited within :data:`_STOP_BOUND`.
    """
    # The etcd client this run uses (--etcd-client), in n2's process too.
    argv = [*etcdswitch.node_command(_ETCD_CLIENT), "node", "run", "--root", str(pair.n2_root.path)]
    with log.open("ab") as out:
        process = await trio.lowlevel.open_process(argv, stdout=out, stderr=out)
    try:
        await _process_ready(pair, process, log)
        yield process
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
                with trio.move_on_after(_STOP_BOUND):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


async def _set_consensus(pair: Pair, on: bool) -> None:
    # The owner's RPC itself (Owner.set_roles would first look the key up).
    request = m.UpdateNodeRolesRequest(pubkey=pair.n2_key, consensus_member=on)
    await pair.owner.client.unary(methods.UPDATE_NODE_ROLES, request)


async def grant(pair: Pair, n2: RoleServer) -> float:
    """Seconds from granting ConsensusMember until n2 votes and its curator serves."""
    start = trio.current_time()
    await _set_consensus(pair, True)
    with n2.membership.watch() as w:
        membership = await w.get(_local)
    assert membership.local_consensus is not None and membership.local_curator is not None
    await membership.local_consensus.wait_running()  # running means a voter
    with membership.local_curator.port.watch() as port:
        await port.get()
    return trio.current_time() - start


#: How often the separate-process grant retries a refused connection to
#: n2's curator port (and, should n2 not yet be a voter when its curator
#: answers, looks at n1's member list again).
_GRANT_POLL = 0.005
#: An HTTP/2 client preface and an empty SETTINGS frame (RFC 9113 3.4).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


async def _curator_answers(host: str, port: int, context: ssl.SSLContext) -> float | None:
    """When the curator at ``host:port`` completed TLS with our owner certificate, if it
    then sent its HTTP/2 SETTINGS; None if the connection was refused or broke."""
    try:
        tcp = await trio.open_tcp_stream(host, port)
    except OSError:
        return None
    stream = trio.SSLStream(tcp, context, server_hostname=host)
    try:
        # A port bound while the API still loads holds us in its backlog:
        # the handshake completes once the API serves.
        await stream.do_handshake()
        handshake = trio.current_time()
        await stream.send_all(_H2_PREFACE)
        # TLS 1.3: the server judges our certificate after the handshake;
        # its first frame (SETTINGS, type 4) says it accepted it and serves.
        head = b""
        while len(head) < 9:
            chunk = await stream.receive_some(9 - len(head))
            if not chunk:
                return None
            head += chunk
        return handshake if head[3] == 4 else None
    except (OSError, trio.BrokenResourceError, ssl.SSLError):
        return None
    finally:
        await trio.aclose_forcefully(stream)


async def grant_process(pair: Pair) -> tuple[float, float]:
    """Seconds from granting ConsensusMember to n2 (its own process) until it votes and
    its curator serves, both seen from outside n2 (see the module docstring); and
    until it votes and its curator completed the TLS handshake (for information)."""
    peer_url = f"https://{pair.n2_settings.peer_address}"
    host, port = pair.n2_settings.address, pair.n2_settings.curator_port
    async with Client(pair.n1.root.ephemeral.consensus / SOCKET_NAME) as etcd:
        with trio.fail_after(120):
            start = trio.current_time()
            await _set_consensus(pair, True)
            # Another process's port: a refused connection is retried.
            while (shaken := await _curator_answers(host, port, pair.owner_access.context)) is None:  # noqa: ASYNC110
                await trio.sleep(_GRANT_POLL)
            serves = trio.current_time()
            looked_again = False
            # n2's curator starts only once n2's etcd is a voter (its
            # launcher waits for the promotion), so this holds at once; it
            # is looked at afterwards, not polled beside: no polling of n1's
            # etcd in this thread, n1's, on the grant's critical path.
            while not any(
                peer_url in m.peer_urls and not m.is_learner for m in await etcd.member_list()
            ):
                await trio.sleep(_GRANT_POLL)
                looked_again = True
            # 0: already a voter when the curator answered.
            voter = trio.current_time() if looked_again else 0.0
    return max(voter, serves) - start, max(voter, shaken) - start


async def _until_gone(pair: Pair) -> tuple[float, float]:
    """Revoke ConsensusMember: seconds until n2 is no member in n1's etcd, and when it started."""
    name = node_id(pair.n2_key)
    gone = 0.0
    async with Client(pair.n1.root.ephemeral.consensus / SOCKET_NAME) as etcd:

        async def until_gone() -> None:
            nonlocal gone
            # etcd has no membership watch: look until the member is gone
            # (beside the call: the curator removes it before it answers).
            while any(m.name == name for m in await etcd.member_list()):  # noqa: ASYNC110
                await trio.sleep(_MEMBER_POLL)
            gone = trio.current_time() - start

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(until_gone)
            await _set_consensus(pair, False)
    return gone, start


async def revoke(pair: Pair, n2: RoleServer) -> tuple[float, float]:
    """Seconds from revoking ConsensusMember until n2 is no etcd member; until it stopped."""
    gone, start = await _until_gone(pair)
    with n2.membership.watch() as w:
        await w.get(lambda m: m.home and m.local_consensus is None)
    stopped = trio.current_time() - start
    return gone, stopped


async def _settled(root: Root) -> None:
    """Wait until a revoked node has wiped its etcd data (its next grant joins fresh)."""
    etcd = root.data.etcd
    while etcd.data.exists() or not etcd.peer_pki.path.is_dir():  # noqa: ASYNC110
        await trio.sleep(0.05)


async def paired_join(bare: BareCluster, joined: Callable[[], object] = lambda: None) -> float:
    """etcd's own join, timed; then, untimed, its cluster back to one member.

    ``joined`` is called at once when the join is over (its learner still runs).

    The baseline of the grant that follows, and removed before it: while
    the nodes' cluster has one member during this join, a second bare
    member left running through the grant would heartbeat on these cores
    (20-50 ms of CPU per grant, measured with schedstat).
    """
    join = await bare.join()
    joined()
    await trio.sleep(_HEALTHY_AFTER)
    await bare.remove()
    return join


async def quiet_after_revoke(root: Root) -> None:
    """Wait, untimed, until a revoke is over, also for the node's callers.

    A revoked node wipes its etcd data, and its callers move from its own
    curator to a remote one (reconnecting: TLS both ends). Measured with
    schedstat: that work still ran during the next baseline join when it
    followed at once, on the same two cores.
    """
    await _settled(root)
    await trio.sleep(_AFTERMATH)


# --- the run --------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the table: medians, and the spread of the per-pair ratios."""

    name: str
    #: Median of the measured values, in seconds.
    seconds: float
    #: Median of the per-pair ratios (value / its baseline).
    ratio: float
    #: First and third quartile of the per-pair ratios (equal for one pair).
    low: float
    high: float


def _row(name: str, values: list[float], baseline: list[float]) -> Row:
    ratios = sorted(v / b for v, b in zip(values, baseline, strict=True))
    low, high = (
        statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else (ratios[0], ratios[0])
    )
    return Row(name, statistics.median(values), statistics.median(ratios), low, high)


async def startup_rows(base: Path, runs: int) -> list[Row]:
    # Interleaved, so that a load change on this shared machine hits a node
    # start and its baseline alike; each ratio is the median of per-pair ratios.
    bare: list[float] = []
    boots: list[tuple[float, float]] = []
    bare_restart: list[float] = []
    restarts: list[tuple[float, float]] = []
    roots = [Root(base / f"n{i}") for i in range(runs)]
    for i, root in enumerate(roots):
        prepare_loopback_bootstrap(root)
        bare.append(await bare_etcd_start(base / f"bare{i}"))
        boots.append(await node_start(root))
    for i, root in enumerate(roots):
        bare_restart.append(await bare_etcd_start(base / f"bare{i}"))
        restarts.append(await node_start(root))
    return [
        _row("etcd bare start (baseline)", bare, bare),
        _row("bootstrap to home", [b[0] for b in boots], bare),
        _row("bootstrap to curator leading", [b[1] for b in boots], bare),
        _row("etcd bare restart (baseline)", bare_restart, bare_restart),
        _row("run to home", [r[0] for r in restarts], bare_restart),
        _row("run to curator leading", [r[1] for r in restarts], bare_restart),
    ]


async def membership_rows(base: Path, runs: int) -> list[Row]:
    fresh: list[float] = []
    joins: list[float] = []
    removes: list[float] = []
    grants: list[float] = []
    gone: list[float] = []
    stopped: list[float] = []
    proc_joins: list[float] = []
    proc_grants: list[float] = []
    proc_handshakes: list[float] = []
    log = base / "n2-process.log"
    async with two_nodes(base / "cluster") as pair, BareCluster.open(base / "bare") as bare:
        # n2 in this process (and Trio thread), for all its grants.
        async with in_process(pair) as n2:
            for i in range(runs):
                join, remove = await bare_join(base / f"join{i}")
                fresh.append(join)
                removes.append(remove)
                joins.append(await paired_join(bare))
                grants.append(await grant(pair, n2))
                await trio.sleep(_HEALTHY_AFTER)
                g, s = await revoke(pair, n2)
                gone.append(g)
                stopped.append(s)
                await quiet_after_revoke(pair.n2_root)
        # Then n2 in its own OS process on the same root, one process for
        # all its grants (as a node lives), each paired with the baseline
        # join that replays the same history.
        async with own_process(pair, log):
            for _ in range(runs):
                proc_joins.append(await paired_join(bare))
                served, shaken = await grant_process(pair)
                proc_grants.append(served)
                proc_handshakes.append(shaken)
                await trio.sleep(_HEALTHY_AFTER)
                await _until_gone(pair)
                await quiet_after_revoke(pair.n2_root)
    return [
        _row("etcd add+start+promote (baseline)", joins, joins),
        _row("etcd add+start+promote, next (baseline)", proc_joins, proc_joins),
        _row("grant ConsensusMember to voting", grants, joins),
        _row("grant, n2 in its own process", proc_grants, proc_joins),
        _row("  (its first grant, same process)", proc_grants[:1], proc_joins[:1]),
        _row("  (own process, until TLS handshake)", proc_handshakes, proc_joins),
        _row("revoke ConsensusMember to member gone", gone, joins),
        _row("  (etcd add+start+promote, fresh cluster)", fresh, joins),
        _row("  (grant, against the fresh cluster)", grants, fresh),
        _row("  (etcd member remove, bare)", removes, joins),
        _row("  (revoke to n2's etcd stopped)", stopped, joins),
    ]


async def main(runs: int, startup_runs: int, only: str | None) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as tmp:
        base = Path(tmp)
        rows: list[Row] = []
        if only in (None, "startup"):
            rows += await startup_rows(base, startup_runs)
        if only in (None, "membership"):
            rows += await membership_rows(base, runs)
    # The quartiles of the per-pair ratios say how far one run's median can
    # be trusted: on this 2-core machine a pair's ratio ranges widely.
    print(f"{'measure':<42} {'median':>10} {'ratio':>8}  {'ratio quartiles':>15}")
    for row in rows:
        print(
            f"{row.name:<42} {row.seconds * 1000:>7.0f} ms {row.ratio:>8.2f}"
            f"  {row.low:>6.2f} - {row.high:.2f}"
        )
        if not row.name.endswith("(baseline)") and not row.name.startswith(" "):
            report("controlplane", row.name, row.ratio, "<= 1.5")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="membership changes (default 5)")
    parser.add_argument(
        "--startup-runs", type=int, default=40, help="start-ups (default 40; see above)"
    )
    parser.add_argument(
        "--only", choices=("startup", "membership"), help="one half of the table (default: both)"
    )
    parser.add_argument(
        "--etcd-client",
        choices=etcdswitch.CHOICES,
        default="gateway",
        help="the nodes' etcd client (bench.etcdswitch; default gateway)",
    )
    args = parse_args(parser, {"runs": 1, "startup_runs": 1})
    logging.basicConfig(level=logging.ERROR)
    _ETCD_CLIENT = etcdswitch.install(args.etcd_client)
    trio.run(main, args.runs, args.startup_runs, args.only)
