"""What the swap-in kernel can run: size limits, shared-memory budget, defaults.

Torch-free and SGLang-free on purpose: ``--hisparse-config`` validation
(:mod:`sglang_hisparse.config`) imports this module to check a config
before anything heavy is loaded, and the launch wrappers check the same
rules, so the limits are stated once. The row-layout ids the CUDA templates
take (``LAYOUTS``) and DeepSeek-V4's C4 page geometry live here as well,
because they are part of the same contract with ``jit_csrc/``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

# --------------------------------------------------------------------------
# row layouts (mirror kv_rows.cuh)

# Layout name -> the id the CUDA templates take.
LAYOUTS = {"rows": 0, "dsv4_c4": 1, "c4": 1}
LAYOUT_ROWS = LAYOUTS["rows"]
LAYOUT_C4 = LAYOUTS["dsv4_c4"]

C4_TOKENS_PER_PAGE = 64
C4_VALUE_BYTES = 576
C4_SCALE_BYTES = 8
C4_ITEM_BYTES = C4_VALUE_BYTES + C4_SCALE_BYTES
C4_SCALE_OFFSET = C4_VALUE_BYTES * C4_TOKENS_PER_PAGE
C4_PAGE_BYTES = -(-C4_ITEM_BYTES * C4_TOKENS_PER_PAGE // C4_VALUE_BYTES) * C4_VALUE_BYTES


def layout_id(layout: str) -> int:
    try:
        return LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}") from None


# --------------------------------------------------------------------------
# swap-in sizes (mirror the static_asserts of swap_in.cuh)

# The kernel keeps one bit per buffer position a thread owns, in 32-bit masks.
MAX_POSITIONS_PER_THREAD = 32
# LRU slots are int16.
MAX_HOT_BUFFER_SIZE = 32767
# Whole warps, at least two (two warps run the block's two scans at once);
# 1024 is CUDA's limit on threads per block.
WARP_SIZE = 32
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 64, 1024

# Threads per swap-in block, for every size. The resolve is a chain of short
# per-thread loops between barriers, so its latency falls with every thread
# added: on an H200 (top_k 2048, hot buffer 4096) 1024 threads cut a 0%-miss
# call from 17.7 to 12.8 us and a batch-64 one from 25.6 to 19.3 us. A full
# block also caps registers at 64 a thread; the kernel fits. And it is the one
# size that serves every hot buffer up to MAX_HOT_BUFFER_SIZE (at most 32
# positions per thread).
DEFAULT_BLOCK_SIZE = 1024

# A block may use at most 227 KiB of shared memory (sm_90).
MAX_SMEM_BYTES = 227 * 1024

# Hash buckets per top-k entry (template kHashScale), widest first: the
# default is the first whose table fits a block's shared memory.
HASH_SCALES = (8, 4, 2)
MIN_HASH_SCALE = HASH_SCALES[-1]
# What the template accepts (SwapInSmem's static_assert); a tuning override.
ALLOWED_HASH_SCALES = (1, 2, 4, 8, 16)


def swap_in_smem_bytes(top_k: int, hot_buffer_size: int, hash_scale: int = MIN_HASH_SCALE) -> int:
    """Dynamic shared memory of one swap-in block (mirrors SwapInSmem)."""
    hash_size = 1 << max(1, (hash_scale * top_k - 1).bit_length())
    chunks = lambda n: -(-n // 32)  # noqa: E731
    return (
        8 * hash_size  # keys + values
        + 4 * top_k * 2  # resolution + miss tokens
        + 4 * (chunks(hot_buffer_size) + chunks(top_k) + 4)
        + 2 * hot_buffer_size  # slot owners, later the regrouped LRU
    )


@functools.cache  # read when a launch is first validated
def default_hash_scale(top_k: int, hot_buffer_size: int) -> int:
    """Buckets per top-k entry for the resolve's hash table: the widest of
    HASH_SCALES that fits shared memory. Fewer buckets mean longer probes;
    on an H200 (top_k 2048, buffer 4096) a 0%-miss call took 12.3 / 9.1 /
    8.7 us at batch 1 and 16.1 / 10.6 / 9.8 us at batch 64 with 2 / 4 / 8."""
    for scale in HASH_SCALES:
        if swap_in_smem_bytes(top_k, hot_buffer_size, scale) <= MAX_SMEM_BYTES:
            return scale
    return MIN_HASH_SCALE


def size_problem(
    top_k: int,
    hot_buffer_size: int,
    block_size: Optional[int] = None,
    *,
    draft_tokens: int = 1,
    hot_name: str = "hot_buffer_size",
    block_name: str = "block_size",
) -> Optional[str]:
    """Why the swap-in kernel cannot run these sizes, or None if it can.

    The one statement of the kernel's size limits, shared by the launch
    wrappers and by ``--hisparse-config`` validation, which passes its own
    names for the sizes (``device_buffer_size``, ``swap_in_block_size``) so
    the message names what the user wrote. ``block_size`` None:
    DEFAULT_BLOCK_SIZE. A speculative verify step (``draft_tokens`` > 1)
    resolves ``draft_tokens x top_k`` entries per request at once: the
    limits apply to that count.
    """
    hot = hot_buffer_size
    if top_k < 1:
        return f"top_k must be >= 1, got {top_k}"
    if draft_tokens < 1:
        return f"draft_tokens must be >= 1, got {draft_tokens}"
    entries = top_k * draft_tokens
    what = "top_k" if draft_tokens == 1 else f"draft_tokens x top_k ({draft_tokens} x {top_k})"
    if not entries <= hot <= MAX_HOT_BUFFER_SIZE:
        return (f"{hot_name} must be in [{what}, {MAX_HOT_BUFFER_SIZE}] (lru is int16), "
                f"got {hot} with {what} {entries}")
    smem = swap_in_smem_bytes(entries, hot)
    if smem > MAX_SMEM_BYTES:
        fits = [b for b in range(entries, MAX_HOT_BUFFER_SIZE + 1, 64)
                if swap_in_smem_bytes(entries, b) <= MAX_SMEM_BYTES]
        hint = (f"{hot_name} must be <= {fits[-1]} with {what} {entries}" if fits
                else f"{what} {entries} is too large for the swap-in kernel")
        return (f"{what} {entries} with {hot_name} {hot} needs {smem} B of shared memory "
                f"per block; the limit is {MAX_SMEM_BYTES}; {hint}")
    block = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if block % WARP_SIZE or not MIN_BLOCK_SIZE <= block <= MAX_BLOCK_SIZE:
        return (f"{block_name} must be a multiple of {WARP_SIZE} in [{MIN_BLOCK_SIZE}, "
                f"{MAX_BLOCK_SIZE}], got {block}")
    for name, size in ((hot_name, hot), (what, entries)):
        if math.ceil(size / block) > MAX_POSITIONS_PER_THREAD:
            least = 32 * math.ceil(math.ceil(size / MAX_POSITIONS_PER_THREAD) / 32)
            return (f"{block_name} {block} is too small for {name} {size}: at most "
                    f"{MAX_POSITIONS_PER_THREAD} slots per thread, so {block_name} "
                    f"must be >= {least}")
    return None


def hash_scale_problem(top_k: int, hot_buffer_size: int, hash_scale: int) -> Optional[str]:
    """Why an explicit hash scale (a tuning override) cannot run, or None."""
    if hash_scale not in ALLOWED_HASH_SCALES:
        allowed = ", ".join(map(str, ALLOWED_HASH_SCALES))
        return f"hash_scale must be one of {allowed}, got {hash_scale}"
    smem = swap_in_smem_bytes(top_k, hot_buffer_size, hash_scale)
    if smem > MAX_SMEM_BYTES:
        return (f"hash_scale {hash_scale} with top_k {top_k} and hot_buffer_size "
                f"{hot_buffer_size} needs {smem} B of shared memory; the limit is "
                f"{MAX_SMEM_BYTES}")
    return None


def item_bytes_problem(item_bytes: int, layout: str) -> Optional[str]:
    """Why rows of ``item_bytes`` cannot be moved in ``layout``, or None."""
    if layout_id(layout) == LAYOUT_C4:
        if item_bytes != C4_ITEM_BYTES:
            return (f"item_bytes must be {C4_ITEM_BYTES} (576 B value + 8 B scale) for "
                    f"layout 'dsv4_c4', got {item_bytes}")
    elif item_bytes <= 0 or item_bytes % 4:
        return f"item_bytes must be a positive multiple of 4, got {item_bytes}"
    return None
