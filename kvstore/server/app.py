"""Process lifecycle of a store node: build tiers and store, serve gRPC, drain on SIGTERM.

``StoreServer(cfg).start()`` binds the port (``.port`` is the bound port, so
tests can listen on port 0), registers the KVStore service, the standard
``grpc.health.v1`` health service and server reflection (v1 and v1alpha), and starts the
metrics endpoint and the background demoter. ``stop(grace)`` flips health to
NOT_SERVING, refuses new RPCs, lets in-flight streams finish for ``grace``
seconds, then closes the tiers (flushing the NVMe write buffer). Every RPC
passes the ``Gatekeeper`` interceptor (kvstore/server/auth.py: tokens,
tenants, stream limits, deadlines); SIGHUP re-reads the TLS and tenants files.
"""

from __future__ import annotations

import errno
import faulthandler
import logging
import os
import shutil
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.codecs.policy import LossyPolicy
from kvstore.config import ServeConfig
from kvstore.hugepages import SHMEM_ENABLED, THP_ENABLED, anonymous_huge_pages
from kvstore.server import drain, dram_sharing, ports, reflection, tls
from kvstore.server.auth import Gatekeeper
from kvstore.server.metrics import Metrics
from kvstore.server.service import KVStoreService, add_to_server
from kvstore.server.validate import Limits
from kvstore.sizes import format_size
from kvstore.store import BlockStore
from kvstore.tiers.arena import ArenaTier
from kvstore.tiers.base import MemoryTier, Tier
from kvstore.v1 import kvstore_pb2, lanes_pb2

log = logging.getLogger("kvstore.server")

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name
LANES_SERVICE_NAME = lanes_pb2.DESCRIPTOR.services_by_name["KVStoreLanes"].full_name


def build_tiers(cfg: ServeConfig) -> list[Tier]:
    tiers: list[Tier] = []
    hbm = cfg.hbm or hbm_from_fraction(cfg.hbm_device, cfg.hbm_fraction)
    if hbm:
        tiers.append(ArenaTier(hbm, device=cfg.hbm_device, page_size=_page_size(cfg)))
    index_disk_bytes = cfg.nvme if index_names_disk(cfg) else 0
    sharing = dram_sharing.decide(cfg, dram_sharing.HostFacts.read(cfg.shm_dir), index_disk_bytes)
    log.info("DRAM arena: %s", sharing.reason)

    def dram_tier(share_dir: str | None) -> ArenaTier:
        return ArenaTier(
            cfg.dram,
            device="cpu",
            page_size=_page_size(cfg),
            pinned=False if share_dir else None,
            share_dir=share_dir,
            prefault=cfg.dram_prefault,
            share_index=cfg.dram_index,
            index_disk_bytes=index_disk_bytes,
            index_dir=None if share_dir else disk_index_dir(cfg),
        )

    share_dir = sharing.directory
    try:
        dram = dram_tier(share_dir)
    except OSError as err:
        if share_dir is None or sharing.asked:
            raise dram_allocation_error(err, cfg.dram, share_dir) from err
        log.warning("--share-dram auto: no shared DRAM arena in %s (%s); it is private", share_dir, err)
        share_dir = None
        try:
            dram = dram_tier(None)
        except OSError as err2:
            raise dram_allocation_error(err2, cfg.dram, None) from err2
    tiers.append(dram)
    if cfg.nvme_dir:
        from kvstore.tiers.nvme import NvmeTier

        try:
            nvme = NvmeTier(
                cfg.nvme_dir, capacity_bytes=cfg.nvme, segment_bytes=cfg.nvme_segment, write_policy=cfg.nvme_sync
            )
        except BaseException:  # (an unusable --nvme-dir): the arenas' files must not outlive the start
            close_tiers(tiers)
            raise
        tiers.append(nvme)
        if (short := nvme_room_shortfall(cfg.nvme_dir, cfg.nvme)) is not None:
            log.warning(
                "--nvme %s, but %s has %s free and its files hold %s: once the disk fills, the tier's writes fail "
                "(ENOSPC) and it stops taking blocks until space comes back (docs/nvme.md, Faults); lower --nvme",
                format_size(cfg.nvme),
                cfg.nvme_dir,
                format_size(short.free),
                format_size(short.held),
            )
        if anonymous_huge_pages() is False:
            log.warning(
                "transparent huge pages are off (%s is never): the NVMe tier's read and write buffers and the DRAM "
                "arena get 4 KiB pages, into which O_DIRECT reads ran 2.5-4x slower here (docs/nvme.md); set it "
                "to madvise",
                THP_ENABLED,
            )
        top = tiers[0]
        if cfg.promote_on_hit and isinstance(top, MemoryTier) and top.small_pages:  # the arena's own finding
            log.log(
                logging.WARNING if sharing.asked else logging.INFO,  # auto chose the file: advice, not a fault
                "shared DRAM arena: files in %s get 4 KiB pages, into which NVMe reads ran at half the speed of reads "
                "into huge pages, so promotions are read into private memory and copied into the shared DRAM arena "
                "after each Get (docs/nvme.md); pass --shm-dir on a tmpfs mounted huge=within_size, or set %s to "
                "advise, to read them in place",
                share_dir,
                SHMEM_ENABLED,
            )
    return tiers


def dram_allocation_error(err: OSError, size: int, share_dir: str | None) -> OSError:
    """``err`` (from making the DRAM arena) saying which option asked for too much, and what there is."""
    if err.errno == errno.ENOSPC and share_dir is not None:
        free = shutil.disk_usage(share_dir).free
        return OSError(
            err.errno,
            f"--dram {format_size(size)}: {share_dir} has {format_size(free)} free for the shared DRAM arena "
            "(--share-dram); lower --dram, or pass --shm-dir on a larger tmpfs",
        )
    if err.errno == errno.ENOMEM:
        return OSError(
            err.errno,
            f"--dram {format_size(size)}: the DRAM arena cannot be allocated ({available_memory()}); lower --dram",
        )
    return err


def available_memory() -> str:
    """This host's available memory as /proc/meminfo gives it, in words."""
    available = dram_sharing.available_memory_bytes()
    if available is None:
        return "this host's available memory is unknown"
    return f"{format_size(available)} available on this host"


@dataclass(frozen=True)
class NvmeRoom:
    free: int  # the file system's free bytes
    held: int  # the bytes the tier's directory already holds (its segments, preallocated)


def nvme_room_shortfall(nvme_dir: str, capacity: int) -> NvmeRoom | None:
    """What there is, when the NVMe tier's directory cannot grow to ``capacity`` bytes; None when it can."""
    free = shutil.disk_usage(nvme_dir).free
    held = sum(e.stat().st_blocks * 512 for e in os.scandir(nvme_dir) if e.is_file(follow_symlinks=False))
    return NvmeRoom(free, held) if free + held < capacity else None


def index_names_disk(cfg: ServeConfig) -> bool:
    """Whether the DRAM index names NVMe-only blocks in their segment files (clients may read those): beside the
    shared arena's blocks with --share-dram, else in a table of its own in --shm-dir."""
    return bool(cfg.dram_index and cfg.nvme_shared)


def disk_index_dir(cfg: ServeConfig) -> str | None:
    """Where the index of NVMe-only blocks goes when there is no shared DRAM arena to hold it beside: the shm
    lanes' directory, when their clients can read the index (a direct channel reports their hits back)."""
    from kvstore.lanes import cma
    from kvstore.lanes.server.wiring import lane_kinds

    if not (cfg.shm_direct and cma.available()) or "shm" not in lane_kinds(cfg.lanes):
        return None
    if not os.path.isdir(cfg.shm_dir):
        return None
    return cfg.shm_dir


def metrics_token(cfg: ServeConfig) -> str | None:
    """The bearer token /metrics requires (from --metrics-token-file), or None."""
    if not cfg.metrics_token_file:
        return None
    token = Path(cfg.metrics_token_file).read_text().strip()
    if not token:
        raise ValueError(f"--metrics-token-file {cfg.metrics_token_file} is empty")
    return token


def hbm_from_fraction(device: str, fraction: float) -> int:
    """HBM tier bytes as ``fraction`` of the device's free memory now (0 when no fraction is asked for)."""
    if fraction <= 0:
        return 0
    if not 0 < fraction < 1:
        raise ValueError(f"--hbm-fraction must be between 0 and 1; got {fraction}")
    from kvstore.tiers.arena import cuda_available

    if not cuda_available():
        raise ValueError(f"--hbm-fraction {fraction} asks for an HBM tier, but there is no CUDA device here")
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    nbytes = int(free * fraction) // (2 << 20) * (2 << 20)
    log.info("HBM tier: %.2f of %d free bytes on %s = %d bytes", fraction, free, device, nbytes)
    return nbytes


def _page_size(cfg: ServeConfig) -> int:
    return max(8 << 20, -(-cfg.max_block // 4096) * 4096)


def close_tiers(tiers: list[Tier]) -> None:
    """Close tiers a start that failed built: a shared arena's file would hold its memory until a later sweep."""
    for tier in tiers:
        try:
            tier.close()
        except Exception:  # noqa: BLE001 - the start's own error is the one to report
            log.exception("closing the %s tier after a failed start", tier.name)


def build_store(cfg: ServeConfig, tiers: list[Tier] | None = None) -> BlockStore:
    from kvstore.store.policies import policy_factory

    built = tiers or build_tiers(cfg)
    try:
        store = BlockStore(
            built,
            promote_on_hit=cfg.promote_on_hit,
            policy_factory=policy_factory(cfg.eviction_policy),
            write_through=cfg.write_policy == "write-through",
            nvme_admit_uses=cfg.nvme_admit_uses,
            nvme_eviction=cfg.nvme_eviction,
            index_disk=index_names_disk(cfg),
        )
    except BaseException:
        if tiers is None:  # ours
            close_tiers(built)
        raise
    for tier in store.tiers:
        if hasattr(tier, "on_relocate"):
            tier.on_relocate = lambda moves, rank=tier.rank: store.relocate(rank, moves)
    return store


SLOW_STOP_SECONDS = 30.0  # past the drain, a stop this much slower dumps the threads' stacks


class StoreServer:
    def __init__(self, cfg: ServeConfig, store: BlockStore | None = None):
        self.cfg = cfg
        self.store = store or build_store(cfg)
        try:  # what fails here is the config's: a store built for it closes with it, its files with it
            self.metrics = Metrics(self.store.stats)
            self.limits = Limits(
                max_block_bytes=cfg.max_block,
                max_message_bytes=cfg.max_message,
                max_hashes=cfg.max_hashes,
                max_stream_bytes=cfg.max_stream,
                lossy=LossyPolicy.from_spec(cfg.lossy_namespaces),
            )
            self.node_id = cfg.node_id or cfg.advertise or cfg.listen
            self.health = health.HealthServicer()
            tls.transport(cfg)  # refuse an unsafe transport before anything starts
            self.gate = Gatekeeper.from_config(cfg, self.store, self.metrics)  # tokens, tenants, quotas, deadlines
            self.calls = drain.CallsInFlight()
            self.service = KVStoreService(
                self.store, self.limits, self.metrics, self.node_id, gate=self.gate, get_codec=cfg.get_codec
            )
            self.tls: tls.CertReloader | None = None
            self.server: grpc.Server | None = None
            self.port = 0
            self._metrics_http: Any = None
            self._stopped = threading.Event()
            self.cluster: Any = None  # kvstore.cluster.node.ClusterNode when cfg.redis is set
        except BaseException:
            if store is None:  # a shared arena held --dram of /dev/shm until the next start swept it
                self.store.close(flush=False)
            raise

    def grpc_options(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_receive_message_length", self.cfg.max_message),
            ("grpc.max_send_message_length", self.cfg.max_message),
            ("grpc.so_reuseport", 0),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_permit_without_calls", 1),
        ]

    def _warm_up(self) -> None:
        from kvstore.store.policies import policy_factory
        from kvstore.store.warmup import warm_up

        try:
            seconds = warm_up(policy_factory(self.cfg.eviction_policy), index=self.store.published_index is not None)
            if "tcp" in self.cfg.lanes.split(",") and self.cfg.nvme_dir:  # TCP Gets of NVMe blocks, compiled
                from kvstore import send_runs

                send_runs.warm_up()
        except Exception:  # noqa: BLE001 - a failed warm-up leaves compiling to the first requests, no more
            log.exception("warming up the store's kernels failed; the first requests compile them")
            return
        self.metrics.set("warm_up_seconds", seconds)
        log.info("store kernels warmed up in %.2f s", seconds)

    def start(self) -> StoreServer:
        """Bind and serve. A start that fails stops what it started and closes the store, whose files would
        otherwise outlive it (a shared DRAM arena held --dram of /dev/shm until the next start swept it)."""
        try:
            return self._start()
        except BaseException:
            self.stop(grace=0)
            raise

    def _start(self) -> StoreServer:
        token = metrics_token(self.cfg) if self.cfg.metrics_port else None  # a bad token file fails before binding
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.cfg.workers, thread_name_prefix="kvstore-rpc"),
            options=self.grpc_options(),
            maximum_concurrent_rpcs=self.cfg.workers * 4,
            interceptors=[self.calls, *self.gate.interceptors()],
        )
        add_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable(server, (SERVICE_NAME, LANES_SERVICE_NAME, health.SERVICE_NAME))  # v1 and v1alpha
        from kvstore.lanes.server.wiring import LaneServer  # fast data lanes (shm, tcp), negotiated over gRPC

        # The asked-for ports first: a lane listening on port 0 (the tcp lane's default) could be handed one of
        # them (a test's free port, picked and closed a moment before: seen in CI as "Address already in use").
        self.port = self._bind(server)
        if self.cfg.metrics_port:  # bound before serving starts, so a taken port stops the start, not a later step
            try:
                self._metrics_http = self.metrics.start_http(self.cfg.metrics_port, token=token)
            except OSError as err:
                server.stop(None)
                raise ports.PortError("--metrics-port", str(self.cfg.metrics_port), ports.describe(err)) from None
        try:
            self.lanes = LaneServer(self).register(server)
        except (OSError, ValueError) as err:  # an OSError: a --tcp-lane-listen port taken since the preflight
            server.stop(None)
            if self._metrics_http is not None:
                self._metrics_http[0].shutdown()
                self._metrics_http[0].server_close()
            if isinstance(err, ValueError):  # says which flag itself (--shm-dir, --cuda-lane-bytes)
                raise
            raise ports.PortError("--tcp-lane-listen", self.cfg.tcp_lane_listen, ports.describe(err)) from None
        server.start()
        self.server = server
        self.gate.start()
        self.store.start()
        if self.cfg.warm_up:  # the kernels compile (or load from their cache) before the first requests need them
            threading.Thread(target=self._warm_up, name="kvstore-warm-up", daemon=True).start()
        if self.cfg.redis:  # cluster mode: membership heartbeats and the global index, on background threads
            from kvstore.cluster.node import ClusterNode

            self.cluster = ClusterNode(self.cfg, self.store, self.metrics, self.port).start()
            self.node_id = self.service.node_id = self.cluster.node_id
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving on %s (port %d); tiers: %s",
            self.cfg.listen,
            self.port,
            ", ".join(f"{t.name}={t.capacity_bytes}" for t in self.store.tiers),
        )
        if self.cfg.nvme_shared:
            index = self.store.published_index
            log.info(
                "shm clients of this user read NVMe blocks from %s themselves (--share-nvme %s)%s",
                self.cfg.nvme_dir,
                self.cfg.share_nvme,
                f", finding them unasked in {index.path}" if index is not None else "",
            )
        return self

    def _bind(self, server: grpc.Server) -> int:
        try:
            port, self.tls = tls.bind(server, self.cfg)  # TLS/mTLS, or plaintext only where the rule allows it
        except RuntimeError as err:  # grpc: "Failed to bind to address ..."
            raise ports.PortError("--listen", self.cfg.listen, f"gRPC could not bind it: {err}") from None
        return port

    def reload(self) -> None:
        """SIGHUP: re-read the TLS files (before the next handshake) and the tenants file."""
        if self.tls is not None:
            self.tls.request_reload()
        self.gate.reload_tenants()

    def stop(self, grace: float | None = None) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.cfg.drain_seconds if grace is None else grace
        deadline = time.monotonic() + grace
        self.health.enter_graceful_shutdown()
        if self.cluster is not None:
            self.cluster.stop()  # deregister first: clients stop routing here while streams drain
        if self.server is not None:
            self._drain(deadline)
            self.server.stop(max(0.0, deadline - time.monotonic())).wait()
        if getattr(self, "lanes", None) is not None:  # their frames ran beside the gRPC drain: what is left of it
            self.lanes.close(max(0.0, deadline - time.monotonic()))
        self.store.close()
        if self._metrics_http is not None:
            httpd, thread = self._metrics_http
            httpd.shutdown()
        self.gate.stop()
        log.info("stopped")

    def _drain(self, deadline: float) -> None:
        """Before grpc's stop: new calls refused, the calls in flight ended, their last bytes with the clients."""
        start = time.monotonic()
        if not self.calls.drain(deadline):
            log.warning("drain: calls still in flight at the deadline, cancelled: %s", self.calls.in_flight())
        left = drain.wait_sent(lambda: drain.port_unsent(self.port), deadline)
        if left:
            log.warning("drain: %d bytes of replies not yet taken by their clients at the deadline", left)
        log.info("drained in %.2f s", time.monotonic() - start)

    def wait(self) -> None:
        if self.server is not None:
            self.server.wait_for_termination()

    def serve_forever(self) -> None:
        """Run until SIGTERM/SIGINT, then drain and exit."""
        done = threading.Event()

        def on_signal(signum: int, _frame: Any) -> None:
            log.info("%s: draining (up to %.0fs)", signal.Signals(signum).name, self.cfg.drain_seconds)
            done.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGHUP, lambda _signum, _frame: self.reload())
        self.start()
        # Python runs a signal's handler on the main thread only, and a signal the kernel hands to another thread
        # does not wake a main thread blocked in a wait without a timeout. Waking twice a second bounds that (twice
        # under two xdist workers a SIGTERM went unanswered for 10-30 s; whether this was why is not established).
        while not done.wait(0.5):
            pass
        # A stop that outlasts the drain by far prints every thread's stack (a report only: a large flush
        # of write-back blocks to NVMe may take long, and cutting it short would lose acknowledged blocks).
        faulthandler.dump_traceback_later(self.cfg.drain_seconds + SLOW_STOP_SECONDS)
        self.stop()
        faulthandler.cancel_dump_traceback_later()
