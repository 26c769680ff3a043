"""In-server exactness check of the swap-in (``jit_csrc/exactness_check.cuh``)
and its torch reference.

A debug aid: with ``SGLANG_HISPARSE_CHECK=1`` (``config.CHECK_ENV``) the coordinator calls
:func:`check_swap_in` right after each layer's swap-in. It verifies, for every
real batch row ``b`` (request ``r = req_pool_indices[b]``, ``L =
seq_lens[b]``, ``B = hot_buffer_size``) and every top-k entry ``j`` (``t =
top_k_tokens[b, j]``, valid iff ``0 <= t < min(L, host_locs.size(1))``),
that the row attention is about to read at ``out[b, j]`` holds the
authoritative KV of position ``t``:

1. resident request (``resident`` given, ``resident[r] != 0``):
   ``out[b, j] == token_to_row[req_to_token[r, t]]`` (kind 1);
2. newest position ``t == L - 1`` (not written through to host yet):
   ``out[b, j] == slot_locs[r, min(L - 1, B)]``, and for layout ``"rows"``,
   when ``req_to_token``/``token_to_row`` are given, that row is also
   ``token_to_row[req_to_token[r, L - 1]]``, the row the attention write
   path mapped (kind 2; C4's ``req_to_token`` holds full ids, so skipped);
3. every other valid entry: the bytes of device row ``out[b, j]`` equal the
   bytes of host row ``host_locs[r, t]`` (kind 3), in the layout's row
   geometry (C4: the token's 576 value and 8 scale bytes); ``out[b, j]`` or
   the host row negative or past its pool is kind 5 (missing row);
4. invalid entries must be -1 (kind 4).

A speculative verify step (``draft_tokens = n > 1``, the swap-in's union
layout): row ``b`` belongs to request ``g = b // n`` (``r =
req_pool_indices[g]``), its entries are valid below its own ``L =
seq_lens[b]``, and rule 2 covers every position ``t >= S`` this step
verifies (``S = seq_lens[g * n] - 1``): ``out[b, j]`` must be
``slot_locs[r, t]`` while ``S < B``, else ``slot_locs[r, B + t - S]``, and
the row the mapping gives ``t``. ``n = 1`` is the decode rules above.

Padding rows (``b >= num_real_reqs[0]``) are skipped. Results accumulate in
persistent buffers from :func:`new_check_state`: ``counters`` (int64 [2]) +=
(entries checked, mismatches), every entry of a real row counting as
checked; ``first`` (int64 [8]) keeps the first mismatch recorded, once:
[flag, req_pool_idx, layer_id, batch row, position, out row, expected (host
row for kinds 3 and 5, device row for 1 and 2, else -1), kind]. The CUDA
kernel does no host sync and no allocation (CUDA-graph capturable); with
several mismatches in one launch, which one it records first is whichever
warp got there first, while the reference records the lowest (b, j).
:func:`decode_first_mismatch` turns the record into a readable dict.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence, Union

import torch

from sglang_hisparse.kernels import _jit
from sglang_hisparse.kernels._validate import (
    check_kv,
    check_selection,
    check_tensor,
    fail,
    given_together,
)
from sglang_hisparse.kernels.limits import C4_TOKENS_PER_PAGE, LAYOUT_C4, LAYOUT_ROWS, layout_id
from sglang_hisparse.kernels.reference import read_rows, real_rows

CHECK_SOURCE = _jit.CSRC_DIR / "exactness_check.cuh"

# Mismatch kinds (struct CheckKind in exactness_check.cuh).
KIND_RESIDENT, KIND_NEWEST, KIND_BYTES, KIND_INVALID_NOT_MINUS_ONE, KIND_MISSING_ROW = 1, 2, 3, 4, 5
KIND_NAMES = {
    KIND_RESIDENT: "resident",
    KIND_NEWEST: "newest",
    KIND_BYTES: "bytes",
    KIND_INVALID_NOT_MINUS_ONE: "invalid_not_minus_one",
    KIND_MISSING_ROW: "missing_row",
}
# Slots of the first-mismatch record (struct FirstMismatch).
FIRST_FIELDS = ("flag", "req_pool_idx", "layer_id", "batch_row", "position", "out_row",
                "expected", "kind")
FIRST_SLOTS = len(FIRST_FIELDS)
# Threads per block of the kernel (kCheckThreads); one warp checks one entry.
CHECK_WARPS = 256 // 32


def new_check_state(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(counters int64 [2], first int64 [8]), zeroed, on ``device``: the
    persistent buffers :func:`check_swap_in` accumulates into."""
    return (torch.zeros(2, dtype=torch.int64, device=device),
            torch.zeros(FIRST_SLOTS, dtype=torch.int64, device=device))


def check_module(item_bytes: int, lid: int):
    return _jit.load_module(
        "hisparse_plugin_exactness_check", CHECK_SOURCE.name, "exactness_check",
        "hisparse_plugin::ExactnessCheck", (item_bytes, lid),
    )


def variant_name(item_bytes: int, layout: str) -> str:
    return _jit.variant_name("exactness_check", item_bytes=item_bytes, layout=layout)


def default_blocks_per_row(device: torch.device, batch: int, top_k: int) -> int:
    """About four blocks per SM over the batch (host reads are latency-bound,
    so many warps in flight), but no block without an entry to check."""
    sms = _jit.sm_count(_jit.device_index(device))
    return max(1, min(-(-4 * sms // max(batch, 1)), -(-top_k // CHECK_WARPS), 65535))


def check_swap_in(
    *,
    top_k_tokens: torch.Tensor,
    out: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_real_reqs: torch.Tensor,
    slot_locs: torch.Tensor,
    host_locs: torch.Tensor,
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    hot_buffer_size: int,
    layer_id: int,
    counters: torch.Tensor,
    first: torch.Tensor,
    layout: str = "rows",
    resident: Optional[torch.Tensor] = None,
    req_to_token: Optional[torch.Tensor] = None,
    token_to_row: Optional[torch.Tensor] = None,
    blocks_per_row: Optional[int] = None,
    draft_tokens: int = 1,
) -> None:
    """Check one layer's swap-in result (the rules: module docstring),
    accumulating into ``counters`` and ``first`` (:func:`new_check_state`):
    the CUDA kernel when ``top_k_tokens`` is on a GPU, else the torch
    reference (same counts). The arguments are the swap-in's, after it
    ran, plus ``hot_buffer_size`` (B, the LRU width) and ``layer_id`` (for
    the record); ``blocks_per_row`` tunes the CUDA grid; ``draft_tokens``
    rows per request (a verify step)."""
    a = SimpleNamespace(**locals())
    (_check_cuda if top_k_tokens.is_cuda else _check_reference)(a)


def _check_mapping(a) -> bool:
    mapping = given_together(req_to_token=a.req_to_token, token_to_row=a.token_to_row)
    if a.resident is not None and not mapping:
        raise ValueError("resident needs req_to_token and token_to_row")
    return mapping


def _check_cuda(a) -> None:
    ndt = int(a.draft_tokens)
    if ndt < 1:
        fail("draft_tokens", f"must be >= 1, got {ndt}")
    device, bs, top_k = check_selection(a.top_k_tokens, a.out, a.req_pool_indices, a.seq_lens,
                                        a.num_real_reqs, ndt)
    bs *= ndt  # batch rows
    check_tensor("slot_locs", a.slot_locs, dtypes=(torch.int32,), ndim=2, device=device)
    hot, width = int(a.hot_buffer_size), a.slot_locs.size(1)
    if not 1 <= hot < width:
        fail("hot_buffer_size", f"must be in [1, slot_locs.size(1)) = [1, {width}) "
                                f"(slot B holds the newest token), got {hot}")
    check_tensor("host_locs", a.host_locs, dtypes=(torch.int64,), ndim=2, device=device)
    lid = layout_id(a.layout)
    item_bytes = check_kv(a.layout, a.host_kv, a.device_kv, device)
    for name, t, n in (("counters", a.counters, 2), ("first", a.first, FIRST_SLOTS)):
        check_tensor(name, t, dtypes=(torch.int64,), ndim=1, device=device)
        if t.numel() != n:
            fail(name, f"expected {n} elements, got {t.numel()}")
    mapping = _check_mapping(a)
    max_reqs = a.slot_locs.size(0)
    if mapping:
        check_tensor("req_to_token", a.req_to_token, dtypes=(torch.int32,), ndim=2, device=device)
        check_tensor("token_to_row", a.token_to_row, dtypes=(torch.int64,), ndim=1, device=device)
    if a.resident is not None:
        check_tensor("resident", a.resident, dtypes=(torch.int32,), ndim=1, device=device)
    for name, t in (("req_to_token", a.req_to_token), ("resident", a.resident)):
        if t is not None and t.size(0) != max_reqs:
            fail(name, f"expected {max_reqs} rows (one per request slot), got {t.size(0)}")
    blocks = a.blocks_per_row
    if blocks is None:
        blocks = default_blocks_per_row(device, bs, top_k)
    elif not 1 <= int(blocks) <= 65535:
        raise ValueError(f"blocks_per_row must be in [1, 65535], got {blocks}")
    if bs == 0:
        return
    empty = a.top_k_tokens.new_empty(0)
    check_module(item_bytes, lid).exactness_check(
        a.top_k_tokens, a.out, a.req_pool_indices, a.seq_lens, a.num_real_reqs, a.slot_locs,
        a.host_locs, a.host_kv, a.device_kv,
        a.resident if a.resident is not None else empty,
        a.req_to_token if mapping else empty,
        a.token_to_row if mapping else empty,
        a.counters, a.first, hot, int(a.layer_id), int(blocks), ndt,
    )


def _mapped_rows(req_to_token: torch.Tensor, token_to_row: torch.Tensor, r: int,
                 positions: torch.Tensor) -> torch.Tensor:
    """token_to_row[req_to_token[r, t]] per position, -1 where there is none."""
    dev = positions.device
    width, size = req_to_token.size(1), token_to_row.numel()
    inside = (positions >= 0) & (positions < width)
    logical = req_to_token[r].to(dev, torch.int64)[positions.clamp(0, max(width - 1, 0))] \
        if width else torch.full_like(positions, -1)
    inside &= (logical >= 0) & (logical < size)
    rows = token_to_row.to(dev)[logical.clamp(0, max(size - 1, 0))] if size else torch.full_like(positions, -1)
    return torch.where(inside, rows.to(torch.int64), torch.full_like(positions, -1))


def _check_reference(a) -> None:
    """The torch check: the CUDA one's counts; records the lowest (b, j)
    mismatch as the first."""
    lid = layout_id(a.layout)
    mapping = _check_mapping(a)
    bs, top_k = a.top_k_tokens.shape
    dev = a.top_k_tokens.device
    hot = int(a.hot_buffer_size)
    per_row = C4_TOKENS_PER_PAGE if lid == LAYOUT_C4 else 1
    host_rows, device_rows = a.host_kv.size(0) * per_row, a.device_kv.size(0) * per_row
    max_ctx = a.host_locs.size(1)
    ndt = int(a.draft_tokens)
    real = real_rows(a.num_real_reqs, bs // ndt) * ndt
    reqs, lens = a.req_pool_indices.tolist(), a.seq_lens.tolist()
    minus = torch.full((top_k,), -1, dtype=torch.int64, device=dev)
    checked = bad = 0
    record = None
    for b in range(real):
        r, seq_len = int(reqs[b // ndt]), int(lens[b])
        committed = int(lens[b - b % ndt]) - 1  # S: positions >= S are this step's
        t = a.top_k_tokens[b].to(dev, torch.int64)
        o = a.out[b].to(dev, torch.int64)
        valid = (t >= 0) & (t < min(seq_len, max_ctx))
        kind = torch.zeros(top_k, dtype=torch.int64, device=dev)
        expected = minus.clone()
        kind[~valid & (o != -1)] = KIND_INVALID_NOT_MINUS_ONE
        if a.resident is not None and int(a.resident[r]) != 0:
            want = _mapped_rows(a.req_to_token, a.token_to_row, r, t)
            expected = torch.where(valid, want, expected)
            kind[valid & ((want < 0) | (o != want))] = KIND_RESIDENT
        else:
            # The newest position (decode) or those this step verifies.
            newest = valid & (t >= committed)
            width = a.slot_locs.size(1)
            slot = t if committed < hot else hot + t - committed
            inside = (slot >= 0) & (slot < width)
            newest_row = torch.where(
                inside, a.slot_locs[r].to(dev, torch.int64)[slot.clamp(0, width - 1)], minus)
            wrong_row = newest_row < 0
            if lid == LAYOUT_ROWS and mapping:
                wrong_row |= _mapped_rows(a.req_to_token, a.token_to_row, r, t) != newest_row
            expected[newest] = newest_row[newest]
            kind[newest & (wrong_row | (o != newest_row))] = KIND_NEWEST
            rest = valid & ~newest
            host = torch.where(rest, a.host_locs[r].to(dev)[t.clamp(0, max(max_ctx - 1, 0))], minus)
            expected[rest] = host[rest]
            missing = rest & ((o < 0) | (o >= device_rows) | (host < 0) | (host >= host_rows))
            kind[missing] = KIND_MISSING_ROW
            idx = (rest & ~missing).nonzero().squeeze(1)
            if idx.numel():
                want = read_rows(a.host_kv, host[idx], a.layout)
                got = read_rows(a.device_kv, o[idx], a.layout)
                differ = (want.to(got.device) != got).any(1).to(dev)
                kind[idx[differ]] = KIND_BYTES
        wrong = kind != 0
        checked += top_k
        n_wrong = int(wrong.sum())
        bad += n_wrong
        if record is None and n_wrong:
            j = int(wrong.nonzero()[0, 0])
            record = [1, r, int(a.layer_id), b, int(t[j]), int(o[j]), int(expected[j]), int(kind[j])]
    a.counters += torch.tensor([checked, bad], dtype=torch.int64, device=a.counters.device)
    if record is not None and int(a.first[0]) == 0:
        a.first.copy_(torch.tensor(record, dtype=torch.int64))


def decode_first_mismatch(first: Union[torch.Tensor, Sequence[int]]) -> Optional[dict]:
    """The first-mismatch record (the ``first`` tensor or its ``tolist()``) as
    a dict with a readable ``message``; None if nothing was recorded."""
    vals = [int(v) for v in (first.tolist() if isinstance(first, torch.Tensor) else first)]
    if len(vals) != FIRST_SLOTS:
        raise ValueError(f"first: expected {FIRST_SLOTS} values, got {len(vals)}")
    if vals[0] == 0:
        return None
    rec = dict(zip(FIRST_FIELDS[1:], vals[1:]))
    kind = rec["kind"]
    rec["kind_name"] = KIND_NAMES.get(kind, f"unknown({kind})")
    o, e, t = rec["out_row"], rec["expected"], rec["position"]
    what = {
        KIND_RESIDENT: f"resident request: out row {o}, its req_to_token/token_to_row mapping gives {e}",
        KIND_NEWEST: f"newest position: out row {o}, expected row {e} (slot_locs at min(L - 1, B), "
                     "also the mapped row)",
        KIND_BYTES: f"device row {o} does not hold the bytes of host row {e}",
        KIND_INVALID_NOT_MINUS_ONE: f"invalid entry: out is {o}, not -1",
        KIND_MISSING_ROW: f"no row to read: out row {o}, host row {e}",
    }.get(kind, f"out {o}, expected {e}")
    rec["message"] = (f"HiSparse exactness check: layer {rec['layer_id']}, batch row "
                      f"{rec['batch_row']} (request slot {rec['req_pool_idx']}), position {t}: {what}")
    return rec
