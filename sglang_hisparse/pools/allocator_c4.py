"""DeepSeek-V4 HiSparse: the C4 allocator around SGLang's SWA allocator.

The id spaces (full, compressed, C4 row) and the C4 device pool are in
:mod:`sglang_hisparse.pools.device_c4`; this allocator owns the
``mapping[compressed] -> C4 row`` and registers it into that pool.
Admission, the budget and the two-space bookkeeping are shared with the DSA
allocator (:class:`~sglang_hisparse.pools.admission.HostBackedAdmission`),
counted here in C4 rows.

Drop-in (class REPLACE) for 0.5.13
``hisparse_memory_pool.DeepSeekV4HiSparseTokenToKVPoolAllocator`` -
constructed by ``model_runner_kv_cache_mixin.py:811`` around the SWA
allocator. ``isinstance`` users (``schedule_policy.py:482-485``,
``chunk_cache.py:118-124``) name the class through a module-top
``from ... import``; HookRegistry's ``_propagate_patch`` rebinds those names
when the module is already imported, and a module imported later picks up
the rebound attribute, so both checks see this class. The mixin's
draft-worker branch (``:817-823``) reads ``logical_attn_allocator``. Other
users: ``PrefillAdder`` (``available_size``, ``full_available_size``,
``swa_available_size``), ``mem_cache/common.py`` (``alloc_extend``,
``alloc_decode``, ``free``, ``free_group_*``, ``backup_state``),
``ScheduleBatch`` SWA eviction (``free_swa``), the SWA chunk cache
(``translate_loc_from_full_to_swa``, ``free_swa``), PD decode
(``disaggregation/decode.py:818,957,1133,1316``: ``hisparse_attn_allocator``,
``hisparse_page_size``, ``logical_attn_allocator``, ``alloc_logical_only``)
and our coordinator (``hisparse_kvcache``, ``compress_ratio``,
``size_full``, ``full_to_hisparse_device_index_mapping``,
``alloc_device_buffer``, ``get_last_loc_compressed``,
``free_hisparse``/``free_compressed``, ``free_hisparse_indices``,
``hisparse_attn_allocator.alloc``, ``set_reservation_provider``,
``attach_host_pool``, ``take_prefill_claim``).

0.5.17's own allocator adds ``alloc_extend_swa_tail`` (a PD decode's
prealloc of the SWA tail only, taken when the allocator has it:
``decode.py`` ``_uses_swa_tail_prealloc``). Ours does not offer it, so the
SWA is allocated at full prompt length as on 0.5.15.post1 (a DeepSeek-V4 PD
decode with HiSparse; ``tests/test_dsv4.py`` ``NOT_OFFERED``). A retracted
request's window is then restored into SWA slots that cover its whole
length (``engine/retained_device_state.py``).
"""

from __future__ import annotations

import logging
import weakref

import torch

from sglang_hisparse.adapter.sglang_classes import BaseTokenToKVPoolAllocator
from sglang_hisparse.engine.streams import fill_at
from sglang_hisparse.pools.admission import HostBackedAdmission, _ReservingPagedAllocator
from sglang_hisparse.pools.device_c4 import C4_RATIO

logger = logging.getLogger(__name__)


class DSV4HiSparseAllocator(HostBackedAdmission):
    """Drop-in for 0.5.13 ``DeepSeekV4HiSparseTokenToKVPoolAllocator``.

    Wraps the SWA allocator SGLang built (it stays the owner of the full and
    SWA id spaces) and adds a paged C4 row allocator plus the compressed ->
    C4 row mapping. Public ``page_size`` is the logical (full) page size;
    C4 allocation uses ``hisparse_page_size`` (= full page / 4).

    Sizes reported in *full tokens* (``available_size``,
    ``full_available_size``) convert C4 rows with the ratio 4. Like
    :class:`~sglang_hisparse.pools.allocator.HiSparseDualAllocator`, the C4 budget
    holds back what live requests may still claim (from the coordinator's
    reservation provider, in C4 rows) and is capped by free host rows
    (:meth:`_c4_budget_tokens`). There is no C4 logical free list: the
    compressed ids follow the full ids, whose free slots the SWA allocator
    reports in full tokens.
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
        # Admission state, filled by the coordinator (all in C4 rows).
        self._init_admission()

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

    # ------------------------------------------------------ admission control
    def _c4_budget_tokens(self) -> int:
        """Full tokens the C4 side can still admit (device rows and host rows)."""
        host_rows, rows = self.budgets()
        if host_rows is not None and host_rows < rows:
            rows = host_rows
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
        fill_at(mapping, compressed, 0)
        return buffer

    # ------------------------------------------------------------------- free
    def free_hisparse(self, full_indices: torch.Tensor) -> None:
        """Release the C4 rows behind full ids (0.5.13 semantics: full ids)."""
        self.free_compressed(self.hisparse_kvcache.translate_loc_from_full_to_compressed(full_indices))

    def merge_and_sort_free(self):
        for sub in (self.logical_attn_allocator.full_attn_allocator,
                    self.logical_attn_allocator.swa_attn_allocator,
                    self.hisparse_attn_allocator):
            sub.merge_and_sort_free()
