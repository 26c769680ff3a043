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

Under 0.5.13's overlap scheduler the CPU does not know ``S`` when it
prepares a verify step: the previous step's accept lengths are still on the
GPU (``kv_committed_len`` lags by a step). ``S`` is therefore read only on
the device (the batch's ``seq_lens``), and the CPU works from the upper
bound it does know, ``kv_allocated_len`` (the spec reserve covers every
position the step can write, ``S + n <= kv_allocated_len``):

:meth:`VerifyStep.map_slots` runs before the forward. On the CPU it takes
host rows up to ``kv_allocated_len`` and grows short buffers as far (at most
to the padded buffer); on the device it points the verify slots' mapping at
``slot(S + j)``'s row. :meth:`VerifyStep.commit` runs once the forward has
written them, whatever was accepted: it writes all ``n`` positions through
to their host rows on the backup stream and unmaps the verify slots, all in
stream order with no sync and no accept length on the CPU. Rejected
positions land in host rows and slots no reader sees (at or past the new
committed length) and are written again by the step that commits them. The
next ``map_slots`` orders the forward after that copy, since its verify
slots may be the ones being copied.

Growing a short buffer past ``S`` marks slots whose position is not yet
written as holding it; a row of length ``S + j + 1`` selects nothing past
``S + j``, and ``S .. S + j`` are this step's in-place writes, so such a
slot is never read before the step that writes it.

A step needs no state of its own (:mod:`.state`): between the two calls
the request is HOT, and a finish, abort or retraction in between releases
the verify slots with the rest (they lie inside ``kv_allocated_len``, whose
mapping ``request_finished`` clears).

A resident request (:mod:`.policies.residency`) needs none of this: its
verify positions are its own rows. ``map_slots`` first has
``Residency.cover_reserve`` give every logical page of its spec reserve
(up to ``kv_allocated_len``) a physical page, mapped for good; the forward
writes the draft tokens' KV there, the swap-in's resident path translates
every selected position through the same mapping, and ``commit`` leaves it
alone (nothing goes to host while resident). When rows run short there,
residents are demoted as on the decode path (their KV up to
``kv_allocated_len`` copied to host: positions past the committed length
are not yet written or rejected, and are written again by the step that
commits them), and a demoted request is mapped below as HOT in the same
step. Requests in any other state (staging, parked) are not in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from sglang_hisparse.engine.state import ReqState
from sglang_hisparse.engine.streams import device_index, fill_at

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
        # The step in flight: what map_slots mapped (commit writes those back,
        # no others: a request that got no host rows has none to write to).
        self._step: Optional[_MappedStep] = None

    def _hot_rows(self, req_pool_indices: Sequence[int]) -> List[int]:
        """Batch rows of the requests that decode from a hot buffer."""
        record = self.coord.requests.record
        return [b for b, idx in enumerate(req_pool_indices)
                if (rec := record(int(idx))) is not None and rec.state is _HOT]

    def map_slots(self, req_pool_indices: Sequence[int], allocated_lens: Sequence[int],
                  committed: torch.Tensor, verify_locs: torch.Tensor) -> None:
        """Before the verify forward. ``req_pool_indices`` and
        ``allocated_lens`` (``kv_allocated_len``) are the batch's CPU values;
        ``committed`` (S per request, the batch's ``seq_lens``) and
        ``verify_locs`` ([bs, n] or [bs * n], request-major as 0.5.13's
        ``out_cache_loc``: the logical slots the forward writes) stay on the
        device."""
        c, n = self.coord, self.draft_tokens
        if c.exactness is not None and not c.exactness.armed:
            c.exactness.arm()  # graph capture is over (decode arms it in map_last_loc_to_buffer)
        c.streams.wait_for_pending_backup()  # the last commit still reads these slots
        self._step = None
        if c.residency.count:
            # Residents read their own rows: the reserve's pages get rows
            # (demoting residents when rows run short; a demoted one is HOT
            # below, its KV on host).
            c.residency.cover_reserve(req_pool_indices, allocated_lens)
        picks = self._hot_rows(req_pool_indices)
        width = c.req_to_host_pool.size(1) - c.page_size
        full = c.padded_buffer_size
        grow_to, grow_idx, kept = [], [], []
        for b in picks:
            idx, upper = int(req_pool_indices[b]), min(int(allocated_lens[b]), width)
            if int(c.tables.buffer_size_np[idx]) < full:
                grow_to.append(upper)
                grow_idx.append(idx)
            have = int(c.tables.host_len_np[idx])
            if upper > have and c.mem_pool_host.try_alloc_paged_token_slots(
                    c.req_to_host_pool, c.req_to_host_pool_allocated_len, idx, have,
                    upper - have) is None:
                c._drift(c.requests.record(idx).req, "host pool exhausted for verify rows")
                continue
            kept.append(b)
        if grow_to:
            c._grow_device_buffers(grow_to, grow_idx)
        if not kept:
            return
        dev = verify_locs.device
        req_slots = tuple(int(req_pool_indices[b]) for b in kept)
        sel = device_index(kept, dev)
        idx = device_index(req_slots, dev)
        seq = committed.to(torch.int64)[sel]
        B = c.device_buffer_size
        positions = seq[:, None] + self._offsets
        slots = torch.where(seq[:, None] < B, positions, B + self._offsets)
        rows = c.req_to_device_buffer[idx[:, None], slots]
        locs = verify_locs.reshape(-1, n)[sel]
        c._mapping()[locs.reshape(-1)] = rows.reshape(-1)
        # commit reads the same tensors: batch.seq_lens moves on before it runs.
        self._step = _MappedStep(idx=idx, positions=positions, rows=rows, locs=locs,
                                 req_slots=req_slots)

    def commit(self) -> None:
        """After the verify forward (queued in stream order; no sync): all
        ``n`` positions of the requests ``map_slots`` mapped through to host,
        their verify slots unmapped."""
        c, n, step = self.coord, self.draft_tokens, self._step
        self._step = None
        if step is None:
            return
        # 0.5.13 commits right after the verify forward, before any finish or
        # retraction of that step; a request released in between anyway has
        # no host rows left to write to.
        live = self._hot_rows(step.req_slots)
        if len(live) < len(step.req_slots):
            if not live:
                return
            step = step.only(live)
        host_rows = c.req_to_host_pool[step.idx[:, None], step.positions].reshape(-1)
        dev_rows = step.rows.reshape(-1)
        c.streams.wait_for_pending_backup()
        with c.streams.begin_write_through():
            c.mem_pool_host.backup_from_device_all_layer(
                c.mem_pool_device, host_rows, dev_rows, io_backend="kernel")
            c.streams.end_write_through(host_rows, dev_rows)
        c.host_bytes_written += len(step.req_slots) * n * c.item_size_bytes * c.layer_num
        fill_at(c._mapping(), step.locs, 0)  # a plain index assignment would sync


@dataclass(frozen=True)
class _MappedStep:
    """What map_slots mapped, for commit: request slots [k] (on the device
    and as CPU ints), positions, device rows and logical verify slots [k, n]."""
    idx: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    locs: torch.Tensor
    req_slots: tuple

    def only(self, keep: Sequence[int]) -> "_MappedStep":
        """The same step for the requests at positions ``keep``."""
        sel = device_index(keep, self.idx.device)
        return _MappedStep(idx=self.idx[sel], positions=self.positions[sel], rows=self.rows[sel],
                           locs=self.locs[sel], req_slots=tuple(self.req_slots[k] for k in keep))
