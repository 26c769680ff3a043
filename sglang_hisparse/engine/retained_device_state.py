"""A retracted request's device-resident state: copied to the CPU by page, and back.

A PD decode node's retraction (``engine/policies/retain_on_retract.py``)
leaves a request's HiSparse KV in the host pool. What the forward keeps on
the device for every token stays there, addressed through the request's
logical or SWA slots. SGLang frees those slots right after the retraction
and hands them to other requests, so the state must go to the CPU and come
back into the slots the request resumes with. Which buffers that is depends
on the model:

* DSA (DeepSeek-V3.2, GLM-5): the indexer's keys
  (``index_k_with_scale_buffer``), one page per logical page (0.5.13's
  ``DSATokenToKVPool.get_cpu_copy`` snapshots them the same way).
* DeepSeek-V4: what its PD transfer moves besides the C4 KV, which is on
  host (0.5.13 ``DeepSeekV4TokenToKVPool.get_contiguous_buf_infos`` and
  ``get_state_buf_infos``):
  - the C4 indexer's keys and the C128 KV, one page per logical page (page
    256 full tokens = 64 C4 ids = 2 C128 ids);
  - the SWA KV, one page per SWA page;
  - each compressor state pool, ``ring_size`` rows per SWA page
    (``CompressStatePool.translate_from_swa_loc_to_state_loc``); from
    0.5.15 the C128 attention state is kept per request instead,
    ``ring_size`` rows per request slot (``clear_c128_req_state``, the PD
    transfer's ``C128_STATE``), and goes with the request to its new slot.

A page is found again by a *key*: the position in the request of a token on
it. Positions do not move when the request resumes; slots do (rows kept per
request slot are found by the old slot and the new). A logical page is keyed
by its first position. An SWA page is keyed by the first position on
it that still has an SWA slot: SGLang frees the SWA slots of tokens behind
the window, so only the window's pages are saved, as the PD transfer sends
only those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class SavedPages:
    """One group's pages on the CPU: ``tensors[i]`` holds buffer ``i``'s rows
    for every key, in key order."""

    keys: torch.Tensor  # int64 positions in the request, on the CPU
    tensors: tuple


def _ring_rows(base: torch.Tensor, ring: int) -> torch.Tensor:
    """Rows ``base * ring .. base * ring + ring - 1`` of every base, in order."""
    r = torch.arange(ring, dtype=torch.int64, device=base.device)
    return (base.to(torch.int64)[:, None] * ring + r).flatten()


class LogicalPages:
    """Buffers with one page per logical page of ``page_size`` tokens."""

    def __init__(self, buffers: Sequence[torch.Tensor], page_size: int):
        self.buffers = tuple(buffers)
        self.page_size = page_size

    def keys(self, full_ids: torch.Tensor) -> torch.Tensor:
        return torch.arange(0, full_ids.numel(), self.page_size, dtype=torch.int64)

    def rows(self, full_ids: torch.Tensor, keys: torch.Tensor, req_slot: int) -> list:
        pages = full_ids[keys.to(full_ids.device)].to(torch.int64) // self.page_size
        return [pages] * len(self.buffers)


class SwaPages:
    """The SWA KV (a page per SWA page) and the compressor states
    (``ring`` rows per SWA page), through the full-to-SWA mapping."""

    def __init__(self, kv_buffers: Sequence[torch.Tensor], ring_buffers: Sequence[tuple],
                 swa_page_size: int, to_swa: Callable[[torch.Tensor], torch.Tensor]):
        self.buffers = tuple(kv_buffers) + tuple(buf for buf, _ in ring_buffers)
        self.rings = (0,) * len(kv_buffers) + tuple(ring for _, ring in ring_buffers)
        self.swa_page_size = swa_page_size
        self.to_swa = to_swa

    def keys(self, full_ids: torch.Tensor) -> torch.Tensor:
        # Slot 0 is SGLang's dummy SWA slot: > 0 means the token has one.
        live = (self.to_swa(full_ids) > 0).cpu()
        pos = torch.nonzero(live).flatten()
        chunk = pos // self.swa_page_size
        first = torch.ones_like(chunk, dtype=torch.bool)
        first[1:] = chunk[1:] != chunk[:-1]
        return pos[first]

    def rows(self, full_ids: torch.Tensor, keys: torch.Tensor, req_slot: int) -> list:
        swa = self.to_swa(full_ids[keys.to(full_ids.device)]).to(torch.int64)
        if bool((swa <= 0).any()):
            raise RuntimeError(
                "HiSparse: a resumed DeepSeek-V4 request has no SWA slot for a position "
                "of its retained window")
        pages = swa // self.swa_page_size
        return [pages if ring == 0 else _ring_rows(pages, ring) for ring in self.rings]


class RequestSlotRows:
    """Compressor states kept per request slot: ``ring`` rows per slot."""

    def __init__(self, ring_buffers: Sequence[tuple]):
        self.buffers = tuple(buf for buf, _ in ring_buffers)
        self.rings = tuple(ring for _, ring in ring_buffers)

    def keys(self, full_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.int64)  # the slot is the key

    def rows(self, full_ids: torch.Tensor, keys: torch.Tensor, req_slot: int) -> list:
        slot = torch.tensor([int(req_slot)], dtype=torch.int64)
        return [_ring_rows(slot, ring) for ring in self.rings]


class RetainedDeviceState:
    """The groups of device buffers a model keeps per token or per request,
    saved and restored together; no groups: nothing to keep (the saved tuple
    is empty)."""

    def __init__(self, groups: Sequence = ()):
        self.groups = tuple(g for g in groups if g.buffers)

    def save(self, full_ids: torch.Tensor, req_slot: int) -> tuple:
        """CPU copies of what the request in slot ``req_slot`` keeps for its
        first ``len(full_ids)`` tokens. The forward that wrote the newest of
        them must be done."""
        if full_ids.numel() == 0:
            return ()
        saved = []
        for group in self.groups:
            keys = group.keys(full_ids)
            rows = group.rows(full_ids, keys, req_slot)
            saved.append(SavedPages(keys, tuple(
                buf[r.to(buf.device)].to("cpu") for buf, r in zip(group.buffers, rows, strict=True))))
        return tuple(saved)

    def load(self, saved: tuple, full_ids: torch.Tensor, req_slot: int) -> None:
        """Write ``saved`` into the resumed request's new slots."""
        for group, pages in zip(self.groups, saved, strict=True):
            rows = group.rows(full_ids, pages.keys, req_slot)
            for buf, r, data in zip(group.buffers, rows, pages.tensors, strict=True):
                buf[r.to(buf.device)] = data.to(buf.device)


def dsa_indexer_state(pool, page_size: int) -> RetainedDeviceState:
    """DSA: the indexer's keys by logical page (none for a pool without an indexer)."""
    bufs = getattr(pool, "index_k_with_scale_buffer", None) or ()
    return RetainedDeviceState([LogicalPages(bufs, page_size)])


def dsv4_device_state(pool, to_swa: Callable[[torch.Tensor], torch.Tensor]) -> RetainedDeviceState:
    """DeepSeek-V4 (``DeepSeekV4TokenToKVPool``, paged layout): everything but the C4 KV."""
    if getattr(pool, "_unified_kv", False):
        raise RuntimeError(
            "HiSparse: DeepSeek-V4's unified KV layout (one buffer per layer, SWA as a "
            "per-request ring) is not supported on a PD decode node; use the paged layout")
    # A pool that clears a request's C128 state by slot keeps it per request
    # (0.5.15 on); before, every compressor state is per SWA page.
    per_request = hasattr(pool, "clear_c128_req_state")
    by_swa, by_slot = [], []
    for layer, ratio in enumerate(pool.compression_ratios):
        attention = pool.compress_state_pools[layer]
        for state in (attention, pool.indexer_compress_state_pools[layer]):
            if state is not None:
                per_slot = per_request and ratio == 128 and state is attention
                (by_slot if per_slot else by_swa).append((state.kv_score_buffer.kv_score,
                                                          state.ring_size))
    return RetainedDeviceState([
        LogicalPages(list(pool.c4_indexer_kv_pool.index_k_with_scale_buffer)
                     + list(pool.c128_kv_pool.kv_buffer), pool.page_size),
        SwaPages(pool.swa_kv_pool.kv_buffer, by_swa, pool.swa_kv_pool.page_size, to_swa),
        RequestSlotRows(by_slot),
    ])


def retained_device_state(coord) -> RetainedDeviceState:
    """The coordinator's model's device-resident state."""
    alloc = coord.token_to_kv_pool_allocator
    if coord.is_dsv4_hisparse:
        return dsv4_device_state(alloc.get_kvcache(), alloc.translate_loc_from_full_to_swa)
    return dsa_indexer_state(coord.mem_pool_device, coord.page_size)
