"""Pinned, page-granular host KV pools that back HiSparse's logical space.

Allocation is by page (the device pool's page size) while callers address
token rows, exactly like the transfer engine and the swap-in kernel expect:
a request's ``req_to_host_pool`` row is filled a whole page at a time and
read token by token.

Two layouts:

* :class:`HiSparseMLAHostPool` - DSA / MLA latent rows (``kv_lora_rank +
  qk_rope_head_dim`` = 576 values; bf16 rows are 1152 B, the FP8
  ``flashmla_kv`` rows are 656 B of uint8). Built on HiCache's
  ``MLATokenToKVPoolHost`` (0.5.13 ``memory_pool_host.py:899``), layout
  ``layer_first``; its CUDA transfer functions (``sgl_kernel.kvcacheio`` /
  JIT hicache) move bytes on GPU, plain index copies move them on CPU.
* :class:`HiSparseC4HostPool` - DeepSeek-V4 C4 layout: one row per 64-token
  page, the 64 value runs (576 B each) first, then the 64 scale runs (8 B
  each), row padded to a multiple of 576 B. Token-granular copies move the
  value and scale pieces of a token separately.

An exhausted pool never raises from the admission-aware entry point
(:meth:`try_alloc_paged_token_slots` returns None); the allocator reads
:meth:`available_size` to keep admission within what the pool can serve.
``alloc_paged_token_slots`` keeps 0.5.13's contract (raises) for the PD
decode prealloc call site (``disaggregation/decode.py:1326``), which the
allocator's logical budget keeps from overrunning the pool.
Host buffers come from :mod:`sglang_hisparse.pools.host_memory` (how they are
pinned decides the swap-in kernel's zero-copy read rate);
``destroy()`` waits for outstanding copies and unpins them.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, List, Optional

import torch

from sglang_hisparse.adapter.sglang_classes import HostKVCache, MLATokenToKVPoolHost
from sglang_hisparse.engine.streams import device_index

from sglang_hisparse.pools import host_memory

logger = logging.getLogger(__name__)


class HostPoolExhausted(RuntimeError):
    """The host pool has fewer free pages than a request needs."""


def _is_gpu_tensor(t: Optional[torch.Tensor]) -> bool:
    return t is not None and t.device.type not in ("cpu", "meta")


def _bytes_view(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.view(torch.uint8).reshape(rows, -1)


def _row_copy(dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor,
              src_idx: torch.Tensor) -> None:
    """``dst[dst_idx] = src[src_idx]`` on row tensors, as a bit copy (CPU path)."""
    dst_rows = dst.view(torch.uint8).reshape(dst.shape[0], -1)
    src_rows = src.view(torch.uint8).reshape(src.shape[0], -1)
    if dst_rows.shape[1] % 2 == 0 and dst_rows.shape[1] == src_rows.shape[1]:
        dst_rows, src_rows = dst_rows.view(torch.int16), src_rows.view(torch.int16)
    dst_rows.index_copy_(0, dst_idx.to(torch.int64).cpu(),
                         src_rows.index_select(0, src_idx.to(torch.int64).cpu()))


class PagedHostSlots:
    """Page free list with token-granular results; mixed in before a HostKVCache.

    Requires ``self.size`` (tokens, a page multiple), ``self.page_size`` and
    ``self.lock`` before :meth:`clear` runs.
    """

    page_size: int
    size: int

    # -------------------------------------------------------------- state
    def clear(self):
        with self.lock:
            self.num_pages = self.size // self.page_size
            self._free_page_ids = torch.arange(self.num_pages, dtype=torch.int64)
            self._page_in_use = torch.zeros(self.num_pages, dtype=torch.bool)

    def available_size(self) -> int:
        return self._free_page_ids.shape[0] * self.page_size

    def free_page_count(self) -> int:
        return len(self._free_page_ids)

    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.page_size)

    # --------------------------------------------------------- token API
    def alloc_page(self, num_pages: int) -> Optional[torch.Tensor]:
        """``num_pages`` whole pages as token rows, or None."""
        with self.lock:
            if num_pages > len(self._free_page_ids):
                return None
            pages = self._free_page_ids[:num_pages]
            self._free_page_ids = self._free_page_ids[num_pages:]
            self._page_in_use[pages] = True
        offs = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offs).reshape(-1)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        return self.alloc_page(self.pages_for(need_size))

    def free(self, indices: torch.Tensor) -> int:
        """Free the pages that hold ``indices`` (any token of a page frees it)."""
        if indices.numel() == 0:
            return 0
        pages = torch.unique(indices.to(device="cpu", dtype=torch.int64) // self.page_size)
        with self.lock:
            if not bool(self._page_in_use[pages].all()):
                bad = pages[~self._page_in_use[pages]].tolist()
                raise RuntimeError(f"host pool: double free of pages {bad[:8]}")
            self._page_in_use[pages] = False
            self._free_page_ids = torch.cat([self._free_page_ids, pages])
        return int(indices.numel())

    # ------------------------------------------------ per-request rows
    def try_alloc_paged_token_slots(
        self,
        req_to_host_pool: torch.Tensor,
        req_to_host_pool_allocated_len: torch.Tensor,
        req_pool_idx: int,
        start_pos: int,
        num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """Host rows for positions ``[start_pos, start_pos+num_tokens)`` of a request,
        adding whole pages to its row as needed. None (nothing changed) when the
        pool cannot supply the pages."""
        dev = req_to_host_pool.device
        if num_tokens <= 0:
            return torch.empty((0,), dtype=torch.int64, device=dev)
        have = int(req_to_host_pool_allocated_len[req_pool_idx])
        if start_pos > have:
            raise ValueError(
                f"host rows must grow contiguously (start {start_pos} > allocated {have})"
            )
        end = start_pos + num_tokens
        want = self.pages_for(end) * self.page_size
        if want > req_to_host_pool.shape[1]:
            raise ValueError(f"position {end} beyond req_to_host_pool width")
        if want > have:
            rows = self.alloc_page((want - have) // self.page_size)
            if rows is None:
                return None
            # Every decode step that starts a host page passes here: no
            # pageable copy, which can stall the step in flight.
            req_to_host_pool[req_pool_idx, have:want] = device_index(rows, dev)
            req_to_host_pool_allocated_len[req_pool_idx] = want
        return req_to_host_pool[req_pool_idx, start_pos:end]

    def alloc_paged_token_slots(self, req_to_host_pool, req_to_host_pool_allocated_len,
                                req_pool_idx, start_pos, num_tokens) -> torch.Tensor:
        rows = self.try_alloc_paged_token_slots(
            req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx,
            start_pos, num_tokens,
        )
        if rows is None:
            raise HostPoolExhausted(
                f"HiSparse host pool exhausted: {num_tokens} tokens at {start_pos} "
                f"for request slot {req_pool_idx}, {self.free_page_count()} pages free"
            )
        return rows

    def allocated_host_indices(self, req_to_host_pool, req_pool_idx, allocated_len):
        n = min(self.pages_for(int(allocated_len)) * self.page_size, req_to_host_pool.shape[1])
        rows = req_to_host_pool[req_pool_idx, :n]
        return rows[rows >= 0]

    def release_request_rows(self, req_to_host_pool, req_to_host_pool_allocated_len,
                             req_pool_idx) -> int:
        """Free every page of a request's row and reset the row; returns pages freed."""
        rows = self.allocated_host_indices(
            req_to_host_pool, req_pool_idx, req_to_host_pool_allocated_len[req_pool_idx]
        )
        n = 0
        if rows.numel():
            page_starts = rows[rows % self.page_size == 0]
            n = int(page_starts.numel())
            self.free(page_starts)
        req_to_host_pool[req_pool_idx, :] = -1
        req_to_host_pool_allocated_len[req_pool_idx] = 0
        return n

    # ------------------------------------------------------- teardown
    def _registered_buffers(self) -> List[torch.Tensor]:
        return []

    def destroy(self) -> None:
        """Drain device copies, then unpin host memory. Idempotent."""
        if getattr(self, "_destroyed", False):
            return
        self._destroyed = True
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        for buf in self._registered_buffers():
            host_memory.release(buf)


class HiSparseMLAHostPool(PagedHostSlots, MLATokenToKVPoolHost):
    """Host mirror of a DSA/MLA device pool, ``layer_first``: ``kv_buffer[layer][row]``."""

    def __init__(
        self,
        device_pool,
        host_to_device_ratio: float = 2,
        host_size: int = 0,
        page_size: Optional[int] = None,
        layout: str = "layer_first",
        pin_memory: Optional[bool] = None,
        override_kv_cache_dim: Optional[int] = None,
        alloc_host_buffer: Optional[Callable[..., torch.Tensor]] = None,
    ):
        """``alloc_host_buffer(shape, dtype, pin=...)`` makes the host buffer
        (default :func:`host_memory.alloc_pinned`; the adapter passes a
        shared node-wide buffer with SGLANG_HISPARSE_SHARED_HOST_POOL=1)."""
        # Read by init_kv_buffer, which HostKVCache.__init__ calls.
        self._alloc_host_buffer = alloc_host_buffer or host_memory.alloc_pinned
        if layout != "layer_first":
            raise ValueError("HiSparse host pool supports layout='layer_first' only")
        if pin_memory is None:
            pin_memory = str(device_pool.device).startswith("cuda")
        super().__init__(
            device_pool=device_pool,
            host_to_device_ratio=host_to_device_ratio,
            host_size=host_size,
            page_size=page_size or device_pool.page_size,
            layout=layout,
            pin_memory=pin_memory,
            device="cpu",
            override_kv_cache_dim=override_kv_cache_dim
            if override_kv_cache_dim is not None
            else getattr(device_pool, "kv_cache_dim", None),
        )
        self.item_bytes = self.token_stride_size

    def init_kv_buffer(self):
        # MLATokenToKVPoolHost's layer_first layout, pinned our way.
        dims = (self.layer_num, self.size, 1, self.kv_cache_dim)
        self.token_stride_size = self.kv_cache_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        return self._alloc_host_buffer(dims, self.dtype, pin=self.pin_memory)

    def _registered_buffers(self):
        return [self.kv_buffer]

    def layer_rows(self, layer_id: int) -> torch.Tensor:
        """uint8 ``[rows, item_bytes]`` view of one layer (the kernel's host_kv)."""
        return _bytes_view(self.kv_buffer[layer_id], self.size)

    @staticmethod
    def device_layer_rows(device_pool, layer_id: int) -> torch.Tensor:
        buf = device_pool.kv_buffer[layer_id]
        return _bytes_view(buf, buf.shape[0])

    def _cpu_path(self, device_pool, *idx) -> bool:
        return not str(device_pool.device).startswith("cuda") and not any(
            _is_gpu_tensor(t) for t in idx
        )

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices,
                                     io_backend="kernel"):
        if host_indices.numel() == 0:
            return
        if self._cpu_path(device_pool, host_indices, device_indices):
            for layer in range(self.layer_num):
                _row_copy(self.kv_buffer[layer], host_indices,
                          device_pool.kv_buffer[layer], device_indices)
            return
        super().backup_from_device_all_layer(device_pool, host_indices, device_indices,
                                             io_backend)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id,
                                 io_backend="kernel"):
        if host_indices.numel() == 0:
            return
        if self._cpu_path(device_pool, host_indices, device_indices):
            _row_copy(device_pool.kv_buffer[layer_id], device_indices,
                      self.kv_buffer[layer_id], host_indices)
            return
        super().load_to_device_per_layer(device_pool, host_indices, device_indices,
                                         layer_id, io_backend)


# DeepSeek-V4 C4 page layout (0.5.13 jit_kernel deepseek_v4/kvcacheio.cuh).
C4_PAGE_SIZE = 64
C4_VALUE_BYTES = 576
C4_SCALE_BYTES = 8


def c4_page_bytes(page_size: int = C4_PAGE_SIZE, value_bytes: int = C4_VALUE_BYTES,
                  scale_bytes: int = C4_SCALE_BYTES) -> int:
    raw = page_size * (value_bytes + scale_bytes)
    return -(-raw // value_bytes) * value_bytes


def c4_token_byte_index(slots: torch.Tensor, page_size: int = C4_PAGE_SIZE,
                        value_bytes: int = C4_VALUE_BYTES,
                        scale_bytes: int = C4_SCALE_BYTES) -> torch.Tensor:
    """Flat byte offsets (within a ``[pages, page_bytes]`` buffer) of each token's
    value run then scale run: shape ``[n, value_bytes + scale_bytes]``."""
    slots = slots.to(torch.int64)
    pb = c4_page_bytes(page_size, value_bytes, scale_bytes)
    page, off = slots // page_size, slots % page_size
    base = page * pb
    v = (base + off * value_bytes)[:, None] + torch.arange(value_bytes, device=slots.device)
    s = (base + page_size * value_bytes + off * scale_bytes)[:, None] + torch.arange(
        scale_bytes, device=slots.device
    )
    return torch.cat([v, s], dim=1)


class HiSparseC4HostPool(PagedHostSlots, HostKVCache):
    """Host mirror of DeepSeek-V4 C4 layers (one ``[pages, page_bytes]`` uint8 per layer)."""

    def __init__(
        self,
        device_buffers: List[torch.Tensor],
        num_host_pages: int,
        page_size: int = C4_PAGE_SIZE,
        value_bytes: int = C4_VALUE_BYTES,
        scale_bytes: int = C4_SCALE_BYTES,
        pin_memory: Optional[bool] = None,
    ):
        # HostKVCache.__init__ sizes itself from an MLA-like device pool; the
        # C4 pool is sized in pages, so the fields are set here instead.
        self.device_buffers = list(device_buffers)
        self.layer_num = len(self.device_buffers)
        self.page_size = page_size
        self.value_bytes = value_bytes
        self.scale_bytes = scale_bytes
        self.page_bytes = c4_page_bytes(page_size, value_bytes, scale_bytes)
        self.item_bytes = self.page_bytes
        self.item_size_bytes = value_bytes + scale_bytes
        self.dtype = torch.uint8
        self.layout = "layer_first"
        self.device = "cpu"
        gpu = self.device_buffers[0].device if self.device_buffers else torch.device("cpu")
        self.gpu_device = gpu
        self.pin_memory = gpu.type == "cuda" if pin_memory is None else pin_memory
        self.size = int(num_host_pages) * page_size
        self.size_per_token = self.page_bytes // page_size
        self.start_layer, self.end_layer = 0, self.layer_num
        self.lock = threading.RLock()
        self._ptrs = None  # (device, host) layer base addresses on the GPU, see _layer_ptrs
        self.kv_buffer = [
            host_memory.alloc_pinned((int(num_host_pages), self.page_bytes), torch.uint8,
                                     pin=self.pin_memory)
            for _ in range(self.layer_num)
        ]
        self.clear()

    def _registered_buffers(self):
        return list(self.kv_buffer)

    def get_contiguous_buf_infos(self):
        """Per-layer page buffers, the transfer target of a PD decode
        (0.5.13 ``DecodePreallocQueue._init_kv_manager``, decode.py:392-399,
        registers them before the device tail). One item is one C4 page, as
        on the prefill's C4 device pool (the same padded page bytes), so a
        prefill page lands whole on a host page."""
        return ([buf.data_ptr() for buf in self.kv_buffer],
                [buf.nbytes for buf in self.kv_buffer],
                [self.page_bytes] * self.layer_num)

    def get_size_per_token(self):
        return self.size_per_token

    def get_ksize_per_token(self):
        return self.size_per_token

    def init_kv_buffer(self):
        return self.kv_buffer

    def get_data_page(self, index, flat: bool = True):
        raise NotImplementedError("HiSparse C4 host pool is not a HiCache storage pool")

    def get_dummy_flat_data_page(self):
        raise NotImplementedError("HiSparse C4 host pool is not a HiCache storage pool")

    def set_from_flat_data_page(self, index, data_page):
        raise NotImplementedError("HiSparse C4 host pool is not a HiCache storage pool")

    def _copy_tokens(self, src: torch.Tensor, dst: torch.Tensor, src_slots, dst_slots):
        s = c4_token_byte_index(src_slots, self.page_size, self.value_bytes, self.scale_bytes)
        d = c4_token_byte_index(dst_slots, self.page_size, self.value_bytes, self.scale_bytes)
        dst.view(-1)[d.reshape(-1)] = src.reshape(-1)[s.reshape(-1)].to(dst.device)

    def _gpu(self, *t) -> bool:
        return self.gpu_device.type == "cuda" or any(_is_gpu_tensor(x) for x in t)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices,
                                     io_backend="kernel"):
        if host_indices.numel() == 0:
            return
        if self._gpu(host_indices, device_indices):
            device_ptrs, host_ptrs = self._layer_ptrs()
            self._cuda_copy(device_ptrs, host_ptrs, device_indices, host_indices)
            return
        for layer in range(self.layer_num):
            self._copy_tokens(self.device_buffers[layer], self.kv_buffer[layer],
                              device_indices, host_indices)

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id,
                                 io_backend="kernel"):
        if host_indices.numel() == 0:
            return
        if self._gpu(host_indices, device_indices):
            device_ptrs, host_ptrs = self._layer_ptrs()
            self._cuda_copy(host_ptrs[layer_id : layer_id + 1],
                            device_ptrs[layer_id : layer_id + 1],
                            host_indices, device_indices)
            return
        self._copy_tokens(self.kv_buffer[layer_id], self.device_buffers[layer_id],
                          host_indices, device_indices)

    def _layer_ptrs(self):
        """``(device, host)`` per-layer base addresses as tensors on the GPU.

        Built at the first GPU copy, then reused: the buffers never move (the
        host buffers live as long as this pool, the device buffers as the
        device pool), so a copy in steady state does no host-to-device
        transfer for its pointer arrays (a layer's are slices of these)."""
        if self._ptrs is None:
            dev = self.gpu_device
            self._ptrs = tuple(
                torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=dev)
                for bufs in (self.device_buffers, self.kv_buffer)
            )
        return self._ptrs

    def _cuda_copy(self, src_ptrs, dst_ptrs, src_slots, dst_slots):
        """Token-granular C4 copy across layers by pointer arrays.

        Calls SGLang's ``transfer_cache_dsv4_mla`` (``sglang.jit_kernel.hisparse``;
        0.5.17: ``sglang.kernels.ops.kvcache.hisparse``)
        although we never call native HiSparse: despite its module it is a
        plain copy kernel (per token, the 576 B value run and the 8 B scale
        run from one page-padded C4 buffer to another, by per-layer pointer
        arrays) that reads no HiSparse state (no hot buffer, LRU or mapping).
        0.5.13 calls it the same way from ``DeepSeekV4PagedHostPool``
        (``memory_pool_host.py:2054``), the host pool its HiCache hybrid
        assembler builds too, for copies that are not whole pages. Our own
        copy of it would add nothing. tests/test_host_pool_gpu.py holds this
        path to the CPU path (``_copy_tokens``) byte for byte on the GPU
        (passed on the H200, 2026-12-04-s2).
        """
        from sglang_hisparse.adapter import releases

        dev = self.gpu_device
        releases.current.hisparse_ops().transfer_cache_dsv4_mla(
            src_ptrs=src_ptrs, dst_ptrs=dst_ptrs,
            src_indices=src_slots.to(device=dev, dtype=torch.int64),
            dst_indices=dst_slots.to(device=dev, dtype=torch.int64),
        )
