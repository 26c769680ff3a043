"""DeepSeek-V4 HiSparse: the C4 device pool, where only hot buffers live.

DeepSeek-V4 keeps three kinds of attention KV: a sliding window (SWA), a C4
pool (one compressed token per 4 tokens) and a C128 pool. HiSparse only
touches C4: its logical id space (``c4_logical_size`` = full / 4) is backed
by host memory and only a small hot buffer per request lives in the C4
*device* pool, which is ``host_to_device_ratio`` times smaller.

Id spaces (the allocator, :mod:`sglang_hisparse.pools.allocator_c4`, owns
the mapping between them):

* *full* - what ``req_to_token`` stores (the SWA allocator's full space);
* *compressed* - ``full // 4`` for the full ids whose token closes a group
  of 4 (``(full + 1) % 4 == 0``); it indexes the C4 mapping;
* *C4 row* - a row of :class:`DSV4C4DevicePool` (``c4_page_size`` rows per
  page, page 0 is the padding sink).

``mapping[compressed] -> C4 row`` (0 = unmapped, a trailing -1 so that the
compressed id -1 of a request without prefix maps to -1) is owned by the
allocator and registered into this pool, which translates every C4 write
location through it.

Drop-in (class REPLACE) for 0.5.13
``deepseek_v4_memory_pool.HiSparseC4DevicePool`` - constructed by
``DeepSeekV4TokenToKVPool.__init__`` (``deepseek_v4_memory_pool.py:470``, a
module-global lookup at call time, so the rebound name is ours). Read by
``compressor_v2.py:509-515`` and ``dsv4/indexer.py:629``
(``translate_loc_to_hisparse_device``), ``DeepSeekV4TokenToKVPool``
(``set_key_buffer``/``set_key_buffer_fused``/``get_key_buffer``,
``page_size``, ``kv_buffer``), our coordinator and C4 host pool
(``kv_buffer``, ``kv_cache_total_dim``, ``store_dtype``, ``layer_num``,
``translate_loc_from_full_to_compressed``).
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_hisparse.adapter.sglang_classes import DeepSeekV4SingleKVPool

# C4 layers compress 4 consecutive tokens into one.
C4_RATIO = 4


class DSV4C4DevicePool(DeepSeekV4SingleKVPool):
    """The C4 KV pool of a HiSparse DeepSeek-V4 model: only hot buffers live here.

    Storage is the plain DeepSeek-V4 single pool (``[pages, padded page
    bytes]`` uint8 per C4 layer); what HiSparse adds is the translation of
    every write location from the compressed id space to a C4 row.
    """

    compress_ratio = C4_RATIO

    def __init__(
        self, size: int, page_size: int, dtype: torch.dtype,
        qk_nope_head_dim: int, qk_rope_head_dim: int, layer_num: int, device: str,
        enable_memory_saver: bool, start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
    ):
        super().__init__(
            size, page_size, dtype, qk_nope_head_dim, qk_rope_head_dim, layer_num,
            device, enable_memory_saver, start_layer, end_layer,
        )
        # Per-layer base addresses, as the 0.5.13 pool exposes them (SGLang's
        # paged host pool transfer kernels take them).
        self.data_ptrs = torch.tensor(
            [buf.data_ptr() for buf in self.kv_buffer], dtype=torch.uint64, device=self.device
        )
        # Set by the allocator (register_mapping) right after construction.
        self.full_to_hisparse_device_index_mapping: Optional[torch.Tensor] = None

    def register_mapping(self, mapping: torch.Tensor) -> None:
        self.full_to_hisparse_device_index_mapping = mapping

    # ------------------------------------------------------------ id spaces
    def translate_loc_from_full_to_compressed(self, full_indices: torch.Tensor) -> torch.Tensor:
        """Compressed ids of the full ids that close a group of 4 (others dropped)."""
        closes_group = (full_indices + 1) % C4_RATIO == 0
        return full_indices[closes_group] // C4_RATIO

    def _translate_loc_to_hisparse_device(self, compressed: torch.Tensor) -> torch.Tensor:
        """C4 rows (int64) of compressed ids."""
        return self.full_to_hisparse_device_index_mapping[compressed]

    def translate_loc_to_hisparse_device(self, compressed: torch.Tensor) -> torch.Tensor:
        """C4 rows as int32: what the store / compress / FlashMLA kernels take."""
        return self._translate_loc_to_hisparse_device(compressed).to(torch.int32)

    def translate_loc_from_full_to_hisparse_device(self, full_indices: torch.Tensor) -> torch.Tensor:
        return self._translate_loc_to_hisparse_device(
            self.translate_loc_from_full_to_compressed(full_indices)
        )

    # --------------------------------------------------------------- writes
    # DeepSeekV4TokenToKVPool hands compressed ids; storage wants C4 rows.
    def set_key_buffer(self, layer_id: int, loc: torch.Tensor, cache_nope_fp8_rope_bf16_pack):
        rows = self.translate_loc_to_hisparse_device(loc)
        super().set_key_buffer(layer_id, rows, cache_nope_fp8_rope_bf16_pack)

    def set_key_buffer_fused(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        rows = self.translate_loc_to_hisparse_device(loc)
        return super().set_key_buffer_fused(layer_id, rows, cache_k)

    # Hot buffers hold a moving subset of a request's tokens: a CPU snapshot
    # of them (retraction offload) would not restore a request.
    def get_cpu_copy(self, indices, mamba_indices=None):
        raise NotImplementedError("the HiSparse C4 device pool cannot be copied to CPU")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise NotImplementedError("the HiSparse C4 device pool cannot be loaded from CPU")
