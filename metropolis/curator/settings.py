"""The curator's settings a node saves: its leader lease's default TTL.

Apart from :mod:`.election` (which re-exports it) so that reading a node's
settings (the owner's commands do) imports nothing of the election or etcd.
"""

from __future__ import annotations

__all__ = ["DEFAULT_TTL"]

#: Seconds a dead leader can block the election (Monogon's default).
DEFAULT_TTL = 10
