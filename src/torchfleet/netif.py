"""Network interfaces: which exist, their addresses, and which one reaches a host.

`torchfleet doctor` lists them; a multi-machine launch needs the interface
that routes to the master (to set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME).
No torch import here: this module must stay cheap and usable before torch loads.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SYS_NET = Path("/sys/class/net")
LOOPBACK = "127.0.0.1"

# ARPHRD_* link types from <linux/if_arp.h>, as found in /sys/class/net/<n>/type.
_KINDS = {1: "ethernet", 32: "infiniband", 772: "loopback"}

_IFF_UP = 0x1  # <linux/if.h>
_IFF_LOOPBACK = 0x8
_SIOCGIFADDR = 0x8915  # ioctl: the IPv4 address of an interface


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: tuple[str, ...]  # IPv4 first, then IPv6
    is_loopback: bool
    is_up: bool
    kind: str  # "ethernet", "loopback", "infiniband" or "other"


def _read_sys(name: str, field: str) -> str | None:
    try:
        return (SYS_NET / name / field).read_text().strip()
    except OSError:
        return None


def _kind(name: str) -> str:
    raw = _read_sys(name, "type")
    return _KINDS.get(int(raw), "other") if raw and raw.isdigit() else "other"


def _from_ip_json(entries: list[dict]) -> list[Interface]:
    result = []
    for entry in entries:
        name = entry["ifname"]
        flags = entry.get("flags", [])
        infos = entry.get("addr_info", [])
        # IPv4 first: it is what Gloo and NCCL bind to by default.
        v4 = [a["local"] for a in infos if a.get("family") == "inet"]
        v6 = [a["local"] for a in infos if a.get("family") == "inet6"]
        result.append(
            Interface(
                name=name,
                addresses=tuple(v4 + v6),
                is_loopback="LOOPBACK" in flags,
                is_up="UP" in flags,
                kind=_kind(name),
            )
        )
    return result


def _via_ip_command() -> list[Interface] | None:
    """Parse `ip -j addr`; None when the binary is missing or its output is unusable."""
    ip = shutil.which("ip")
    if ip is None:
        return None
    try:
        out = subprocess.run([ip, "-j", "addr"], capture_output=True, text=True, timeout=5)
        return _from_ip_json(json.loads(out.stdout)) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        return None  # old iproute2 without -j, or a sandbox that forbids it


def _ipv4_of(name: str) -> str | None:
    import fcntl  # Unix only; imported here so the module loads everywhere

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, name.encode()[:15].ljust(256, b"\0"))
        except OSError:
            return None  # no IPv4 address on this interface
    return socket.inet_ntoa(packed[20:24])  # struct ifreq: 16-byte name, then sockaddr_in


def _ipv6_by_name() -> dict[str, list[str]]:
    """IPv6 addresses from /proc/net/if_inet6 (hex address, ..., interface name)."""
    found: dict[str, list[str]] = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) == 6:
            found.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(int(fields[0], 16))))
    return found


def _via_ioctl() -> list[Interface]:
    v6 = _ipv6_by_name()
    result = []
    for _, name in socket.if_nameindex():
        raw_flags = _read_sys(name, "flags")
        flags = int(raw_flags, 16) if raw_flags else 0
        v4 = _ipv4_of(name)
        kind = _kind(name)
        result.append(
            Interface(
                name=name,
                addresses=tuple(([v4] if v4 else []) + v6.get(name, [])),
                is_loopback=bool(flags & _IFF_LOOPBACK) or kind == "loopback",
                is_up=bool(flags & _IFF_UP),
                kind=kind,
            )
        )
    return result


def list_interfaces() -> list[Interface]:
    """Every network interface with its IPv4 (then IPv6) addresses."""
    found = _via_ip_command()
    return found if found is not None else _via_ioctl()


def addresses_of(host: str) -> list[str]:
    """The IP addresses `host` resolves to (IPv4 first); [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return []
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def is_local(host: str) -> bool:
    """Whether `host` names this machine: loopback, or an address of one of its interfaces."""
    found = addresses_of(host)
    mine = {a for i in list_interfaces() for a in i.addresses}
    return bool(found) and all(is_loopback(a) or a in mine for a in found)


def source_address(dest: str) -> str | None:
    """The local address the kernel would send from to reach `dest`; None if unroutable."""
    return _source_address(dest)


def _source_address(dest: str) -> str | None:
    """The local address the kernel would send from to reach `dest`; None if unroutable."""
    try:
        infos = socket.getaddrinfo(dest, 9, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    # Prefer IPv4, as the distributed backends do.
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect(sockaddr)  # UDP connect only picks a route: nothing is sent
            except OSError:
                continue
            return sock.getsockname()[0]
    return None


def interface_for(dest: str) -> Interface | None:
    """The interface whose route reaches `dest` (host name or IP), or None if none does."""
    source = _source_address(dest)
    if source is None:
        return None
    source = source.split("%")[0]  # an IPv6 link-local source carries its scope: fe80::1%eth0
    interfaces = list_interfaces()
    if ipaddress.ip_address(source).is_loopback:
        # 127.0.0.2 etc. is routed through lo even though lo only lists 127.0.0.1.
        return next((i for i in interfaces if i.is_loopback), None)
    return next((i for i in interfaces if source in i.addresses), None)


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on at `host` now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_reachable(host: str, port: int, wait: float, interval: float) -> float:
    """Seconds it took host:port to accept a TCP connection, knocking every `interval` seconds.

    A name that does not resolve raises socket.gaierror at once; a port still closed after
    `wait` seconds raises the last OSError. Callers say what the host was meant to be.
    """
    socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    start = time.monotonic()
    deadline = start + wait
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
                return time.monotonic() - start
        except OSError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(interval)
