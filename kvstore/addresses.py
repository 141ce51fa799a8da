"""HOST:PORT options, checked where they are read (gRPC would wrap a port over 65535 round to another one)."""

from __future__ import annotations

from typing import Any


def parse_address(text: Any) -> str:
    """HOST:PORT (or PORT alone, any host) with a port 0-65535, returned as given; ValueError otherwise."""
    value = str(text).strip()
    port = value.rpartition(":")[2]
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"not HOST:PORT with a port 0-65535: {value!r}")
    return value
