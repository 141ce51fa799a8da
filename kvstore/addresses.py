"""HOST:PORT options, checked where they are read (gRPC would wrap a port over 65535 round to another one)."""

from __future__ import annotations

from typing import Any


def _port(address: str) -> int | None:
    """The number after the last colon (all of it without one); None when it is not digits."""
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def parse_address(text: Any) -> str:
    """HOST:PORT (or PORT alone, any host) with a port 0-65535, returned as given; ValueError otherwise."""
    value = str(text).strip()
    port = _port(value)
    if port is None or port > 65535:
        raise ValueError(f"not HOST:PORT with a port 0-65535: {value!r}")
    return value


def check_target(target: str) -> None:
    """A client's gRPC target: a plain HOST:PORT whose port is over 65535 is refused (gRPC would reach port
    PORT % 65536, perhaps another service); other gRPC target forms (``dns:///``, ``unix:``, ...) pass as given."""
    if "://" in target or target.split(":", 1)[0] in ("unix", "unix-abstract", "ipv4", "ipv6", "dns", "vsock"):
        return
    port = _port(target)
    if port is not None and port > 65535:
        raise ValueError(f"target {target!r}: the port must be 0-65535")
