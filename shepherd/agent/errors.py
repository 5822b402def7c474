"""The agent's errors: a failure it reports to the initializer, an install's, an upgrade's."""

from __future__ import annotations


class AgentError(Exception):
    """A failure the agent reports to the initializer as TakeoverError."""


class InstallFailed(AgentError):
    """An install failed; the message is the cause the report carries."""


class UpgradeFailed(AgentError):
    """An upgrade failed and nothing changed on the machine; the message is the cause."""
