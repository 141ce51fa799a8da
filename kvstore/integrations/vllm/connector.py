"""``KVStoreConnector``: kvstore behind vLLM's v1 KV connector interface (``KVConnectorBase_V1``).

vLLM builds the class twice: once in the scheduler (role SCHEDULER) and once in each worker (role WORKER),
in one process or two depending on ``VLLM_ENABLE_V1_MULTIPROCESSING``; the halves share nothing but the
``StepPlan`` vLLM carries from one to the other. Each verb below only forwards to its side:

Scheduler side (``scheduler.SchedulerSide``, no KV bytes):
    get_num_new_matched_tokens  one batched Lookup, no side effects, one prompt token always left to compute
    update_state_after_alloc    binds the allocated blocks to the planned load
    build_connector_meta        this step's StepPlan: loads, saves of newly computed full blocks, preemptions
    update_connector_output     the workers' StepReports, for the load planner (``planning.CostPlanner``)
    request_finished            True while saves of the request may still read its blocks

Worker side (``worker.WorkerSide``, the bytes):
    register_kv_caches          views the KV cache as one store block per vLLM block
    bind_connector_metadata     the step starts (its forward pass is timed for the load planner)
    start_load_kv               synchronous Gets straight into the KV cache before the forward pass
    wait_for_layer_load         nothing: everything is loaded before the first layer runs
    save_kv_layer               nothing: whole blocks are saved after the step, all layers at once
    wait_for_save               hands the step's saves to the background saver and returns
    handle_preemptions          waits for saves still reading blocks vLLM is about to reuse
    get_finished                requests whose saves are done (their blocks may be freed)
    get_block_ids_with_load_errors  blocks that failed to load: vLLM recomputes them
    build_connector_worker_meta the step's StepReport (loads and forward pass measured) for the scheduler
    shutdown                    drains the saver

Roles: ``kv_producer`` saves, ``kv_consumer`` loads, ``kv_both`` does both. Keys: ``settings.Settings``.
A failed load is recomputed: the scheduler-side connector sets vLLM's ``kv_load_failure_policy`` to
``recompute`` (vLLM's default, ``fail``, would end the request) unless the key ``on_load_error`` is ``fail``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.integrations.vllm.identity import EngineShape, request_namespace
from kvstore.integrations.vllm.plan import StepPlan
from kvstore.integrations.vllm.planning import CostPlanner
from kvstore.integrations.vllm.scheduler import Learner, LoadPlanner, SchedulerSide, planner_from_spec
from kvstore.integrations.vllm.settings import ClientSlot, Settings
from kvstore.integrations.vllm.stats import StatsFile, stats_files
from kvstore.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
_WIRE_DTYPES = ("float32", "bfloat16", "float16")


class KVStoreConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = Settings.from_extra(transfer.kv_connector_extra_config)
        self.shape = EngineShape.from_vllm(vllm_config, self.settings.model_id, kv_cache_config)
        self.loads, self.saves = bool(transfer.is_kv_consumer), bool(transfer.is_kv_producer)
        stats = stats_files(self.settings.stats_path, self.shape.rank) if self.settings.stats_path else None
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self.settings.on_load_error == "recompute" and transfer.kv_load_failure_policy != "recompute":
                # vLLM defaults to failing a request whose KV did not load; a cache miss must only cost time.
                # The scheduler reads the policy right after building this connector.
                log.info("KVStoreConnector: kv_load_failure_policy %r -> 'recompute'", transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"
            self._lookup_client = ClientSlot(self.settings.client)
            spec = self.settings.load_planner
            planner: LoadPlanner = (
                CostPlanner(lane=_expected_lane(self.settings)) if spec == "cost" else planner_from_spec(spec)
            )
            page = 2 * self.shape.kv_heads * self.shape.head_size * self.shape.block_size
            itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(self.shape.dtype, 1)
            self._scheduler = SchedulerSide(
                self.shape,
                self.settings.namespace,
                lambda ns, hashes: self._lookup_client.call(lambda c: c.lookup_tiers(ns, hashes)),
                loads=self.loads,
                saves=self.saves,
                block_bytes=page * itemsize * self.shape.layers,
                planner=planner,
                learner=planner if isinstance(planner, Learner) else None,
                stats=StatsFile(stats[0]) if stats else None,
            )
        else:
            self._worker = WorkerSide(
                self.settings.client,
                dtype=self.shape.dtype if self.shape.dtype in _WIRE_DTYPES else "uint8",
                load_chunk=self.settings.load_chunk,
                load_streams=self.settings.load_streams,
                verify_loads=self.settings.verify_loads,
                save_chunk=self.settings.save_chunk,
                saves=self.saves,
                stats=StatsFile(stats[1]) if stats else None,
                rank=self.shape.rank,
                stores_saves=self.shape.stores_saves,
                staging=self.settings.staging,
                huge_pages=self.settings.huge_pages,
            )
        log.info(
            "KVStoreConnector %s: target %s, namespace %s, role %s, fingerprint %s",
            role.name,
            self.settings.target,
            request_namespace(self.settings.namespace, None),
            transfer.kv_role,
            self.shape.fingerprint(),
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss, never lost output

    # ==============================  worker side  ==============================
    def _work(self) -> WorkerSide:
        assert self._worker is not None, "worker-side verb called on the scheduler-side connector"
        return self._worker

    def _plan(self) -> StepPlan:
        plan = self._get_connector_metadata()
        assert isinstance(plan, StepPlan), type(plan)
        return plan

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_step()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            plan = self._plan()
            self._work().end_step(plan)
            self._work().save(plan)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().take_report()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, StepPlan):
            self._work().preempting(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().finished_sending(finished_req_ids), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._lookup_client.close()

    # ==============================  scheduler side  ==============================
    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side verb called on the worker-side connector"
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().step_plan(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().report(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().finished(request), None


def _expected_lane(settings: Settings) -> str:
    """The lane the workers' loads will likely use, until their first report says (a prior only)."""
    if settings.lane != "auto":
        return settings.lane
    host = settings.target.rsplit(":", 1)[0].strip("[]")
    return "shm" if host in ("127.0.0.1", "localhost", "::1") else "tcp"
