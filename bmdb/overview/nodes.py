"""Which machine runs which cluster node: the machines whose current
installation reported each node key (the web UI's cluster page joins a
cluster's nodes to the fleet by it).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from bmdb._pg import Row
from bmdb.connection import Connection
from bmdb.errors import InvalidArgument
from bmdb.model import Queries
from bmdb.transaction import Isolation

#: The machines whose current installation succeeded with one of the node
#: keys %(keys)s (a report on an older generation names no node any more).
NODE_MACHINES_SQL = """
SELECT orp.node_public_key, orp.machine_id FROM machine_os_installation_report orp
JOIN machine_os_installation_request oq
  ON oq.machine_id = orp.machine_id AND oq.generation = orp.generation
WHERE orp.success AND orp.node_public_key = ANY(%(keys)s::bytea[])
ORDER BY orp.machine_id
"""

#: The most node keys `machines_of_nodes` looks up at once.
MAX_NODE_KEYS = 10_000


async def machines_of_nodes(
    conn: Connection, public_keys: Sequence[bytes]
) -> dict[bytes, tuple[uuid.UUID, ...]]:
    """The machines installed with each of the nodes ``public_keys`` (raw
    Ed25519 keys, as the install reports carry them), by key; a key no
    current report names is absent. Normally one machine per key: two
    means two agents reported the same node, which the views show as is.
    `InvalidArgument` for more than `MAX_NODE_KEYS` keys or a key that is
    not 32 bytes."""
    keys = [bytes(k) for k in public_keys]
    if len(keys) > MAX_NODE_KEYS:
        raise InvalidArgument(f"at most {MAX_NODE_KEYS} node keys at once, got {len(keys)}")
    if any(len(k) != 32 for k in keys):
        raise InvalidArgument("a node public key is 32 bytes")
    if not keys:
        return {}

    async def body(q: Queries) -> list[Row]:
        return await q.execute(NODE_MACHINES_SQL, {"keys": keys})

    found: dict[bytes, tuple[uuid.UUID, ...]] = {}
    for key, machine_id in await conn.transact(body, isolation=Isolation.REPEATABLE_READ):
        found[bytes(key)] = (*found.get(bytes(key), ()), machine_id)
    return found
