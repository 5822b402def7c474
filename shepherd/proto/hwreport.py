"""The agent's hardware report (``hwreport.proto``, package ``cloud.agent.api``)."""

from shepherd.proto.gen.cloud.agent.api import (
    BlockDevice,
    BlockDeviceProtocol,
    Cpu,
    CpuX8664,
    EfiSupport,
    NetworkInterface,
    Node,
)

__all__ = [
    "BlockDevice",
    "BlockDeviceProtocol",
    "Cpu",
    "CpuX8664",
    "EfiSupport",
    "NetworkInterface",
    "Node",
]
