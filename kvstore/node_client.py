"""The client of one kvstore node: ``NodeClient``. Users reach it as ``kvstore.client.Client`` (DESIGN 2.4).

    from kvstore.client import Client
    with Client("127.0.0.1:7070") as kv:
        n = kv.lookup("ns", hashes)                  # leading hashes present
        results = kv.put("ns", hashes, payloads)      # one stream, many blocks
        blocks = kv.get("ns", hashes)                 # bytes-like, in order

``kvstore.client.Client("redis://HOST:PORT")`` returns a ``kvstore.cluster.client.ClusterClient`` instead:
the same verbs over every node of a cluster (see kvstore/cluster/client.py), built from NodeClients.

Verbs and promises:
- ``lookup(namespace, hashes) -> int``; ``lookup_tiers`` also returns the tier of each.
- ``put(namespace, hashes, payloads, *, parent=None, dtype=None) -> [PutResult]``: one
  result per block (stored, already present, or rejected with a reason).
  Payloads are bytes-like, numpy arrays or torch tensors; they are sliced, not
  copied, until the gRPC layer serializes each chunk. Consecutive hashes form a
  chain (block i is the parent of block i+1); ``parent`` names the block before
  the first, so the store can evict leaves before their parents.
- ``get(namespace, hashes, *, out=None, allow_missing=False, verify=True)``:
  payloads in order; with ``out`` the bytes land in the caller's buffers (for
  example a paged KV pool's blocks) instead of new ones. Raises
  ``KVStoreError`` (code NOT_FOUND) on a missing hash unless ``allow_missing``,
  which returns None in its place. Every block's CRC32C is checked.
- ``delete``, ``stats``; deadlines on every call (``timeout``) and retries with
  backoff on UNAVAILABLE (``retries``).

Scatter-gather blocks (``kvstore.client.Segments``, from ``kvstore/payload.py``): a block that lives in
several buffers, such as a vLLM block (one slice of each layer's KV tensor), is passed as
``Segments([part, part, ...])`` wherever a payload goes (``put``) or an ``out`` buffer goes (``get``); parts
are contiguous host buffers (bytes-like, numpy arrays, CPU torch tensors) and the block is their
concatenation. ``put`` reads the parts where they are; ``get`` writes the block across them in order (bytes
of the parts past the block's length are unspecified) and returns the Segments in its place, the CRC32C
of the whole block (chained over the parts) checked before the call returns. Segments and plain payloads
mix freely in one call. ``SegmentRows(layer_tensors).block(b)`` builds the Segments of block b when each
buffer holds one row per block (vLLM's ``[num_blocks, ...]`` per-layer caches) from offsets worked out once,
without a tensor operation per part. Copies per block, against the same bytes as one buffer: none added on the shm
lane (the store reads and writes the parts with one multi-iovec process_vm_readv/writev per piece; through
the region, one copy per part with its CRC fused in), on the tcp lane (sendmsg over the parts' views,
recvmsg_into them) and on gRPC (chunks assembled from the parts, where gRPC copies anyway). Coded transfers
(codec other than none), the cuda_ipc lane and Segments holding CUDA tensors join each block into one host
buffer first (Put) or scatter it from one after the call (Get): one copy per block, small beside the
codec's work or the device copies there.

Data lanes (``lane=``, kvstore/lanes): ``"auto"`` (default) moves the bytes of
put and get over shared memory when the server is on this host, else over the
bulk TCP lane, and falls back to the gRPC stream when neither is offered;
``"shm"``/``"tcp"``/``"cuda_ipc"`` insist on that lane (KVStoreError when it
cannot be had); ``"grpc"`` always streams over gRPC. ``lane_kind`` tells which
is in use. CUDA tensors (``put`` payloads, ``get`` ``out``) move device to
device over the cuda_ipc lane when the store runs on this host and GPU
(``"auto"`` asks for it on the first call that carries them); elsewhere they
go through one pinned host staging buffer per call on the host lanes.

Compression (``codec=``, kvstore/codecs; DESIGN 5): ``"none"`` (default: raw
bytes, the fastest choice on local and fast links, on any lane), a codec
name (``"zstd"``, ``"byteplane"``, ``"fp8"``, ...) or ``"auto"`` (a per-client
bandit picks a codec per batch of >= 256 KiB from the encode and decode time,
ratio and link bandwidth it measures). ``put(..., codec=, lossy_ok=)`` and
``get(..., codec=, lossy_ok=)`` override it per call. A coded Put encodes
the next batch while the current one is on the wire and sends each block's
CRC32C of its raw bytes (of the bytes the reader will decode, under a lossy
codec); a coded Get tells the server which codecs it accepts (the server's
own controller picks among them), decodes into ``out`` and reports its
decode time back with the next Get. Lossy codecs (fp8, fp8+zstd) are used
only when the caller passes ``lossy_ok=True`` *and* the server's policy for
the namespace allows lossy KV (``lossy_allowed(namespace)``; the server
refuses a lossy Put elsewhere with INVALID_ARGUMENT). Coded transfers travel
on the gRPC stream (the lanes carry raw bytes); ``"auto"`` sends raw bytes
when the client's lane is shared memory. ``codec_stats()`` shows the
client's controller (choices, bandwidth, ratio and speed estimates).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore import memops_jit
from kvstore.addresses import check_target
from kvstore.background_compile import warm_up_logged
from kvstore.checksum import crc32c
from kvstore.codecs.transfer import DecodeTally, TransferPlan
from kvstore.codecs.transfer_client import ClientCoding
from kvstore.devices import is_device_tensor, stage_out
from kvstore.errors import KVStoreError, from_rpc
from kvstore.get_stream import get_call, receive_blocks
from kvstore.lanes.client.negotiate import LanePool
from kvstore.lanes.shared_pool import SharedPool
from kvstore.payload import Segments, as_bytes_view, wire_dtype
from kvstore.put_stream import PutShape, put_call, put_requests
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import CHUNK_BYTES, TIER_NAMES, PutResult, put_results

T = TypeVar("T")


class NodeClient:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        timeout: float = 60.0,
        retries: int = 3,
        chunk_bytes: int = CHUNK_BYTES,
        max_message: int = 4 << 20,
        lane: str = "auto",
        codec: str = "none",
    ):
        if target.startswith("redis://") or target.startswith("rediss://"):
            raise KVStoreError(
                grpc.StatusCode.UNIMPLEMENTED,
                "cluster targets (redis://) are served by kvstore.client.Client (a ClusterClient)",
            )
        check_target(target)
        self.target, self.timeout, self.retries, self.chunk_bytes = target, timeout, retries, chunk_bytes
        options = [("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", max_message)]
        if tls_ca or tls_cert:
            creds = grpc.ssl_channel_credentials(_read(tls_ca), _read(tls_key), _read(tls_cert))
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._stub = pb_grpc.KVStoreStub(self._channel)
        # raw Gets and Puts: the messages that carry block bytes made and read by hand (block_messages)
        self._get_raw = get_call(self._channel)
        self._put_raw = put_call(self._channel)
        self._put_shape = PutShape()  # packed small blocks and chunk sizes, as the store said or refused
        self._lanes = LanePool(
            self._channel, target, lane, metadata=self._metadata, timeout=timeout, tls=bool(tls_ca or tls_cert)
        )
        self._device_lanes = (
            self._lanes
            if lane == "cuda_ipc"
            else LanePool(
                self._channel,
                target,
                "cuda_ipc" if lane == "auto" else "grpc",
                metadata=self._metadata,
                timeout=timeout,
                tls=bool(tls_ca or tls_cert),
                optional=True,
            )
        )
        self._coding = ClientCoding(codec)
        self._lossy_allowed: dict[str, bool] = {}
        self._last_lane = ""

    @property
    def lane_kind(self) -> str:
        """The data lane in use: "shm", "tcp", "cuda_ipc" or "grpc"."""
        return self._lanes.kind

    @property
    def last_lane(self) -> str:
        """The lane the last Get or Put moved its bytes on ("" before any): ``lane_kind``, or "cuda_ipc" for CUDA
        tensors the device lane took, or "grpc" for a coded or fallen-back call."""
        return self._last_lane

    # -- lifecycle ----------------------------------------------------------------------
    def connect(self) -> str:
        """Open a data lane now (its negotiation, shared region and handshake), so that the first Get or Put
        does not pay for it; the lane kind ("grpc" when none opened)."""
        self._lanes.run(lambda lane: None)
        return self.lane_kind

    def warm_up(self) -> str:
        """``connect``, and set up now what the first Gets would otherwise pay for: the copy and CRC32C kernels
        and, on an shm lane, the reader of the store's NVMe files (its compiled runs and its threads) and the DRAM
        index's kernels, compiled or loaded from numba's cache on this thread. Imports numba where it is
        installed: an engine whose start that breaks (vLLM 0.32, kvstore/memops_kernels.py) calls it once it
        has started. A kernel that fails to compile is logged, not raised: its uncompiled path serves, as before
        it compiles. The lane kind, as ``connect``."""
        warm_up_logged(memops_jit.warm_up, "the copy and CRC32C kernels")
        self._lanes.run(lambda lane: lane.warm_up())
        return self.lane_kind

    def shared_pool(self, nbytes: int, name: str = "kvstore-pool") -> SharedPool:
        """``nbytes`` of host memory shared with a store on this host (``kvstore.lanes.shared_pool``): NVMe blocks
        of a Get whose ``out`` buffers lie in its ``array`` are read by the store straight into them, with no copy
        (on the shm lane after its direct handshake; elsewhere it is plain memory). Offered to each lane before its
        next call; the store keeps it mapped until the lane closes."""
        pool = SharedPool(nbytes, name)
        self.offer_pool(pool)
        return pool

    def offer_pool(self, pool: SharedPool) -> None:
        """Offer a ``SharedPool`` made elsewhere (one a cluster client offers every node) to this client's lanes."""
        if pool not in self._lanes.shared:
            self._lanes.shared.append(pool)

    def close(self) -> None:
        self._lanes.close()
        self._device_lanes.close()
        self._channel.close()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- verbs ---------------------------------------------------------------------------
    def lookup(self, namespace: str, hashes: Sequence[bytes]) -> int:
        return self.lookup_tiers(namespace, hashes)[0]

    def lookup_tiers(self, namespace: str, hashes: Sequence[bytes]) -> tuple[int, list[str]]:
        reply = self._call(
            lambda: self._stub.Lookup(
                pb.LookupRequest(namespace=namespace, hashes=list(hashes)),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        )
        return reply.prefix_length, [TIER_NAMES.get(t, "?") for t in reply.tiers]

    def put(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        payloads: Sequence[Any],
        *,
        parent: bytes | None = None,
        dtype: str | None = None,
        chained: bool = True,
        codec: str | None = None,
        lossy_ok: bool = False,
    ) -> list[PutResult]:
        if len(hashes) != len(payloads):
            raise ValueError(f"{len(hashes)} hashes but {len(payloads)} payloads")
        if not hashes:
            return []
        whole = self._device_lanes is self._lanes  # lane="cuda_ipc": the device lane copies whole blocks
        if any(isinstance(p, Segments) and (whole or not p.on_host) for p in payloads):  # joined on the host
            payloads = [p.join() if isinstance(p, Segments) and (whole or not p.on_host) else p for p in payloads]
        if (codec or self._coding.codec) in ("none", "auto") and any(is_device_tensor(p) for p in payloads):
            on_device = self._put_device(namespace, hashes, payloads, parent, dtype, chained)
            if on_device is not None:
                self._last_lane = self._device_lanes.kind
                return on_device
        views = [(p, p.dtype) if isinstance(p, Segments) else as_bytes_view(p) for p in payloads]
        headers = _headers(hashes, [(_nbytes(v), kind) for v, kind in views], parent, dtype, chained)
        plan = self._put_plan(namespace, {dtype or kind for _, kind in views}, codec, lossy_ok)
        self._last_lane = "grpc"
        if plan is not None:  # the codec reads each block whole: segments are joined once
            blocks = [v.join() if isinstance(v, Segments) else v for v, _ in views]
            return self._put_coded(namespace, list(hashes), [h.parent for h in headers], blocks, plan)
        on_lane = self._lanes.run(lambda lane: lane.put(namespace, headers, [v for v, _ in views]))
        if on_lane is not None:
            self._last_lane = self._lanes.kind
            return on_lane
        for header, (view, _) in zip(headers, views):
            # C implementation; accepts any buffer (chained over the segments of a Segments)
            header.crc32c = view.crc32c() if isinstance(view, Segments) else crc32c(view)
        raw = [view for view, _ in views]
        reply = self._put_shaped(
            lambda packed, chunk: self._put_raw(
                put_requests(namespace, headers, raw, chunk, packed=packed),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        )
        return put_results(reply.results)

    def _put_shaped(self, send: Callable[[int, int], pb.PutResponse], packs: bool = True) -> pb.PutResponse:
        """``send(packed, chunk)`` cut as the store last said it takes Puts (``PutShape``), and sent again cut
        smaller when the store refuses it for its shape."""
        shape = self._put_shape
        while True:
            packed, chunk = shape.packed if packs else 0, shape.chunk(self.chunk_bytes)
            try:
                reply = self._call(lambda: send(packed, chunk))
            except KVStoreError as err:
                if shape.refused(err, packed, chunk):
                    continue
                raise
            shape.learn(reply, self.chunk_bytes)
            return reply

    def _put_device(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        payloads: Sequence[Any],
        parent: bytes | None,
        dtype: str | None,
        chained: bool,
    ) -> list[PutResult] | None:
        """A Put of CUDA tensors device to device over the cuda_ipc lane; None when there is none."""
        from kvstore.devices import flat_bytes

        flats, sizes = [], []
        for p in payloads:
            if is_device_tensor(p):
                flat = flat_bytes(p)
                flats.append(flat)
                sizes.append((flat.numel(), str(p.dtype).removeprefix("torch.")))
            elif isinstance(p, Segments):  # the device lane copies whole blocks: joined once
                flats.append(p.join())
                sizes.append((p.nbytes, p.dtype))
            else:
                view, kind = as_bytes_view(p)
                flats.append(view)
                sizes.append((len(view), kind))
        headers = _headers(hashes, sizes, parent, dtype, chained)
        return self._device_lanes.run(lambda lane: lane.put(namespace, headers, flats))

    def _put_plan(self, namespace: str, kinds: set[str], codec: str | None, lossy_ok: bool) -> TransferPlan | None:
        """How this Put codes its blocks; None: raw bytes (codec none, mixed or non-float dtypes, a shm lane)."""
        if len(kinds) != 1 or ((codec or self._coding.codec) == "auto" and self.lane_kind == "shm"):
            return None
        return self._coding.put_plan(codec, kinds.pop(), lossy_ok, lambda: self.lossy_allowed(namespace))

    def _put_coded(
        self, namespace: str, hashes: list[bytes], parents: list[bytes], blocks: list[memoryview], plan: TransferPlan
    ) -> list[PutResult]:
        errors: list[BaseException] = []

        def attempt(_packed: int, chunk: int) -> pb.PutResponse:
            errors.clear()
            clock = plan.send_clock()
            requests = self._coding.put_requests(namespace, hashes, parents, blocks, plan, clock, chunk, errors)
            reply: pb.PutResponse = self._stub.Put(requests, timeout=self.timeout, metadata=self._metadata)
            clock.finish(drained=True)
            return reply

        reply = self._put_shaped(attempt, packs=False)  # coded blocks go a block a message
        if errors:
            raise errors[0]
        plan.observe_decode(DecodeTally.from_wire(reply.decode_timings))
        return put_results(reply.results)

    def lossy_allowed(self, namespace: str) -> bool:
        """Whether the server lets ``namespace`` hold lossy KV (asked once per namespace, from its Stats)."""
        allowed = self._lossy_allowed.get(namespace)
        if allowed is None:
            counters = self.stats(namespace)["counters"]
            allowed = self._lossy_allowed[namespace] = counters.get("codec_lossy_allowed", 0.0) > 0.0
        return allowed

    def codec_stats(self) -> dict[str, float]:
        """This client's codec controller: choices, bandwidth, ratio and speed estimates (controller.snapshot)."""
        return self._coding.controller.snapshot()

    def get(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        *,
        out: Sequence[Any] | None = None,
        allow_missing: bool = False,
        verify: bool = True,
        codec: str | None = None,
        lossy_ok: bool = False,
    ) -> list[Any]:
        if out is not None and len(out) != len(hashes):
            raise ValueError(f"{len(hashes)} hashes but {len(out)} output buffers")
        if not hashes:
            return []
        mixed = out is not None and not all(type(x) is np.ndarray for x in out)  # numpy buffers: neither case below
        if out is not None and mixed and any(isinstance(x, Segments) for x in out):
            return self._get_segments(namespace, hashes, out, allow_missing, verify, codec, lossy_ok)
        on_device = out is not None and mixed and any(is_device_tensor(x) for x in out)
        if on_device and (codec or self._coding.codec) in ("none", "auto"):
            got = self._device_lanes.run(lambda lane: lane.get(namespace, list(hashes), out, allow_missing, verify))
            if got is not None:
                self._last_lane = self._device_lanes.kind
                return got
        device_out, out = out, None
        finish: Callable[[], None] = _nothing
        if on_device:  # CUDA destinations are filled through pinned host buffers
            out, finish = stage_out(device_out)
        else:
            out = device_out
        accepted = self._accepted(codec, lossy_ok)
        result: list[Any] | None
        if accepted:  # coded blocks may come: the gRPC stream, decoded here
            request = pb.GetRequest(
                namespace=namespace,
                hashes=list(hashes),
                allow_missing=allow_missing,
                accepted_codecs=accepted,  # type: ignore[arg-type]  # protoc's .pyi: Codec | str; ints are what it takes
                decode_report=self._coding.take_report(),
            )
            result = self._call(
                lambda: self._coding.receive(
                    self._stub.Get(request, timeout=self.timeout, metadata=self._metadata), len(hashes), out, verify
                )
            )
        else:
            result = self._lanes.run(lambda lane: lane.get(namespace, list(hashes), out, allow_missing, verify))
        self._last_lane = self._lanes.kind if result is not None and not accepted else "grpc"
        if result is None:
            request = pb.GetRequest(namespace=namespace, hashes=list(hashes), allow_missing=allow_missing, packed=True)
            result = self._call(lambda: self._receive(request, out, verify))
        if device_out is not None and out is not device_out:
            finish()
            return [None if r is None else d for r, d in zip(result, device_out)]
        return result

    def _accepted(self, codec: str | None, lossy_ok: bool) -> list[int]:
        """The codecs a Get accepts beyond none (none: raw bytes on the lane or the gRPC stream)."""
        if self.lane_kind == "shm" and (codec or self._coding.codec) == "auto":
            return []
        return self._coding.accepted(codec, lossy_ok)

    def _get_segments(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        out: Sequence[Any],
        allow_missing: bool,
        verify: bool,
        codec: str | None,
        lossy_ok: bool,
    ) -> list[Any]:
        """A Get whose ``out`` holds Segments: scattered into them by the host lanes and the gRPC stream;
        through one host buffer per block, scattered once after the call, where a codec decodes the blocks,
        a device lane copies them or a Segments holds CUDA tensors."""
        staged = (
            self._device_lanes is self._lanes
            or any(is_device_tensor(x) for x in out)
            or any(isinstance(x, Segments) and not x.on_host for x in out)
            or bool(self._accepted(codec, lossy_ok))
        )
        if not staged:
            result = self._lanes.run(lambda lane: lane.get(namespace, list(hashes), out, allow_missing, verify))
            self._last_lane = self._lanes.kind if result is not None else "grpc"
            if result is None:
                request = pb.GetRequest(
                    namespace=namespace, hashes=list(hashes), allow_missing=allow_missing, packed=True
                )
                result = self._call(lambda: self._receive(request, out, verify))
            return result
        buffers = [memoryview(bytearray(x.nbytes)) if isinstance(x, Segments) else x for x in out]
        result = self.get(
            namespace, hashes, out=buffers, allow_missing=allow_missing, verify=verify, codec=codec, lossy_ok=lossy_ok
        )
        for i, (x, buf) in enumerate(zip(out, buffers)):
            if isinstance(x, Segments) and result[i] is not None:
                x.scatter(buf)
                result[i] = x
        return result

    def _receive(self, request: pb.GetRequest, out: Sequence[Any] | None, verify: bool) -> list[Any]:
        """A raw gRPC Get (its requests ask for ``packed``: small blocks several to a message, get_stream)."""
        stream = self._get_raw(request, timeout=self.timeout, metadata=self._metadata)
        return receive_blocks(stream, len(request.hashes), out, verify)

    def delete(self, namespace: str, hashes: Sequence[bytes]) -> int:
        reply: pb.DeleteResponse = self._call(
            lambda: self._stub.Delete(
                pb.DeleteRequest(namespace=namespace, hashes=list(hashes)),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        )
        return reply.deleted

    def stats(self, namespace: str = "") -> dict[str, Any]:
        reply = self._call(
            lambda: self._stub.Stats(
                pb.StatsRequest(namespace=namespace), timeout=self.timeout, metadata=self._metadata
            )
        )
        out: dict[str, Any] = {
            f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields if f.name not in ("tiers", "counters")
        }
        out["counters"] = dict(reply.counters)
        out["tiers"] = [{f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields} for t in reply.tiers]
        return out

    # -- retries ---------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> T:
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
                if code == grpc.StatusCode.UNAVAILABLE and attempt < self.retries:
                    time.sleep(delay)
                    delay = min(delay * 4, 2.0)
                    continue
                raise from_rpc(err) from None
        raise AssertionError("unreachable")


def _headers(
    hashes: Sequence[bytes], sizes: Sequence[tuple[int, str]], parent: bytes | None, dtype: str | None, chained: bool
) -> list[pb.BlockHeader]:
    """Raw (codec none) headers of a Put: lengths, dtypes and the parent chain."""
    headers: list[pb.BlockHeader] = []
    prev = parent or b""
    for i, (key, (n, kind)) in enumerate(zip(hashes, sizes)):
        headers.append(
            pb.BlockHeader(
                hash=key,
                parent=prev if chained else (parent or b"") if i == 0 else b"",
                codec=pb.CODEC_NONE,
                raw_length=n,
                stored_length=n,
                dtype=wire_dtype(dtype or kind),
            )
        )
        prev = key
    return headers


def _read(path: str | None) -> bytes | None:
    """A PEM file's bytes, or None when not given."""
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _nbytes(view: memoryview | Segments) -> int:
    return view.nbytes if isinstance(view, Segments) else len(view)


def _nothing() -> None:
    """The ``finish`` of a Get with no device buffers to fill."""
