"""The takeover protocol (``agent.proto``, package ``cloud.agent.api``)."""

from shepherd.proto.gen.cloud.agent.api import (
    TakeoverError,
    TakeoverInit,
    TakeoverResponse,
    TakeoverSuccess,
)

__all__ = ["TakeoverError", "TakeoverInit", "TakeoverResponse", "TakeoverSuccess"]
