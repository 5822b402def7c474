"""The role server: decides what this node runs, and runs its control plane.

* :mod:`.values`: the inputs (bootstrap data, cluster membership, roles).
* :mod:`.startup`: the pure ``reduce()`` from those inputs to a
  :class:`~.startup.ControlPlaneStartup`, and ``changed()``.
* :mod:`.controlplane`: the control-plane worker (mappers, reducer, launcher).
* :mod:`.disk`: what a node keeps on disk to bootstrap and restart.
* :mod:`.server`: :class:`~.server.RoleServer`, the role server of a whole
  node (the worker and the node's other runnables), as run by
  ``python -m metropolis node``.
* :mod:`.loopback`: a node root ready to bootstrap on loopback (tests,
  benchmarks, demos).
"""
