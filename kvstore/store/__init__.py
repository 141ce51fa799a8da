"""The block store: index, placement across tiers, leases, eviction (kvstore.store.blockstore)."""

from kvstore.store.blockstore import BlockStore
from kvstore.store.cascade import CapacityError
from kvstore.store.leases import DataLossError, Lease, NotFoundError, PutTicket

__all__ = ["BlockStore", "CapacityError", "DataLossError", "Lease", "NotFoundError", "PutTicket"]
