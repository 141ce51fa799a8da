"""The per-step plan the scheduler side hands the worker side: all the two sides share. Picklable.

- ``BlockRun``: one request's run of consecutive blocks: namespace, their store hashes and the vLLM block ids
  they occupy, plus the hash of the block before the first (the parent in the store's chain, or empty). An
  engine of several workers carries every rank's hashes and parents too (``rank_hashes``, ``rank_parents``:
  each worker's part of a block is a store block of its own); ``for_rank(r)`` is the run worker r moves.
- ``StepPlan`` (vLLM's ``KVConnectorMetadata`` when vLLM is importable): ``loads`` to land in the KV cache
  before this step's forward pass, ``saves`` of full blocks this step computes (sent after it, in the
  background), ``preempted`` request ids whose blocks vLLM may reuse once this step starts, and ``spans``:
  the tokens each scheduled request computes in this step.
- ``StepReport`` (vLLM's ``KVConnectorWorkerMetadata``): what the worker side measured in a step, carried
  back to the scheduler side, where the load planner learns from it: each load run's ``LoadReport``
  (blocks loaded intact, seconds, Get calls, lane), the step's ``spans`` and its forward pass's seconds.

The promise between the sides: a request id appears in ``saves`` of some step iff the scheduler side returns
True from ``request_finished`` for it, so the worker reports exactly those ids as finished sending.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

try:  # the plan travels inside vLLM's SchedulerOutput, the report in its ModelRunnerOutput: their base classes
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata as _MetadataBase
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata as _ReportBase
except ImportError:  # unit tests of the pure logic run without vLLM

    class _MetadataBase:  # type: ignore[no-redef]
        pass

    class _ReportBase:  # type: ignore[no-redef]
        pass


@dataclass(frozen=True)
class BlockRun:
    req_id: str
    namespace: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    parent: bytes = b""
    rank_hashes: tuple[tuple[bytes, ...], ...] = ()  # several workers: each rank's hashes of the same blocks
    rank_parents: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if len(self.hashes) != len(self.block_ids):
            raise ValueError(f"{len(self.hashes)} hashes but {len(self.block_ids)} block ids")
        if len(self.rank_parents) != len(self.rank_hashes) or any(len(h) != len(self.hashes) for h in self.rank_hashes):
            raise ValueError("every rank needs a parent and one hash a block")

    def for_rank(self, rank: int) -> BlockRun:
        """The run as worker ``rank`` moves it: that rank's hashes (the run itself with one worker)."""
        if not self.rank_hashes:
            return self
        return replace(self, hashes=self.rank_hashes[rank], parent=self.rank_parents[rank], rank_hashes=(),
                       rank_parents=())  # fmt: skip

    def __len__(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True)
class Span:
    """Tokens [start, end) of one request computed in a step."""

    req_id: str
    start: int
    end: int


@dataclass
class StepPlan(_MetadataBase):
    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)
    preempted: frozenset[str] = frozenset()
    spans: tuple[Span, ...] = ()

    @property
    def load_block_ids(self) -> set[int]:
        return {b for run in self.loads for b in run.block_ids}


@dataclass(frozen=True)
class LoadReport:
    req_id: str
    planned: int  # blocks of the run
    loaded: int  # leading blocks that arrived intact (bytes and CRC32C) and stay in the KV cache
    seconds: float
    calls: int  # Gets made
    lane: str


@dataclass
class StepReport(_ReportBase):
    loads: list[LoadReport] = field(default_factory=list)
    spans: tuple[Span, ...] = ()
    forward_s: float = 0.0  # the step's forward pass (after its loads), as the worker saw it

    def aggregate(self, other: StepReport) -> StepReport:  # one report per worker; tensor parallel ranks
        return StepReport(self.loads + other.loads, self.spans or other.spans, max(self.forward_s, other.forward_s))
