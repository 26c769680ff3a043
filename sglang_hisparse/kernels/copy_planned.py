"""Copy-only replay of a recorded swap-in miss plan (``jit_csrc/copy_planned.cuh``).

Layers that share one indexer see the same top-k, so the anchor layer's
plan (host row -> device row per miss, recorded by a swap-in given
``miss_src``/``miss_dst``/``miss_count``) is valid for them too and only the
bytes need to move. Used by the benchmark's gather floor and the tests today;
IndexShare prefetch is its serving user to come. The torch version is
:func:`sglang_hisparse.kernels.reference.copy_planned`.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_hisparse.kernels import _jit
from sglang_hisparse.kernels._validate import check_cuda, check_kv, check_miss_plan, check_num_real, fail
from sglang_hisparse.kernels.limits import layout_id

COPY_PLANNED_SOURCE = _jit.CSRC_DIR / "copy_planned.cuh"
# Offsets of all rows live in shared memory (mirrors the launcher's check).
MAX_PLANNED_ROWS = 12000


def copy_planned_module(item_bytes: int, lid: int):
    return _jit.load_module(
        "hisparse_plugin_copy_planned", COPY_PLANNED_SOURCE.name, "copy_planned",
        "hisparse_plugin::CopyPlanned", (item_bytes, lid),
    )


def variant_name(item_bytes: int, layout: str) -> str:
    return _jit.variant_name("copy_planned", item_bytes=item_bytes, layout=layout)


def copy_planned(
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    num_real_reqs: torch.Tensor,
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    *,
    layout: str = "rows",
    num_blocks: Optional[int] = None,
) -> None:
    """Replay a recorded miss plan on another layer's pools: for each real row
    b and m < miss_count[b], copy host row miss_src[b, m] to device row
    miss_dst[b, m]. ``num_blocks`` fixes the grid (default: one per SM)."""
    device = check_cuda("miss_src", miss_src, dtypes=(torch.int64,), ndim=2)
    check_miss_plan(miss_src, miss_dst, miss_count, device)
    check_num_real(num_real_reqs, device)
    bs = miss_src.size(0)
    if miss_count.size(0) != bs:
        fail("miss_count", f"expected {bs} entries, got {miss_count.size(0)}")
    if bs > MAX_PLANNED_ROWS:
        fail("miss_src", f"at most {MAX_PLANNED_ROWS} rows, got {bs}")
    lid = layout_id(layout)
    item_bytes = check_kv(layout, host_kv, device_kv, device)
    if num_blocks is None:
        num_blocks = _jit.sm_count(_jit.device_index(device))
    if bs == 0:
        return
    copy_planned_module(item_bytes, lid).copy_planned(
        miss_src, miss_dst, miss_count, num_real_reqs, host_kv, device_kv, int(num_blocks)
    )
