"""Argument checks shared by the launch wrappers: a ValueError names the
offending argument and what it must be, before anything is launched."""

from __future__ import annotations

from typing import Optional

import torch

from sglang_hisparse.kernels.limits import (
    C4_ITEM_BYTES,
    C4_PAGE_BYTES,
    LAYOUT_C4,
    layout_id,
)


def fail(name: str, what: str) -> None:
    raise ValueError(f"{name}: {what}")


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtypes: tuple[torch.dtype, ...],
    ndim: int,
    device: Optional[torch.device] = None,
    inner_contiguous: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        fail(name, f"dtype must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != ndim:
        fail(name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        fail(name, f"must be on {device}, got {t.device}")
    if inner_contiguous and t.dim() and t.size(-1) > 1 and t.stride(-1) != 1:
        fail(name, f"last dim must be contiguous, got strides {t.stride()}")


def check_cuda(name: str, t: torch.Tensor, *, dtypes: tuple[torch.dtype, ...], ndim: int) -> torch.device:
    """The first argument of a launch: a CUDA tensor, whose device the rest must share."""
    check_tensor(name, t, dtypes=dtypes, ndim=ndim)
    if not t.is_cuda:
        fail(name, f"must be a CUDA tensor, got {t.device}")
    return t.device


def check_num_real(num_real_reqs: torch.Tensor, device: torch.device) -> None:
    check_tensor("num_real_reqs", num_real_reqs, dtypes=(torch.int32,), ndim=1, device=device)
    if num_real_reqs.numel() != 1:
        fail("num_real_reqs", f"expected 1 element, got {num_real_reqs.numel()}")


def check_batch_index(name: str, t: torch.Tensor, bs: int, device: torch.device,
                      batch_of: str = "top_k_tokens") -> None:
    """A per-row index (request slots, sequence lengths): int32 or int64 [bs]."""
    check_tensor(name, t, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
    if t.size(0) != bs:
        fail(name, f"expected {bs} entries (batch of {batch_of}), got {t.size(0)}")


def check_miss_plan(miss_src: torch.Tensor, miss_dst: torch.Tensor, miss_count: torch.Tensor,
                    device: torch.device) -> None:
    """A swap-in miss plan: miss_src int64 and miss_dst int32 of one 2-D
    shape, miss_count int32 [rows], all on ``device``. (How many rows and
    columns it needs is the caller's.)"""
    check_tensor("miss_src", miss_src, dtypes=(torch.int64,), ndim=2, device=device)
    check_tensor("miss_dst", miss_dst, dtypes=(torch.int32,), ndim=2, device=device)
    check_tensor("miss_count", miss_count, dtypes=(torch.int32,), ndim=1, device=device)
    if miss_src.shape != miss_dst.shape:
        fail("miss_dst", f"shape {tuple(miss_dst.shape)} differs from miss_src's {tuple(miss_src.shape)}")


def check_selection(top_k_tokens, out, req_pool_indices, seq_lens, num_real_reqs,
                    draft_tokens: int = 1) -> tuple[torch.device, int, int]:
    """A swap-in's batch: top_k_tokens int32 [bs * n, K] on a GPU, out int32
    [bs * n, K], req_pool_indices int32 or int64 [bs], seq_lens int32 or int64
    [bs * n], num_real_reqs int32 [1], all on one device (``n = draft_tokens``
    rows per request; n > 1 is a speculative verify step). Returns (device,
    bs, K)."""
    device = check_cuda("top_k_tokens", top_k_tokens, dtypes=(torch.int32,), ndim=2)
    rows, top_k = top_k_tokens.shape
    check_tensor("out", out, dtypes=(torch.int32,), ndim=2, device=device)
    if tuple(out.shape) != (rows, top_k):
        fail("out", f"expected shape {(rows, top_k)}, got {tuple(out.shape)}")
    if rows % draft_tokens:
        fail("top_k_tokens", f"{rows} rows are not whole requests of draft_tokens={draft_tokens}")
    bs = rows // draft_tokens
    check_batch_index("req_pool_indices", req_pool_indices, bs, device,
                      "top_k_tokens" if draft_tokens == 1 else
                      f"top_k_tokens: {rows} rows / draft_tokens={draft_tokens}")
    check_batch_index("seq_lens", seq_lens, rows, device)
    check_num_real(num_real_reqs, device)
    return device, bs, top_k


def check_kv(layout: str, host_kv: torch.Tensor, device_kv: torch.Tensor, device: torch.device) -> int:
    """Validates both KV pools; returns the row bytes (template item size)."""
    check_tensor("host_kv", host_kv, dtypes=(torch.uint8,), ndim=2)
    check_tensor("device_kv", device_kv, dtypes=(torch.uint8,), ndim=2, device=device)
    if host_kv.is_cuda:
        if host_kv.device != device:
            fail("host_kv", f"must be pinned CPU memory or on {device}, got {host_kv.device}")
    elif not torch.cuda.is_current_stream_capturing() and not host_kv.is_pinned():
        # (the pointer query behind is_pinned is skipped while capturing)
        fail("host_kv", "CPU tensor must be pinned (page-locked) for device access")
    if host_kv.size(1) != device_kv.size(1):
        fail("device_kv", f"row bytes {device_kv.size(1)} differ from host_kv's {host_kv.size(1)}")
    if layout_id(layout) == LAYOUT_C4:
        if host_kv.size(1) != C4_PAGE_BYTES:
            fail("host_kv", f"dsv4_c4 pools are [pages, {C4_PAGE_BYTES}] bytes, got {tuple(host_kv.shape)}")
        item_bytes, vec = C4_ITEM_BYTES, 16
    else:
        item_bytes = host_kv.size(1)
        if item_bytes <= 0 or item_bytes % 4:
            fail("host_kv", f"row bytes must be a positive multiple of 4, got {item_bytes}")
        vec = 16 if item_bytes % 16 == 0 else 8 if item_bytes % 8 == 0 else 4
    for name, t in (("host_kv", host_kv), ("device_kv", device_kv)):
        if t.data_ptr() % vec or (t.size(0) > 1 and t.stride(0) % vec):
            fail(name, f"base address and row stride must be multiples of {vec} bytes (stride {t.stride(0)})")
    return item_bytes


def given_together(**optional) -> bool:
    """True if every optional argument is given, False if none is; else an error."""
    given = [v is not None for v in optional.values()]
    if any(given) and not all(given):
        names = list(optional)
        raise ValueError(f"{', '.join(names[:-1])} and {names[-1]} must be given together")
    return all(given)
