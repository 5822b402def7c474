"""Data private to a node (``private.proto``)."""

from metropolis.proto.gen.metropolis.proto.private import SealedConfiguration

__all__ = ["SealedConfiguration"]
