"""Machines that are real Linux systems: ``systemd-nspawn --boot`` containers.

Where the loopback fleet (`shepherd.localfleet`) gives each machine a folder
and a port, these have what a server has: systemd as PID 1, sshd on port 22
of an address of their own, a NIC in their own network namespace, a real
block device, and power through a Redfish BMC. One idea per module:

* `shepherd.nspawn.rootfs`   the Debian 12 root (mmdebstrap), cached by its request
* `shepherd.nspawn.network`  the fleet's bridge and each machine's namespace and veth
* `shepherd.nspawn.disk`     a sparse file on a loop device (and how partitions show)
* `shepherd.nspawn.machine`  one machine: its overlay root, nspawn, power
* `shepherd.nspawn.bmc`      a Redfish service powering the machines
* `shepherd.nspawn.fleet`    all of it together, stopped in order (`open_fleet`)

``python -m shepherd.nspawn up --machines N`` brings a fleet up for an
operator and prints each machine's address and BMC URL. Needs root.
"""
