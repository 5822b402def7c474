"""grpclib's client stub and server base for the two Management methods `bench.rpc` calls.

The baseline of `bench.rpc` is grpclib, the gRPC library betterproto2
generates stubs for. The product's generated classes carry no service
stubs (``tools/genproto.py``: grpclib and asyncio are a quarter of a node's
imports, and the product speaks gRPC through :mod:`metropolis.rpc`), so the
benchmark spells out the two it needs, as betterproto2's compiler writes
them, over the product's message classes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpclib
import grpclib.const
import grpclib.server
from betterproto2.grpclib import ServiceBase, ServiceStub

from metropolis.proto import management

__all__ = ["ManagementBase", "ManagementStub"]

_INFO = "/metropolis.proto.api.Management/GetClusterInfo"
_NODES = "/metropolis.proto.api.Management/GetNodes"


class ManagementStub(ServiceStub):
    """The client side: a unary call and a server stream."""

    async def get_cluster_info(
        self, message: management.GetClusterInfoRequest
    ) -> management.GetClusterInfoResponse:
        return await self._unary_unary(_INFO, message, management.GetClusterInfoResponse)

    async def get_nodes(
        self, message: management.GetNodesRequest
    ) -> AsyncIterator[management.Node]:
        async for response in self._unary_stream(_NODES, message, management.Node):
            yield response


class ManagementBase(ServiceBase):
    """The server side: override both methods."""

    async def get_cluster_info(
        self, message: management.GetClusterInfoRequest
    ) -> management.GetClusterInfoResponse:
        raise grpclib.GRPCError(grpclib.const.Status.UNIMPLEMENTED)

    async def get_nodes(
        self, message: management.GetNodesRequest
    ) -> AsyncIterator[management.Node]:
        raise grpclib.GRPCError(grpclib.const.Status.UNIMPLEMENTED)
        yield management.Node()  # a generator, as the override is

    async def _rpc_get_cluster_info(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(await self.get_cluster_info(request))

    async def _rpc_get_nodes(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await self._call_rpc_handler_server_stream(self.get_nodes, stream, request)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            _INFO: grpclib.const.Handler(
                self._rpc_get_cluster_info,
                grpclib.const.Cardinality.UNARY_UNARY,
                management.GetClusterInfoRequest,
                management.GetClusterInfoResponse,
            ),
            _NODES: grpclib.const.Handler(
                self._rpc_get_nodes,
                grpclib.const.Cardinality.UNARY_STREAM,
                management.GetNodesRequest,
                management.Node,
            ),
        }
