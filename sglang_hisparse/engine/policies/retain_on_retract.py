"""PD decode: a retracted request keeps its KV in the host pool.

Under memory pressure a PD decode node retracts requests. SGLang 0.5.13
snapshots a retracted request's KV to the CPU (``Req.offload_kv_cache`` ->
allocator ``get_cpu_copy``), frees its slots, and when memory allows restores
the snapshot into fresh slots (``DecodePreallocQueue.resume_retracted_reqs``
-> ``_pre_alloc`` -> ``Req.load_kv_cache`` -> ``load_cpu_copy``); the request
then decodes on without a new prefill. With HiSparse the device pool holds
only a hot buffer, so 0.5.13 raises ``NotImplementedError`` there
(sglang#40729).

With HiSparse the request's KV already lives in the host pool, so nothing is
copied back and forth:

* ``retract_req`` writes the newest token through to host if the last
  write-through has not, *detaches* the request's host rows into a
  :class:`RetainedHostKV` and releases its hot buffer as usual;
* what the forward keeps on the device for every token is not in the host
  pool, and retraction frees the slots that address it (other requests
  reuse them): the DSA indexer's keys by logical page; on DeepSeek-V4 the
  C4 indexer's keys and the C128 KV by logical page, the SWA window's KV and
  the compressor states by SWA page. ``retract_req`` copies those pages to
  the CPU into the :class:`RetainedHostKV` and ``load_cpu_copy`` writes them
  into the resumed request's new pages
  (:mod:`sglang_hisparse.engine.retained_device_state`), as 0.5.13's
  ``DSATokenToKVPool`` snapshot does for the indexer; without it the resumed
  request's top-k scored foreign or zero keys, and a V4 request attended
  over another request's window;
* the allocator's ``get_cpu_copy`` hands that object to SGLang, which keeps
  it on the request as ``kv_cache_cpu`` while it waits in the retracted queue;
* when SGLang resumes it, ``_pre_alloc`` (patched) asks the coordinator for
  its host rows, which puts the retained rows back into the request's new
  host-row table (:meth:`RetainOnRetract.adopt`): nothing is allocated for
  what they hold, so a request resumes even when the pool is full of kept
  KV; ``load_cpu_copy`` then admits it as if its KV had just arrived
  (``admit_request_direct``);
* an abort while retracted frees the retained rows
  (:func:`sglang_hisparse.adapter.scheduler.scheduler_abort_request`).

A request aborted in the same retraction (SGLang aborts the last one when
even it does not fit) is released whole instead: it will not come back.

Retraction frees no host row, so it cannot make room on host for the
running requests: the PD token budget (``Coordinator.pd_host_reserve``)
holds back what every request on the node, retracted ones included, may
still write, and SGLang's prealloc keeps the next prompt waiting until that
fits. The policy lists the retained KV it has handed out (:meth:`kept`) for
that count.

DeepSeek-V4 (C4 rows on host, counted in compressed tokens) takes the same
path: the C4 row of a group of four tokens goes through to host one step
after the group closes, as in decode, and the device-resident state above
is what differs.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_hisparse.engine.retained_device_state import RetainedDeviceState, retained_device_state
from sglang_hisparse.engine.state import ReqState
from sglang_hisparse.engine.streams import device_index


@dataclass
class RetainedHostKV:
    """A retracted request's KV, left in the host pool (SGLang's ``kv_cache_cpu``).

    ``rows`` are the host rows of positions ``[0, num_tokens)`` (whole pages,
    as allocated); None once restored or released. Empty for a request that
    was released whole.
    """

    rid: str
    num_tokens: int
    rows: Optional[torch.Tensor]
    allocated_len: int
    req: object = None
    # The device-resident pages of positions [0, num_tokens) on the CPU
    # (RetainedDeviceState.save; empty: the model keeps nothing there).
    device_state: tuple = ()
    # Set when the rows went back into the resumed request's table (adopt).
    adopted: bool = False

    @property
    def holds_rows(self) -> bool:
        return self.rows is not None and self.rows.numel() > 0


class RetainOnRetract:
    """The PD-decode retraction policy over the coordinator's state: a
    retracted ``HOT`` request leaves the table (its slot is SGLang's to
    reuse) and its host rows live on in a :class:`RetainedHostKV` that SGLang
    holds until the request resumes or is aborted."""

    def __init__(self, coord, enabled: bool):
        self.coord = coord
        self.enabled = enabled
        # retract_req -> get_cpu_copy hand-off: SGLang calls get_cpu_copy
        # right after retract_req for the same request (0.5.13
        # ScheduleBatch.release_req), so one slot suffices; it must be empty.
        self._pending: Optional[RetainedHostKV] = None
        # Retained KV SGLang holds (retracted queue), by id, in retraction order.
        self._kept: dict = {}
        # The model's device-resident buffers (the coordinator's pools are
        # built before its policies); only a PD decode node retracts to host.
        self.device_state: Optional[RetainedDeviceState] = (
            retained_device_state(coord) if enabled else None)

    def kept(self):
        """The retained KV of every retracted request (rows still held)."""
        return self._kept.values()

    @contextmanager
    def releasing(self):
        """Retractions inside release every row they hold: the caller will
        have the KV recomputed, so nothing takes a CPU copy (0.5.17's
        rebootstrap retraction, ``release_req(offload_kv=False)``)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def retains(self, req) -> bool:
        return (self.enabled and getattr(req, "to_finish", None) is None
                and self.coord.requests.state_of(req) is ReqState.HOT)

    def retract_to_host(self, req) -> None:
        """Keep the request's host rows (plus its newest token) and release the rest."""
        coord = self.coord
        if self._pending is not None:
            raise RuntimeError(
                f"HiSparse: {req.rid} retracts while {self._pending.rid}'s retained KV was "
                "never taken by get_cpu_copy (0.5.13 calls it right after retract_req)")
        idx = req.req_pool_idx
        need = len(req.origin_input_ids) + len(req.output_ids) - 1  # SGLang's snapshot length
        coord.streams.before_release()
        # Host holds [0, kv_allocated_len - 1): each decode step writes the
        # previous token through. Until the first step after admission the
        # whole prompt is there already. Write the rest (only ever the newest
        # token) through the same way, as if the next step had begun.
        rec = coord.requests.record(idx)
        on_host = coord.kv_allocated_len(req) - (0 if rec.skip_first_backup else 1)
        seqs = [pos + 2 for pos in range(max(on_host, 0), need)]
        if seqs:
            dev = coord.req_to_host_pool.device
            coord._eager_backup_previous_token(
                device_index(seqs, dev),
                torch.full((len(seqs),), idx, dtype=torch.int64, device=dev), seqs, [idx] * len(seqs))
        alloc_len = int(coord.req_to_host_pool_allocated_len[idx])  # whole host pages
        rows = coord.req_to_host_pool[idx, :alloc_len].clone()
        coord.req_to_host_pool[idx, :] = -1
        coord.req_to_host_pool_allocated_len[idx] = 0
        # (before_release above ordered this after the forward that wrote them)
        state = self.device_state.save(coord.req_to_token_pool.req_to_token[idx, :need], idx)
        self._pending = RetainedHostKV(req.rid, need, rows, alloc_len, req, state)
        coord.request_finished(req)  # hot buffer, device rows; no host rows left to free

    # ------------------------------------------------ allocator entry points
    def take_retained(self, num_tokens: int) -> RetainedHostKV:
        """``get_cpu_copy``: what ``retract_req`` just kept for this request."""
        kept, self._pending = self._pending, None
        if kept is None:  # released whole (aborted, finished, staging)
            return RetainedHostKV("", num_tokens, None, 0)
        if kept.num_tokens != num_tokens:
            self.release_retained(kept)
            raise RuntimeError(
                f"HiSparse: retraction snapshot of {kept.rid} covers {kept.num_tokens} "
                f"tokens, SGLang asked for {num_tokens}")
        if kept.holds_rows:
            self._kept[id(kept)] = kept
        return kept

    def adopt(self, req) -> None:
        """``_pre_alloc`` of a resuming request (it still carries its
        ``kv_cache_cpu``): its kept rows become its new slot's host rows, so
        the prealloc allocates only what they do not cover."""
        kept = getattr(req, "kv_cache_cpu", None)
        if not isinstance(kept, RetainedHostKV) or not kept.holds_rows:
            return
        coord, idx = self.coord, req.req_pool_idx
        if int(coord.req_to_host_pool_allocated_len[idx]):
            raise RuntimeError(f"HiSparse: {req.rid} resumes into slot {idx}, which holds host rows")
        coord.req_to_host_pool[idx, :kept.rows.numel()] = kept.rows
        coord.req_to_host_pool_allocated_len[idx] = kept.allocated_len
        kept.rows, kept.adopted = None, True
        self._kept.pop(id(kept), None)

    def restore_retained(self, kept, token_indices) -> None:
        """``load_cpu_copy``: the request is back with a new slot, its kept
        rows already its host rows (``_pre_alloc`` adopted them); admit it."""
        if not isinstance(kept, RetainedHostKV) or not kept.adopted:
            raise RuntimeError(
                "HiSparse: load_cpu_copy got no retained host KV (the request was "
                "released whole when it was retracted, or its prealloc did not take "
                "its kept rows back)")
        if len(token_indices) != kept.num_tokens:
            raise RuntimeError(
                f"HiSparse: {kept.rid} resumes with {len(token_indices)} tokens, "
                f"retained {kept.num_tokens}")
        if kept.device_state:
            self.device_state.load(kept.device_state, token_indices, kept.req.req_pool_idx)
            kept.device_state = ()
        self.coord.admit_request_direct(kept.req)

    def release_retained(self, kept) -> None:
        """Free a retained request's host rows (aborted while retracted)."""
        if isinstance(kept, RetainedHostKV):
            self._kept.pop(id(kept), None)
            if kept.holds_rows:
                self.coord.mem_pool_host.free(kept.rows[kept.rows >= 0])
            kept.rows, kept.device_state = None, ()
