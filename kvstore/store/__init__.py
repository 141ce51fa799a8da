"""The block store: index, placement across tiers, leases, eviction (kvstore.store.blockstore)."""

from kvstore.store.blockstore import BlockStore, DataLossError, Lease, NotFoundError, PutTicket
from kvstore.store.cascade import CapacityError

__all__ = ["BlockStore", "CapacityError", "DataLossError", "Lease", "NotFoundError", "PutTicket"]
