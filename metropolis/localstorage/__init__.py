"""The node's on-disk layout, atomic file writes, and the sealed configuration.

One root directory per node::

    <root>/
      data/                       persistent, private (0700)
        etcd/                     consensus member state
          data/                   etcd's --data-dir
          peer_pki/               ca.pem, cert.pem, key.pem   (peer TLS)
          peer_crl.pem            CRL etcd re-reads per peer connection
        node/credentials/         ca.pem, cert.pem, key.pem   (node identity)
      ephemeral/                  cleared on boot on a real node, private (0700)
        consensus/                etcd's working dir: client socket "client.sock:0"
      esp/                        what the boot partition holds
        cluster_directory.pb      ClusterDirectory (who to contact), 0644
        sealed_configuration.pb   SealedConfiguration (node secrets), 0600

Every file is written with :func:`atomic_write` so that a crash leaves
either the old or the new content, never a torn mix: readers (and etcd, for
the CRL) never observe half a file.

Checked files. A file that is still short or different from what was
written can then only come from outside damage (a disk, a copy, a hand),
and protobuf cannot tell: betterproto2 parses a message cut at a field
boundary as a shorter valid one, and keeps unparseable tails as unknown
fields, so a ``roles.pb`` cut in half reads as a node without roles. The
node's own state files (the cluster directory, the sealed configuration,
and in :mod:`metropolis.roleserve.disk` the settings, intents and roles)
are therefore written by :func:`write_checked` behind one header line::

    METROPOLIS-FILE 1 <kind> <payload length> <SHA-256 of the payload, hex>\n<payload>

and read by :func:`read_checked`, which gives :class:`CorruptFile` naming
the file for a missing or malformed header, another kind, a format version
it does not know, a length or a digest that does not match. A text header
keeps the JSON files readable (``tail -n +2``); the kind catches one file
copied over another; the version leaves room for a TPM-sealed payload.
Files without the header (written before it existed) are refused the same
way rather than read unchecked: without it, damage cannot be told from
content, which is the very failure the header removes; such a root is
bootstrapped or registered anew. PEM files (credentials, peer PKI, the
owner certificate) stay plain: etcd reads some of them, and their parsers
plus :class:`~metropolis.identity.NodeCredentials`' checks (key, certificate
and CA fit together) already refuse a cut or changed one.

Root checks. :meth:`Root.check` is what every entry point that opens a
root runs first (``node bootstrap``, ``register``, ``run``, ``owner``;
through :meth:`Root.create` and :func:`metropolis.roleserve.disk.load`):
the root, every folder and file under it owned by us and not writable by
group or others, secrets under ``data/`` and the sealed configuration not
readable by them either, no symlink anywhere, and no folder above the root
that another user could rename it out of. It refuses with
:class:`UnsafeRootError`, naming the path, its mode and the command that
fixes it; it never changes a mode itself (who loosened it, and did they
swap something meanwhile, is the operator's question).

Where each idea lives: ``layout`` (the records below), ``checked`` (the
header), ``rootcheck`` (the root checks), ``fs`` (descriptor-based folders
and reads), ``errors``; the atomic write is :mod:`common.durable`'s.

Path objects here are plain records; nothing touches the disk until a method
says so (:meth:`Root.create`, :func:`atomic_write`, :meth:`SealedConfigurationFile.seal`).
"""

from __future__ import annotations

from metropolis.localstorage.checked import (
    checked_content,
    parse_checked,
    read_checked,
    write_checked,
)
from metropolis.localstorage.errors import (
    CorruptFile,
    InsecureSealError,
    LocalStorageError,
    UnsafeRootError,
)
from metropolis.localstorage.fs import read_file
from metropolis.localstorage.layout import (
    DataDirectory,
    EphemeralDirectory,
    ESPDirectory,
    EtcdDataDirectory,
    PKIDirectory,
    Root,
    SealedConfigurationFile,
)

__all__ = [
    "CorruptFile",
    "DataDirectory",
    "ESPDirectory",
    "EphemeralDirectory",
    "EtcdDataDirectory",
    "InsecureSealError",
    "LocalStorageError",
    "PKIDirectory",
    "Root",
    "SealedConfigurationFile",
    "UnsafeRootError",
    "checked_content",
    "parse_checked",
    "read_checked",
    "read_file",
    "write_checked",
]
