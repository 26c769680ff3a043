"""What both HiSparse allocators share: host-backed admission and the two id spaces.

:class:`~sglang_hisparse.pools.allocator.HiSparseDualAllocator` (DSA) and
:class:`~sglang_hisparse.pools.allocator_c4.DSV4HiSparseAllocator`
(DeepSeek-V4's C4 rows) have the same shape:

* ``logical_attn_allocator`` owns the id space ``req_to_token`` stores (DSA:
  a paged allocator over the logical space; DeepSeek-V4: SGLang's SWA
  allocator over the full and SWA spaces);
* ``hisparse_attn_allocator`` (a :class:`_ReservingPagedAllocator`) owns the
  rows of the GPU pool, ``hisparse_page_size`` rows a page;
* ``full_to_hisparse_device_index_mapping[id] -> row`` (0 = unmapped, a
  trailing -1 so that -1 maps to -1) joins them; ids are logical for DSA and
  compressed (``full // 4``) for DeepSeek-V4.

:class:`HostBackedAdmission` holds what goes with that shape and is the same
for both: the admission state the coordinator fills (reservation provider,
host pool, prefill claims, residency hooks, PD decode retraction), the
budget (:mod:`sglang_hisparse.engine.budget`) behind ``budgets()`` and the
sub-allocators' ``available_size()``, and the bookkeeping that only touches
the two spaces through the mapping (``free``, free groups, ``clear``,
``backup_state``/``restore_state``, hot-buffer growth). What differs
(sizes, ``alloc_extend``, ``alloc_device_buffer``, last-loc translation,
``available_size``) stays in the two allocators.

A subclass sets, before it calls :meth:`HostBackedAdmission._init_admission`
or anything else here: ``page_size`` (of the ids ``free`` receives),
``hisparse_page_size``, ``compress_ratio``, ``logical_attn_allocator``,
``hisparse_attn_allocator``, ``full_to_hisparse_device_index_mapping``,
``_kvcache``, ``_logical_free_list`` (the sub-allocator whose free slots are
the logical budget in host rows, or None) and ``free_hisparse(ids)`` (the
rows behind the ids ``free`` receives).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from sglang_hisparse.adapter.sglang_classes import (
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
)
from sglang_hisparse.engine.budget import admission_budgets
from sglang_hisparse.engine.streams import fill_at


def _pages_to_tokens(num_tokens: int, page_size: int) -> int:
    return -(-int(num_tokens) // page_size) * page_size


def _free_as_is(free: int) -> int:
    return free


class _ReservingPagedAllocator(PagedTokenToKVPoolAllocator):
    """A ``PagedTokenToKVPoolAllocator`` whose *reported* free size is its
    owner's budget (``_budget(free) -> available``), not its free pages.
    Allocation itself (``alloc``, ``alloc_extend``, ``alloc_decode``) reads
    ``free_pages`` directly and is not affected; only callers that budget
    with ``available_size()`` are.
    """

    def __init__(self, *args, **kwargs):
        self._budget: Callable[[int], int] = _free_as_is
        super().__init__(*args, **kwargs)

    def raw_available_size(self) -> int:
        # shape[0], not len(): the scheduler asks several times a step, and
        # Tensor.__len__ is a Python-level call.
        return (self.free_pages.shape[0] + self.release_pages.shape[0]) * self.page_size

    def available_size(self) -> int:
        return self._budget(
            (self.free_pages.shape[0] + self.release_pages.shape[0]) * self.page_size
        )


_NO_SNAPSHOTS = ("HiSparse: KV snapshots for retraction exist only on a PD decode node "
                 "(--disaggregation-mode decode) with DSA models")


class HostBackedAdmission(BaseTokenToKVPoolAllocator):
    """Shared base of the HiSparse allocators (see the module docstring).

    Public API used by our coordinator: ``set_reservation_provider``,
    ``attach_host_pool``, ``set_residency``, ``set_retraction``,
    ``make_rows_available``, ``budgets``, ``pending_prefill_claim``,
    ``take_prefill_claim``, ``translate_to_physical``,
    ``free_hisparse_indices``, ``free_compressed``,
    ``physical_available_size``, ``release_after_group``; by SGLang: ``alloc`` (refused),
    ``alloc_decode``, ``alloc_logical_only``, ``free``,
    ``free_group_begin``/``free_group_end``, ``clear``, ``backup_state``,
    ``restore_state``, ``get_cpu_copy``, ``load_cpu_copy``, ``get_kvcache``.
    """

    compress_ratio = 1
    _logical_free_list: Optional[_ReservingPagedAllocator] = None

    def _init_admission(self) -> None:
        """Admission state (filled by the coordinator) and the sub-allocators'
        budgets. Call once the sub-allocators exist."""
        # provider() -> (physical rows, host rows) still owed to live requests.
        self._reservation_provider: Optional[Callable[[], Tuple[int, int]]] = None
        self._host_pool = None
        self._hot_claim_tokens = 0  # padded hot buffer size, once known
        # Physical claim of requests that started prefill but are not staged
        # yet, keyed by the first logical slot of the request.
        self._prefill_claims: Dict[int, int] = {}
        # Residency (coordinator): rows demotion would free, and the demoter.
        self._reclaimable: Callable[[], int] = lambda: 0
        self._reclaim: Optional[Callable[[int], int]] = None
        self._retraction: Optional[tuple] = None  # (take, restore), PD decode
        # PD decode: host rows the token budget holds back (engine/coordinator.py
        # pd_host_reserve); None: the host rows live requests still owe.
        self._host_reserve: Optional[Callable[[], int]] = None
        # Releases the coordinator left for the end of SGLang's free group.
        self._releases_after_group: List[Callable[[], None]] = []
        self.hisparse_attn_allocator._budget = self._physical_rows_available
        if self._logical_free_list is not None:
            self._logical_free_list._budget = self._logical_slots_available

    # ------------------------------------------------------ admission state
    def set_reservation_provider(self, provider: Callable[[], Tuple[int, int]]):
        """``provider() -> (physical_tokens, host_tokens)`` still owed to live requests."""
        self._reservation_provider = provider

    def attach_host_pool(self, host_pool, hot_claim_tokens: int) -> None:
        self._host_pool = host_pool
        self._hot_claim_tokens = int(hot_claim_tokens)

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

    def pending_prefill_claim(self) -> int:
        return sum(self._prefill_claims.values())

    def take_prefill_claim(self, first_logical_loc: int) -> int:
        """Drop the provisional claim of a request (staged, finished or aborted)."""
        return self._prefill_claims.pop(int(first_logical_loc), 0)

    def _register_prefill_claims(self, prefix_lens_cpu, seq_lens_cpu, logical) -> None:
        """A new request will hold a whole padded hot buffer of rows even if
        its prompt holds fewer; hold the difference back from admission until
        it is staged (``take_prefill_claim``) or released (``free``)."""
        claim = self._hot_claim_tokens
        if claim <= 0:
            return
        ratio, ps = self.compress_ratio, self.hisparse_page_size
        start = 0
        for pre, seq in zip(prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()):
            if pre == 0 and seq > 0:
                held = _pages_to_tokens(seq // ratio, ps)
                if claim > held:
                    self._prefill_claims[int(logical[start])] = claim - held
            start += seq - pre

    # --------------------------------------------------------------- budget
    def budgets(self) -> Tuple[Optional[int], int]:
        """``(logical, physical)`` admission may still use, in rows of this
        allocator's GPU pool (:func:`~sglang_hisparse.engine.budget.admission_budgets`;
        logical is None for DeepSeek-V4 without a host pool). One call of the
        reservation provider (one walk of the live requests) for both."""
        provider = self._reservation_provider
        phys_owed, host_owed = provider() if provider is not None else (0, 0)
        host = self._host_pool
        logical = self._logical_free_list
        return admission_budgets(
            self.hisparse_attn_allocator.raw_available_size(), phys_owed,
            sum(self._prefill_claims.values()), self._reclaimable(),
            None if logical is None else logical.raw_available_size(),
            None if host is None else host.available_size(), host_owed,
        )

    def _physical_rows_available(self, free_rows: int) -> int:
        """``hisparse_attn_allocator.available_size()``: the physical budget
        without demotion (the PD decode prealloc budget; resident growth)."""
        provider = self._reservation_provider
        owed = provider()[0] if provider is not None else 0
        return admission_budgets(free_rows, owed, sum(self._prefill_claims.values()),
                                 0, None, None, 0)[1]

    def _logical_slots_available(self, free_logical: int) -> int:
        """``logical_attn_allocator.available_size()`` (DSA): the logical
        budget (the PD decode token budget)."""
        host = self._host_pool
        if host is None:
            return admission_budgets(0, 0, 0, 0, free_logical, None, 0)[0]
        if self._host_reserve is not None:
            return admission_budgets(0, 0, 0, 0, free_logical, host.available_size(),
                                     self._host_reserve())[0]
        provider = self._reservation_provider
        host_owed = provider()[1] if provider is not None else 0
        return admission_budgets(0, 0, 0, 0, free_logical, host.available_size(), host_owed)[0]

    def physical_available_size(self) -> int:
        """Free rows of the GPU pool, nothing held back."""
        return self.hisparse_attn_allocator.raw_available_size()

    def get_kvcache(self):
        return self._kvcache

    # ------------------------------------------------- PD decode retraction
    def set_retraction(self, take: Callable[[int], object],
                       restore: Callable[[object, torch.Tensor], None]) -> None:
        """PD decode retraction (``engine/policies/retain_on_retract.py``):
        ``take(n)`` returns the host KV the coordinator kept for the request
        just retracted; ``restore(kept, indices)`` gives it back to the
        resumed request."""
        self._retraction = (take, restore)

    def set_host_reserve(self, reserve: Callable[[], int]) -> None:
        """PD decode: ``reserve() -> host rows`` the token budget
        (``logical_attn_allocator.available_size()``) holds back instead of
        the rows live requests owe: what every request on the node may still
        write (retraction frees no host row), a retracted request's kept
        rows counted free."""
        self._host_reserve = reserve

    def get_cpu_copy(self, indices, mamba_indices=None):
        if self._retraction is None:
            raise NotImplementedError(_NO_SNAPSHOTS)
        return self._retraction[0](len(indices))

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        if self._retraction is None:
            raise NotImplementedError(_NO_SNAPSHOTS)
        self._retraction[1](kv_cache_cpu, indices)

    # ----------------------------------------------------------- allocation
    def translate_to_physical(self, logical: torch.Tensor) -> torch.Tensor:
        return self.full_to_hisparse_device_index_mapping[logical]

    def alloc(self, need_size: int):
        # 0.5.13 calls alloc() only where page_size == 1 (mem_cache/common.py
        # alloc_token_slots and the speculative page-1 paths), which the
        # HiSparse allocators refuse at construction.
        raise NotImplementedError(
            f"{type(self).__name__}: HiSparse allocates through alloc_extend / "
            "alloc_decode only"
        )

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc):
        """Decode: a logical slot only; the coordinator maps it to the newest-token slot."""
        return self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)

    def alloc_logical_only(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                           last_loc, extend_num_tokens: int):
        """Logical slots without rows (PD decode prealloc: the KV lands on host)."""
        return self.logical_attn_allocator.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
            extend_num_tokens,
        )

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

    # ----------------------------------------------------------------- free
    def free_hisparse_indices(self, physical: torch.Tensor) -> None:
        physical = physical[physical > 0]  # page 0 is the padding sink
        if physical.numel() == 0:
            return
        self.hisparse_attn_allocator.is_not_in_free_group = True
        self.hisparse_attn_allocator.free(physical)

    def free_compressed(self, compressed: torch.Tensor) -> None:
        """Release the rows mapped by ids of the mapping's space (logical for
        DSA, compressed for DeepSeek-V4) and unmap them."""
        mapping = self.full_to_hisparse_device_index_mapping
        self.free_hisparse_indices(mapping[compressed])
        fill_at(mapping, compressed, 0)

    def free(self, free_index: torch.Tensor):
        """Logical slots, then the rows still mapped from them. A staged
        request had its mapping cleared by ``request_finished``, so what is
        still mapped belongs to one released before staging (finished right
        after prefill, aborted, retracted), which also gives its prefill
        claim back."""
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        if self._prefill_claims:
            starts = free_index[free_index % self.page_size == 0].tolist()
            for loc in starts:
                self._prefill_claims.pop(int(loc), None)
        self.logical_attn_allocator.free(free_index)
        self.free_hisparse(free_index)

    def release_after_group(self, release: Callable[[], None]) -> None:
        """Run ``release`` now or, inside SGLang's free group, when the group
        ends (before the group's own frees).

        Why. 0.5.13 collects a decode step's frees in a group that ends after
        the step's tokens are streamed (``process_batch_result_decode``), so
        the device sync of its free (``torch.unique``) waits for the batch in
        flight only after the tokens are out. Freeing a hot buffer's rows and
        a request's host rows syncs too (boolean masks on the device). Run
        when the request finishes, inside the group, that sync holds the
        step's tokens until the next batch (a prefill batch, with streaming
        on) has run: the ~15 ms more on the gap at each finish on
        2026-12-07-s4 (the gap ends with the finishing request's last
        token). With this change (2026-12-07-s5) those finish gaps fell from
        41-43 ms to 33-39 ms: what remains is the prefill batch beside them.
        """
        if self.is_not_in_free_group:
            release()
        else:
            self._releases_after_group.append(release)

    def _run_releases_after_group(self) -> None:
        releases, self._releases_after_group = self._releases_after_group, []
        for release in releases:
            release()

    def free_group_begin(self):
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self):
        self.is_not_in_free_group = True
        self._run_releases_after_group()
        if self.free_group:
            self.free(torch.cat(self.free_group))
        self.free_group = []

    def clear(self):
        self._run_releases_after_group()
        self.logical_attn_allocator.clear()
        self.hisparse_attn_allocator.clear()
        self.full_to_hisparse_device_index_mapping[:-1].fill_(0)
        self._prefill_claims.clear()
        self.is_not_in_free_group = True
        self.free_group = []

    # Two-level state: (logical side, physical side). Up to 0.5.15.post1 only:
    # 0.5.17's allocators have no backup_state/restore_state and nothing
    # calls them (the allocation helpers lost their backup_state argument).
    def backup_state(self):
        return (
            self.logical_attn_allocator.backup_state(),
            self.hisparse_attn_allocator.backup_state(),
        )

    def restore_state(self, state):
        logical, physical = state
        self.logical_attn_allocator.restore_state(logical)
        self.hisparse_attn_allocator.restore_state(physical)
