"""The provider interface and the machine record every provider returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from bmdb import ProviderStatus
from shepherd.errors import ShepherdError


class ProviderError(ShepherdError):
    """A provider could not answer. Subclasses say why."""


class MachineNotFound(ProviderError):
    """The provider has no machine with the requested id."""


class ProviderUnsupported(ProviderError):
    """The provider cannot do this at all (e.g. a static list creating machines)."""


class PowerState(enum.Enum):
    """A machine's power state as its BMC reports it (Redfish ``PowerState`` values)."""

    ON = "On"
    OFF = "Off"
    POWERING_ON = "PoweringOn"
    POWERING_OFF = "PoweringOff"
    PAUSED = "Paused"


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
    """``creation_slots()`` and ``create_machine()`` make new machines
    (e.g. deploy a server on a hardware reservation)."""
    REBOOT = "reboot"
    """``reboot()`` power-cycles a machine (through the provider's API or a BMC)."""
    REFRESH = "refresh"
    """``refresh()`` returns live state worth recording again (address, status, power)."""


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
    #: What the provider says about the machine's life cycle, None if it says nothing.
    status: ProviderStatus | None = None
    #: Power state read from the machine's BMC, None if not known (no BMC, not asked).
    power: PowerState | None = None
    #: Redfish ComputerSystem URL of the machine's BMC, None if it has none.
    bmc: str | None = None


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

    async def creation_slots(self) -> list[str]:
        """Where new machines can be made now (e.g. free hardware reservation ids).

        Empty without ``Capability.CREATE``. Slots that recently failed are
        left out by the provider itself.
        """
        ...

    async def create_machine(self, slot: str) -> Machine:
        """Make a new machine in ``slot`` (one of :meth:`creation_slots`).

        Must be idempotent: called again for the same slot after an error, it
        returns the machine made by the first call instead of making a second.
        :class:`ProviderUnsupported` without ``Capability.CREATE``.
        """
        ...

    async def refresh(self, machine_id: str) -> Machine:
        """Live state of one machine (address, status and, with a BMC, power).

        Slower than :meth:`get_machine` (it may ask a BMC). Without
        ``Capability.REFRESH`` it returns what :meth:`get_machine` returns.
        """
        ...

    async def reboot(self, machine_id: str) -> None:
        """Power-cycle a machine; :class:`ProviderUnsupported` without ``Capability.REBOOT``
        (or for a machine the provider cannot reboot, e.g. one without a BMC)."""
        ...

    async def release(self, machine_id: str) -> str:
        """Give a decommissioned (wiped) machine back; returns one line saying
        how. Idempotent: a machine released already is released. Raises
        :class:`ProviderError` if the provider refuses or cannot be reached."""
        ...


def describe(exc: BaseException) -> str:
    """The first non-empty message along ``exc``'s cause chain.

    Some library errors (httpx connection errors under Trio) carry no message
    of their own; the reason (refused, TLS verification failed) is in a cause.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if str(seen):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return "no detail"
