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
one's (read by the PD decode token budget) are reduced the same way, so
neither path admits work whose hot buffer or host backing cannot be served
later (upstream sglang#23704: host pool exhausted after admission).

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

import logging
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch

from sglang.srt.mem_cache.allocator import (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
)

logger = logging.getLogger(__name__)


def _pages_to_tokens(num_tokens: int, page_size: int) -> int:
    return -(-int(num_tokens) // page_size) * page_size


class _ReservingPagedAllocator(PagedTokenToKVPoolAllocator):
    """A ``PagedTokenToKVPoolAllocator`` whose *reported* free size excludes a
    reservation supplied by its owner. Allocation itself (``alloc``,
    ``alloc_extend``, ``alloc_decode``) reads ``free_pages`` directly and is not
    affected; only callers that budget with ``available_size()`` are.
    """

    def __init__(self, *args, **kwargs):
        self._held_back: Callable[[], int] = lambda: 0
        super().__init__(*args, **kwargs)

    def raw_available_size(self) -> int:
        # shape[0], not len(): the scheduler asks several times a step, and
        # Tensor.__len__ is a Python-level call.
        return (self.free_pages.shape[0] + self.release_pages.shape[0]) * self.page_size

    def available_size(self) -> int:
        return max(0, self.raw_available_size() - int(self._held_back()))


_NO_SNAPSHOTS = ("HiSparse: KV snapshots for retraction exist only on a PD decode node "
                 "(--disaggregation-mode decode) with DSA models")


class HiSparseDualAllocator(BaseTokenToKVPoolAllocator):
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
        self._kvcache = kvcache
        self.page_size = page_size
        self.dtype = dtype
        self.device = device
        self.need_sort = need_sort
        self.compress_ratio = 1
        self.host_to_device_ratio = host_to_device_ratio
        self._physical_size = int(size)
        self._logical_size = int(size) * int(host_to_device_ratio)

        # Reservation state (tokens). Filled by the coordinator.
        self._reservation_provider: Optional[Callable[[], Tuple[int, int]]] = None
        self._retraction: Optional[tuple] = None  # (take, restore), PD decode
        self._host_pool = None
        # Residency (coordinator): rows demotion would free, and the demoter.
        self._reclaimable: Callable[[], int] = lambda: 0
        self._reclaim: Optional[Callable[[int], int]] = None
        # Physical claim of requests that started prefill but are not staged
        # yet, keyed by the first logical slot of the request.
        self._prefill_claims: Dict[int, int] = {}
        self._hot_claim_tokens = 0  # padded hot buffer size once known

        self.logical_attn_allocator = _ReservingPagedAllocator(
            self._logical_size, page_size, dtype, device, kvcache, need_sort
        )
        self.hisparse_attn_allocator = _ReservingPagedAllocator(
            self._physical_size, page_size, dtype, device, kvcache, need_sort
        )
        self.logical_attn_allocator._held_back = self._logical_held_back
        self.hisparse_attn_allocator._held_back = self._physical_held_back

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
    def set_reservation_provider(self, provider: Callable[[], Tuple[int, int]]):
        """``provider() -> (physical_tokens, host_tokens)`` still owed to live requests."""
        self._reservation_provider = provider

    def set_retraction(self, take: Callable[[int], object],
                       restore: Callable[[object, torch.Tensor], None]) -> None:
        """PD decode retraction (see ``disaggregation.py``): ``take(n)`` returns the
        host KV the coordinator kept for the request just retracted;
        ``restore(kept, indices)`` gives it back to the resumed request."""
        self._retraction = (take, restore)

    def get_cpu_copy(self, indices, mamba_indices=None):
        if self._retraction is None:
            raise NotImplementedError(_NO_SNAPSHOTS)
        return self._retraction[0](len(indices))

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        if self._retraction is None:
            raise NotImplementedError(_NO_SNAPSHOTS)
        self._retraction[1](kv_cache_cpu, indices)

    def set_residency(self, reclaimable: Callable[[], int], reclaim: Callable[[int], int]) -> None:
        """Resident requests hold rows that demotion gives back: admission may
        count them (``reclaimable() -> rows``) and allocation takes them
        (``reclaim(rows) -> rows freed``) when the free rows fall short."""
        self._reclaimable = reclaimable
        self._reclaim = reclaim

    def make_rows_available(self, need: int) -> None:
        """Demote residents until ``need`` rows are free beyond those owed."""
        short = need - self.hisparse_attn_allocator.available_size()
        if short > 0 and self._reclaim is not None:
            self._reclaim(short)

    def attach_host_pool(self, host_pool, hot_claim_tokens: int) -> None:
        self._host_pool = host_pool
        self._hot_claim_tokens = int(hot_claim_tokens)

    def _owed(self) -> Tuple[int, int]:
        if self._reservation_provider is None:
            return 0, 0
        phys, host = self._reservation_provider()
        return int(phys), int(host)

    def pending_prefill_claim(self) -> int:
        return sum(self._prefill_claims.values())

    def take_prefill_claim(self, first_logical_loc: int) -> int:
        """Drop the provisional claim of a request (staged, finished or aborted)."""
        return self._prefill_claims.pop(int(first_logical_loc), 0)

    def _physical_held_back(self) -> int:
        return self._owed()[0] + self.pending_prefill_claim()

    def _host_headroom(self) -> Optional[int]:
        if self._host_pool is None:
            return None
        return self._host_pool.available_size() - self._owed()[1]

    def _logical_held_back(self) -> int:
        head = self._host_headroom()
        if head is None:
            return 0
        raw = self.logical_attn_allocator.raw_available_size()
        return max(0, raw - max(0, head))

    def budgets(self) -> Tuple[int, int]:
        """(logical, physical) tokens admission may still use: logical slots
        less the host space owed to live requests, and free rows less those
        owed (hot buffers still to grow, prefill claims) plus what demoting
        residents gives back. One walk of the live requests for both."""
        provider = self._reservation_provider
        phys_owed, host_owed = provider() if provider is not None else (0, 0)
        physical = max(0, self.hisparse_attn_allocator.raw_available_size() - phys_owed
                       - self.pending_prefill_claim()) + self._reclaimable()
        logical = self.logical_attn_allocator.raw_available_size()
        if self._host_pool is not None:
            logical = min(logical, max(0, self._host_pool.available_size() - host_owed))
        return logical, physical

    def available_size(self) -> int:
        # The scheduler asks several times per step. Same value as
        # min(logical.available_size(), physical.available_size() + reclaimable).
        return min(self.budgets())

    def physical_available_size(self) -> int:
        return self.hisparse_attn_allocator.raw_available_size()

    def logical_available_size(self) -> int:
        return self.logical_attn_allocator.raw_available_size()

    def get_kvcache(self):
        return self._kvcache

    def debug_print(self) -> str:
        return (
            f"#logical-free={self.logical_available_size()}, "
            f"#physical-free={self.physical_available_size()}, "
            f"#prefill-claims={len(self._prefill_claims)}"
        )

    # ------------------------------------------------------------ translation
    def translate_to_physical(self, logical: torch.Tensor) -> torch.Tensor:
        return self.full_to_hisparse_device_index_mapping[logical]

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        return last_locs

    def get_last_loc_hisparse_device(self, last_locs: torch.Tensor) -> torch.Tensor:
        return self.translate_to_physical(last_locs)

    # ------------------------------------------------------------- allocation
    def alloc(self, need_size: int):
        """Token allocation (page_size 1 only): logical + physical, mapped."""
        if self.page_size != 1:
            raise NotImplementedError(
                "HiSparse allocator with page_size > 1 allocates through "
                "alloc_extend / alloc_decode"
            )
        self.make_rows_available(need_size)
        if need_size > self.physical_available_size():
            return None
        logical = self.logical_attn_allocator.alloc(need_size)
        if logical is None:
            return None
        physical = self.hisparse_attn_allocator.alloc(need_size)
        if physical is None:
            self.logical_attn_allocator.free(logical)
            return None
        self.full_to_hisparse_device_index_mapping[logical] = physical
        return logical

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                     last_loc, extend_num_tokens: int):
        """Prefill: logical and physical slots for every new token, mapped."""
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

    def _register_prefill_claims(self, prefix_lens_cpu, seq_lens_cpu, logical):
        """A new request will eventually hold ``hot_claim`` physical rows even if
        its prompt is shorter; hold the difference back from admission now."""
        if self._hot_claim_tokens <= 0:
            return
        offset = 0
        ps = self.page_size
        for pre, seq in zip(prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()):
            n = seq - pre
            if pre == 0 and n > 0:
                owned = _pages_to_tokens(seq, ps)
                claim = max(0, self._hot_claim_tokens - owned)
                if claim:
                    self._prefill_claims[int(logical[offset])] = claim
            offset += n

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc):
        """Decode: logical slot only; the coordinator maps it to the newest-token slot."""
        if self.page_size == 1:
            # The paged decode kernel's page accounting (seq_len % page == 1)
            # never counts a new page when page_size is 1.
            return self.logical_attn_allocator.alloc(len(seq_lens_cpu))
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def alloc_logical_only(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                           last_loc, extend_num_tokens: int):
        """Logical slots without physical rows (PD decode prealloc: KV goes to host)."""
        return self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
            extend_num_tokens,
        )

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
            mapping[allocated_indices] = 0
            return keep
        buffer = self._grow_rows_to(owned, need_size, self.page_size)
        if buffer is None:
            return None
        mapping[allocated_indices] = 0
        return buffer

    def _grow_rows_to(self, owned: torch.Tensor, need_size: int, page: int):
        """``owned`` (token order, fewer than ``need_size``), then the rest of its
        last page (already the request's), then fresh pages up to ``need_size``.
        None, with nothing allocated, when no fresh pages are free."""
        residual = int(owned.numel()) % page
        if residual:
            tail = owned[-1] + torch.arange(
                1, page - residual + 1, dtype=owned.dtype, device=owned.device
            )
            owned = torch.cat([owned, tail])
        missing = need_size - int(owned.numel())
        if missing > 0:
            fresh = self.hisparse_attn_allocator.alloc(missing)
            if fresh is None:
                return None
            owned = torch.cat([owned, fresh.to(owned.dtype)])
        return owned

    # ------------------------------------------------------------------ free
    def free_hisparse_indices(self, physical: torch.Tensor) -> None:
        physical = physical[physical > 0]  # page 0 is the padding sink
        if physical.numel() == 0:
            return
        self.hisparse_attn_allocator.is_not_in_free_group = True
        self.hisparse_attn_allocator.free(physical)

    def free_hisparse(self, logical: torch.Tensor) -> None:
        mapping = self.full_to_hisparse_device_index_mapping
        self.free_hisparse_indices(mapping[logical])
        mapping[logical] = 0

    def free(self, free_index: torch.Tensor):
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        if self._prefill_claims:
            # A request released before staging (finished right after prefill,
            # aborted, retracted) gives its provisional claim back.
            starts = free_index[free_index % self.page_size == 0].tolist()
            for loc in starts:
                self._prefill_claims.pop(int(loc), None)
        self.logical_attn_allocator.free(free_index)
        self.free_hisparse(free_index)

    def free_group_begin(self):
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self):
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(torch.cat(self.free_group))
        self.free_group = []

    def clear(self):
        self.logical_attn_allocator.clear()
        self.hisparse_attn_allocator.clear()
        self.full_to_hisparse_device_index_mapping[:-1].fill_(0)
        self._prefill_claims.clear()
        self.is_not_in_free_group = True
        self.free_group = []

    def backup_state(self):
        return (
            self.logical_attn_allocator.backup_state(),
            self.hisparse_attn_allocator.backup_state(),
        )

    def restore_state(self, state):
        logical, physical = state
        self.logical_attn_allocator.restore_state(logical)
        self.hisparse_attn_allocator.restore_state(physical)

    def merge_and_sort_free(self):
        self.logical_attn_allocator.merge_and_sort_free()
        self.hisparse_attn_allocator.merge_and_sort_free()
