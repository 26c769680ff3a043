"""The per-request tables HiSparse keeps on the device and the CPU.

One row per ``req_pool_idx`` slot, allocated once for the pool's capacity
(the swap-in kernel and CUDA graphs read them in place):

* ``req_to_device_buffer`` [R, B + page] int64 - the physical row of each
  hot-buffer slot (slot ``B`` holds a long request's newest token);
* ``req_device_buffer_size`` [R] int64, CPU - hot-buffer rows a request holds;
* ``req_to_host_pool`` [R, host ctx + page] int64 - host row per (compressed)
  position, -1 unallocated; ``req_to_host_pool_allocated_len`` [R], CPU;
* per layer: ``slot_tokens`` (position each slot holds, -1 empty),
  ``slot_locs`` (its row), ``lru`` (slots least recently used first) - the
  swap-in kernel's state;
* ``resident`` [R] int32 - the kernel's flag for requests whose whole KV is
  on the GPU;
* ``top_k_out`` / ``raw_indices`` [R x rows per request, top_k] int32 - the
  swap-in's output and SGLang's raw top-k scratch (``raw_indices_buffer``);
  a speculative verify step has one row per draft token.

The names of the 0.5.13 coordinator attributes SGLang reads
(``req_to_host_pool``, ``req_to_host_pool_allocated_len``,
``padded_buffer_size``, ``raw_indices_buffer``) are kept on the coordinator.
"""

from __future__ import annotations

import torch

from sglang_hisparse.engine.streams import fill_at


class RequestTables:
    def __init__(self, *, max_reqs: int, max_host_ctx: int, layers: int, top_k: int,
                 buffer_size: int, page_size: int, device, rows_per_req: int = 1):
        B, P = buffer_size, buffer_size + page_size
        self.buffer_size, self.padded_buffer_size = B, P
        i32 = dict(dtype=torch.int32, device=device)
        self.req_to_device_buffer = torch.zeros((max_reqs, P), dtype=torch.int64, device=device)
        # Slot B's row per request (a view): where a long request's newest token lives.
        self.newest_slot_rows = self.req_to_device_buffer[:, B]
        self.req_device_buffer_size = torch.zeros(max_reqs, dtype=torch.int64)
        self.req_to_host_pool = torch.full(
            (max_reqs, max_host_ctx + page_size), -1, dtype=torch.int64, device=device)
        self.req_to_host_pool_allocated_len = torch.zeros(max_reqs, dtype=torch.int64)
        # numpy views of the two CPU tables (same memory): per-element reads
        # on the per-step paths cost ~0.1 us instead of a tensor index's ~2 us.
        self.buffer_size_np = self.req_device_buffer_size.numpy()
        self.host_len_np = self.req_to_host_pool_allocated_len.numpy()
        self.slot_tokens = torch.full((layers, max_reqs, P), -1, **i32)
        self.slot_locs = torch.full((layers, max_reqs, P), -1, **i32)
        self.lru_init = torch.arange(B, dtype=torch.int16, device=device)
        self.lru = self.lru_init.repeat(layers, max_reqs, 1).contiguous()
        self.arange_i32 = torch.arange(P, **i32)
        self.top_k_out = torch.full((max_reqs * rows_per_req, top_k), -1, **i32)
        self.raw_indices = torch.full((max_reqs * rows_per_req, top_k), -1, **i32)
        self.resident = torch.zeros(max_reqs, **i32)

    def set_hot_buffer(self, idx: int, rows: torch.Tensor) -> None:
        """Slots ``0..len(rows)`` hold rows ``rows``; slot i holds position i
        (up to B); every layer's LRU starts over."""
        size = int(rows.numel())
        held = min(size, self.buffer_size)
        self.req_to_device_buffer[idx, :size] = rows
        self.req_device_buffer_size[idx] = size
        self.slot_tokens[:, idx, :] = -1
        self.slot_tokens[:, idx, :held] = self.arange_i32[:held]
        self.slot_locs[:, idx, :] = -1
        self.slot_locs[:, idx, :size] = rows.to(torch.int32)
        self.lru[:, idx, :].copy_(self.lru_init)

    def grow_hot_buffer(self, idx: int, old: int, new: int, rows: torch.Tensor) -> None:
        """A short request's buffer grows from ``old`` to ``new`` slots."""
        self.req_to_device_buffer[idx, old:new] = rows
        self.slot_locs[:, idx, old:new] = rows.to(torch.int32)
        hi = min(new, self.buffer_size)
        if hi > old:
            self.slot_tokens[:, idx, old:hi] = self.arange_i32[old:hi]
        self.req_device_buffer_size[idx] = new

    def forget_buffer_contents(self, idx: int) -> None:
        """Nothing on the device is valid: every selected token misses."""
        self.slot_tokens[:, idx, :] = -1

    def reset(self, idx: int) -> None:
        """A free slot (host rows are released by the host pool first)."""
        fill_at(self.resident, idx, 0)  # an int index assignment would sync
        self.slot_tokens[:, idx, :] = -1
        self.slot_locs[:, idx, :] = -1
        self.req_to_device_buffer[idx, :] = 0
        self.req_device_buffer_size[idx] = 0
        self.lru[:, idx, :].copy_(self.lru_init)
