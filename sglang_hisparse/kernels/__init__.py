"""HiSparse swap-in kernels: CUDA (JIT through SGLang's loader) and a torch reference.

``swap_in`` / ``copy_planned`` launch the CUDA kernels, ``reference`` holds
the pure-torch versions (and the written-down semantics), and
``swap_in_selected`` picks one by the tensors' device. Importing this package
does not import SGLang; the first kernel build does.
"""

from sglang_hisparse.kernels import reference
from sglang_hisparse.kernels.reference import C4_ITEM_BYTES, C4_PAGE_BYTES, LAYOUTS
from sglang_hisparse.kernels.swap_in import (
    arrivals_workspace,
    compile_variants,
    copy_planned,
    default_block_size,
    default_blocks_per_req,
    default_hash_scale,
    PROBE_PHASES,
    new_probe,
    nvcc_available,
    probe_phases_us,
    swap_in,
    swap_in_selected,
)

__all__ = [
    "C4_ITEM_BYTES",
    "C4_PAGE_BYTES",
    "LAYOUTS",
    "PROBE_PHASES",
    "arrivals_workspace",
    "compile_variants",
    "copy_planned",
    "default_block_size",
    "default_blocks_per_req",
    "default_hash_scale",
    "new_probe",
    "nvcc_available",
    "probe_phases_us",
    "reference",
    "swap_in",
    "swap_in_selected",
]
