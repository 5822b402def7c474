"""The hardware report: this machine described as a cloud.agent.api.Node.

Read from /proc and /sys. Every probe is best effort: what cannot be read is
left out and said in a warning, never fatal, because a report with gaps is
still worth more to the operator than none.
"""

from __future__ import annotations

import os

from .disks import LOOPBACK_MODEL, LOOPBACK_VENDOR, loopback_disks, real_disks
from .files import read_int, read_text
from .wire import (
    EFI_SUPPORT_ENABLED,
    EFI_SUPPORT_UNKNOWN,
    PROTOCOL_MMC,
    PROTOCOL_NVME,
    PROTOCOL_SCSI,
    PROTOCOL_UNKNOWN,
    HwBlockDevice,
    HwCPU,
    HwNetworkInterface,
    HwNode,
)


def _cpus(warnings: list[str]) -> list[HwCPU]:
    """One entry per socket ("physical id"), from /proc/cpuinfo."""
    text = read_text("/proc/cpuinfo")
    if text is None:
        warnings.append("cannot read /proc/cpuinfo")
        return []
    sockets: dict[str, HwCPU] = {}
    for block in text.split("\n\n"):
        info: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                info[key.strip()] = value.strip()
        if "processor" not in info:
            continue
        cpu = sockets.setdefault(info.get("physical id", "0"), HwCPU())
        cpu.hardware_threads += 1
        cpu.vendor = cpu.vendor or info.get("vendor_id", "")
        cpu.model = cpu.model or info.get("model name", "")
        if info.get("cpu cores", "").isdigit():
            cpu.cores = int(info["cpu cores"])
        numbers = [info.get(k, "") for k in ("cpu family", "model", "stepping")]
        if cpu.x86_64 is None and all(n.isdigit() for n in numbers):
            cpu.x86_64 = (int(numbers[0]), int(numbers[1]), int(numbers[2]))
    for cpu in sockets.values():
        cpu.cores = cpu.cores or cpu.hardware_threads
    return list(sockets.values())


def _memory(node: HwNode, warnings: list[str]) -> None:
    """Installed memory from the online memory blocks in sysfs; MemTotal as usable."""
    total_kib = None
    for line in (read_text("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            total_kib = int(line.split()[1])
    base = "/sys/devices/system/memory"
    block = read_text(f"{base}/block_size_bytes")
    installed = 0
    if block is not None:
        try:
            names = os.listdir(base)
        except OSError:
            names = []
        online = sum(
            1 for n in names if n.startswith("memory") and read_text(f"{base}/{n}/online") == "1"
        )
        installed = online * int(block, 16)
    if not installed and total_kib:
        warnings.append("no memory blocks in sysfs; installed memory is MemTotal")
        installed = total_kib * 1024
    node.memory_installed_bytes = installed
    if installed and total_kib:
        node.memory_usable_ratio = min(1.0, total_kib * 1024 / installed)


def _block_devices() -> list[HwBlockDevice]:
    """The real disks (`disks.real_disks`); one without a serial number is
    named by its kernel name there, the name a request gives it."""
    devices = []
    for disk in real_disks():
        name = disk.kernel_name
        base = f"/sys/block/{name}"
        protocol = PROTOCOL_UNKNOWN
        if name.startswith("nvme"):
            protocol = PROTOCOL_NVME
        elif name.startswith("mmcblk"):
            protocol = PROTOCOL_MMC
        elif name.startswith("sd"):
            protocol = PROTOCOL_SCSI
        wwid = read_text(f"{base}/wwid") or read_text(f"{base}/device/wwid") or ""
        devices.append(
            HwBlockDevice(
                vendor=read_text(f"{base}/device/vendor") or "",
                device_model=read_text(f"{base}/device/model") or "",
                serial_number=disk.name,
                wwn=wwid.encode("utf-8"),
                rotational=read_text(f"{base}/queue/rotational") == "1",
                capacity_bytes=(read_int(f"{base}/size") or 0) * 512,
                logical_block_size_bytes=read_int(f"{base}/queue/logical_block_size") or 0,
                physical_block_size_bytes=read_int(f"{base}/queue/physical_block_size") or 0,
                protocol=protocol,
            )
        )
    return devices


def _loopback_devices(agent_dir: str) -> list[HwBlockDevice]:
    """The loopback disks (`disks`), their capacity the space free beneath them."""
    devices = []
    for name, path in loopback_disks(agent_dir).items():
        try:
            fs = os.statvfs(path)
            capacity, block = fs.f_bavail * fs.f_frsize, fs.f_bsize
        except OSError:
            capacity = block = 0
        devices.append(
            HwBlockDevice(
                vendor=LOOPBACK_VENDOR,
                device_model=LOOPBACK_MODEL,
                serial_number=name,
                capacity_bytes=capacity,
                logical_block_size_bytes=block,
                physical_block_size_bytes=block,
            )
        )
    return devices


#: Virtual links that are not a machine's NIC (ARPHRD_ETHER all the same).
_NOT_NICS = ("bridge", "bonding", "tun_flags", "team")


def _nic_names(names: list[str]) -> list[str]:
    """The NICs among the interfaces: those with a backing device; on a
    machine with none (a container: its NIC is one end of a veth pair), its
    Ethernet links instead, but for bridges, bonds, teams and tun/tap."""
    physical = [n for n in names if os.path.exists(f"/sys/class/net/{n}/device")]
    if physical:
        return physical
    return [
        n
        for n in names
        if read_text(f"/sys/class/net/{n}/type") == "1"  # ARPHRD_ETHER
        and not any(os.path.exists(f"/sys/class/net/{n}/{m}") for m in _NOT_NICS)
    ]


def _network_interfaces() -> list[HwNetworkInterface]:
    """The NICs (`_nic_names`), with their MACs."""
    nics = []
    try:
        names = sorted(os.listdir("/sys/class/net"))
    except OSError:
        return []
    for name in _nic_names(names):
        base = f"/sys/class/net/{name}"
        try:
            mac = bytes.fromhex((read_text(f"{base}/address") or "").replace(":", ""))
        except ValueError:
            mac = b""
        try:
            driver = os.path.basename(os.readlink(f"{base}/device/driver"))
        except OSError:
            driver = ""
        speed = read_int(f"{base}/speed")  # Mbit/s; -1 or unreadable when down
        nics.append(
            HwNetworkInterface(
                mac=mac,
                driver=driver,
                link_up=read_text(f"{base}/carrier") == "1",
                current_speed_bytes=speed * 125_000 if speed and speed > 0 else 0,
            )
        )
    return nics


def collect_hardware_report(agent_dir: str | None = None) -> tuple[HwNode, list[str]]:
    """Describe this machine; return the report and the warnings met.

    With ``agent_dir``, the loopback disks beside the agent follow the real
    block devices."""
    warnings: list[str] = []
    dmi = "/sys/class/dmi/id"
    node = HwNode(
        manufacturer=read_text(f"{dmi}/sys_vendor") or "",
        product=read_text(f"{dmi}/product_name") or "",
        serial_number=read_text(f"{dmi}/product_serial") or "",
    )
    if not os.path.isdir(dmi):
        warnings.append("no DMI data in /sys/class/dmi/id")
    node.efi_support = (
        EFI_SUPPORT_ENABLED if os.path.isdir("/sys/firmware/efi") else EFI_SUPPORT_UNKNOWN
    )
    node.cpu = _cpus(warnings)
    _memory(node, warnings)
    node.block_device = _block_devices()
    if agent_dir is not None:
        node.block_device += _loopback_devices(agent_dir)
    node.network_interface = _network_interfaces()
    return node, warnings
