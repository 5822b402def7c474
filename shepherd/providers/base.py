"""The provider interface and the machine record every provider returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from shepherd.errors import ShepherdError


class ProviderError(ShepherdError):
    """A provider could not answer. Subclasses say why."""


class MachineNotFound(ProviderError):
    """The provider has no machine with the requested id."""


class ProviderUnsupported(ProviderError):
    """The provider cannot do this at all (e.g. a static list creating machines)."""


class Availability(enum.Enum):
    """Whether a machine is free for the Shepherd to use, as far as the provider knows."""

    UNKNOWN = "unknown"
    KNOWN_UNUSED = "known_unused"
    KNOWN_USED = "known_used"
    POSSIBLY_USED = "possibly_used"


class Capability(enum.Enum):
    """Something a provider can do beyond knowing its machines.

    Callers check ``capability in provider.capabilities`` before they rely on
    one, instead of finding out from a :class:`ProviderUnsupported` late.
    """

    CREATE = "create"
    """``create_machine()`` makes new machines (e.g. deploys a reserved server)."""
    REBOOT = "reboot"
    """``reboot()`` power-cycles a machine (through the provider's API or a BMC)."""
    REFRESH = "refresh"
    """``get_machine()`` returns live state worth recording again (address, status)."""


@dataclass(frozen=True)
class Machine:
    """One machine as its provider describes it."""

    #: The provider's id for the machine (``provider_id`` in the BMDB).
    id: str
    #: Where to dial it, or None if the provider knows no address (yet).
    address: str | None
    port: int = 22
    location: str | None = None
    availability: Availability = Availability.UNKNOWN
    #: The provider reports the machine as broken (e.g. failed provisioning).
    #: Nothing reads it yet: the recoverer will (not built; see ARCHITECTURE.md).
    failed: bool = False


class Provider(Protocol):
    """A source of machines.

    Implementations must raise :class:`ProviderError` (or a subclass) for
    every failure they can name, so that callers can fail one machine's work
    and carry on with the next.
    """

    #: The provider's name as recorded in the BMDB (``machine_provided.provider``).
    @property
    def type(self) -> str: ...

    #: What this provider can do beyond listing and getting machines.
    @property
    def capabilities(self) -> frozenset[Capability]: ...

    async def list_machines(self) -> list[Machine]:
        """All machines this provider knows about."""
        ...

    async def get_machine(self, machine_id: str) -> Machine:
        """The machine with provider id ``machine_id``; :class:`MachineNotFound` if none."""
        ...

    async def create_machine(self) -> Machine:
        """Make a new machine; :class:`ProviderUnsupported` without ``Capability.CREATE``."""
        ...

    async def reboot(self, machine_id: str) -> None:
        """Power-cycle a machine; :class:`ProviderUnsupported` without ``Capability.REBOOT``."""
        ...
