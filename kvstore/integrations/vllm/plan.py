"""The per-step plan the scheduler side hands the worker side: all the two sides share. Picklable.

- ``BlockRun``: one request's run of consecutive blocks: namespace, their store hashes and the vLLM block ids
  they occupy, plus the hash of the block before the first (the parent in the store's chain, or empty).
- ``StepPlan`` (vLLM's ``KVConnectorMetadata`` when vLLM is importable): ``loads`` to land in the KV cache
  before this step's forward pass, ``saves`` of full blocks this step computes (sent after it, in the
  background), and ``preempted`` request ids whose blocks vLLM may reuse once this step starts.

The promise between the sides: a request id appears in ``saves`` of some step iff the scheduler side returns
True from ``request_finished`` for it, so the worker reports exactly those ids as finished sending.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:  # the plan travels inside vLLM's SchedulerOutput, which expects its metadata base class
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata as _MetadataBase
except ImportError:  # unit tests of the pure logic run without vLLM

    class _MetadataBase:  # type: ignore[no-redef]
        pass


@dataclass(frozen=True)
class BlockRun:
    req_id: str
    namespace: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    parent: bytes = b""

    def __post_init__(self) -> None:
        if len(self.hashes) != len(self.block_ids):
            raise ValueError(f"{len(self.hashes)} hashes but {len(self.block_ids)} block ids")

    def __len__(self) -> int:
        return len(self.hashes)


@dataclass
class StepPlan(_MetadataBase):
    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)
    preempted: frozenset[str] = frozenset()

    @property
    def load_block_ids(self) -> set[int]:
        return {b for run in self.loads for b in run.block_ids}
