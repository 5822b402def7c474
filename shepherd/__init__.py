"""The Shepherd: control loops that bring bare-metal machines under management.

Modules, by concept:

- :mod:`shepherd.initializer`: start the takeover agent on every provided
  machine that lacks one (the ``ShepherdAgentStart`` process), on
- :mod:`shepherd.control_loop`: N workers, each with its own BMDB session,
  sourcing one machine per rate-limited iteration (:mod:`shepherd.rate_limit`);
- :mod:`shepherd.agent_start`: the per-machine step: dial, upload, run, check;
- :mod:`shepherd.ssh`: the SSH client (the only module that uses asyncssh),
  authenticating with the key from :mod:`shepherd.ssh_key`;
- :mod:`shepherd.providers`: where machines come from (``static``: a TOML
  list, whose machines may have Redfish BMCs, :mod:`shepherd.providers.redfish`;
  ``equinix``: Equinix Metal devices on hardware reservations, with a local
  API server for tests and demos);
- :mod:`shepherd.provisioner`: reconcile a provider's machines with the BMDB,
  creating new ones where the provider can;
- :mod:`shepherd.updater`: refresh provided machines' address, location and
  status (power state, for BMCs) in the BMDB;
- :mod:`shepherd.agent`: the agent that gets uploaded (standard library only),
  as one zipapp that :mod:`shepherd.agent_bundle` builds;
- :mod:`shepherd.proto`: the takeover protocol messages;
- :mod:`shepherd.cli`: ``python -m shepherd``.

A machine's way through these steps, and the rules every module keeps, are
in ARCHITECTURE.md at the repository root.
"""
