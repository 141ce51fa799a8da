"""Configuration of `kvstore serve`: one table of options, three sources.

Precedence: command-line flag > environment variable ``KVSTORE_<FLAG>`` >
YAML config file (``--config``; keys are the flag names with dashes or
underscores) > default. ``kvstore serve --help`` prints every option with its
default; docs/config.example.yaml lists them all.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from kvstore.addresses import parse_address
from kvstore.logs import check_level
from kvstore.sizes import parse_size

MIN_MESSAGE = 64 << 10  # the smallest --max-message: a block header and a 32 KiB chunk fit in a message
_NVME_OPTIONS = ("nvme", "nvme_segment", "nvme_sync", "nvme_admit_uses", "nvme_eviction", "share_nvme")


def _bool(text: Any) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _auto_bool(text: Any) -> str:
    """auto, true or false (any spelling ``_bool`` takes)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return "true" if _bool(text) else "false"
    except ValueError:
        raise ValueError(f"auto, true or false; got {text!r}") from None


def _opt(default: Any, help: str, parse: Callable[[Any], Any] = str, metavar: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "parse": parse, "metavar": metavar})


@dataclass
class ServeConfig:
    listen: str = _opt(
        "127.0.0.1:7070", "gRPC listen address HOST:PORT (0.0.0.0:7070 to accept remote clients)", parse_address
    )
    dram: int = _opt(parse_size("1GiB"), "DRAM tier capacity (e.g. 512MiB, 2GiB)", parse_size, "SIZE")
    hbm: int = _opt(0, "HBM tier capacity on the CUDA device (0: no HBM tier)", parse_size, "SIZE")
    hbm_device: str = _opt("cuda:0", "CUDA device of the HBM tier")
    hbm_fraction: float = _opt(
        0.0,
        "HBM tier capacity as a fraction of the device's free memory at start (e.g. 0.5; used when --hbm is 0)",
        float,
    )
    nvme_dir: str | None = _opt(None, "directory of the NVMe segment log (unset: no NVMe tier)", metavar="DIR")
    nvme: int = _opt(parse_size("16GiB"), "NVMe tier capacity on disk", parse_size, "SIZE")
    nvme_segment: int = _opt(parse_size("256MiB"), "NVMe segment file size", parse_size, "SIZE")
    write_policy: str = _opt(
        "write-back",
        "write-back (a Put is acked once in memory; NVMe copies are made on "
        "demotion) or write-through (acked once also on NVMe)",
    )
    nvme_sync: str = _opt(
        "direct",
        "NVMe ack durability: direct (on the device through O_DIRECT: survives a "
        "process crash; segments fdatasync'ed within 1 s) or fdatasync (survives power loss)",
    )
    eviction_policy: str = _opt(
        "adaptive",
        "eviction order inside a tier, always leaves first: adaptive (protects reused blocks for as long as "
        "shadow caches find pays, from none, as LRU, up), freq (LRU that protects blocks seen twice) or lru",
    )
    promote_on_hit: bool = _opt(
        True,
        "copy blocks read from NVMe back into DRAM when there is room (a Get's blocks as the store reads them; "
        "those a --share-nvme client read from the files itself afterwards, by a second read, only into room "
        "under DRAM's high watermark)",
        _bool,
    )
    warm_up: bool = _opt(
        True,
        "compile the index's and eviction policy's kernels on a background thread at start, so the first "
        "requests do not wait for it (about 16 s on 2 cores with nothing cached yet; 0.5 s from the cache)",
        _bool,
    )
    nvme_admit_uses: int = _opt(
        1,
        "demote a block evicted from DRAM to NVMe only once it was used (stored or read) "
        "this many times, else drop it (1: demote every block; 2 writes NVMe about 4x "
        "less on the bench trace at a lower hit rate: docs/nvme.md); needs "
        "an --eviction-policy that counts uses (adaptive or freq)",
        int,
    )
    nvme_eviction: str = _opt(
        "segment",
        "how a full NVMe tier picks what to drop: segment (a victim takes the other unleased leaves of its "
        "segment file with it, so the file goes whole: compaction copied 0.5-13 records per record written "
        "without it, for up to 1.7 points more hit rate on the bench trace with little DRAM: docs/nvme.md) "
        "or block (victims one by one, in the eviction policy's order)",
    )
    max_block: int = _opt(parse_size("8MiB"), "largest accepted block (stored bytes)", parse_size, "SIZE")
    max_message: int = _opt(
        parse_size("4MiB"),
        "gRPC max message size, at least 64KiB (data chunks are at most 1MiB, and at most half of it)",
        parse_size,
        "SIZE",
    )
    max_stream: int = _opt(parse_size("16GiB"), "max payload bytes in one Put stream", parse_size, "SIZE")
    max_hashes: int = _opt(65536, "max hashes in one Lookup/Get/Delete", int)
    workers: int = _opt(16, "gRPC handler threads (concurrent RPCs)", int)
    drain_seconds: float = _opt(15.0, "on SIGTERM, seconds to let in-flight streams finish", float)
    metrics_port: int = _opt(
        7071,
        "Prometheus /metrics port on every interface (0: off); 7071 sits beside the gRPC default 7070 and "
        "off 9090, the Prometheus server's own port. A second store on one host needs its own",
        int,
    )
    metrics_token_file: str | None = _opt(
        None,
        "file holding a bearer token that /metrics then requires (Authorization: Bearer <token>); unset: no token",
        metavar="FILE",
    )
    log_level: str = _opt("info", "debug, info, warning or error", check_level)
    node_id: str = _opt("", "node id shown in Stats (default: the advertise or listen address)")
    config: str | None = _opt(None, "YAML config file (keys are these option names)", metavar="FILE")
    # Cluster and security (DESIGN 2.4)
    redis: str | None = _opt(None, "Redis URL for cluster mode (membership and global index)", metavar="URL")
    advertise: str | None = _opt(
        None, "address other hosts reach this node at (default: --listen)", parse_address, "HOST:PORT"
    )
    cluster_ttl: float = _opt(
        10.0,
        "cluster mode: seconds a node stays listed in Redis without a heartbeat (it "
        "heartbeats every third of it); its index entries expire with it",
        float,
    )
    tls_cert: str | None = _opt(None, "server TLS certificate (PEM)", metavar="FILE")
    tls_key: str | None = _opt(None, "server TLS private key (PEM)", metavar="FILE")
    tls_client_ca: str | None = _opt(None, "CA bundle for client certificates (enables mutual TLS)", metavar="FILE")
    insecure_plaintext: bool = _opt(
        False,
        "allow plaintext gRPC on a non-loopback --listen address (trusted networks "
        "only); without it such a node needs --tls-cert/--tls-key to start",
        _bool,
    )
    tenant_quota: int = _opt(
        0,
        "default byte quota per tenant: bytes stored in its namespaces, all tiers (0: none; "
        "a tenant's quota in the tenants file wins)",
        parse_size,
        "SIZE",
    )
    tenant_streams: int = _opt(
        8, "default max concurrent Put/Get streams per tenant (0: no limit; max_streams in the tenants file wins)", int
    )
    max_rpc_seconds: float = _opt(
        300.0, "server-side limit on any RPC's duration; past it the call ends with DEADLINE_EXCEEDED (0: none)", float
    )
    tenants: str | None = _opt(
        None, "tenants YAML: [{name, token, namespaces: [...]}]; every RPC then needs a token", metavar="FILE"
    )
    # Fast data lanes (kvstore/lanes)
    lanes: str = _opt(
        "shm,tcp,cuda_ipc",
        "data lanes offered beside gRPC: comma list of shm (same-host shared "
        "memory), tcp (bulk socket, off under TLS: it is plaintext) and cuda_ipc "
        "(same-GPU device memory; offered only where CUDA works); empty: gRPC only",
    )
    tcp_lane_listen: str = _opt(
        "",
        "HOST:PORT of the bulk TCP lane (default: the --listen host, a free port)",
        lambda text: parse_address(text) if str(text).strip() else "",
        "HOST:PORT",
    )
    shm_dir: str = _opt(
        "/dev/shm",
        "directory (a tmpfs) of the shm lanes' regions and, with --share-dram, the DRAM arena: a tmpfs mounted "
        "huge=within_size gives them huge pages (/dev/shm as a rule does not), and NVMe reads into the arena ran "
        "twice as fast into those",
        metavar="DIR",
    )
    shm_lane_bytes: int = _opt(
        parse_size("256MiB"),
        "shared-memory region of each shm lane: a batch in flight plus Get results lent to the client; its memory is "
        "reserved as grants reach it, 16 MiB at a time (a direct lane's Gets and Puts seldom do)",
        parse_size,
        "SIZE",
    )
    shm_direct: bool = _opt(
        True,
        "let shm lane clients that allow it (same user; Yama prctl) have their Put blocks "
        "read straight from their memory with process_vm_readv (one copy instead of two) "
        "and their Gets and Puts carried on the handshake's socket, not gRPC calls",
        _bool,
    )
    dram_prefault: bool = _opt(
        False,
        "make the DRAM tier's pages from the start, in the background (the tier's whole capacity is resident "
        "soon after): without it each Put into a slot not used yet pays a page fault and zero-fill per 4 KiB "
        "(Puts of 94 MB into a fresh store took 2-4x as long until every slot had been used once)",
        _bool,
    )
    share_dram: str = _opt(
        "auto",
        "put the DRAM arena in a file of --shm-dir (mode 0600, reserved whole at start) that shm lane clients of "
        "this user map read-only: they find DRAM hits in its index and copy them once, at memcpy speed, without "
        "asking the store (32 x 64 KiB Gets 2.4-2.9x as fast here). Every local client of this user can then "
        "read every tenant's DRAM blocks, so auto shares it only with no --tenants file, an shm lane with --shm-direct, no "
        "CUDA device (whose arena is pinned) and a tmpfs --shm-dir where arena and index take at most 3/4 of the "
        "free space and of available memory (not a container's 64 MiB /dev/shm); the log says which. true: "
        "shared regardless (one trust domain), false: never",
        _auto_bool,
    )
    dram_index: bool = _opt(
        True,
        "with --share-dram: also share a table of where each raw DRAM block lies (read-only for clients, kept "
        "current by the store), so a client finds a Get's DRAM hits and copies them without asking the store "
        "at all; it reports them afterwards, in batches, for the eviction policy (x86-64 only). With --share-nvme "
        "too, the table also names NVMe-only blocks in their segment files, which the client then reads unasked; "
        "without --share-dram it names those alone (a file in --shm-dir of 0.12-0.25%% of --nvme: 20 MiB for 16 GiB)",
        _bool,
    )
    share_nvme: str = _opt(
        "auto",
        "let shm lane clients of this user read the NVMe tier's segment files (mode 0600) themselves: a Get "
        "names each NVMe-only block by file and offset and the client reads it straight into its buffers with "
        "O_DIRECT (no copy on either side) and checks its CRC32C; a client that cannot open them (another user, "
        "another mount namespace) has the store read them. Every local client of this user can then read every "
        "tenant's NVMe blocks, so auto shares them only when there is no --tenants file (where any client may "
        "read any block anyway); true shares them with tenants too (one trust domain), false never",
        _auto_bool,
    )
    cuda_lane_bytes: int = _opt(parse_size("256MiB"), "device memory region of each cuda_ipc lane", parse_size, "SIZE")
    cuda_lane_device: str = _opt(
        "",
        "device of the cuda_ipc lanes' regions (default: --hbm-device); cpu runs the "
        "same lane over host shared memory, for tests without a GPU",
    )
    lane_lease: float = _opt(
        30.0,
        "seconds a lane's uncommitted slot grant lives (a crashed client's slots come "
        "back after it); a lane idle for 10 leases is closed",
        float,
    )
    lane_max: int = _opt(32, "most lanes open at once (each shm lane holds at most --shm-lane-bytes of memory)", int)
    # Compression (kvstore/codecs; DESIGN 5)
    lossy_namespaces: str = _opt(
        "",
        "comma list of namespace patterns (shell globs, e.g. draft-*) whose KV may be "
        "lossy (fp8, fp8+zstd); a lossy Put elsewhere is refused with INVALID_ARGUMENT. "
        "Empty: lossless everywhere",
        metavar="PATTERNS",
    )
    get_codec: str = _opt(
        "auto",
        "codec of Get transfers among those the reader accepts: auto (the bandit picks per "
        "transfer from measured CPU cost, ratio and bandwidth) or a codec name (used when "
        "the reader accepts it, else none)",
        metavar="CODEC",
    )

    @property
    def nvme_shared(self) -> bool:
        """Whether shm clients may read the NVMe tier's files (``--share-nvme``; auto: with no --tenants file)."""
        mode = _auto_bool(self.share_nvme)  # (a ServeConfig made in code may hold a bool)
        if not self.nvme_dir or mode == "false":
            return False
        return mode == "true" or not self.tenants

    @property
    def share_dram_mode(self) -> str:
        """``--share-dram`` as auto, true or false (a ServeConfig made in code may hold a bool);
        ``kvstore.server.dram_sharing`` decides what auto gives."""
        return _auto_bool(self.share_dram)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]") or "0.0.0.0", int(port)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(ServeConfig):
        kind = f.metadata["parse"]
        default: Any = f.default  # each field's own type
        shown = default if kind is not parse_size else _fmt(default)
        parser.add_argument(
            _flag(f.name),
            dest=f.name,
            default=None,
            metavar=f.metadata["metavar"] or f.name.upper(),
            help=f"{f.metadata['help']} [env KVSTORE_{f.name.upper()}; default: {shown}]",
        )


def _fmt(n: int) -> str:
    from kvstore.sizes import format_size

    return format_size(n) if n else "0"


def example_yaml() -> str:
    """docs/config.example.yaml: every option with its help and default (tests keep the file equal to this)."""
    from kvstore.sizes import format_size

    lines = [
        "# kvstore serve configuration: every option with its default.",
        "# Keys are the flag names (dashes or underscores). Precedence: flag > env KVSTORE_<OPTION> > "
        "this file > default.",
        "",
    ]
    for f in fields(ServeConfig):
        if f.name == "config":
            continue
        value: Any = f.default
        if f.metadata["parse"] is parse_size:
            value = format_size(value) if value else 0
        value = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        lines += [f"# {f.metadata['help']}", f"{f.name.replace('_', '-')}: {value}", ""]
    return "\n".join(lines)


def load(args: argparse.Namespace | None = None, env: dict[str, str] | None = None) -> ServeConfig:
    """Merge defaults, the YAML file, KVSTORE_* env vars and flags into a ServeConfig."""
    env = dict(os.environ if env is None else env)
    flags = {k: v for k, v in vars(args).items() if v is not None} if args is not None else {}
    config_path = flags.get("config") or env.get("KVSTORE_CONFIG")
    from_file: dict[str, Any] = {}
    if config_path:
        loaded = yaml.safe_load(Path(config_path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{config_path}: expected a mapping of option names to values")
        from_file = {str(k).replace("-", "_"): v for k, v in loaded.items()}
    known = {f.name for f in fields(ServeConfig)}
    unknown = set(from_file) - known
    if unknown:
        raise ValueError(f"{config_path}: unknown options {sorted(unknown)}")
    values: dict[str, Any] = {}
    given: set[str] = set()  # named by a flag or an env var (a file may list every option at its default)
    for f in fields(ServeConfig):
        sources = (flags.get(f.name), env.get(f"KVSTORE_{f.name.upper()}"), from_file.get(f.name))
        picked = next((k for k, source in enumerate(sources) if source is not None), None)
        if picked is None:
            continue
        raw = sources[picked]
        if picked < 2:
            given.add(f.name)
        try:
            values[f.name] = f.metadata["parse"](raw)
        except ValueError as err:
            raise ValueError(f"option {_flag(f.name)}: {err}") from None
    cfg = ServeConfig(**values)
    from kvstore.store.policies import POLICY_NAMES

    if cfg.eviction_policy not in POLICY_NAMES:
        raise ValueError(f"option --eviction-policy: one of {', '.join(POLICY_NAMES)}")
    if cfg.write_policy not in ("write-back", "write-through"):
        raise ValueError("option --write-policy: write-back or write-through")
    if cfg.nvme_admit_uses < 1:
        raise ValueError("option --nvme-admit-uses: 1 or more (1: demote every block)")
    from kvstore.store.cascade import NVME_EVICTIONS

    if cfg.nvme_sync not in ("direct", "fdatasync"):
        raise ValueError("option --nvme-sync: direct or fdatasync")
    if cfg.nvme_eviction not in NVME_EVICTIONS:
        raise ValueError(f"option --nvme-eviction: one of {', '.join(NVME_EVICTIONS)}")
    if cfg.nvme_admit_uses > 1 and cfg.eviction_policy not in ("adaptive", "freq"):
        raise ValueError("option --nvme-admit-uses above 1 needs --eviction-policy adaptive or freq (they count uses)")
    if 1 <= cfg.dram < 4096:  # a number without a unit is bytes: "--dram 512" meant MiB, and holds no block
        raise ValueError(f"option --dram: at least 4KiB (one page); got {cfg.dram} bytes: give a unit, as in 512MiB")
    for name in ("dram", "max_block", "max_stream", "max_hashes", "workers", "lane_max", "cuda_lane_bytes"):
        if getattr(cfg, name) < 1:  # each would start a store that refuses every Put, every call or every lane
            raise ValueError(f"option {_flag(name)}: 1 or more; got {getattr(cfg, name)}")
    for name in ("lane_lease", "cluster_ttl"):
        if not 0 < getattr(cfg, name) < math.inf:  # a lease or heartbeat of no time: each grant or membership lapses
            raise ValueError(f"option {_flag(name)}: seconds above 0; got {getattr(cfg, name)}")
    for name in ("drain_seconds", "max_rpc_seconds", "tenant_streams"):
        if not 0 <= getattr(cfg, name) < math.inf:
            raise ValueError(f"option {_flag(name)}: 0 or more; got {getattr(cfg, name)}")
    if not 0 <= cfg.metrics_port <= 65535:
        raise ValueError(f"option --metrics-port: 0-65535 (0: off); got {cfg.metrics_port}")
    defaults = ServeConfig()
    if not cfg.nvme_dir:
        # an NVMe option set without the directory would start a store with no NVMe tier and say nothing
        for name in _NVME_OPTIONS:
            if name in given or getattr(cfg, name) != getattr(defaults, name):
                raise ValueError(f"option {_flag(name)} needs --nvme-dir (without it there is no NVMe tier)")
    if cfg.max_message < MIN_MESSAGE:
        # every Get message carries a block header beside its chunk (half the limit): a store below this could
        # start and then fail each Get and Put with RESOURCE_EXHAUSTED
        raise ValueError(f"option --max-message: at least {MIN_MESSAGE >> 10}KiB")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if cfg.get_codec != "auto":
        from kvstore.codecs import CodecError, get_codec

        try:
            get_codec(cfg.get_codec)
        except CodecError as err:
            raise ValueError(f"option --get-codec: auto or {err}") from None
    if cfg.tls_client_ca and not cfg.tls_cert:
        raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    return cfg
