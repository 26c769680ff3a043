"""HiSparse kernels: CUDA (``jit_csrc/``, JIT-built through SGLang's loader)
and their torch references.

One module per concept:

- :mod:`.limits` - what the swap-in can run (sizes, shared memory, defaults,
  row layouts); torch-free, read by ``--hisparse-config`` validation.
- :mod:`.swap_in` - the serving swap-in; :func:`swap_in_selected` is the
  data plane's one entry (the CUDA kernel for CUDA tensors, else
  :func:`.reference.swap_in`).
- :mod:`.copy_planned` - copy-only replay of a recorded miss plan.
- :mod:`.exactness` - the SGLANG_HISPARSE_CHECK check of a swap-in result
  (:func:`check_swap_in`, CUDA or torch by device).
- :mod:`.bench` - benchmark-only variants: the timing probe, hash-scale
  overrides.
- :mod:`.synthetic_top_k` - benchmark-only: a top-k trace of known locality
  in place of the indexer's (SGLANG_HISPARSE_SYNTHETIC_TOPK), CUDA or torch.
- :mod:`.variants` - :func:`compile_variants`, what a config needs built.
- :mod:`.reference` - the torch swap-in and the written-down semantics.

Importing this package imports neither torch nor SGLang (so
``sglang_hisparse.config`` can read :mod:`.limits`); the names below load
their module at first use, and the first kernel build imports SGLang.
"""

from __future__ import annotations

import importlib

from sglang_hisparse.kernels.limits import (
    C4_ITEM_BYTES,
    C4_PAGE_BYTES,
    DEFAULT_BLOCK_SIZE,
    HASH_SCALES,
    LAYOUTS,
    MAX_BLOCK_SIZE,
    MAX_HOT_BUFFER_SIZE,
    MAX_POSITIONS_PER_THREAD,
    MAX_SMEM_BYTES,
    MIN_BLOCK_SIZE,
    default_hash_scale,
    size_problem,
    swap_in_smem_bytes,
)

# name -> submodule that defines it (imported at first access)
_LAZY = {
    "swap_in_selected": "swap_in",
    "arrivals_workspace": "swap_in",
    "default_blocks_per_req": "swap_in",
    "compile_variants": "variants",
    "nvcc_available": "_jit",
    "check_swap_in": "exactness",
    "new_check_state": "exactness",
    "decode_first_mismatch": "exactness",
    "PROBE_PHASES": "bench",
    "new_probe": "bench",
    "probe_phases_us": "bench",
}
_SUBMODULES = ("bench", "copy_planned", "exactness", "limits", "reference", "swap_in",
               "synthetic_top_k", "variants")

__all__ = sorted([
    "C4_ITEM_BYTES", "C4_PAGE_BYTES", "DEFAULT_BLOCK_SIZE", "HASH_SCALES", "LAYOUTS",
    "MAX_BLOCK_SIZE", "MAX_HOT_BUFFER_SIZE", "MAX_POSITIONS_PER_THREAD", "MAX_SMEM_BYTES",
    "MIN_BLOCK_SIZE", "default_hash_scale", "size_problem", "swap_in_smem_bytes",
    *_LAZY, *_SUBMODULES,
])


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
