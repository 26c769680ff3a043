"""Residency: a request keeps its whole KV on the GPU until rows run short.

Mixed into :class:`sglang_hisparse.coordinator.HiSparseCoordinator`, whose
state it uses: ``_resident_rows`` (request slot -> physical rows it holds),
``req_resident`` (the swap-in kernel's per-slot flag), ``_live``, the
pools, tables and streams.

* A request past prefill becomes resident instead of being staged
  (``admit_request_into_staging``); the swap-in kernel then only translates
  its positions, and nothing of it goes to host.
* A resident's current page is mapped ahead of its tokens (logical and
  physical pages share offsets): its prompt's last page when it becomes
  resident (:meth:`_map_page_tail`), each fresh page when a token starts one
  (:meth:`_grow_residents`). The decode steps in between launch nothing for
  it. A mapping ahead of the tokens is taken back when the request stops
  being resident (:meth:`_unmap_page_tail`), so unused slots never read as
  mapped.
* When rows run short, residents are *demoted* (:meth:`_demote`): their rows
  are copied to host in stream order and they get a hot buffer, exactly as
  after staging. The allocator asks for this through :meth:`reclaim_rows`
  (admission counts :meth:`reclaimable_rows`); growth demotes by itself.

No path here waits on the GPU from the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch


class ResidencyMixin:
    def reclaimable_rows(self) -> int:
        """Rows demotion would give back (a demoted request keeps a hot buffer)."""
        P = self.padded_buffer_size
        return sum(max(0, rows - P) for rows in self._resident_rows.values())

    def reclaim_rows(self, need: int) -> int:
        """Demote the largest residents until ``need`` rows are free; returns
        the rows freed (less than ``need`` when no resident is left to demote)."""
        freed = 0
        while freed < need:
            victim = self._largest_resident()
            if victim is None:
                break
            freed += self._demote(victim, with_new_token=False)
        return freed

    def _largest_resident(self) -> Optional[int]:
        P = self.padded_buffer_size
        best = [(rows, idx) for idx, rows in self._resident_rows.items() if rows > P]
        return max(best)[1] if best else None

    def _page_tail(self, idx: int, n: int):
        """(last logical slot of the first ``n`` tokens, offsets 1.. of the rest
        of its page) or None when the ``n`` tokens end on a page boundary."""
        rest = -n % self.page_size
        if n <= 0 or rest == 0:
            return None
        last = self.req_to_token_pool.req_to_token[idx, n - 1].to(torch.int64)
        mapping = self._mapping()
        return last, torch.arange(1, rest + 1, dtype=torch.int64, device=mapping.device)

    def _map_page_tail(self, idx: int, n: int) -> None:
        """Map the rest of the page holding token ``n - 1`` to the rest of its
        physical page (prefill allocated both pages whole)."""
        tail = self._page_tail(idx, n)
        if tail is not None:
            last, offsets = tail
            mapping = self._mapping()
            mapping[last + offsets] = mapping[last] + offsets

    def _unmap_page_tail(self, idx: int, n: int) -> None:
        """Undo the mapping ahead of the first ``n`` tokens."""
        tail = self._page_tail(idx, n)
        if tail is not None:
            last, offsets = tail
            self._mapping()[last + offsets] = 0

    def _grow_residents(self, seq_list, idx_list, out_cache_loc) -> None:
        """Map each fresh page a resident's new token starts (its other tokens
        are mapped already). Demote residents when the pool (less what others
        are owed) cannot supply the pages."""
        ps = self.page_size
        alloc = self.token_to_kv_pool_allocator.hisparse_attn_allocator
        batch = {idx: i for i, idx in enumerate(idx_list) if idx in self._resident_rows}
        new_page = [idx for idx in batch if (seq_list[batch[idx]] - 1) % ps == 0]
        P = self.padded_buffer_size

        def short_of_rows() -> bool:
            # A resident below a hot buffer's size grows into rows held back for it.
            need = len(new_page) * ps
            own = sum(min(ps, max(0, P - self._resident_rows[idx])) for idx in new_page)
            return need > alloc.available_size() + own or need > alloc.raw_available_size()

        while new_page and short_of_rows():
            victim = self._largest_resident()
            if victim is None:
                # None frees rows, but one at a hot buffer's size stops needing
                # any once demoted (its next token goes to the newest slot).
                full = [idx for idx in new_page if self._resident_rows[idx] >= P]
                victim = full[0] if full else None
            if victim is None:
                raise RuntimeError(
                    "HiSparse: no rows for resident growth and nothing to demote; "
                    "admission accounting was bypassed")
            self._demote(victim, with_new_token=victim in batch)
            batch.pop(victim, None)
            new_page = [idx for idx in new_page if idx != victim]
        if not new_page:
            return
        mapping = self._mapping()
        rows = alloc.alloc(len(new_page) * ps)
        if rows is None:
            raise RuntimeError("HiSparse: resident growth found fewer free rows than counted")
        sel = torch.tensor([batch[idx] for idx in new_page], dtype=torch.int64,
                           device=out_cache_loc.device)
        # The new token is its logical page's first slot: map the whole page.
        first = out_cache_loc[sel].to(torch.int64).to(mapping.device)
        offsets = torch.arange(ps, dtype=torch.int64, device=mapping.device)
        mapping[(first[:, None] + offsets).reshape(-1)] = rows.to(mapping.device)
        for idx in new_page:
            self._resident_rows[idx] += ps

    def _demote(self, idx: int, with_new_token: bool) -> int:
        """Copy a resident's KV to host and shrink it to a hot buffer; returns
        the rows freed. ``with_new_token``: its newest position was just
        allocated for the step being prepared and has no row yet."""
        if self._streams.gpu and self.decode_producer_stream is not None:
            # Order everything below after the in-flight decode step, which may
            # still write this request's newest row and read its mapping.
            torch.cuda.current_stream().wait_stream(self.decode_producer_stream)
        req = self._live[idx]
        rows_before = self._resident_rows[idx]
        n = req.kv_allocated_len - (1 if with_new_token else 0)
        self._unmap_page_tail(idx, n)
        rows = self._prefix_rows(idx, n)
        if rows is None:
            raise RuntimeError("HiSparse: host pool exhausted while demoting a resident "
                               "request; admission accounting was bypassed")
        host, physical = rows
        self.mem_pool_host.backup_from_device_all_layer(
            self.mem_pool_device, host, physical, io_backend="kernel")
        self.host_bytes_written += n * self.item_size_bytes * self.layer_num
        del self._resident_rows[idx]
        self.req_resident[idx] = 0
        self.alloc_device_buffer(req)
        self._skip_first_backup[idx] = True  # the copy above covered it
        req.hisparse_staging = False  # holds a hot buffer now, even if not collected yet
        self.demotions += 1
        return rows_before - int(self.req_device_buffer_size[idx])
