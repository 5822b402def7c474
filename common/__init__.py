"""Small pieces shared by both halves (``metropolis`` and ``bmdb``/``shepherd``).

Only what more than one package needs and that belongs to none of them lives
here: one way to back off, the CLIs' error reporting, loopback helpers for the
embedded servers. Nothing here imports from the other packages.

Modules: `common.backoff` (retry waits with injected randomness),
`common.net` (loopback ports), `common.numbers` (strict decimal
numbers from the wire), `common.protobuf` (strict protobuf parsing).
See ARCHITECTURE.md at the repository root.
"""
