"""Copy-only replay of a recorded swap-in miss plan (``jit_csrc/copy_planned.cuh``).

Layers that share one indexer see the same top-k, so the anchor layer's
plan (host row -> device row per miss, recorded by a swap-in given
``miss_src``/``miss_dst``/``miss_count``) is valid for them too and only the
bytes need to move. Its serving user is the IndexShare prefetch
(:mod:`sglang_hisparse.engine.prefetch`: one replay per shared layer, on the
prefetch stream); the benchmark's gather floor uses it too. The torch
version is :func:`sglang_hisparse.kernels.reference.copy_planned`;
:func:`copy_planned_selected` picks by device.

A shared layer replays every decode step, so a launch checks its arguments
in full only the first time it sees their geometry (shapes, strides, dtypes,
the pools' addresses, the host pool's storage, whose pinning was checked),
as the swap-in does. CUDA-graph capturable: no allocation, no host sync, the
grid is fixed (one block per SM unless ``num_blocks``) and the real rows are
read on the device (``num_real_reqs``).

``threads`` picks the block shape (the header says why two): 512 (default,
the fastest replay of an otherwise idle GPU) or 32, one warp per block,
meant to fit beside the forward's kernels on their SMs (measured: it hides
less of them than 8 blocks of 512; the IndexShare prefetch's choice is
``engine.prefetch.ReplayGrid``).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from sglang_hisparse.kernels import _jit, reference
from sglang_hisparse.kernels._validate import check_cuda, check_kv, check_miss_plan, check_num_real, fail
from sglang_hisparse.kernels.limits import layout_id

COPY_PLANNED_SOURCE = _jit.CSRC_DIR / "copy_planned.cuh"
# Offsets of all rows live in shared memory (mirrors the launcher's check).
MAX_PLANNED_ROWS = 12000
# Block shapes the header instantiates (threads per block).
COPY_THREADS = (512, 32)


def copy_planned_module(item_bytes: int, lid: int, threads: int = 512):
    return _jit.load_module(
        "hisparse_plugin_copy_planned", COPY_PLANNED_SOURCE.name, "copy_planned",
        "hisparse_plugin::CopyPlanned", (item_bytes, lid, threads),
    )


def variant_name(item_bytes: int, layout: str, threads: int = 512) -> str:
    return _jit.variant_name("copy_planned", item_bytes=item_bytes, layout=layout,
                             **({} if threads == 512 else {"threads": threads}))


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
    threads: int = 512,
) -> None:
    """Replay a recorded miss plan on another layer's pools: for each real row
    b and m < miss_count[b], copy host row miss_src[b, m] to device row
    miss_dst[b, m]. ``num_blocks`` fixes the grid (default: one per SM),
    ``threads`` the block shape (512 or 32)."""
    try:
        key = (_geom(miss_src), _geom(miss_dst), _geom(miss_count), _geom(num_real_reqs),
               _pool_key(host_kv), _pool_key(device_kv), layout, num_blocks, threads)
        verdict = _VERDICTS.get(key)
        if verdict is not None and verdict[2] is not None \
                and verdict[2]() is not host_kv.untyped_storage():
            verdict = None  # a new host pool at an old address: check its pinning again
    except (AttributeError, TypeError):  # not tensors: the full check names the argument
        key = verdict = None
    if verdict is None:
        verdict = _validate(miss_src, miss_dst, miss_count, num_real_reqs, host_kv, device_kv,
                            layout, num_blocks, threads)
        if key is not None and not torch.cuda.is_current_stream_capturing():
            if len(_VERDICTS) >= 256:
                _VERDICTS.clear()
            _VERDICTS[key] = verdict
    module, blocks, _ = verdict
    if miss_src.size(0) == 0:
        return
    module.copy_planned(miss_src, miss_dst, miss_count, num_real_reqs, host_kv, device_kv, blocks)


def copy_planned_selected(*args, **kwargs) -> None:
    """Data-plane entry, same arguments as :func:`copy_planned`: the CUDA
    kernel when the plan is on a GPU, else the torch reference (same bytes)."""
    miss_src = kwargs["miss_src"] if "miss_src" in kwargs else args[0]
    if miss_src.is_cuda:
        copy_planned(*args, **kwargs)
    else:
        reference.copy_planned(*args, **kwargs)


_VERDICTS: dict = {}


def _geom(t):
    return (t.shape, t.stride(), t.dtype, t.device)


def _pool_key(t):
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _validate(miss_src, miss_dst, miss_count, num_real_reqs, host_kv, device_kv, layout,
              num_blocks, threads):
    """(module, grid, the checked host pool's storage or None) or a ValueError."""
    device = check_cuda("miss_src", miss_src, dtypes=(torch.int64,), ndim=2)
    check_miss_plan(miss_src, miss_dst, miss_count, device)
    check_num_real(num_real_reqs, device)
    bs = miss_src.size(0)
    if miss_count.size(0) != bs:
        fail("miss_count", f"expected {bs} entries, got {miss_count.size(0)}")
    if bs > MAX_PLANNED_ROWS:
        fail("miss_src", f"at most {MAX_PLANNED_ROWS} rows, got {bs}")
    if threads not in COPY_THREADS:
        fail("threads", f"must be one of {', '.join(map(str, COPY_THREADS))}, got {threads!r}")
    lid = layout_id(layout)
    item_bytes = check_kv(layout, host_kv, device_kv, device)
    if num_blocks is None:
        num_blocks = _jit.sm_count(_jit.device_index(device))
    elif not 1 <= int(num_blocks) <= (1 << 20):
        fail("num_blocks", f"must be in [1, {1 << 20}], got {num_blocks}")
    storage = None if host_kv.is_cuda else weakref.ref(host_kv.untyped_storage())
    module = copy_planned_module(item_bytes, lid, threads) if bs else None
    return module, int(num_blocks), storage
