"""What a node keeps on disk to bootstrap a cluster and to restart from.

In ``<root>/data/node/`` (owner-only), beside the credentials::

    settings.json    address, peer port, raft timing, sealing mode   written first
    bootstrap.json   the bootstrap intent: node key, join key, unlock keys, owner
                     (present only until the bootstrap has finished)
    register.json    the register intent: node key, join key, unlock keys, ticket,
                     cluster CA and directory (present only until committed)
    roles.pb         the node's roles, as last received
    credentials/     written last by a bootstrap: their presence means done
    credentials.staged/
                     a bootstrap's credentials, written and fsynced while
                     etcd starts; renamed to credentials/ once the cluster
                     exists (meaningless until then: load() ignores it)

and the cluster directory and sealed configuration under ``esp/``. Every
file of these but the credentials (PEM, self-checking) is a checked file
(:func:`~metropolis.localstorage.write_checked`: a header with kind, length
and SHA-256), so :func:`load` tells a cut or changed file from a valid one
and refuses it with :class:`~metropolis.localstorage.CorruptFile` naming
it, rather than run a node without its roles. A damaged file is never
replaced or repaired here: the message says what the operator can do.

A bootstrap saves roles, directory and sealed configuration, then the
credentials, then removes the intent, so a node restarts from whatever a
crash left: credentials -> run; intent without credentials -> resume the
bootstrap (it is idempotent); neither -> a half-written root, refused.

The credentials of a bootstrap are staged: written and fsynced beside the
other files while etcd starts (:func:`save_cluster_files` with
``staged_credentials``), then made the node's by one directory rename and
one directory fsync (:func:`save_credentials`) once the cluster exists in
etcd; writing and fsyncing three files there cost that moment two
filesystem journal commits beside etcd's. A crash between staging and the
rename leaves an intent without credentials: the bootstrap resumes, and
stages again if the cluster etcd holds is another attempt's.

A registering node (``node register``) writes its settings, then its
register intent, before it calls the cluster, and finishes like a bootstrap
(credentials last, then the intent goes). A crash leaves settings alone
(nothing was sent: registering again starts over), or an intent (register
and commit are idempotent for the same keys: ``run`` or ``register``
resumes with them), or credentials (done). No crash can give the node keys
other than the ones the cluster knows it by.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.durable import atomic_write, fsync_directory, make_durable
from metropolis import pki
from metropolis.consensus.settings import Tuning
from metropolis.crashpoint import crash_point
from metropolis.curator.settings import DEFAULT_TTL
from metropolis.errors import MetropolisError
from metropolis.identity import CredentialsError, NodeCredentials
from metropolis.localstorage import (
    CorruptFile,
    LocalStorageError,
    PKIDirectory,
    Root,
    checked_content,
    parse_checked,
    read_checked,
    write_checked,
)
from metropolis.proto.common import ClusterDirectory, NodeRoles
from metropolis.proto.private import SealedConfiguration
from metropolis.roleserve.values import BootstrapData, RegisterIntent

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from metropolis import consensus
    from metropolis.consensus.join import JoinCluster

__all__ = [
    "NodeRootError",
    "NodeSettings",
    "SavedNode",
    "bootstrap_path",
    "drop_finished_intents",
    "finish_bootstrap",
    "load",
    "owner_certificate_path",
    "read_roles",
    "register_path",
    "roles_path",
    "save_cluster_files",
    "save_credentials",
    "save_register_intent",
    "save_roles",
    "save_settings_and_intent",
    "settings_path",
    "staged_credentials_path",
]


class NodeRootError(MetropolisError):
    """The node's root directory is missing, foreign, or half-written."""


@dataclass(frozen=True)
class NodeSettings:
    """How this node runs; chosen at bootstrap, kept for every restart."""

    #: Host (IP or name) other nodes reach this node at.
    address: str
    peer_port: int = 7834
    #: Where this node's curator serves the RPC API (when it runs one).
    curator_port: int = 7835
    tuning: Tuning = field(default_factory=Tuning)
    #: Where this node serves its debug service (the owner's view of what it
    #: runs); 7837 is Monogon's debug service port.
    debug_port: int = 7837
    #: No TPM: the sealed configuration is stored in plain text (logged).
    insecure_seal: bool = False
    #: Seconds between status pushes (the node's heartbeat, as Monogon's 5 s).
    status_interval: float = 5.0
    #: TTL (whole seconds) of this node's curator lease: how long the
    #: election waits for a leader that died (Monogon's 10 s).
    curator_lease_ttl: int = DEFAULT_TTL
    #: Seconds without a status push after which this node's curator, when
    #: it leads, reports a node HEARTBEAT_TIMEOUT; None: twice
    #: ``status_interval`` (see :attr:`curator_heartbeat_timeout`).
    heartbeat_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.curator_lease_ttl < 1:
            raise ValueError(f"curator lease TTL must be >= 1 s, got {self.curator_lease_ttl}")
        if self.heartbeat_timeout is not None and not self.heartbeat_timeout > 0:
            raise ValueError(f"heartbeat timeout must be > 0, got {self.heartbeat_timeout}")

    @property
    def curator_heartbeat_timeout(self) -> float:
        """The heartbeat timeout this node's curator applies (seconds)."""
        if self.heartbeat_timeout is not None:
            return self.heartbeat_timeout
        return 2 * self.status_interval

    @property
    def peer_address(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.peer_port}"

    def consensus_config(
        self, root: Root, key: Ed25519PrivateKey, join: JoinCluster | None
    ) -> consensus.Config:
        """How this node's consensus member runs under ``root``, with the node's
        ``key`` and ``join`` data (None: it bootstraps).

        One place for the control plane and ``node recover``: the etcd
        the latter starts ahead is taken over only for the same command line.
        """
        from metropolis.consensus.config import Config

        return Config(
            data=root.data.etcd,
            ephemeral=root.ephemeral.consensus,
            node_private_key=key,
            peer_address=self.peer_address,
            join_cluster=join,
            tuning=self.tuning,
        )


def settings_path(root: Root) -> Path:
    return root.data.path / "node" / "settings.json"


def bootstrap_path(root: Root) -> Path:
    return root.data.path / "node" / "bootstrap.json"


def register_path(root: Root) -> Path:
    return root.data.path / "node" / "register.json"


def roles_path(root: Root) -> Path:
    return root.data.path / "node" / "roles.pb"


# The kinds of the checked files kept here (localstorage.write_checked).
_SETTINGS = "settings"
_BOOTSTRAP = "bootstrap-intent"
_REGISTER = "register-intent"
_ROLES = "roles"

_ROLES_ADVICE = (
    "the node cannot run without its roles: restore the file from a backup, or remove "
    "the root and register the node again"
)


def _read_json(path: Path, kind: str, advice: str) -> dict[str, Any]:
    """The JSON object in the checked file ``path``; :class:`CorruptFile` if it is not one."""
    payload = read_checked(path, kind, advice=advice)
    try:
        raw = json.loads(payload)
    except ValueError as e:
        raise CorruptFile(path, f"not JSON ({e})", advice) from e
    if not isinstance(raw, dict):
        raise CorruptFile(path, "not a JSON object", advice)
    return raw


def read_roles(root: Root) -> NodeRoles:
    """The roles :func:`save_roles` (or a bootstrap) saved.

    :class:`~metropolis.localstorage.LocalStorageError` if the file cannot
    be read, :class:`~metropolis.localstorage.CorruptFile` if it is damaged.
    """
    path = roles_path(root)
    payload = read_checked(path, _ROLES, advice=_ROLES_ADVICE)
    return parse_checked(path, NodeRoles, payload, advice=_ROLES_ADVICE)


def save_settings_and_intent(root: Root, settings: NodeSettings, data: BootstrapData) -> None:
    """Create the root's layout and persist the settings and bootstrap intent (fsynced).

    Refuses (:class:`NodeRootError`) a root that already holds a node.
    """
    if settings_path(root).exists() or root.data.node_credentials.all_present():
        raise NodeRootError(f"{root.path} already holds a node; use 'run'")
    root.create()
    intent = {
        "node_private_key": pki.encode_private_key(data.node_private_key, pki.Encoding.DER).hex(),
        "join_private_key": pki.encode_private_key(data.join_private_key, pki.Encoding.DER).hex(),
        "cluster_unlock_key": data.cluster_unlock_key.hex(),
        "node_unlock_key": data.node_unlock_key.hex(),
        "initial_owner_key": data.initial_owner_key.hex(),
    }
    # The intent first: settings mark the root as a node's, and a node
    # root must always tell how to go on.
    write_checked(bootstrap_path(root), _BOOTSTRAP, json.dumps(intent).encode())
    write_checked(settings_path(root), _SETTINGS, _settings_json(settings))


def _settings_json(settings: NodeSettings) -> bytes:
    return json.dumps(
        {
            "address": settings.address,
            "peer_port": settings.peer_port,
            "curator_port": settings.curator_port,
            "debug_port": settings.debug_port,
            "heartbeat_ms": settings.tuning.heartbeat_ms,
            "election_ms": settings.tuning.election_ms,
            "member_health_wait": settings.tuning.member_health_wait,
            "insecure_seal": settings.insecure_seal,
            "status_interval_s": settings.status_interval,
            "curator_lease_ttl_s": settings.curator_lease_ttl,
            "heartbeat_timeout_s": settings.heartbeat_timeout,
        }
    ).encode()


def save_register_intent(root: Root, settings: NodeSettings, intent: RegisterIntent) -> None:
    """Persist the settings, then the register intent (fsynced), before any call to the cluster.

    Refuses (:class:`NodeRootError`) a root that holds a node or an intent.
    Settings without an intent (a crash in between) are overwritten: nothing
    had been sent to the cluster yet. Blocking I/O.
    """
    if (
        root.data.node_credentials.all_present()
        or bootstrap_path(root).exists()
        or register_path(root).exists()
    ):
        raise NodeRootError(f"{root.path} already holds a node; use 'run'")
    root.create()
    raw = {
        "node_private_key": pki.encode_private_key(intent.node_private_key, pki.Encoding.DER).hex(),
        "join_private_key": pki.encode_private_key(intent.join_private_key, pki.Encoding.DER).hex(),
        "cluster_unlock_key": intent.cluster_unlock_key.hex(),
        "node_unlock_key": intent.node_unlock_key.hex(),
        "ticket": intent.ticket.hex(),
        "cluster": bytes(intent.cluster).hex(),
    }
    # Settings first: an intent must always find its settings, and settings
    # alone are harmless (nothing reached the cluster).
    write_checked(settings_path(root), _SETTINGS, _settings_json(settings))
    crash_point("register-after-settings")
    write_checked(register_path(root), _REGISTER, json.dumps(raw).encode())
    crash_point("register-after-intent")


def _load_register_intent(root: Root) -> RegisterIntent:
    # Imported for a register intent only (see roleserve.values).
    from metropolis.proto.management import GetClusterInfoResponse

    path = register_path(root)
    advice = f"remove {root.path} and register again"
    raw = _read_json(path, _REGISTER, advice)
    try:
        return RegisterIntent(
            node_private_key=pki.decode_private_key(bytes.fromhex(raw["node_private_key"])),
            join_private_key=pki.decode_private_key(bytes.fromhex(raw["join_private_key"])),
            cluster_unlock_key=bytes.fromhex(raw["cluster_unlock_key"]),
            node_unlock_key=bytes.fromhex(raw["node_unlock_key"]),
            ticket=bytes.fromhex(raw["ticket"]),
            cluster=GetClusterInfoResponse.parse(bytes.fromhex(raw["cluster"])),
        )
    # betterproto2 raises assorted errors on bad input, hence the broad catch.
    except Exception as e:
        raise CorruptFile(
            path, f"its content does not parse ({type(e).__name__}: {e})", advice
        ) from e


def staged_credentials_path(root: Root) -> PKIDirectory:
    """Where a bootstrap stages its credentials (see :func:`save_credentials`)."""
    return PKIDirectory(root.data.path / "node" / "credentials.staged")


def owner_certificate_path(root: Root) -> Path:
    """Where the bootstrap node leaves the owner's certificate (public; no key)."""
    return root.data.path / "node" / "owner-certificate.pem"


def save_roles(root: Root, roles: NodeRoles) -> None:
    """Persist ``roles`` (fsynced), unless the file holds them already.

    The roles a node starts with, or a bootstrap just wrote, come back here
    as the node comes home: rewriting them would cost an fsync exactly when
    the new curator's campaign writes to etcd.
    """
    path = roles_path(root)
    encoded = bytes(roles)
    try:
        if path.read_bytes() == checked_content(_ROLES, encoded):
            return
    except OSError:
        pass
    write_checked(path, _ROLES, encoded)


@dataclass(frozen=True)
class SavedNode:
    """What :func:`load` found: settings, and a finished node, a bootstrap or a registration."""

    settings: NodeSettings
    bootstrap: BootstrapData | None
    credentials: NodeCredentials | None
    directory: ClusterDirectory | None
    roles: NodeRoles | None
    #: A registration to resume (no credentials yet).
    register: RegisterIntent | None = None


def load(root: Root) -> SavedNode:
    """Read a node's saved state, after :meth:`~metropolis.localstorage.Root.check`.

    Raises :class:`NodeRootError` for a root that is missing, holds no node
    or is half-written; :class:`~metropolis.localstorage.UnsafeRootError`
    for one another user could tamper with; :class:`~metropolis.localstorage.CorruptFile`
    naming a damaged file. Reading only.
    """
    if not root.path.is_dir():
        raise NodeRootError(f"{root.path}: no such directory (bootstrap a node first)")
    root.check()
    path = settings_path(root)
    if not os.path.lexists(path):
        raise NodeRootError(
            f"{root.path} is not a node's root (no {path}): "
            "bootstrap or register a node there first"
        )
    advice = "restore it from a backup (it holds the node's address, ports and raft timing)"
    raw = _read_json(path, _SETTINGS, advice)
    try:
        timeout = raw.get("heartbeat_timeout_s")
        settings = NodeSettings(
            address=str(raw["address"]),
            peer_port=int(raw["peer_port"]),
            # Older roots have no curator port: the default.
            curator_port=int(raw.get("curator_port", 7835)),
            debug_port=int(raw.get("debug_port", 7837)),
            tuning=Tuning(
                int(raw["heartbeat_ms"]),
                int(raw["election_ms"]),
                # Older roots have none: etcd's default, the wait.
                member_health_wait=bool(raw.get("member_health_wait", True)),
            ),
            insecure_seal=bool(raw["insecure_seal"]),
            # Older roots have no status interval: the default.
            status_interval=float(raw.get("status_interval_s", 5.0)),
            # Older roots have neither: the defaults.
            curator_lease_ttl=int(raw.get("curator_lease_ttl_s", DEFAULT_TTL)),
            heartbeat_timeout=None if timeout is None else float(timeout),
        )
    except (ValueError, KeyError, TypeError) as e:
        reason = f"its settings do not parse ({type(e).__name__}: {e})"
        raise CorruptFile(path, reason, advice) from e

    if root.data.node_credentials.all_present():
        folder = root.data.node_credentials.path
        try:
            credentials = NodeCredentials.load(root.data.node_credentials)
            directory = root.esp.read_cluster_directory()
            roles = read_roles(root)
            # Not needed to run, but damage there is damage all the same:
            # the operator hears of it now, not at the next TPM unseal.
            root.esp.sealed_configuration.verify()
        except CorruptFile:
            raise  # names the file already
        except CredentialsError as e:
            # All three files are there (all_present): they do not parse
            # or do not fit together.
            reason = str(e).removeprefix(f"credentials in {folder}: ")
            raise CorruptFile(folder, reason, "restore the folder from a backup") from e
        except (LocalStorageError, OSError) as e:
            raise NodeRootError(f"{root.path} is half-written: {e}") from e
        return SavedNode(settings, None, credentials, directory, roles)

    if register_path(root).exists():
        return SavedNode(settings, None, None, None, None, _load_register_intent(root))
    path = bootstrap_path(root)
    if not os.path.lexists(path):
        # Only a registration crashed between its settings and its intent
        # leaves this (a bootstrap saves its intent first): nothing was sent.
        raise NodeRootError(
            f"{root.path} is half-written: neither credentials nor an intent (nothing reached "
            "the cluster): run 'node register' again with the same --root"
        )
    advice = f"remove {root.path} and bootstrap again"
    intent = _read_json(path, _BOOTSTRAP, advice)
    try:
        data = BootstrapData(
            node_private_key=pki.decode_private_key(bytes.fromhex(intent["node_private_key"])),
            join_private_key=pki.decode_private_key(bytes.fromhex(intent["join_private_key"])),
            cluster_unlock_key=bytes.fromhex(intent["cluster_unlock_key"]),
            node_unlock_key=bytes.fromhex(intent["node_unlock_key"]),
            initial_owner_key=bytes.fromhex(intent["initial_owner_key"]),
        )
    except (ValueError, KeyError, TypeError, pki.PKIError) as e:
        raise CorruptFile(
            path, f"its content does not parse ({type(e).__name__}: {e})", advice
        ) from e
    return SavedNode(settings, data, None, None, None)


def drop_finished_intents(root: Root) -> None:
    """Remove intents a crash left beside the credentials (:func:`load` ignores them).

    Does nothing for a root without credentials. Blocking I/O.
    """
    if root.data.node_credentials.all_present():
        bootstrap_path(root).unlink(missing_ok=True)
        register_path(root).unlink(missing_ok=True)


def finish_bootstrap(
    root: Root,
    settings: NodeSettings,
    *,
    roles: NodeRoles,
    directory: ClusterDirectory,
    sealed: SealedConfiguration,
    credentials: NodeCredentials,
    owner_certificate: bytes | None = None,
) -> None:
    """Persist a finished bootstrap or registration in crash-safe order, then drop the intent.

    :func:`save_cluster_files`, then :func:`save_credentials`. Blocking I/O
    (fsync): call it from a worker thread.
    """
    save_cluster_files(
        root,
        settings,
        roles=roles,
        directory=directory,
        sealed=sealed,
        owner_certificate=owner_certificate,
    )
    save_credentials(root, credentials)


def save_cluster_files(
    root: Root,
    settings: NodeSettings,
    *,
    roles: NodeRoles,
    directory: ClusterDirectory,
    sealed: SealedConfiguration,
    owner_certificate: bytes | None = None,
    staged_credentials: NodeCredentials | None = None,
) -> None:
    """Write and fsync what a node needs besides its credentials (first of two rounds).

    ``owner_certificate`` (PEM; the bootstrap node has one) goes to
    :func:`owner_certificate_path`; ``staged_credentials`` to
    :func:`staged_credentials_path`, for :func:`save_credentials`. Without
    credentials these files mean nothing to :func:`load`, so a bootstrap may
    write them before its cluster exists, and again if etcd turns out to
    hold other values. Blocking I/O; the fsyncs run in parallel (one
    journal commit for all).
    """
    write_checked(roles_path(root), _ROLES, bytes(roles), durable=False)
    root.esp.write_cluster_directory(directory, durable=False)
    sealed_file = root.esp.sealed_configuration
    sealed_file.seal(sealed, insecure=settings.insecure_seal, durable=False)
    paths = [roles_path(root), root.esp.cluster_directory, sealed_file.path]
    if owner_certificate is not None:
        atomic_write(owner_certificate_path(root), owner_certificate, durable=False)
        paths.append(owner_certificate_path(root))
    if staged_credentials is not None:
        paths += _stage(root, staged_credentials)
    make_durable(paths)


def _stage(root: Root, credentials: NodeCredentials) -> list[Path]:
    """Write ``credentials`` to the staging directory, unsynced; the files written."""
    staged = staged_credentials_path(root)
    credentials.save(staged, durable=False)
    return list(staged.files())


def _staged_are(root: Root, credentials: NodeCredentials) -> bool:
    """Whether the staging directory holds exactly ``credentials``."""
    staged = staged_credentials_path(root)
    try:
        return (
            staged.key.read_bytes() == pki.encode_private_key(credentials.private_key)
            and staged.certificate.read_bytes() == pki.encode_certificate(credentials.certificate)
            and staged.ca_certificate.read_bytes()
            == pki.encode_certificate(credentials.ca_certificate)
        )
    except OSError:
        return False


def save_credentials(root: Root, credentials: NodeCredentials) -> None:
    """Make ``credentials`` the node's, durably, all at once; then drop the intents.

    The last step of a bootstrap or registration: only after the cluster
    exists and :func:`save_cluster_files` returned (that order is what
    makes a node root crash-safe). The credentials go through the staging
    directory: if it holds ``credentials`` already (staged and fsynced by
    :func:`save_cluster_files`, while etcd started), this is one rename of
    the directory over the empty ``credentials/`` and one fsync of their
    parent; otherwise they are staged and fsynced first. A crash before
    the rename leaves the node without credentials (the bootstrap or
    registration resumes), never with some of them. Blocking I/O.
    """
    crash_point("finish-before-credentials")
    staged = staged_credentials_path(root)
    if not _staged_are(root, credentials):
        make_durable(_stage(root, credentials))
    crash_point("finish-credentials-staged")
    final = root.data.node_credentials
    try:
        os.rename(staged.path, final.path)
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        # Leftovers of a save that never completed (load() took no
        # credentials from there, or this would be no bootstrap), as
        # earlier versions, which wrote the files in place, could leave:
        # rename(2) replaces an empty directory only.
        for path in final.path.iterdir():
            if path.is_file() and not path.is_symlink():
                path.unlink()
        os.rename(staged.path, final.path)
    fsync_directory(final.path.parent)  # the rename survives a crash from here
    crash_point("finish-before-intent-removal")
    # Not fsynced: should the intent come back after a power cut, load()
    # prefers the credentials and the intent is ignored.
    bootstrap_path(root).unlink(missing_ok=True)
    register_path(root).unlink(missing_ok=True)
