"""The paged KV pool: one preallocated tensor of page-first blocks plus block tables.

``pool.kv`` has shape ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``
in the model dtype, so physical block ``b`` (``pool.kv[b]``) is exactly the
block payload of DESIGN 2.2 (``[layers][K,V][block_size][kv_heads][head_dim]``),
contiguous: it goes to and comes from the store without reshuffling.

Verbs (sequence verbs delegate to ``block_manager.BlockManager`` and keep
its promises; this class performs the tensor side, e.g. copy-on-write copies):

- ``add_sequence(seq, hashes) -> reused_tokens``, ``fork(parent, child)``,
  ``free_sequence(seq)``, ``lookup(hashes)``.
- ``append_slots(seq, n) -> Slots``: room for n new tokens, copy-on-write
  already done; the model writes each layer's K/V with ``write_kv``.
- ``extend_with_payloads(seq, payloads) -> ids``: load fetched block payloads
  as the sequence's next full blocks.
- ``reserve_blocks(n)``, ``attach_full(seq, ids)``, ``release_blocks(ids)``:
  blocks filled outside a sequence, then appended to it (``BlockManager``).
- ``block_bytes_view(b)``: block b as a contiguous uint8 tensor aliasing the
  pool (no copy). ``load_block(b, payload)`` / ``load_blocks``: copy payloads in
  (bytes-like, numpy array or tensor of exactly ``block_nbytes`` bytes).
- ``sequence_payloads(seq, first, last)``: byte views of a range of a
  sequence's full blocks, ready for ``Client.put``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.hugepages import huge_buffer
from kvstore.model.block_manager import AppendPlan, BlockManager, SeqId
from kvstore.model.config import ModelConfig
from kvstore.prefault import populate


@dataclass(frozen=True)
class Slots:
    """Physical slots of n new tokens, as index tensors for ``write_kv``."""

    start: int
    blocks: torch.Tensor  # int64 [n]
    offsets: torch.Tensor  # int64 [n]


class PagedKVPool:
    """Preallocated page-first KV blocks and the block tables that map sequences onto them."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        *,
        block_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        memory: np.ndarray | None = None,
        prefault: bool = False,
    ):
        """``memory``: host bytes to lay the pool in (zeroed, uint8, at least ``pool_nbytes`` long), such as a
        ``SharedPool`` a local store reads Gets straight into (``StoreLink.pool_memory``); default: a fresh
        buffer in huge pages where the kernel grants them, whose pages with ``prefault`` are made now (a worker's:
        its memory is then held from the start, and a Get into a pool block never used before does not fault
        its pages in, which made it 1.07-9.5x slower on the shm lane here; ``bench.transfer --cases
        destination``)."""
        self.config = config
        self.block_size = block_size or config.block_size
        self.dtype = dtype or config.torch_dtype
        self.device = torch.device(device)
        shape = (num_blocks, config.layers, 2, self.block_size, config.kv_heads, config.head_dim)
        nbytes = pool_nbytes(config, num_blocks, self.block_size, self.dtype)
        if memory is not None:
            if self.device.type != "cpu" or memory.dtype != np.uint8 or memory.nbytes < nbytes:
                raise ValueError(f"a pool of {nbytes} bytes on {self.device} cannot lie in {memory.nbytes} host bytes")
            self.kv = torch.from_numpy(memory[:nbytes]).view(self.dtype).view(shape)
        elif self.device.type == "cpu":
            # in huge pages where the kernel grants them: the store writes fetched blocks into the pool with
            # process_vm_writev, which ran 1.3-1.5x slower into 4 KiB pages (docs/vllm.md, "Huge pages under a CPU
            # cache"); zeroed, as torch.zeros
            own = huge_buffer(nbytes)
            if prefault:
                populate(own)
            self.kv = torch.from_numpy(own).view(self.dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._bytes = self.kv.view(-1).view(torch.uint8).view(num_blocks, -1)
        self._np_bytes = self._bytes.numpy() if self.device.type == "cpu" else None
        self.manager = BlockManager(num_blocks, self.block_size)

    # -- sizes ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        n: int = self.kv.shape[0]
        return n

    @property
    def block_nbytes(self) -> int:
        n: int = self._bytes.shape[1]
        return n

    @property
    def num_free_blocks(self) -> int:
        return self.manager.allocator.num_free

    # -- sequence verbs ---------------------------------------------------------------
    def add_sequence(self, seq_id: SeqId, hashes: Sequence[bytes] = ()) -> int:
        return self.manager.add(seq_id, hashes)

    def fork(self, parent: SeqId, child: SeqId) -> None:
        self.manager.fork(parent, child)

    def free_sequence(self, seq_id: SeqId) -> list[int]:
        return self.manager.free(seq_id)

    def lookup(self, hashes: Sequence[bytes]) -> int:
        return self.manager.lookup(hashes)

    def add_hashes(self, seq_id: SeqId, hashes: Sequence[bytes]) -> None:
        self.manager.add_hashes(seq_id, hashes)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self.manager.num_tokens(seq_id)

    def block_table(self, seq_id: SeqId) -> list[int]:
        return self.manager.table(seq_id)

    def append_slots(self, seq_id: SeqId, n: int) -> Slots:
        plan: AppendPlan = self.manager.append(seq_id, n)
        for src, dst in plan.copies:
            self.kv[dst].copy_(self.kv[src])
        return Slots(
            start=plan.start,
            blocks=torch.tensor(plan.blocks, dtype=torch.long, device=self.device),
            offsets=torch.tensor(plan.offsets, dtype=torch.long, device=self.device),
        )

    def extend_with_payloads(self, seq_id: SeqId, payloads: Sequence[Any]) -> list[int]:
        ids = self.manager.extend_full(seq_id, len(payloads))
        self.load_blocks(ids, payloads)
        return ids

    def reserve_blocks(self, n: int) -> list[int]:
        return self.manager.reserve(n)

    def attach_full(self, seq_id: SeqId, ids: Sequence[int]) -> None:
        self.manager.attach_full(seq_id, ids)

    def release_blocks(self, ids: Sequence[int]) -> None:
        self.manager.release(ids)

    def sequence_payloads(self, seq_id: SeqId, first: int = 0, last: int | None = None) -> list[torch.Tensor]:
        """Byte views of full blocks ``first..last-1`` of a sequence (default: all full ones)."""
        state = self.manager.state(seq_id)
        full = state.num_tokens // self.block_size
        last = full if last is None else last
        if not 0 <= first <= last <= full:
            raise ValueError(f"block range [{first}, {last}) outside the {full} full blocks")
        return [self._bytes[b] for b in state.table[first:last]]

    # -- tensor side ------------------------------------------------------------------
    def write_kv(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V (each ``[n, kv_heads, head_dim]``) of one layer at their slots."""
        kv_layer = self.kv[:, layer]  # [num_blocks, 2, block_size, kv_heads, head_dim]
        kv_layer[slots.blocks, 0, slots.offsets] = k.to(self.dtype)
        kv_layer[slots.blocks, 1, slots.offsets] = v.to(self.dtype)

    def gather_kv(self, layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer through block tables ``[..., n_blocks]``.

        Returns two views ``[..., kv_heads, n_blocks * block_size, head_dim]``
        of freshly gathered tensors (one copy each, no further reshuffling).
        """
        lead, nb = table.shape[:-1], table.shape[-1]
        flat = table.reshape(-1)
        bs, kvh, hd = self.kv.shape[3:]
        out = []
        for which in (0, 1):
            # index_select copies whole blocks (memcpy-like); advanced indexing is ~8x slower here.
            g = torch.index_select(self.kv[:, layer, which], 0, flat)  # [B*n_blocks, bs, kvh, hd]
            out.append(g.view(*lead, nb * bs, kvh, hd).transpose(-3, -2))
        return out[0], out[1]

    def block_bytes_view(self, block: int) -> torch.Tensor:
        """Block ``block`` as a contiguous uint8 tensor sharing the pool's memory."""
        return self._bytes[block]

    def load_block(self, block: int, payload: Any) -> None:
        """Copy one payload (exactly ``block_nbytes`` bytes) into block ``block``."""
        if isinstance(payload, torch.Tensor):
            src = payload.detach().contiguous().reshape(-1).view(torch.uint8)
            self._check_len(src.numel())
            self._bytes[block].copy_(src)
            return
        arr = _as_uint8_array(payload)
        self._check_len(arr.size)
        if self._np_bytes is not None:
            self._np_bytes[block] = arr
        else:
            self._bytes[block].copy_(torch.from_numpy(arr.copy()))

    def load_blocks(self, blocks: Sequence[int], payloads: Sequence[Any]) -> None:
        if len(blocks) != len(payloads):
            raise ValueError(f"{len(blocks)} blocks but {len(payloads)} payloads")
        for b, p in zip(blocks, payloads):
            self.load_block(b, p)

    def _check_len(self, n: int) -> None:
        if n != self.block_nbytes:
            raise ValueError(
                f"payload has {n} bytes but a block of this pool holds {self.block_nbytes} "
                f"(shape {tuple(self.kv.shape[1:])}, {self.dtype}): wrong model, dtype or block size?"
            )


def pool_nbytes(
    config: ModelConfig, num_blocks: int, block_size: int | None = None, dtype: torch.dtype | None = None
) -> int:
    """The bytes of a ``PagedKVPool`` of ``num_blocks`` blocks (the model's block size and dtype by default)."""
    per_token = config.layers * 2 * config.kv_heads * config.head_dim
    element: int = torch.empty((), dtype=dtype or config.torch_dtype).element_size()
    return num_blocks * (block_size or config.block_size) * per_token * element


def _as_uint8_array(payload: Any) -> np.ndarray:
    if isinstance(payload, np.ndarray):
        return np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    return np.frombuffer(payload, dtype=np.uint8)
