"""A real node's gRPC servers (curator and debug port) survive a bad header.

Issue 24, finding 2: one HEADERS frame with a header value ``b"\\xff\\xfe"``
failed the curator and debug runnables, which the supervisor restarted, so
the owner's calls failed. Here a real ``metropolis node`` process gets that
frame on both ports; each refuses only that stream, the owner's calls still
work, and the supervisor never logs a restart.
"""

from __future__ import annotations

import signal
from pathlib import Path

import h2.errors
import trio
from hyperframe.frame import RstStreamFrame

from metropolis.identity import NodeCredentials
from metropolis.localstorage import Root
from metropolis.owner import load_owner_key, open_owner
from metropolis.rpc import Status, methods, wire
from tests.fixtures.rpc import RawPeer, grpc_request_headers, grpc_status
from tests.metropolis.test_node_cli import BOUND, LEADS, bootstrap_args, node


async def _bad_header_then_good_stream(port: int, root: Root, path: str) -> None:
    ca = NodeCredentials.load(root.data.node_credentials).ca_certificate
    peer = await RawPeer.connect(port, ca)
    try:
        assert await peer.start()
        assert await peer.headers(
            1, grpc_request_headers(path, (b"x-junk", b"\xff\xfe")), end_stream=True
        )
        answer = await peer.answer(1)
        assert isinstance(answer, RstStreamFrame), answer
        assert answer.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
        # The connection goes on (no certificate: UNAUTHENTICATED).
        assert await peer.headers(3, grpc_request_headers(path))
        assert await peer.data(3, wire.frame(b""), end_stream=True)
        assert grpc_status(await peer.answer(3)) == Status.UNAUTHENTICATED
    finally:
        await peer.aclose()


async def test_node_servers_survive_a_header_that_is_not_utf8(tmp_path: Path) -> None:
    args = bootstrap_args(tmp_path)
    curator_port = int(args[args.index("--curator-port") + 1])
    debug_port = int(args[args.index("--debug-port") + 1])
    root = Root(tmp_path / "n")
    with trio.fail_after(BOUND):
        async with node(*args) as proc:
            await proc.wait_for(LEADS)
            await proc.wait_for("status pushed")
            await _bad_header_then_good_stream(curator_port, root, methods.GET_NODES.path)
            await _bad_header_then_good_stream(debug_port, root, methods.GET_SUPERVISION_TREE.path)
            async with open_owner(root, load_owner_key(tmp_path / "owner.pem")) as owner:
                rows = await owner.nodes()
                assert len(rows) == 1
                tree = await owner.supervision_tree(rows[0])
                assert tree.runnables
            assert not proc.logged("restarting in"), "\n".join(proc.lines)
            proc.process.send_signal(signal.SIGTERM)
        assert proc.process.returncode == 0
