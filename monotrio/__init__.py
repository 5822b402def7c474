"""Small pieces shared by both halves (``metropolis`` and ``bmdb``/``shepherd``).

Only what more than one package needs and that belongs to none of them lives
here: one way to back off, the CLIs' error reporting, loopback helpers for the
embedded servers. Nothing here imports from the other packages.

Modules: `monotrio.backoff` (retry waits with injected randomness),
`monotrio.net` (loopback ports), `monotrio.numbers` (strict decimal
numbers from the wire), `monotrio.protobuf` (strict protobuf parsing).
See ARCHITECTURE.md at the repository root.
"""
