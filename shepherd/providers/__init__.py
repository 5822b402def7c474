"""Machine providers: where machines come from and how to reach them.

A provider knows a fleet of machines by its own ids (``provider_id`` in the
BMDB's ``machine_provided`` tag) and can tell, for each, the address the
Shepherd dials. The interface is :class:`Provider`; what a provider can do
beyond listing (create, reboot, refresh) it says in ``capabilities``.
Implementations: :mod:`shepherd.providers.static` (a TOML list; machines with
a Redfish BMC, :mod:`shepherd.providers.redfish`, can be rebooted) and
:mod:`shepherd.providers.equinix` (Equinix Metal).
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
