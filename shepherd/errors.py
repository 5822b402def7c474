"""The exceptions of the ``shepherd`` package, one hierarchy rooted at
`ShepherdError`.

::

    ShepherdError
    ├── ProviderError              shepherd.providers: asking a provider failed
    │   ├── MachineNotFound        the provider does not know the machine
    │   ├── ProviderUnsupported    the provider cannot do that (see its capabilities)
    │   └── StaticFileError        .static: the machines file is unreadable or invalid
    ├── SSHError                   shepherd.ssh: talking to a machine over SSH
    │   ├── ConnectError           cannot connect
    │   │   └── ConnectTimeout     not within the connect timeout
    │   ├── AuthenticationError    the machine refused our key
    │   ├── HostKeyChanged         the machine's host key is not the recorded one
    │   └── ChannelError           the command channel failed
    ├── SSHKeyError                shepherd.ssh_key: the Shepherd's own key file
    ├── TakeoverFailed             shepherd.agent_start: the agent did not start
    ├── ProcessingFailed           shepherd.control_loop: a processor's verdict on
    │                              one machine (recorded as a failed work)
    ├── RateSyntaxError            shepherd.rate_limit: a bad rate (also a ValueError)
    ├── LocalSshdError             shepherd.localsshd: the local sshd did not start
    ├── LocalClusterError          shepherd.localcluster: the local first node failed
    ├── DemoFailed                 shepherd.demo_cluster: a step of the demo failed
    └── WorkdirError               shepherd.demo_workdir: the demo's folder is unusable

BMDB errors (`bmdb.errors.BMDBError`) pass through the Shepherd unchanged:
the control loop handles them (a new session), and the CLI reports them.
Other exceptions a public function may raise are Python's own, for misuse
(`ValueError`, `RuntimeError`), and Trio's `trio.Cancelled`. The takeover
agent (`shepherd.agent`) is outside this tree on purpose: it runs alone on
the target machine and imports nothing from the rest of the package.
``tests/test_error_trees.py`` checks the tree and what public functions
raise.
"""

from __future__ import annotations

__all__ = ["ShepherdError"]


class ShepherdError(Exception):
    """Base class of every error raised by the ``shepherd`` package."""
