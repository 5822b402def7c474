"""Python mirrors of the SQL enum types (see migrations/0001_initial.sql), and
of SQL's other fixed words the BMDB uses: the audit log's actions
(`Action`) and the isolation levels (`Isolation`).

Each member's value is the SQL label, so a member can be passed to a query
as is. Converting an unknown string raises `InvalidArgument`. Nothing here
needs the driver: the CLI parses these names before it connects.
"""

from __future__ import annotations

import enum
from typing import Self

from bmdb.errors import InvalidArgument


class _SQLEnum(enum.StrEnum):
    @classmethod
    def parse(cls, value: str) -> Self:
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(m.value for m in cls)
            raise InvalidArgument(f"unknown {cls.__name__} {value!r} (known: {known})") from None


class Process(_SQLEnum):
    """A kind of work on a machine; a machine has at most one work per process."""

    SHEPHERD_AGENT_START = "ShepherdAgentStart"
    SHEPHERD_RECOVERY = "ShepherdRecovery"
    SHEPHERD_PROVISION = "ShepherdProvision"
    SHEPHERD_DECOMMISSION = "ShepherdDecommission"
    SHEPHERD_UPGRADE = "ShepherdUpgrade"
    UNIT_TEST_1 = "UnitTest1"
    UNIT_TEST_2 = "UnitTest2"


class Provider(_SQLEnum):
    """Where a machine comes from."""

    EQUINIX = "Equinix"
    STATIC = "Static"


class ProviderStatus(_SQLEnum):
    """What the provider last said about a machine."""

    UNKNOWN = "Unknown"
    RUNNING = "Running"
    PROVISIONING = "Provisioning"
    PROVISIONING_FAILED_PERMANENT = "ProvisioningFailedPermanent"
    STOPPED = "Stopped"
    MISSING = "Missing"


class WorkEvent(_SQLEnum):
    """An entry kind of the work history."""

    STARTED = "Started"
    FINISHED = "Finished"
    FAILED = "Failed"
    CANCELED = "Canceled"


class Action(enum.StrEnum):
    """An operator action (the CLI's subcommand names)."""

    RETRY_NOW = "retry-now"
    HOLD = "hold"
    RELEASE = "release"
    FORGET_HOST_KEY = "forget-host-key"
    RECOVER_NOW = "recover-now"
    FORGET_MACHINE = "forget-machine"
    DECOMMISSION = "decommission"


class Isolation(enum.StrEnum):
    """Transaction isolation levels, as SQL spells them."""

    SERIALIZABLE = "SERIALIZABLE"
    REPEATABLE_READ = "REPEATABLE READ"
    READ_COMMITTED = "READ COMMITTED"
