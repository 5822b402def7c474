"""The node half: what runs on every cluster node.

A supervision tree (`metropolis.supervisor`) of Trio runnables sharing
watchable values (`metropolis.event`); the consensus service
(`metropolis.consensus`: an etcd member, its peer PKI, a Trio-native etcd
client); keys and certificates (`metropolis.pki`, `metropolis.identity`);
the node's on-disk state (`metropolis.localstorage`). Errors derive from
`metropolis.errors.MetropolisError`.

ARCHITECTURE.md at the repository root draws the node's dataflow and the
rules every module keeps (task ownership, errors, cancellation).
"""
