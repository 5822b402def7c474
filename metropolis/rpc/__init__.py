"""The curator's RPC: gRPC on the wire, mutual TLS with Ed25519, on Trio.

A Go gRPC client built from the same ``.proto`` files can call our server,
and our client can call a Go server: requests are HTTP/2 POSTs of
length-prefixed protobuf messages answered with ``grpc-status`` trailers
(:mod:`metropolis.rpc.wire`), over TLS 1.3 with ALPN ``h2``
(:mod:`metropolis.rpc.tls`). The test suite proves it with Google's own
gRPC runtime (grpcio) calling our server.

Pieces:

- :mod:`~metropolis.rpc.method`: a method's path, types, shape and access.
- :mod:`~metropolis.rpc.auth`: identity = the peer certificate's public key
  (node certificate, or the owner's certificate), revocation per call, and
  a proof-of-possession signature for callers without a cluster certificate.
- :mod:`~metropolis.rpc.server`: handlers behind those checks; followers
  answer leader-only methods with UNAVAILABLE naming the leader.
- :mod:`~metropolis.rpc.channel`: one call on an HTTP/2 connection
  (:class:`StreamCall`), and :class:`Channel`, calls to one server over any
  byte stream (the node's etcd on its UNIX socket).
- :mod:`~metropolis.rpc.client`: calls one curator of a list, moving to
  another (or the named leader) when one stops or is not the leader.
- :mod:`~metropolis.rpc.transport`: one HTTP/2 connection (``h2``) over a
  Trio byte stream (``trio.SSLStream`` for the curator).
- :mod:`~metropolis.rpc.limits`: what one connection may make a server hold
  (message and buffer sizes, streams, frame, request and idle timeouts);
  anyone who reaches the port can try, before any authentication.

Why our own small gRPC on ``h2`` and Trio, and not a library
-------------------------------------------------------------
We weighed three stacks:

1. **grpclib behind trio-asyncio.** Mature, and it does Ed25519 mutual TLS;
   a handler can reach the peer certificate through the transport's SSL
   object. But every call crosses the asyncio/Trio bridge twice, and the
   semantics we need most live exactly on that bridge: a Trio cancellation
   (the role server tearing down its control plane) must become an asyncio
   cancellation of the right grpclib stream and an RST_STREAM, and a
   grpclib stream reset must cancel the Trio code running the handler.
   Server-streaming Watch handlers would be asyncio code or need a
   channel pair per stream across the bridge. Every entry point and test
   would also have to open a trio-asyncio loop, and every call would pay
   for the bridge in CPU.
2. **connectrpc (0.13) under hypercorn's Trio worker.** Native Trio and it
   speaks gRPC, but hypercorn does not hand the ASGI application the client
   certificate, and identity *is* the client certificate's key. Working
   around it means patching hypercorn internals.
3. **gRPC framing on the sans-IO ``h2`` library over Trio's TLS**
   (chosen; the TLS is now :mod:`~metropolis.rpc.pipe`'s memory-BIO
   ``ssl.SSLObject``, cheaper per write than ``trio.SSLStream``). The TLS
   object's ``getpeercert()`` gives the client certificate per
   connection; cancellation is plain Trio structured concurrency end to
   end: a handler is a Trio task in its connection's nursery, cancelled by
   the caller's RST_STREAM or by the connection ending, and a cancelled
   client call sends RST_STREAM. The cost is code of our own (server,
   client, framing, transport), kept to what the curator uses: unary,
   server-streaming and bidirectional calls, no compression. ``h2`` was already installed (grpclib
   depends on it) and is the maintained HTTP/2 state machine that hypercorn
   and httpx use.

Speed: ``python -m bench.rpc`` measures the CPU time of server and client
per unary call and per streamed message, Ed25519 mutual TLS on loopback,
as ratios to grpclib on plain asyncio and to grpclib bridged through
trio-asyncio, in the same run (December 2026, load 1.8: unary 0.85x
grpclib on asyncio, a streamed message 1.01x).

Wiring a curator: a :class:`Server` with :func:`server_context` (the
node's credentials) and a :class:`ServerSecurity` whose three hooks answer
from state the curator keeps current (the initial owner key, the cluster
CA's CRL, and the election: a leader says ``is_leader``, a follower names
the leader's node ID and, from its node status, its curator address);
handlers registered for the methods in :mod:`metropolis.rpc.methods`; served
on :data:`CURATOR_PORT`. A node calls through :func:`open_client` with
:func:`endpoints_from_directory` and :func:`client_context` (its node
certificate), or with a proof key and no certificate to register.

Cancellation semantics are stated in :mod:`~metropolis.rpc.server` and
:mod:`~metropolis.rpc.client`; errors are
:class:`~metropolis.rpc.status.RPCError` (a
:class:`~metropolis.errors.MetropolisError`).
"""

from typing import TYPE_CHECKING

from common.lazy import exports

# Imported on first use (common.lazy): a client (the owner's commands) does
# not import the server and its metrics.
if TYPE_CHECKING:
    from metropolis.rpc.auth import Leadership as Leadership
    from metropolis.rpc.auth import Peer as Peer
    from metropolis.rpc.auth import PeerKind as PeerKind
    from metropolis.rpc.auth import ServerSecurity as ServerSecurity
    from metropolis.rpc.auth import sign_proof as sign_proof
    from metropolis.rpc.channel import Channel as Channel
    from metropolis.rpc.channel import ChannelClosed as ChannelClosed
    from metropolis.rpc.channel import StreamCall as StreamCall
    from metropolis.rpc.client import CURATOR_PORT as CURATOR_PORT
    from metropolis.rpc.client import Client as Client
    from metropolis.rpc.client import Endpoint as Endpoint
    from metropolis.rpc.client import endpoints_from_directory as endpoints_from_directory
    from metropolis.rpc.client import open_client as open_client
    from metropolis.rpc.limits import Limits as Limits
    from metropolis.rpc.method import Access as Access
    from metropolis.rpc.method import Method as Method
    from metropolis.rpc.metrics import RPCMetrics as RPCMetrics
    from metropolis.rpc.server import CallContext as CallContext
    from metropolis.rpc.server import Server as Server
    from metropolis.rpc.status import LeaderHint as LeaderHint
    from metropolis.rpc.status import RPCError as RPCError
    from metropolis.rpc.status import Status as Status
    from metropolis.rpc.tls import client_context as client_context
    from metropolis.rpc.tls import server_context as server_context
else:
    __getattr__ = exports(
        __name__,
        {
            "metropolis.rpc.auth": [
                "Leadership",
                "Peer",
                "PeerKind",
                "ServerSecurity",
                "sign_proof",
            ],
            "metropolis.rpc.channel": ["Channel", "ChannelClosed", "StreamCall"],
            "metropolis.rpc.client": [
                "CURATOR_PORT",
                "Client",
                "Endpoint",
                "endpoints_from_directory",
                "open_client",
            ],
            "metropolis.rpc.limits": ["Limits"],
            "metropolis.rpc.method": ["Access", "Method"],
            "metropolis.rpc.metrics": ["RPCMetrics"],
            "metropolis.rpc.server": ["CallContext", "Server"],
            "metropolis.rpc.status": ["LeaderHint", "RPCError", "Status"],
            "metropolis.rpc.tls": ["client_context", "server_context"],
        },
    )

__all__ = [
    "CURATOR_PORT",
    "Access",
    "CallContext",
    "Channel",
    "ChannelClosed",
    "Client",
    "Endpoint",
    "LeaderHint",
    "Leadership",
    "Limits",
    "Method",
    "Peer",
    "PeerKind",
    "RPCError",
    "RPCMetrics",
    "Server",
    "ServerSecurity",
    "Status",
    "StreamCall",
    "client_context",
    "endpoints_from_directory",
    "open_client",
    "server_context",
    "sign_proof",
]
