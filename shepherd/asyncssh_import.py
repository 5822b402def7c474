"""asyncssh, imported without its import-time deprecation warnings.

asyncssh (2.24, the newest) names cryptography's DSA classes in its type
aliases, and cryptography 47 and later warns on every such name
(``CryptographyDeprecationWarning: DSA is deprecated``): five warnings on
the stderr of every command that imports it, where operators and scripts
expect one line. We never use DSA keys (`shepherd.ssh_key` is Ed25519), so
those warnings say nothing to us; any other warning still shows. Import
asyncssh from here: ``from shepherd.asyncssh_import import asyncssh``.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="DSA is deprecated")
    import asyncssh

__all__ = ["asyncssh"]
