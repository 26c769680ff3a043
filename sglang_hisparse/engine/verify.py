"""The speculative verify step (MTP/EAGLE with linear drafts): where the
tokens a verify forward writes go, and what it leaves on host.

A verify step checks ``n`` (draft tokens) positions ``S .. S + n - 1`` of
each request, ``S`` being the request's committed length. The forward writes
their KV through the allocator's mapping (logical slot -> device row), then
the swap-in resolves every row's top-k as one union per request
(``kernels.reference.swap_in(draft_tokens=n)``), which reads the verified
positions from these slots:

* a short request (``S < B``) keeps position ``p`` at hot-buffer slot ``p``
  (the buffer grows to cover ``S + n - 1``; slots past ``B`` are the
  newest-token page of the padded buffer);
* a long request puts position ``S + j`` at slot ``B + j`` of that page.

:meth:`VerifyStep.map_slots` runs before the forward: it grows short
buffers, takes host rows for all ``n`` positions (admission reserved them:
the spec reserve is part of ``kv_allocated_len``) and points the verify
slots' mapping at those rows. :meth:`VerifyStep.commit` runs once the
forward has written them, whatever was accepted: it writes all ``n``
positions through to their host rows on the backup stream and unmaps the
verify slots. Rejected positions land in host rows no reader sees (past the
committed length) and are written again by the step that commits them, so
the commit needs no accept length on the CPU and no device sync. The next
``map_slots`` orders the forward after that copy, since its verify slots
are the ones being copied.

A step needs no state of its own (:mod:`.state`): between the two calls
the request is HOT, and a finish, abort or retraction in between releases
the verify slots with the rest (they lie inside ``kv_allocated_len``, whose
mapping ``request_finished`` clears).

Requests in any other state are left alone (a resident's verify tokens are
its own rows: residency is off under speculation until that path lands).
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from sglang_hisparse.engine.state import ReqState

_HOT = ReqState.HOT


class VerifyStep:
    def __init__(self, coord, draft_tokens: int):
        if draft_tokens < 2:
            raise ValueError(f"a verify step checks >= 2 draft tokens, got {draft_tokens}")
        if draft_tokens > coord.page_size:
            raise ValueError(
                f"draft_tokens ({draft_tokens}) must be <= the page size ({coord.page_size}): "
                "tokens verified past the hot buffer sit in its newest-token page")
        self.coord = coord
        self.draft_tokens = draft_tokens
        self._offsets = torch.arange(draft_tokens, dtype=torch.int64, device=coord.device)
        # The step in flight: request slot -> committed length of the
        # requests map_slots mapped (commit writes those back, no others: a
        # request that got no host rows has none to write to).
        self._mapped: dict[int, int] = {}

    def _hot_rows(self, req_pool_indices: Sequence[int]) -> List[int]:
        """Batch rows of the requests that decode from a hot buffer."""
        record = self.coord.requests.record
        return [b for b, idx in enumerate(req_pool_indices)
                if (rec := record(int(idx))) is not None and rec.state is _HOT]

    def _slots(self, picks, req_pool_indices, committed):
        """(request slots [k], committed lengths [k], hot-buffer slots [k, n])."""
        dev = self.coord.device
        idx = torch.tensor([int(req_pool_indices[b]) for b in picks], dtype=torch.int64, device=dev)
        seq = torch.tensor([int(committed[b]) for b in picks], dtype=torch.int64, device=dev)
        B = self.coord.device_buffer_size
        positions = seq[:, None] + self._offsets
        slots = torch.where(seq[:, None] < B, positions, B + self._offsets)
        return idx, seq, slots

    def map_slots(self, req_pool_indices: Sequence[int], committed: Sequence[int],
                  verify_locs: torch.Tensor) -> None:
        """Before the verify forward. ``req_pool_indices`` and ``committed``
        (S per request) are the batch's CPU values; ``verify_locs`` [bs, n]
        the logical slots the forward writes (0.5.13's ``out_cache_loc``,
        request-major)."""
        c, n = self.coord, self.draft_tokens
        if c.exactness is not None and not c.exactness.armed:
            c.exactness.arm()  # graph capture is over (decode arms it in map_last_loc_to_buffer)
        c.streams.wait_for_pending_backup()  # the last commit still reads these slots
        self._mapped = {}
        picks = self._hot_rows(req_pool_indices)
        B = c.device_buffer_size
        short = [(int(committed[b]) + n, int(req_pool_indices[b])) for b in picks
                 if int(committed[b]) < B]
        if short:
            c._grow_device_buffers([s for s, _ in short], [i for _, i in short])
        kept = []
        for b in picks:
            idx, seq = int(req_pool_indices[b]), int(committed[b])
            rows = c.mem_pool_host.try_alloc_paged_token_slots(
                c.req_to_host_pool, c.req_to_host_pool_allocated_len, idx, seq, n)
            if rows is None:
                c._drift(c.requests.record(idx).req, "host pool exhausted for verify rows")
                continue
            kept.append(b)
            self._mapped[idx] = seq
        if not kept:
            return
        idx, seq, slots = self._slots(kept, req_pool_indices, committed)
        rows = c.req_to_device_buffer[idx[:, None], slots]
        sel = torch.tensor(kept, dtype=torch.int64, device=verify_locs.device)
        c._mapping()[verify_locs[sel].reshape(-1)] = rows.reshape(-1)
        long = seq >= B
        if bool(long.any()):
            # The kernel reads a verified position's row from slot_locs.
            c.req_device_buffer_token_locs[:, idx[long], B:B + n] = rows[long].to(torch.int32)

    def commit(self, req_pool_indices: Sequence[int], committed: Sequence[int],
               verify_locs: torch.Tensor) -> None:
        """After the verify forward (queued in stream order; no sync): all
        ``n`` positions through to host, the verify slots unmapped."""
        c, n = self.coord, self.draft_tokens
        mapped = self._mapped
        picks = [b for b in self._hot_rows(req_pool_indices)
                 if mapped.get(int(req_pool_indices[b])) == int(committed[b])]
        self._mapped = {}
        if not picks:
            return
        idx, seq, slots = self._slots(picks, req_pool_indices, committed)
        dev_rows = c.req_to_device_buffer[idx[:, None], slots].reshape(-1)
        host_rows = c.req_to_host_pool[idx[:, None], seq[:, None] + self._offsets].reshape(-1)
        c.streams.wait_for_pending_backup()
        with c.streams.begin_write_through():
            c.mem_pool_host.backup_from_device_all_layer(
                c.mem_pool_device, host_rows, dev_rows, io_backend="kernel")
            c.streams.end_write_through(host_rows, dev_rows)
        c.host_bytes_written += len(picks) * n * c.item_size_bytes * c.layer_num
        sel = torch.tensor(picks, dtype=torch.int64, device=verify_locs.device)
        c._mapping()[verify_locs[sel].reshape(-1)] = 0
