"""SGLang's own HiSparse data plane in the native comparison mode
(``SGLANG_HISPARSE_NATIVE=1``): what makes it measurable like ours.

* :func:`native_swap_in_selected_pages` - AROUND ``HiSparseCoordinator.
  swap_in_selected_pages`` (0.5.13 ``hisparse_coordinator.py:783``): under
  ``SGLANG_HISPARSE_SYNTHETIC_TOPK`` the indexer's top-k is replaced by the
  synthetic trace (``kernels/synthetic_top_k.py``) before SGLang's swap-in,
  exactly as our coordinator does before ours; otherwise a pass-through.
"""

from __future__ import annotations

import functools


@functools.cache
def _trace():
    from sglang_hisparse.kernels.synthetic_top_k import from_env

    return from_env()


def native_swap_in_selected_pages(original, self, req_pool_indices, compressed_seq_lens,
                                  top_k_result, layer_id):
    trace = _trace()
    if trace is not None:
        import torch

        from sglang_hisparse.kernels.synthetic_top_k import synthetic_top_k

        buf = getattr(self, "_hisparse_synthetic_top_k", None)
        if buf is None:  # one static buffer: CUDA graphs capture its address
            buf = self._hisparse_synthetic_top_k = torch.empty_like(self.top_k_device_locs_buffer)
        bs = req_pool_indices.size(0)
        top_k_result = synthetic_top_k(req_pool_indices, compressed_seq_lens, layer_id, trace,
                                       buf[:bs, :top_k_result.size(1)])
    return original(self, req_pool_indices, compressed_seq_lens, top_k_result, layer_id)
