"""Dual (logical + physical) paged KV allocator for HiSparse.

Two id spaces live side by side:

* the *logical* space is what ``req_to_token`` stores and what the scheduler,
  the radix-free ``ChunkCache`` and ``release_kv_cache`` see. It is
  ``host_to_device_ratio`` times larger than the GPU pool because every
  logical token is backed by a row of the host pool;
* the *physical* space indexes rows of the GPU KV pool. A request holds
  physical rows for its whole prompt during prefill; once its prompt is
  staged to host it keeps only a small "hot buffer" (plus one page whose first
  slot holds the newest token) and gives the rest back.

``mapping[logical] -> physical`` (0 = unmapped, the trailing extra element is
-1 so that ``last_loc == -1`` maps to -1) is what the device pool uses to
translate write/read locations.

Admission control. ``available_size()`` is what ``PrefillAdder`` (schedule
policy ``rem_total_tokens``/``cur_rem_tokens``) and
``ScheduleBatch.check_decode_mem`` compare against. It is the minimum of
(a) free logical tokens, (b) free physical tokens minus what live requests
may still claim (hot-buffer growth of short requests, the newest-token page,
and a per-new-request claim registered at its first prefill chunk), and
(c) free host tokens minus the host rows live requests will still need for
logical tokens they already own. The physical sub-allocator's
``available_size()`` (read by the PD decode prealloc budget) and the logical
one's (read by the PD decode token budget) report the same formula, so
neither path admits work whose hot buffer or host backing cannot be served
later (upstream sglang#23704: host pool exhausted after admission). The
formula is :func:`sglang_hisparse.engine.budget.admission_budgets`; the
state behind it and everything else this allocator shares with DeepSeek-V4's
lives in :class:`~sglang_hisparse.pools.admission.HostBackedAdmission`.

Paged only: 0.5.13 allocates with ``alloc`` where ``page_size == 1``
(``mem_cache/common.py`` ``alloc_token_slots``), which HiSparse does not
serve, so page size 1 is refused at construction (DSA models run with 64).

0.5.13 call sites served (grep of the 0.5.13 tree):

* ``model_runner_kv_cache_mixin.py:780`` constructs it (class REPLACE of
  ``HiSparseTokenToKVPoolAllocator``), same keyword signature;
* ``mem_cache/common.py`` ``alloc_paged_token_slots_extend`` -> ``alloc_extend``,
  ``backup_state``; ``alloc_for_decode`` -> ``alloc_decode``;
  ``release_kv_cache``/``ChunkCache`` -> ``free``, ``free_group_begin/end``;
* ``schedule_policy.py`` ``PrefillAdder`` and ``schedule_batch.py``
  ``check_decode_mem`` -> ``available_size``;
* ``disaggregation/decode.py:818,1133,1316`` ->
  ``hisparse_attn_allocator.available_size``,
  ``logical_attn_allocator.available_size``, ``alloc_logical_only``;
* ``ModelRunner.max_token_pool_size`` (our PROPERTY hook) -> ``size_full``;
* ``schedule_batch.py:1388,1397`` (``Req.offload_kv_cache``/``load_kv_cache``,
  PD decode retraction) -> ``get_cpu_copy``, ``load_cpu_copy``;
* our coordinator -> ``alloc_device_buffer``, ``free_hisparse_indices``,
  ``free_hisparse``, ``translate_to_physical``, ``hisparse_attn_allocator.alloc``,
  ``set_reservation_provider``, ``attach_host_pool``, ``set_retraction``.
"""

from __future__ import annotations

import contextlib
import logging
import weakref

import torch

from sglang_hisparse.engine.streams import fill_at
from sglang_hisparse.pools.admission import (
    HostBackedAdmission,
    _ReservingPagedAllocator,
)

logger = logging.getLogger(__name__)


class HiSparseDualAllocator(HostBackedAdmission):
    """Drop-in replacement for 0.5.13 ``HiSparseTokenToKVPoolAllocator``."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device,
        kvcache,
        need_sort: bool,
        host_to_device_ratio: int = 2,
    ):
        if host_to_device_ratio < 1:
            raise ValueError(f"host_to_device_ratio must be >= 1, got {host_to_device_ratio}")
        if int(page_size) <= 1:
            raise ValueError(
                f"HiSparse needs a paged KV cache (--page-size > 1; DSA models run with 64), "
                f"got page_size={page_size}"
            )
        self._kvcache = kvcache
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.need_sort = need_sort
        self.host_to_device_ratio = host_to_device_ratio
        self._physical_size = int(size)
        self._logical_size = int(size) * int(host_to_device_ratio)
        # Set by logical_only(): alloc_extend then takes logical slots only.
        self._logical_only = False
        # Set by host_side_only(): available_size() answers the host side.
        self._host_side_only = False

        self.logical_attn_allocator = _ReservingPagedAllocator(
            self._logical_size, page_size, dtype, device, kvcache, need_sort
        )
        self.hisparse_attn_allocator = _ReservingPagedAllocator(
            self._physical_size, page_size, dtype, device, kvcache, need_sort
        )
        # Logical slots and host rows are the same unit: the logical free
        # list is one term of the budget.
        self._logical_free_list = self.logical_attn_allocator
        self._init_admission()

        # +page_size: the paged pools have one padding page; the trailing -1
        # makes mapping[-1] == -1 (last_loc of a request with no prefix).
        self.full_to_hisparse_device_index_mapping = torch.zeros(
            self._logical_size + page_size + 1, dtype=torch.int64, device=device
        )
        self.full_to_hisparse_device_index_mapping[-1] = -1

        self.free_pages = None
        self.release_pages = None
        self.is_not_in_free_group = True
        self.free_group = []
        self.clear()
        register = getattr(kvcache, "register_mapping", None)
        if register is not None:
            register(weakref.proxy(self.full_to_hisparse_device_index_mapping))

    # ------------------------------------------------------------------ sizes
    @property
    def size(self) -> int:
        return self._logical_size

    @size.setter
    def size(self, value):  # BaseTokenToKVPoolAllocator.__init__ assigns it
        pass

    @property
    def size_full(self) -> int:
        return self._logical_size

    @property
    def logical_capacity(self) -> int:
        """Longest context a request can hold (feeds ``max_token_pool_size``)."""
        return self._logical_size

    @property
    def physical_size(self) -> int:
        return self._physical_size

    @property
    def hisparse_page_size(self) -> int:
        return self.page_size

    # ------------------------------------------------------ admission control
    def available_size(self) -> int:
        # The scheduler asks several times per step. Same value as
        # min(logical.available_size(), physical.available_size() + reclaimable).
        budgets = self.budgets()
        if self._host_side_only and budgets[0] is not None:
            return budgets[0]
        return min(budgets)

    @contextlib.contextmanager
    def host_side_only(self):
        """Within it, ``available_size()`` is the host side (logical) alone:
        what a decode step of the running batch takes. A hot-buffer request's
        new token takes a logical slot and a host row; its device rows (the
        buffer and the newest-token page) were reserved when it was staged.
        A resident's new page takes device rows, which demoting residents
        gives back before an allocation fails. See
        ``adapter/prefill_adder.batch_check_decode_mem``."""
        self._host_side_only = True
        try:
            yield
        finally:
            self._host_side_only = False

    def logical_available_size(self) -> int:
        return self.logical_attn_allocator.raw_available_size()

    def debug_print(self) -> str:
        return (
            f"#logical-free={self.logical_available_size()}, "
            f"#physical-free={self.physical_available_size()}, "
            f"#prefill-claims={len(self._prefill_claims)}"
        )

    # ------------------------------------------------------------ translation
    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        return last_locs

    def get_last_loc_hisparse_device(self, last_locs: torch.Tensor) -> torch.Tensor:
        return self.translate_to_physical(last_locs)

    # ------------------------------------------------------------- allocation
    @contextlib.contextmanager
    def logical_only(self):
        """Within it, ``alloc_extend`` takes logical slots only: the
        speculative reserve, whose draft positions the verify step maps to
        hot-buffer rows itself (engine/verify.py); rows taken here would sit
        mapped to nothing the step reads, until the request's release."""
        self._logical_only = True
        try:
            yield
        finally:
            self._logical_only = False

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                     last_loc, extend_num_tokens: int):
        """Prefill: logical and physical slots for every new token, mapped."""
        if self._logical_only:
            return self.alloc_logical_only(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                                           last_loc, extend_num_tokens)
        ps = self.page_size
        new_pages = int(
            ((seq_lens_cpu + ps - 1) // ps - (prefix_lens_cpu + ps - 1) // ps).sum()
        )
        if new_pages * ps > self.logical_available_size():
            return None
        self.make_rows_available(new_pages * ps)
        if new_pages * ps > self.physical_available_size():
            return None
        logical = self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
            extend_num_tokens, num_new_pages=new_pages,
        )
        if logical is None:
            return None
        physical = self.hisparse_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
            self.translate_to_physical(last_loc), extend_num_tokens,
            num_new_pages=new_pages,
        )
        if physical is None:  # cannot happen after the size checks above
            self.logical_attn_allocator.free(logical)
            return None
        self.full_to_hisparse_device_index_mapping[logical] = physical
        self._register_prefill_claims(prefix_lens_cpu, seq_lens_cpu, logical)
        return logical

    def alloc_device_buffer(self, allocated_indices: torch.Tensor, need_size: int):
        """Turn a request's prefill rows into its hot buffer of ``need_size`` rows.

        The physical rows mapped by ``allocated_indices`` (the request's logical
        prefix, in token order) are unmapped; the first ``need_size`` of them are
        kept (so buffer slot i holds token i), the rest are freed. When the
        request owns fewer rows (short prompt, or direct-to-host admission with
        nothing mapped) the rest of its last page and fresh pages are added.
        Returns None when fresh pages are needed and the physical pool has none.
        """
        if need_size % self.page_size:
            raise ValueError(f"hot buffer size {need_size} is not page aligned")
        mapping = self.full_to_hisparse_device_index_mapping
        owned = mapping[allocated_indices]
        owned = owned[owned > 0]
        if owned.numel() >= need_size:
            keep = owned[:need_size]
            self.free_hisparse_indices(owned[need_size:])
            fill_at(mapping, allocated_indices, 0)
            return keep
        buffer = self._grow_rows_to(owned, need_size, self.page_size)
        if buffer is None:
            return None
        fill_at(mapping, allocated_indices, 0)
        return buffer

    # ------------------------------------------------------------------ free
    def free_hisparse(self, logical: torch.Tensor) -> None:
        """Release the rows behind logical ids (they index the mapping as they are)."""
        self.free_compressed(logical)

    def merge_and_sort_free(self):
        self.logical_attn_allocator.merge_and_sort_free()
        self.hisparse_attn_allocator.merge_and_sort_free()
