"""An installation request, checked: the `Plan` of one install, or the cause it is refused for.

What a request must keep before the install does anything (`check_request`):
node parameters within a bound, a ``root_device`` that is one of the
loopback disks (`disks`) or a real disk as the hardware report names it
(its serial number, or its kernel name without one: `disks.real_disks`;
else a node /dev/<name>) that `blockdev.check_device` accepts, a node
address that is an IP address or a host name, and an image reference
(`image_source`, which an upgrade request's image keeps too): a SHA-256
digest, https (or http when the agent's own endpoint is http), HOST[:PORT].
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re

from . import blockdev, bootentry, gpt
from .disks import real_disks, resolve_real, valid_name
from .download import Source
from .errors import InstallFailed
from .wire import InstallationRequest, OSImageRef

#: Bound on the raw NodeParameters a request may carry.
MAX_NODE_PARAMETERS = 1024 * 1024
BLOCK_DEVICE_REFUSAL = (
    "installing onto a block device is not implemented: a real install would partition, "
    "write the image, add a boot entry and reboot"
)

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_HOST = re.compile(r"(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9.-]+))(?::([0-9]{1,5}))?")
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked request: what to download from where, and where to put it."""

    generation: int
    disk: str
    scheme: str
    host: str
    port: int
    path: str
    digest: str  # 64 lowercase hex
    node_parameters: bytes
    node_address: str
    #: A real block device's path ("" for a loopback disk); ``disk`` is then
    #: the folder the download's temporary file goes to.
    device: str = ""

    @property
    def source(self) -> Source:
        return Source(self.scheme, self.host, self.port, self.path)


def _valid_host_name(name: str) -> bool:
    labels = name.rstrip(".").split(".") if len(name) <= 253 else []
    return (
        bool(labels)
        and all(_LABEL.fullmatch(label) for label in labels)
        and not (
            labels[-1].isdigit()  # 1.2.3.999 is a bad address, not a name
        )
    )


def _valid_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return _valid_host_name(text)
    return True


def _has_boot_entry(target: bootentry.Target) -> bool:
    return os.path.exists(os.path.join(target.systemd_root, bootentry.NODE_UNIT))


def real_device_name(name: str, loopback: dict[str, str]) -> str:
    """The kernel name of the device a request's ``root_device`` names, when
    it is no loopback disk: the real disk the hardware report names so
    (`disks.real_disks`), else a node ``/dev/<name>`` (which
    `blockdev.check_device` then judges: a character device, a partition,
    a RAM disk are refused there). InstallFailed if it names nothing."""
    real = real_disks()
    try:
        found = resolve_real(name, real)
    except ValueError as exc:
        raise InstallFailed(str(exc)) from exc
    if found is not None:
        return found
    if valid_name(name) and os.path.lexists(f"/dev/{name}"):
        return name
    listed = ", ".join(loopback) or "none"
    named = ", ".join(d.name for d in real) or "none"
    raise InstallFailed(
        f"root device {name!r} is not one of this machine's loopback disks ({listed}) "
        f"nor of its real disks ({named})"
    )


def check_request(
    request: InstallationRequest,
    disks: dict[str, str],
    endpoint_scheme: str,
    layout: gpt.Layout | None = None,
    work_dir: str = "",
    target: bootentry.Target | None = None,
) -> Plan:
    """The plan of a request, or InstallFailed with the cause it is refused for.
    ``target``: where this agent's installs put their boot entry; a device
    one of them runs from (its data mounted there) is not refused as
    mounted, since the install stops that node first."""
    m = request.metropolis
    if m is None:
        raise InstallFailed("the request holds no Metropolis installation")
    if m.node_parameters is None:
        raise InstallFailed("the request holds no node_parameters")
    if len(m.node_parameters) > MAX_NODE_PARAMETERS:
        raise InstallFailed(
            f"node_parameters of {len(m.node_parameters)} bytes, over the bound of "
            f"{MAX_NODE_PARAMETERS}"
        )
    name = m.root_device
    device = ""
    if name not in disks:
        kernel_name = real_device_name(name, disks)
        if layout is None:
            raise InstallFailed(f"root device {name}: {BLOCK_DEVICE_REFUSAL}")
        own = target.mount_point if target is not None and _has_boot_entry(target) else None
        try:
            device = blockdev.check_device(kernel_name, layout, own_mount=own)
        except blockdev.DeviceRefused as exc:
            raise InstallFailed(str(exc)) from exc
    if not _valid_address(m.node_address):
        raise InstallFailed(f"node_address {m.node_address!r} is not an IP address or host name")
    image = m.os_image
    if image is None:
        raise InstallFailed("the request holds no os_image")
    source, digest = image_source(image, endpoint_scheme)
    return Plan(
        generation=request.generation,
        disk=work_dir if device else disks[m.root_device],
        scheme=source.scheme,
        host=source.host,
        port=source.port,
        path=source.path,
        digest=digest,
        node_parameters=m.node_parameters,
        node_address=m.node_address,
        device=device,
    )


def image_source(image: OSImageRef, endpoint_scheme: str) -> tuple[Source, str]:
    """Where an OSImageRef's image is downloaded from, and its hex SHA-256;
    InstallFailed with the cause a request is refused for."""
    digest = _DIGEST.fullmatch(image.digest)
    if digest is None:
        raise InstallFailed(f"image digest {image.digest!r} is not sha256:<64 lowercase hex>")
    if image.scheme not in ("http", "https"):
        raise InstallFailed(f"image scheme {image.scheme!r} is neither https nor http")
    if image.scheme == "http" and endpoint_scheme != "http":
        raise InstallFailed("a plain http image is refused: the agent's endpoint uses https")
    host = _HOST.fullmatch(image.host)
    if host is None:
        raise InstallFailed(f"image host {image.host!r} is not HOST[:PORT]")
    v6, name_or_v4, port_text = host.groups()
    port = int(port_text) if port_text else (443 if image.scheme == "https" else 80)
    if v6 is not None:
        try:
            ipaddress.IPv6Address(v6)
        except ValueError:
            raise InstallFailed(f"image host {image.host!r} is not HOST[:PORT]") from None
    elif not _valid_address(name_or_v4):
        raise InstallFailed(f"image host {image.host!r} is not HOST[:PORT]")
    if not 0 < port < 65536:
        raise InstallFailed(f"image host {image.host!r}: port out of range")
    source = Source(
        image.scheme,
        v6 if v6 is not None else name_or_v4,
        port,
        f"/images/sha256/{digest.group(1)}",
    )
    return source, digest.group(1)
