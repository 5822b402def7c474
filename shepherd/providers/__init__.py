"""Machine providers: where machines come from and how to reach them.

A provider knows a fleet of machines by its own ids (``provider_id`` in the
BMDB's ``machine_provided`` tag) and can tell, for each, the address the
Shepherd dials. The interface is :class:`Provider`; implementations live one
per module here (:mod:`shepherd.providers.static`, ...).
"""

from __future__ import annotations

from shepherd.providers.base import (
    Availability,
    Capability,
    Machine,
    MachineNotFound,
    PowerState,
    Provider,
    ProviderError,
    ProviderUnsupported,
)

__all__ = [
    "Availability",
    "Capability",
    "Machine",
    "MachineNotFound",
    "PowerState",
    "Provider",
    "ProviderError",
    "ProviderUnsupported",
]
