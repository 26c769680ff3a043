"""DeepSeek-V4 HiSparse: the C4 device pool and the allocator around SGLang's SWA allocator.

DeepSeek-V4 keeps three kinds of attention KV: a sliding window (SWA), a C4
pool (one compressed token per 4 tokens) and a C128 pool. HiSparse only
touches C4: its logical id space (``c4_logical_size`` = full / 4) is backed
by host memory and only a small hot buffer per request lives in the C4
*device* pool, which is ``host_to_device_ratio`` times smaller.

Id spaces used below:

* *full* - what ``req_to_token`` stores (the SWA allocator's full space);
* *compressed* - ``full // 4`` for the full ids whose token closes a group
  of 4 (``(full + 1) % 4 == 0``); it indexes the C4 mapping;
* *C4 row* - a row of :class:`DSV4C4DevicePool` (``c4_page_size`` rows per
  page, page 0 is the padding sink).

``mapping[compressed] -> C4 row`` (0 = unmapped, a trailing -1 so that the
compressed id -1 of a request without prefix maps to -1) is owned by the
allocator and registered into the device pool, which translates every C4
write location through it.

Drop-in (class REPLACE) for 0.5.13:

* ``deepseek_v4_memory_pool.HiSparseC4DevicePool`` - constructed by
  ``DeepSeekV4TokenToKVPool.__init__`` (``deepseek_v4_memory_pool.py:470``,
  a module-global lookup at call time, so the rebound name is ours). Read by
  ``compressor_v2.py:509-515`` and ``dsv4/indexer.py:629``
  (``translate_loc_to_hisparse_device``), ``DeepSeekV4TokenToKVPool``
  (``set_key_buffer``/``set_key_buffer_fused``/``get_key_buffer``,
  ``page_size``, ``kv_buffer``), our coordinator and C4 host pool
  (``kv_buffer``, ``kv_cache_total_dim``, ``store_dtype``, ``layer_num``,
  ``translate_loc_from_full_to_compressed``).
* ``hisparse_memory_pool.DeepSeekV4HiSparseTokenToKVPoolAllocator`` -
  constructed by ``model_runner_kv_cache_mixin.py:811`` around the SWA
  allocator. ``isinstance`` users (``schedule_policy.py:482-485``,
  ``chunk_cache.py:118-124``) name the class through a module-top
  ``from ... import``; HookRegistry's ``_propagate_patch`` rebinds those
  names when the module is already imported, and a module imported later
  picks up the rebound attribute, so both checks see this class. The mixin's
  draft-worker branch (``:817-823``) reads ``logical_attn_allocator``.
  Other users: ``PrefillAdder`` (``available_size``, ``full_available_size``,
  ``swa_available_size``), ``mem_cache/common.py`` (``alloc_extend``,
  ``alloc_decode``, ``free``, ``free_group_*``, ``backup_state``),
  ``ScheduleBatch`` SWA eviction (``free_swa``), the SWA chunk cache
  (``translate_loc_from_full_to_swa``, ``free_swa``), PD decode
  (``disaggregation/decode.py:818,957,1133,1316``:
  ``hisparse_attn_allocator``, ``hisparse_page_size``,
  ``logical_attn_allocator``, ``alloc_logical_only``) and our coordinator
  (``hisparse_kvcache``, ``compress_ratio``, ``size_full``,
  ``full_to_hisparse_device_index_mapping``, ``alloc_device_buffer``,
  ``get_last_loc_compressed``, ``free_hisparse``/``free_compressed``,
  ``free_hisparse_indices``, ``hisparse_attn_allocator.alloc``,
  ``set_reservation_provider``, ``attach_host_pool``, ``take_prefill_claim``).
"""

from __future__ import annotations

import logging
import weakref
from typing import Dict, Optional

import torch

from sglang.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool

from sglang_hisparse.allocator import (
    HiSparseDualAllocator,
    _pages_to_tokens,
    _ReservingPagedAllocator,
)

logger = logging.getLogger(__name__)

# C4 layers compress 4 consecutive tokens into one.
C4_RATIO = 4


# ===================================================================== pool
class DSV4C4DevicePool(DeepSeekV4SingleKVPool):
    """The C4 KV pool of a HiSparse DeepSeek-V4 model: only hot buffers live here.

    Storage is the plain DeepSeek-V4 single pool (``[pages, padded page
    bytes]`` uint8 per C4 layer); what HiSparse adds is the translation of
    every write location from the compressed id space to a C4 row.
    """

    compress_ratio = C4_RATIO

    def __init__(
        self, size: int, page_size: int, dtype: torch.dtype,
        qk_nope_head_dim: int, qk_rope_head_dim: int, layer_num: int, device: str,
        enable_memory_saver: bool, start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
    ):
        super().__init__(
            size, page_size, dtype, qk_nope_head_dim, qk_rope_head_dim, layer_num,
            device, enable_memory_saver, start_layer, end_layer,
        )
        # Per-layer base addresses, as the 0.5.13 pool exposes them (SGLang's
        # paged host pool transfer kernels take them).
        self.data_ptrs = torch.tensor(
            [buf.data_ptr() for buf in self.kv_buffer], dtype=torch.uint64, device=self.device
        )
        # Set by the allocator (register_mapping) right after construction.
        self.full_to_hisparse_device_index_mapping: Optional[torch.Tensor] = None

    def register_mapping(self, mapping: torch.Tensor) -> None:
        self.full_to_hisparse_device_index_mapping = mapping

    # ------------------------------------------------------------ id spaces
    def translate_loc_from_full_to_compressed(self, full_indices: torch.Tensor) -> torch.Tensor:
        """Compressed ids of the full ids that close a group of 4 (others dropped)."""
        closes_group = (full_indices + 1) % C4_RATIO == 0
        return full_indices[closes_group] // C4_RATIO

    def _translate_loc_to_hisparse_device(self, compressed: torch.Tensor) -> torch.Tensor:
        """C4 rows (int64) of compressed ids."""
        return self.full_to_hisparse_device_index_mapping[compressed]

    def translate_loc_to_hisparse_device(self, compressed: torch.Tensor) -> torch.Tensor:
        """C4 rows as int32: what the store / compress / FlashMLA kernels take."""
        return self._translate_loc_to_hisparse_device(compressed).to(torch.int32)

    def translate_loc_from_full_to_hisparse_device(self, full_indices: torch.Tensor) -> torch.Tensor:
        return self._translate_loc_to_hisparse_device(
            self.translate_loc_from_full_to_compressed(full_indices)
        )

    # --------------------------------------------------------------- writes
    # DeepSeekV4TokenToKVPool hands compressed ids; storage wants C4 rows.
    def set_key_buffer(self, layer_id: int, loc: torch.Tensor, cache_nope_fp8_rope_bf16_pack):
        rows = self.translate_loc_to_hisparse_device(loc)
        super().set_key_buffer(layer_id, rows, cache_nope_fp8_rope_bf16_pack)

    def set_key_buffer_fused(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        rows = self.translate_loc_to_hisparse_device(loc)
        return super().set_key_buffer_fused(layer_id, rows, cache_k)

    # Hot buffers hold a moving subset of a request's tokens: a CPU snapshot
    # of them (retraction offload) would not restore a request.
    def get_cpu_copy(self, indices, mamba_indices=None):
        raise NotImplementedError("the HiSparse C4 device pool cannot be copied to CPU")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise NotImplementedError("the HiSparse C4 device pool cannot be loaded from CPU")


# ================================================================ allocator
class DSV4HiSparseAllocator(BaseTokenToKVPoolAllocator):
    """Drop-in for 0.5.13 ``DeepSeekV4HiSparseTokenToKVPoolAllocator``.

    Wraps the SWA allocator SGLang built (it stays the owner of the full and
    SWA id spaces) and adds a paged C4 row allocator plus the compressed ->
    C4 row mapping. Public ``page_size`` is the logical (full) page size;
    C4 allocation uses ``hisparse_page_size`` (= full page / 4).

    Sizes reported in *full tokens* (``available_size``,
    ``full_available_size``) convert C4 rows with the ratio 4. Like
    :class:`~sglang_hisparse.allocator.HiSparseDualAllocator`, the C4 budget
    holds back what live requests may still claim (from the coordinator's
    reservation provider, in C4 rows) and is capped by free host rows.
    """

    compress_ratio = C4_RATIO

    def __init__(self, logical_attn_allocator: BaseTokenToKVPoolAllocator):
        kvcache = logical_attn_allocator.get_kvcache()
        c4_pool = getattr(kvcache, "c4_kv_pool", None)
        if not hasattr(c4_pool, "register_mapping"):
            raise TypeError(
                "DeepSeek-V4 HiSparse needs DeepSeekV4TokenToKVPool(enable_hisparse=True) "
                f"(its C4 pool is {type(c4_pool).__name__})"
            )
        self.logical_attn_allocator = logical_attn_allocator
        self.hisparse_kvcache = c4_pool
        self._kvcache = kvcache
        self.page_size = logical_attn_allocator.page_size
        self.hisparse_page_size = c4_pool.page_size
        self.dtype = c4_pool.dtype
        self.device = c4_pool.device
        self.need_sort = logical_attn_allocator.need_sort
        if self.page_size != self.hisparse_page_size * C4_RATIO:
            raise ValueError(
                f"C4 page size {self.hisparse_page_size} is not page size {self.page_size} / 4"
            )

        self.hisparse_attn_allocator = _ReservingPagedAllocator(
            c4_pool.size, self.hisparse_page_size, self.dtype, self.device, c4_pool,
            self.need_sort,
        )
        self.hisparse_attn_allocator._held_back = self._physical_held_back

        # Admission state, filled by the coordinator (all in C4 rows).
        self._reservation_provider = None
        self._host_pool = None
        self._hot_claim_tokens = 0
        self._prefill_claims: Dict[int, int] = {}

        # One slot per compressed id (+ a padding page), then the -1 sentinel.
        n = kvcache.c4_logical_size + self.hisparse_page_size
        self.full_to_hisparse_device_index_mapping = torch.zeros(
            n + 1, dtype=torch.int64, device=self.device
        )
        self.full_to_hisparse_device_index_mapping[n] = -1

        # The sub-allocators own the free lists; these exist for the base API.
        self.free_pages = self.release_pages = None
        self.clear()  # also resets the free-group state
        c4_pool.register_mapping(weakref.proxy(self.full_to_hisparse_device_index_mapping))

    # ------------------------------------------------------------------ sizes
    @property
    def size(self) -> int:
        return self.logical_attn_allocator.size

    @size.setter
    def size(self, value):  # BaseTokenToKVPoolAllocator.__init__ would assign it
        pass

    @property
    def size_full(self) -> int:
        return self.logical_attn_allocator.size_full

    @property
    def size_swa(self) -> int:
        """SWA slots (the sliding window side of the wrapped allocator)."""
        return self.logical_attn_allocator.size_swa

    @property
    def logical_capacity(self) -> int:
        """Longest context a request can hold (feeds ``max_token_pool_size``)."""
        return self.logical_attn_allocator.size_full

    @property
    def physical_size(self) -> int:
        return self.hisparse_attn_allocator.size

    @property
    def full_to_swa_index_mapping(self) -> torch.Tensor:
        return self.logical_attn_allocator.full_to_swa_index_mapping

    def get_kvcache(self):
        return self._kvcache

    # ------------------------------------------------------ admission control
    # Shared with the DSA allocator: the reservation provider, host pool
    # attachment, prefill claims and the physical sub-allocator hold-back.
    set_reservation_provider = HiSparseDualAllocator.set_reservation_provider
    attach_host_pool = HiSparseDualAllocator.attach_host_pool
    _owed = HiSparseDualAllocator._owed
    pending_prefill_claim = HiSparseDualAllocator.pending_prefill_claim
    take_prefill_claim = HiSparseDualAllocator.take_prefill_claim
    _physical_held_back = HiSparseDualAllocator._physical_held_back
    _host_headroom = HiSparseDualAllocator._host_headroom

    def physical_available_size(self) -> int:
        """Free C4 rows, nothing held back."""
        return self.hisparse_attn_allocator.raw_available_size()

    def _c4_budget_tokens(self) -> int:
        """Full tokens the C4 side can still admit (device rows and host rows)."""
        rows = self.hisparse_attn_allocator.available_size()
        head = self._host_headroom()
        if head is not None:
            rows = min(rows, max(0, head))
        return rows * C4_RATIO

    def available_size(self) -> int:
        return min(self.logical_attn_allocator.available_size(), self._c4_budget_tokens())

    def full_available_size(self) -> int:
        return min(self.logical_attn_allocator.full_available_size(), self._c4_budget_tokens())

    def swa_available_size(self) -> int:
        return self.logical_attn_allocator.swa_available_size()

    def debug_print(self) -> str:
        return self.logical_attn_allocator.debug_print() + (
            f"#c4-free={self.physical_available_size()}, "
            f"#c4-prefill-claims={len(self._prefill_claims)}, "
        )

    # ---------------------------------------------------------- SWA passthrough
    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor):
        return self.logical_attn_allocator.translate_loc_from_full_to_swa(kv_indices)

    def free_swa(self, free_indices: torch.Tensor) -> None:
        self.logical_attn_allocator.free_swa(free_indices)

    def set_full_to_swa_mapping(self, full_indices, swa_indices) -> None:
        self.logical_attn_allocator.set_full_to_swa_mapping(full_indices, swa_indices)

    # ------------------------------------------------------------ translation
    translate_to_physical = HiSparseDualAllocator.translate_to_physical

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        """Compressed id of the last C4 token at or before each full id.

        Full ids keep the token's offset within its (4-aligned) page, so
        ``(loc - 3) // 4`` is the group closed at or before ``loc``; -1 maps
        to -1 (no prefix). For a loc in the first 3 slots of a page the
        result belongs to another page, but then the request's compressed
        length is page aligned and the paged allocator does not read it.
        """
        return (last_locs - (C4_RATIO - 1)) // C4_RATIO

    def get_last_loc_hisparse_device(self, last_locs: torch.Tensor) -> torch.Tensor:
        return self.translate_to_physical(self.get_last_loc_compressed(last_locs))

    # ------------------------------------------------------------- allocation
    def alloc(self, need_size: int):
        raise NotImplementedError(
            "DeepSeek-V4 HiSparse allocates through alloc_extend / alloc_decode only"
        )

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                     seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor, extend_num_tokens: int):
        """Prefill: full + SWA slots for every token, a C4 row for every 4th."""
        cps = self.hisparse_page_size
        c_prefix_cpu = prefix_lens_cpu // C4_RATIO
        c_seq_cpu = seq_lens_cpu // C4_RATIO
        c4_pages = int(((c_seq_cpu + cps - 1) // cps - (c_prefix_cpu + cps - 1) // cps).sum())
        if c4_pages * cps > self.physical_available_size():
            return None
        logical = self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )
        if logical is None:
            return None
        compressed = self.hisparse_kvcache.translate_loc_from_full_to_compressed(logical)
        if compressed.numel():
            rows = self.hisparse_attn_allocator.alloc_extend(
                prefix_lens // C4_RATIO, c_prefix_cpu, seq_lens // C4_RATIO, c_seq_cpu,
                self.get_last_loc_hisparse_device(last_loc), int(compressed.numel()),
                num_new_pages=c4_pages,
            )
            if rows is None:  # not reached after the size check above
                self.logical_attn_allocator.free(logical)
                return None
            self.full_to_hisparse_device_index_mapping[compressed] = rows.to(torch.int64)
        self._register_prefill_claims(prefix_lens_cpu, seq_lens_cpu, logical)
        return logical

    def _register_prefill_claims(self, prefix_lens_cpu, seq_lens_cpu, logical) -> None:
        """A new request ends up holding a whole padded hot buffer of C4 rows;
        hold back what its prefill rows do not cover until it is staged."""
        if self._hot_claim_tokens <= 0:
            return
        cps = self.hisparse_page_size
        start = 0
        for pre, seq in zip(prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()):
            if pre == 0 and seq > 0:
                held = _pages_to_tokens(seq // C4_RATIO, cps)
                if self._hot_claim_tokens > held:
                    self._prefill_claims[int(logical[start])] = self._hot_claim_tokens - held
            start += seq - pre

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc):
        """Decode: full + SWA slot only; the coordinator maps new C4 tokens to slot B."""
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def alloc_logical_only(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                           seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                           last_loc: torch.Tensor, extend_num_tokens: int):
        """Full + SWA slots without C4 rows (PD decode prealloc: C4 KV lands on host)."""
        return self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )

    def alloc_device_buffer(self, compressed: torch.Tensor, need_size: int):
        """Turn a request's prefill C4 rows into its hot buffer of ``need_size`` rows.

        ``compressed`` are the request's compressed ids in token order;
        ``need_size`` is the padded buffer ``B + c4_page_size``. Slot ``i``
        holds token ``i`` for ``i < B``; slot ``B`` must hold the newest
        token. When the request has more than ``B + 1`` C4 tokens, the buffer
        is the ``B / c4_page_size`` pages of tokens ``0..B-1`` plus the page
        of the newest token (rotated so that the newest row comes first), and
        every other page is freed - the buffer spans exactly
        ``need_size / c4_page_size`` pages. Shorter requests keep all their
        rows (slot i = token i) and get fresh pages for the rest. Returns
        None, with nothing changed, when fresh pages are needed and none are
        free.
        """
        cps = self.hisparse_page_size
        if need_size % cps or need_size <= cps:
            raise ValueError(f"hot buffer size {need_size} is not a multiple of {cps} above it")
        mapping = self.full_to_hisparse_device_index_mapping
        owned = mapping[compressed]
        owned = owned[owned > 0]
        newest_slot = need_size - cps
        n = int(owned.numel())
        if n > newest_slot + 1:
            newest = owned[n - 1]
            page_base = newest - newest % cps
            rotation = (torch.arange(cps, dtype=owned.dtype, device=owned.device)
                        + newest % cps) % cps
            buffer = torch.cat([owned[:newest_slot], page_base + rotation])
            owned_pages = torch.unique(owned // cps)
            kept = torch.isin(owned_pages, torch.unique(buffer // cps))
            self.free_hisparse_indices(owned_pages[~kept] * cps)
        else:
            buffer = self._grow_rows_to(owned, need_size, cps)
            if buffer is None:
                return None
        mapping[compressed] = 0
        return buffer

    _grow_rows_to = HiSparseDualAllocator._grow_rows_to

    # ------------------------------------------------------------------- free
    free_hisparse_indices = HiSparseDualAllocator.free_hisparse_indices

    def free_compressed(self, compressed: torch.Tensor) -> None:
        """Release the C4 rows mapped by compressed ids and unmap them."""
        mapping = self.full_to_hisparse_device_index_mapping
        self.free_hisparse_indices(mapping[compressed])
        mapping[compressed] = 0

    def free_hisparse(self, full_indices: torch.Tensor) -> None:
        """Release the C4 rows behind full ids (0.5.13 semantics: full ids)."""
        self.free_compressed(self.hisparse_kvcache.translate_loc_from_full_to_compressed(full_indices))

    # Full + SWA slots (the SWA allocator frees both), then the C4 rows still
    # mapped from them: a staged request had its mapping cleared by
    # request_finished, so what is still mapped belongs to a request released
    # before staging (finished right after prefill, aborted).
    free = HiSparseDualAllocator.free

    free_group_begin = HiSparseDualAllocator.free_group_begin
    free_group_end = HiSparseDualAllocator.free_group_end

    # Same two-level state as the DSA allocator: (logical side, physical side).
    clear = HiSparseDualAllocator.clear
    backup_state = HiSparseDualAllocator.backup_state
    restore_state = HiSparseDualAllocator.restore_state

    def merge_and_sort_free(self):
        for sub in (self.logical_attn_allocator.full_attn_allocator,
                    self.logical_attn_allocator.swa_attn_allocator,
                    self.hisparse_attn_allocator):
            sub.merge_and_sort_free()
