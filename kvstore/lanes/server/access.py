"""What a lane's opener may do: the tenant bound at OpenLane, checked on every lane request.

The node's ``Gatekeeper`` (kvstore/server/auth.py) authenticates the OpenLane
call like any RPC; ``LaneAccess.of_current_call(gate)`` records that call's
principal in the lane. Every later request on the lane (a LanePut stream, a
LaneGet, a TCP frame, which carries no bearer token of its own) is held to
the same rules as the gRPC Put/Get:

- ``check(ns)``: PERMISSION_DENIED for a namespace the tenant was not
  granted, with the gate's own message and before the store is touched, so a
  lane reveals no more about other tenants' blocks than the gRPC path does.
- ``admit(ns, nbytes) -> reason | None``: the tenant's byte quota, asked
  before ``begin_put`` (a tenant over quota never evicts anyone's blocks).
- ``charge(ns, nbytes)``: after a block is stored.

Without a tenants file the principal is open and all three pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from kvstore.lanes.base import LaneError


@dataclass(frozen=True)
class LaneAccess:
    gate: Any = None  # kvstore.server.auth.Gatekeeper, or None for an embedded store
    principal: Any = None  # kvstore.server.auth.Principal of the OpenLane call

    @classmethod
    def of_current_call(cls, gate: Any) -> LaneAccess:
        if gate is None:
            return cls()
        from kvstore.server.auth import current_principal

        principal = current_principal()
        if principal is None:
            raise LaneError(grpc.StatusCode.UNAUTHENTICATED, "the OpenLane call did not pass authentication")
        return cls(gate, principal)

    def check(self, namespace: str) -> None:
        p = self.principal
        if p is not None and not p.allows(namespace):
            self.gate.count("permission_denied")
            raise LaneError(grpc.StatusCode.PERMISSION_DENIED, f"tenant {p.name!r} may not use namespace {namespace!r}")

    def admit(self, namespace: str, nbytes: int) -> str | None:
        return self.gate.admit_block(namespace, nbytes) if self.gate is not None else None

    def charge(self, namespace: str, nbytes: int) -> None:
        if self.gate is not None:
            self.gate.charge(namespace, nbytes)


OPEN_ACCESS = LaneAccess()
