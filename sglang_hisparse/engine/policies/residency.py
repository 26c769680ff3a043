"""Residency: a request keeps its whole KV on the GPU until rows run short.

States it drives: ``RESIDENT_JOINING`` / ``RESIDENT`` in, ``HOT_JOINING`` /
``HOT`` out (demotion). Per-request fact: ``RequestRecord.resident_rows``,
the physical rows a resident holds (whole pages).

* A request past prefill becomes resident instead of being staged
  (:meth:`Residency.admits`), unless prompts wait for rows (parking's
  ``prefill_pending``: a resident's rows would be the next prompt's). The
  swap-in kernel then only translates its positions (``resident`` flag), and
  nothing of it goes to host.
* A resident's current page is mapped ahead of its tokens (logical and
  physical pages share offsets): its prompt's last page when it becomes
  resident, each fresh page when a token starts one (:meth:`grow`). The
  decode steps in between launch nothing for it. The mapping ahead is taken
  back when the request stops being resident (:meth:`unmap_page_tail`), so
  unused slots never read as mapped. Under speculation (MTP/EAGLE) the
  verify step maps every page of the spec reserve, up to
  ``kv_allocated_len``, before its forward (:meth:`cover_reserve`): the
  draft tokens' KV is written into the resident's own rows and read
  through the same mapping, whatever is accepted.
* When rows run short, residents are *demoted* (:meth:`demote`): their rows
  are copied to host in stream order and they get a hot buffer, exactly as
  after staging. The allocator asks for this through :meth:`reclaim_rows`
  (admission counts :meth:`reclaimable_rows`); growth demotes by itself.

CPU syncs: demotion's ``alloc_device_buffer`` gathers the request's mapped
rows with a boolean mask, which waits for the in-flight forward (demotion
first orders the current stream after it). Nothing else here waits.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_hisparse.engine.state import ReqState
from sglang_hisparse.engine.streams import device_index, fill_at

S = ReqState
_RESIDENT, _RESIDENT_JOINING = S.RESIDENT, S.RESIDENT_JOINING  # locals for per-step reads


class Residency:
    def __init__(self, coord, enabled: bool):
        self.coord = coord
        self.enabled = enabled

    # -------------------------------------------------------------- reads
    @property
    def count(self) -> int:
        r = self.coord.requests
        return r.count(_RESIDENT) + r.count(_RESIDENT_JOINING)

    def holds(self, idx: int) -> bool:
        rec = self.coord.requests.record(idx)
        return rec is not None and rec.state.is_resident

    def _residents(self):
        return [(idx, rec) for idx, rec in self.coord.requests.records() if rec.state.is_resident]

    def all_mid_page(self, seq_list, idx_list) -> bool:
        """Every request of the step is resident and its new token inside a
        page already mapped (the step needs no work from us). A lone
        request's every step asks this: plain lookups, no helper calls."""
        ps, get = self.coord.page_size, self.coord.requests.record
        resident, joining = _RESIDENT, _RESIDENT_JOINING
        for seq, idx in zip(seq_list, idx_list):
            rec = get(idx)
            if rec is None or (seq - 1) % ps == 0:
                return False
            state = rec.state
            if state is not resident and state is not joining:
                return False
        return True

    def reclaimable_rows(self) -> int:
        """Rows demotion would give back (a demoted request keeps a hot buffer)."""
        # Asked with every available_size(): one flat walk, no helper calls.
        P = self.coord.padded_buffer_size
        total = 0
        for _, rec in self.coord.requests.records():
            extra = rec.resident_rows - P  # 0 rows unless resident
            if extra > 0:
                total += extra
        return total

    # ---------------------------------------------------------- admission
    def admits(self, req) -> bool:
        """Keep the prefill rows: decode resident until rows run short."""
        coord = self.coord
        if not self.enabled or coord.parking.prefill_pending():
            return False
        idx = req.req_pool_idx
        rec = coord.requests.admit(req, S.RESIDENT_JOINING)
        rec.resident_rows = coord._page_up(coord.prefill_len(req))
        fill_at(coord.tables.resident, idx, 1)
        self._map_page_tail(idx, coord.prefill_len(req))
        return True

    # ------------------------------------------------------- page mapping
    def _page_tail(self, idx: int, n: int):
        """(last logical slot of the first ``n`` tokens, offsets 1.. of the rest
        of its page) or None when the ``n`` tokens end on a page boundary."""
        rest = -n % self.coord.page_size
        if n <= 0 or rest == 0:
            return None
        last = self.coord.req_to_token_pool.req_to_token[idx, n - 1].to(torch.int64)
        mapping = self.coord._mapping()
        return last, torch.arange(1, rest + 1, dtype=torch.int64, device=mapping.device)

    def _map_page_tail(self, idx: int, n: int) -> None:
        """Map the rest of the page holding token ``n - 1`` to the rest of its
        physical page (prefill allocated both pages whole)."""
        tail = self._page_tail(idx, n)
        if tail is not None:
            last, offsets = tail
            mapping = self.coord._mapping()
            mapping[last + offsets] = mapping[last] + offsets

    def unmap_page_tail(self, idx: int, n: int) -> None:
        """Undo the mapping ahead of the first ``n`` tokens."""
        tail = self._page_tail(idx, n)
        if tail is not None:
            last, offsets = tail
            self.coord._mapping()[last + offsets] = 0

    # ------------------------------------------------------------- growth
    def _largest(self) -> Optional[int]:
        P = self.coord.padded_buffer_size
        best = [(rec.resident_rows, idx) for idx, rec in self._residents() if rec.resident_rows > P]
        return max(best)[1] if best else None

    def reclaim_rows(self, need: int) -> int:
        """Demote the largest residents until ``need`` rows are free; returns
        the rows freed (less than ``need`` when no resident is left to demote)."""
        freed = 0
        while freed < need:
            victim = self._largest()
            if victim is None:
                break
            freed += self.demote(victim, with_new_token=False)
        return freed

    def grow(self, seq_list, idx_list, out_cache_loc) -> None:
        """Decode: map each fresh page a resident's new token starts (its
        other tokens are mapped already)."""
        ps = self.coord.page_size
        batch = {idx: i for i, idx in enumerate(idx_list) if self.holds(idx)}
        pages = {idx: 1 for idx in batch if (seq_list[batch[idx]] - 1) % ps == 0}

        def first_slots(idxs):
            # The new token is its logical page's first slot.
            sel = device_index([batch[idx] for idx in idxs], out_cache_loc.device)
            return out_cache_loc[sel].to(torch.int64)

        # A demoted request of this step: its newest position has no row yet.
        self._map_new_pages(pages, first_slots, with_new_token=batch)

    def cover_reserve(self, idx_list, allocated_lens) -> None:
        """Speculative verify: map every logical page a resident's spec reserve
        took (up to ``kv_allocated_len``, which covers every position the
        step writes) to a fresh physical page. The verify forward then writes
        its draft tokens' KV into the request's own rows and the swap-in
        reads them through the mapping like any other position: nothing is
        remapped or written back after the step, whatever was accepted, and
        a rejected position's row is written again by the step that commits
        it. The CPU knows ``kv_allocated_len`` but not the committed length
        (the overlap scheduler), which is all this needs."""
        ps, get = self.coord.page_size, self.coord.requests.record
        pages, held = {}, {}
        for idx, n in zip(idx_list, allocated_lens):
            rec = get(idx)
            if rec is None or not rec.state.is_resident:
                continue
            missing = (self.coord._page_up(n) - rec.resident_rows) // ps
            if missing > 0:
                pages[idx], held[idx] = missing, rec.resident_rows // ps
        if not pages:
            return
        r2t = self.coord.req_to_token_pool.req_to_token

        def first_slots(idxs):
            # Logical pages are whole: a page's first slot names it.
            req = [idx for idx in idxs for _ in range(pages[idx])]
            pos = [(held[idx] + k) * ps for idx in idxs for k in range(pages[idx])]
            return r2t[device_index(req, r2t.device),
                       device_index(pos, r2t.device)].to(torch.int64)

        # Every position up to kv_allocated_len is mapped or not yet written:
        # a demoted request copies what it has.
        self._map_new_pages(pages, first_slots, with_new_token=())

    def _map_new_pages(self, pages, first_slots, with_new_token) -> None:
        """Give each resident ``pages[idx]`` fresh physical pages behind the
        logical pages ``first_slots(idxs)`` names (their first slots, in
        ``idxs`` order, ``pages[idx]`` each). Demote residents when the pool
        (less what others are owed) cannot supply them; a demoted request
        needs none (its hot buffer serves it)."""
        coord = self.coord
        ps, P = coord.page_size, coord.padded_buffer_size
        records = coord.requests
        alloc = coord.token_to_kv_pool_allocator.hisparse_attn_allocator
        pages = dict(pages)

        def short_of_rows() -> bool:
            # A resident below a hot buffer's size grows into rows held back for it.
            need = sum(pages.values()) * ps
            own = sum(min(k * ps, max(0, P - records.record(idx).resident_rows))
                      for idx, k in pages.items())
            return need > alloc.available_size() + own or need > alloc.raw_available_size()

        while pages and short_of_rows():
            victim = self._largest()
            if victim is None:
                # None frees rows, but one at a hot buffer's size stops needing
                # any once demoted (its next tokens go to the newest-token page).
                full = [idx for idx in pages if records.record(idx).resident_rows >= P]
                victim = full[0] if full else None
            if victim is None:
                for idx in pages:
                    coord._drift(records.record(idx).req,
                                 "no rows for resident growth and nothing to demote")
                return
            self.demote(victim, with_new_token=victim in with_new_token)
            pages.pop(victim, None)
        if not pages:
            return
        idxs = list(pages)
        total = sum(pages.values())
        rows = alloc.alloc(total * ps)
        if rows is None:
            for idx in idxs:
                coord._drift(records.record(idx).req,
                             "resident growth found fewer free rows than counted")
            return
        mapping = coord._mapping()
        first = first_slots(idxs).to(mapping.device)
        offsets = torch.arange(ps, dtype=torch.int64, device=mapping.device)
        mapping[(first[:, None] + offsets).reshape(-1)] = rows.to(mapping.device)
        for idx in idxs:
            records.record(idx).resident_rows += pages[idx] * ps

    # ----------------------------------------------------------- demotion
    def demote(self, idx: int, with_new_token: bool) -> int:
        """Copy a resident's KV to host and shrink it to a hot buffer; returns
        the rows freed. ``with_new_token``: its newest position was just
        allocated for the step being prepared and has no row yet."""
        coord = self.coord
        # Order everything below after the in-flight decode step, which may
        # still write this request's newest row and read its mapping.
        coord.streams.after_decode_producer()
        rec = coord.requests.record(idx)
        req = rec.req
        rows_before = rec.resident_rows
        n = coord.kv_allocated_len(req) - (1 if with_new_token else 0)
        rows = coord._prefix_rows(idx, n)
        if rows is None:
            coord._drift(req, "host pool exhausted while demoting a resident request")
            return 0
        self.unmap_page_tail(idx, n)
        host, physical = rows
        coord.mem_pool_host.backup_from_device_all_layer(
            coord.mem_pool_device, host, physical, io_backend="kernel")
        coord.host_bytes_written += n * coord.item_size_bytes * coord.layer_num
        fill_at(coord.tables.resident, idx, 0)
        joining = rec.state is S.RESIDENT_JOINING
        if not coord.alloc_device_buffer(req):
            # Cannot happen (the buffer is taken from the resident's own rows).
            coord._drift(req, "no rows for a demoted request's hot buffer")
            return 0
        rec = coord.requests.move(req, S.HOT_JOINING if joining else S.HOT)
        rec.skip_first_backup = True  # the copy above covered it
        coord.demotions += 1
        return rows_before - int(coord.tables.buffer_size_np[idx])
