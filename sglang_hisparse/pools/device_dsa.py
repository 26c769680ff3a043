"""GPU-side KV pool for HiSparse on DSA models (DeepSeek V3.2 / GLM-5 style).

The pool holds two kinds of per-layer buffers that live in *different* id
spaces (see ``allocator.py`` for the two spaces):

* ``kv_buffer`` (MLA latent + rope, the rows the sparse attention kernel
  reads) is sized for the *physical* space only, ``size + page_size`` rows.
  Every caller hands us *logical* locations (what ``req_to_token`` stores),
  so writes, reads and the attention page table go through
  ``mapping[logical] -> physical`` first;
* the indexer's ``index_k_with_scale_buffer`` is sized for the *logical*
  space (``host_to_device_ratio * size``). The top-k indexer scores every
  token of the context, not just the hot ones, so its keys must stay
  resident for all of them and are addressed by logical location unchanged.

The mapping tensor is owned by the allocator (``HiSparseDualAllocator``),
which hands us a ``weakref.proxy`` through :meth:`register_mapping`: the pool
must not keep the allocator's tensor alive, and a stale proxy fails loudly
instead of silently reading freed memory.

Buffer shapes and dtypes are exactly those of SGLang's ``DSATokenToKVPool``
(we only choose ``index_buf_size``), so flashmla / tilelang read
``kv_buffer`` with translated indices just as they would with 0.5.13's
``HiSparseDSATokenToKVPool``.

0.5.13 call sites served (grep of the 0.5.13 tree):

* ``model_runner_kv_cache_mixin.py:553-577`` constructs it (class REPLACE of
  ``HiSparseDSATokenToKVPool``), same keyword signature;
* ``layers/attention/dsa_backend.py:1507`` ->
  ``translate_loc_to_hisparse_device`` on the top-k page table (int32,
  padded with -1);
* the model's KV write (``set_mla_kv_buffer`` / ``set_kv_buffer``) and MHA
  prefill read (``get_mla_kv_buffer``) with logical ``out_cache_loc``;
* ``disaggregation/utils.py:650`` and ``hiradix_cache.py`` test
  ``isinstance(pool, DSATokenToKVPool)``: true, we subclass it;
* our allocator -> ``register_mapping``; our coordinator -> ``kv_buffer``,
  ``kv_cache_dim``, ``store_dtype``, ``page_size``, ``layer_num``,
  ``translate_loc_from_full_to_compressed``,
  ``full_to_hisparse_device_index_mapping`` (fallback when the allocator has
  none); 0.5.13's own coordinator/allocator also call
  ``translate_loc_from_full_to_hisparse_device`` and
  ``_translate_loc_to_hisparse_device``, kept so they keep working.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_hisparse.adapter.sglang_classes import DSATokenToKVPool


class HiSparseDSADevicePool(DSATokenToKVPool):
    """Drop-in replacement for 0.5.13 ``HiSparseDSATokenToKVPool``."""

    def __init__(
        self, size: int, page_size: int, kv_lora_rank: int, dtype: torch.dtype,
        qk_rope_head_dim: int, layer_num: int, device: str, index_head_dim: int,
        enable_memory_saver: bool, kv_cache_dim: int,
        start_layer: Optional[int] = None, end_layer: Optional[int] = None,
        host_to_device_ratio: int = 2,
    ):
        # Same parameters, order and defaults as 0.5.13's class: the model
        # runner passes ``size`` positionally and the rest by keyword.
        if int(host_to_device_ratio) < 1:
            raise ValueError(
                f"host_to_device_ratio must be >= 1, got {host_to_device_ratio}"
            )
        self.host_to_device_ratio = int(host_to_device_ratio)
        # Set before the buffers exist so a translate before the allocator
        # registered its mapping fails with our message, not AttributeError.
        self.full_to_hisparse_device_index_mapping = None

        # ``size`` is the physical row count and sizes kv_buffer; the indexer
        # cache alone is stretched over the logical space.
        super().__init__(
            size=size, page_size=page_size, dtype=dtype, device=device,
            kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
            kv_cache_dim=kv_cache_dim, index_head_dim=index_head_dim,
            layer_num=layer_num, start_layer=start_layer, end_layer=end_layer,
            enable_memory_saver=enable_memory_saver,
            index_buf_size=size * self.host_to_device_ratio,
        )
        # Bytes of one kv_buffer row (all of a token's latent KV in one layer).
        # store_dtype and dtype have the same width (fp8 is stored as uint8).
        self.bytes_per_token = self.kv_cache_dim * self.store_dtype.itemsize

    # --------------------------------------------------------- id translation
    def register_mapping(self, full_to_hisparse_device_index_mapping: torch.Tensor):
        """Called once by the allocator with a weak proxy of its mapping.

        The allocator's mapping ends with a -1 sentinel: indexing it with -1
        (the padding of attention page tables and the ``last_loc`` of a
        request without prefix) yields -1, so padding stays padding.
        """
        mapping = full_to_hisparse_device_index_mapping
        self.full_to_hisparse_device_index_mapping = mapping

    def translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor):
        """Logical locations -> physical kv_buffer rows (int64, same shape).

        A plain gather on purpose: it runs once per layer inside the CUDA
        graph of every decode step, so no masking or syncs here. -1 stays -1
        through the mapping's sentinel; other negative values are not
        expected (they would wrap like any Python index).
        """
        mapping = self.full_to_hisparse_device_index_mapping
        if mapping is None:
            raise RuntimeError(
                "HiSparseDSADevicePool: no logical->physical mapping registered; "
                "the HiSparse allocator must be built on this pool first"
            )
        return mapping[compressed_indices]

    # Aliases under the names 0.5.13's HiSparse allocator/coordinator use.
    # For DSA the "compressed" and "full" spaces are the same (compress ratio
    # 1); DeepSeek V4's C4 pool is where they differ.
    _translate_loc_to_hisparse_device = translate_loc_to_hisparse_device
    translate_loc_from_full_to_hisparse_device = translate_loc_to_hisparse_device

    def translate_loc_from_full_to_compressed(self, full_indices: torch.Tensor):
        return full_indices

    # ------------------------------------------------ latent KV (physical rows)
    # Only the latent KV is redirected; the indexer's K/scale writes
    # (set_index_k_scale_buffer, inherited) keep the logical location.
    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        super().set_kv_buffer(
            layer, self.translate_loc_to_hisparse_device(loc), cache_k, cache_v
        )

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope):
        super().set_mla_kv_buffer(
            layer, self.translate_loc_to_hisparse_device(loc), cache_k_nope, cache_k_rope
        )

    def get_mla_kv_buffer(self, layer, loc, dst_dtype: Optional[torch.dtype] = None):
        return super().get_mla_kv_buffer(
            layer, self.translate_loc_to_hisparse_device(loc), dst_dtype
        )

    # ------------------------------------------------------------ retraction
    # A retracted request's KV lives mostly in the host pool; the device pool
    # only holds its hot buffer, so a row-wise device snapshot would be wrong.
    # The only 0.5.13 caller (retraction under --disaggregation-mode decode)
    # goes through the allocator, which keeps the request's host rows instead
    # (disaggregation.py); fail loudly if anyone reaches the pool directly.
    def get_cpu_copy(self, indices, mamba_indices=None):
        raise NotImplementedError(
            "HiSparseDSADevicePool.get_cpu_copy: HiSparse keeps a request's KV in "
            "host memory with only a hot buffer on the GPU, so a device snapshot "
            "cannot be taken; retract through the HiSparse coordinator instead"
        )

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise NotImplementedError(
            "HiSparseDSADevicePool.load_cpu_copy: HiSparse restores KV from its "
            "host pool through the coordinator, not from a device snapshot"
        )
