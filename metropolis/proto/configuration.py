"""What a new node is given before its first start (``configuration.proto``): messages."""

from metropolis.proto.gen.metropolis.proto.api import (
    NodeParameters,
    NodeParametersClusterBootstrap,
    NodeParametersClusterRegister,
    OsImageRef,
)

__all__ = [
    "NodeParameters",
    "NodeParametersClusterBootstrap",
    "NodeParametersClusterRegister",
    "OsImageRef",
]
