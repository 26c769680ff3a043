"""Pure-torch reference of the HiSparse swap-in, and the definition of its semantics.

The CUDA kernels in ``jit_csrc/`` must produce exactly what this module
produces (outputs, KV bytes, slot tables, LRU order, miss plan), so that GPU
tests can compare byte for byte. The data plane also runs this directly when
its tensors live on the CPU. Works on CPU and CUDA tensors alike.

Per request and sparse layer there is a hot buffer of ``B = lru.size(1)``
slots plus a newest-token page starting at slot ``B``. ``slot_tokens[r, s]``
is the token position slot ``s`` holds (-1: empty), ``slot_locs[r, s]`` its
device row, ``lru[r]`` the slots ``0..B-1`` least-recently-used first,
``host_locs[r, pos]`` the host row of a position.

Rules, for batch row ``b`` (request ``r = req_pool_indices[b]``, ``L =
seq_lens[b]``, entries ``t = top_k_tokens[b, j]``):

1. Padding rows, ``b >= num_real_reqs[0]``: every output is -1, the miss
   count is 0, no state changes.
2. An entry is *valid* iff ``0 <= t < min(L, host_locs.size(1))``; invalid
   entries (the indexer pads with -1) output -1 and are otherwise ignored.
3. Short sequences, ``L <= B``: position == slot, so ``out = slot_locs[r, t]``;
   no IO, no state change, miss count 0.
4. Otherwise ``t == L - 1`` (the newest token) outputs ``slot_locs[r, B]``.
   Every other valid entry is a *candidate*; the first top-k index naming a
   position *owns* it, later duplicates output whatever the owner outputs.
5. Walking the LRU positions ``p = 0..B-1`` (slot ``lru[r, p]``), a slot
   whose token is a candidate position is a *hit*; all others are
   *evictable*. A hit outputs ``slot_locs`` of its slot (were a position
   held by several slots, the one at the largest ``p`` serves it).
6. Owned candidates with no hit are *misses*, numbered ``m = 0, 1, ...`` in
   top-k order of their owners. Miss ``m`` takes the ``m``-th evictable slot
   in LRU order (least recent first) as its victim: it outputs that slot's
   device row, the slot's token becomes the miss position, and the host row
   ``host_locs[r, t]`` is copied to device row ``slot_locs[r, victim]``.
   (Misses beyond the number of evictable slots, which needs a slot table
   holding a position twice, output -1 and are dropped.)
7. New LRU order: ``[evictable slots not used as victims, in old order] +
   [victim slots, in miss order] + [hit slots, in old order]``.
8. Resident requests (``resident[r] != 0``, when ``resident`` is given):
   the whole KV is on the device, so a valid entry outputs
   ``token_to_row[req_to_token[r, t]]`` (the request's logical slot of the
   position, then its device row); no IO, no state change, miss count 0.
   Rule 1 still applies first.
9. Miss plan, when requested: ``miss_src[b, m]`` = host row,
   ``miss_dst[b, m]`` = device row of miss ``m``, ``miss_count[b]`` = number
   of misses (entries past the count are left untouched).
10. Tally, when given: ``tally[0]`` grows by the number of valid entries
   and ``tally[1]`` by the number of misses of the real rows (int64; the
   data plane's running hit/miss counts, kept on the device).

Speculative verify (``draft_tokens = n > 1``, MTP/EAGLE with top-k 1): each
request has ``n`` consecutive batch rows, one per verified token, so
``top_k_tokens``, ``seq_lens`` and ``out`` have ``bs * n`` rows while
``req_pool_indices`` (and ``num_real_reqs``, the miss plan) count
requests. Row ``j`` of request ``g`` is batch row ``g * n + j`` and its
length ``L_j = seq_lens[g * n + j]`` is the indexer's (``S + j + 1``, with
``S = L_0 - 1`` the request's committed length: positions ``S .. S + n - 1``
are the tokens this step verifies, written by this forward). The rules
above apply to the request's *union* of entries, ``n * K`` of them in row
order, with these readings (``n = 1`` is exactly the rules above):

* validity (rule 2) uses the entry's own row length ``L_j``;
* short (rule 3) means ``S < B``: ``out = slot_locs[r, t]`` (the verified
  tokens sit at slot = position, up to ``B + n - 2``);
* the newest token (rule 4) becomes every verified position ``t >= S``:
  it outputs ``slot_locs[r, B + t - S]`` (so ``n`` must fit in the page);
* ownership, hits, misses, victims and the LRU order (rules 4-7) range
  over the union: a position several rows select is one candidate, owned
  by its first occurrence in row order, so it is read from one slot and
  copied at most once, and no miss evicts a slot any row of the request
  reads this step (a hot buffer of ``B >= n * K`` never runs out of
  victims);
* the miss plan (rule 9) is per request: ``miss_src[g, m]`` for the
  request's ``m``-th miss, ``m < n * K``.

Row layouts (``layout``): ``"rows"`` - a row is ``host_kv.size(1)`` bytes at
row index * stride; ``"dsv4_c4"`` (alias ``"c4"``) - DeepSeek-V4 C4 pages of
``C4_PAGE_BYTES``: token ``i`` is 576 value bytes at ``(i % 64) * 576`` and 8
scale bytes at ``64 * 576 + (i % 64) * 8`` of page ``i // 64``.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_hisparse.kernels.limits import (  # noqa: F401  (re-exported: the layout contract)
    C4_ITEM_BYTES,
    C4_PAGE_BYTES,
    C4_SCALE_BYTES,
    C4_SCALE_OFFSET,
    C4_TOKENS_PER_PAGE,
    C4_VALUE_BYTES,
    LAYOUTS,
    layout_id,
)


def _c4_byte_index(rows: torch.Tensor):
    """(page index, byte columns) addressing every byte of the C4 tokens
    ``rows``: a token's value bytes and its scale bytes sit apart in its page.
    (The rows layout needs no byte index: a token is a whole pool row.)"""
    page = rows // C4_TOKENS_PER_PAGE
    slot = rows % C4_TOKENS_PER_PAGE
    value = slot[:, None] * C4_VALUE_BYTES + torch.arange(C4_VALUE_BYTES, device=rows.device)
    scale = (
        C4_SCALE_OFFSET
        + slot[:, None] * C4_SCALE_BYTES
        + torch.arange(C4_SCALE_BYTES, device=rows.device)
    )
    return page[:, None], torch.cat([value, scale], dim=1)


def read_rows(pool: torch.Tensor, rows: torch.Tensor, layout: str = "rows") -> torch.Tensor:
    """The bytes of ``rows`` of a uint8 pool, one output row per token
    (``[n, row bytes]``, or ``[n, 584]`` for C4)."""
    rows = rows.to(device=pool.device, dtype=torch.int64).reshape(-1)
    if layout_id(layout) == LAYOUTS["rows"]:
        # Whole rows: a row gather (a per-byte one cost the CPU soak a third
        # of its run).
        return pool.index_select(0, rows)
    return pool[_c4_byte_index(rows)]


def write_rows(pool: torch.Tensor, rows: torch.Tensor, data: torch.Tensor, layout: str = "rows") -> None:
    rows = rows.to(device=pool.device, dtype=torch.int64).reshape(-1)
    if rows.numel() == 0:
        return
    index = rows if layout_id(layout) == LAYOUTS["rows"] else _c4_byte_index(rows)
    pool[index] = data.to(pool.device)


def copy_rows(
    host_kv: torch.Tensor,
    src_rows: torch.Tensor,
    device_kv: torch.Tensor,
    dst_rows: torch.Tensor,
    layout: str = "rows",
) -> None:
    """device_kv[dst_rows[i]] = host_kv[src_rows[i]] in the given layout."""
    layout_id(layout)
    if src_rows.numel() == 0:
        return
    write_rows(device_kv, dst_rows, read_rows(host_kv, src_rows, layout), layout)


def real_rows(num_real_reqs, bs: int) -> int:
    n = int(num_real_reqs.reshape(-1)[0]) if isinstance(num_real_reqs, torch.Tensor) else int(num_real_reqs)
    return max(0, min(n, bs))


def swap_in(
    top_k_tokens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_real_reqs: torch.Tensor,
    slot_tokens: torch.Tensor,
    slot_locs: torch.Tensor,
    lru: torch.Tensor,
    host_locs: torch.Tensor,
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    *,
    layout: str = "rows",
    miss_src: Optional[torch.Tensor] = None,
    miss_dst: Optional[torch.Tensor] = None,
    miss_count: Optional[torch.Tensor] = None,
    skip_io: bool = False,
    blocks_per_req: Optional[int] = None,
    block_size: Optional[int] = None,
    workspace: Optional[torch.Tensor] = None,
    resident: Optional[torch.Tensor] = None,
    req_to_token: Optional[torch.Tensor] = None,
    token_to_row: Optional[torch.Tensor] = None,
    tally: Optional[torch.Tensor] = None,
    draft_tokens: int = 1,
) -> torch.Tensor:
    """Reference swap-in; see the module docstring for the rules.

    Shapes (``n = draft_tokens``): top_k_tokens int32 [bs * n, K];
    req_pool_indices int32/int64 [bs]; seq_lens int32/int64 [bs * n];
    num_real_reqs int32 [1] (requests); slot_tokens, slot_locs int32
    [R, B + P]; lru int16 [R, B]; host_locs int64 [R, max_ctx]; host_kv /
    device_kv uint8 [rows, row bytes] (C4: [pages, C4_PAGE_BYTES]); out int32
    [bs * n, K] (allocated when None);
    optional miss plan: miss_src int64 [>= bs, >= n * K], miss_dst int32 (same
    shape), miss_count int32 [>= bs]; optional residency (rule 8): resident
    int32 [R], req_to_token int32 [R, ctx], token_to_row int64 [logical
    slots]; optional tally int64 [2] (rule 10). Mutates out, slot_tokens,
    lru, device_kv, the plan and the tally; returns out. ``blocks_per_req``, ``block_size``
    and ``workspace`` only tune the CUDA launch and are ignored here.
    """
    del blocks_per_req, block_size, workspace
    layout_id(layout)
    record = miss_src is not None
    if record != (miss_dst is not None) or record != (miss_count is not None):
        raise ValueError("miss_src, miss_dst and miss_count must be given together")
    if (resident is None) != (req_to_token is None) or (resident is None) != (token_to_row is None):
        raise ValueError("resident, req_to_token and token_to_row must be given together")
    n = int(draft_tokens)
    rows, top_k = top_k_tokens.shape
    bs = req_pool_indices.numel()
    hot = lru.size(1)
    if n < 1 or rows != bs * n or seq_lens.numel() != rows:
        raise ValueError(
            f"draft_tokens={n}: top_k_tokens needs {bs} x {n} rows and seq_lens one per row; "
            f"got {rows} rows and {seq_lens.numel()} lengths for {bs} requests")
    if hot + n > slot_locs.size(1):
        raise ValueError(f"draft_tokens={n} does not fit the {slot_locs.size(1) - hot}-slot "
                         "newest page (verified tokens past the buffer sit there)")
    if out is None:
        out = torch.empty((rows, top_k), dtype=torch.int32, device=top_k_tokens.device)
    max_ctx = host_locs.size(1)
    real = real_rows(num_real_reqs, bs)
    out[real * n:] = -1
    if record:
        miss_count[real:bs] = 0

    reqs = req_pool_indices.tolist()
    lens = seq_lens.tolist()
    dev = out.device
    for g in range(real):
        r = int(reqs[g])
        group = slice(g * n, (g + 1) * n)
        row_lens = torch.tensor(lens[group], dtype=torch.int64, device=dev)
        committed = int(lens[g * n]) - 1  # S: positions >= S are verified this step
        # The union of the request's rows, in row order.
        toks = top_k_tokens[group].to(device=dev, dtype=torch.int64).reshape(-1)
        limit = row_lens.clamp(max=max_ctx).repeat_interleave(top_k)
        valid = (toks >= 0) & (toks < limit)
        locs = slot_locs[r].to(dev)
        safe = torch.where(valid, toks, torch.zeros_like(toks))
        if tally is not None:
            tally[0] += valid.sum().to(tally.device)

        if resident is not None and int(resident[r]) != 0:  # rule 8
            res = token_to_row[req_to_token[r].to(dev)[safe].to(torch.int64)].to(torch.int32)
            out[group] = torch.where(valid, res, torch.full_like(res, -1)).view(n, top_k)
            if record:
                miss_count[g] = 0
            continue

        if committed < hot:  # rule 3
            res = torch.where(valid, locs[safe], torch.full_like(locs[safe], -1))
            out[group] = res.view(n, top_k)
            if record:
                miss_count[g] = 0
            continue

        newest = valid & (toks >= committed)
        cand = valid & ~newest
        cand_idx = cand.nonzero().squeeze(1)
        cand_tok = toks[cand_idx]
        uniq, inv = torch.unique(cand_tok, sorted=True, return_inverse=True)
        n_u = uniq.numel()
        owner = torch.full((n_u,), n * top_k, dtype=torch.int64, device=dev)
        owner = owner.scatter_reduce(0, inv, cand_idx, reduce="amin")

        old = lru[r].to(device=dev, dtype=torch.int64)
        held = slot_tokens[r].to(device=dev, dtype=torch.int64)[old]
        if n_u:
            at = torch.searchsorted(uniq, held).clamp(max=n_u - 1)
            is_hit = (uniq[at] == held) & (held >= 0)
        else:
            at = torch.zeros_like(held)
            is_hit = torch.zeros_like(held, dtype=torch.bool)
        positions = torch.arange(hot, device=dev)
        hit_pos = torch.full((n_u,), -1, dtype=torch.int64, device=dev)
        hit_pos = hit_pos.scatter_reduce(0, at[is_hit], positions[is_hit], reduce="amax")

        evict_slots = old[~is_hit]
        hit_slots = old[is_hit]
        n_evict = evict_slots.numel()
        miss_u = (hit_pos < 0).nonzero().squeeze(1)
        miss_u = miss_u[torch.argsort(owner[miss_u])]
        n_miss = min(miss_u.numel(), n_evict)
        kept_u = miss_u[:n_miss]
        victims = evict_slots[:n_miss]

        loc_u = torch.full((n_u,), -1, dtype=locs.dtype, device=dev)
        has_hit = hit_pos >= 0
        loc_u[has_hit] = locs[old[hit_pos[has_hit]]]
        loc_u[kept_u] = locs[victims]

        res = torch.full((n * top_k,), -1, dtype=out.dtype, device=dev)
        res[cand_idx] = loc_u[inv].to(out.dtype)
        res[newest] = locs[hot + toks[newest] - committed].to(out.dtype)
        out[group] = res.view(n, top_k)

        miss_tok = uniq[kept_u]
        src_rows = host_locs[r].to(dev)[miss_tok]
        dst_rows = locs[victims].to(torch.int64)
        slot_tokens[r, victims.to(slot_tokens.device)] = miss_tok.to(
            device=slot_tokens.device, dtype=slot_tokens.dtype
        )
        lru[r] = torch.cat([evict_slots[n_miss:], victims, hit_slots]).to(
            device=lru.device, dtype=lru.dtype
        )
        if not skip_io:
            copy_rows(host_kv, src_rows, device_kv, dst_rows, layout)
        if tally is not None:
            tally[1] += n_miss
        if record:
            miss_src[g, :n_miss] = src_rows.to(miss_src.device)
            miss_dst[g, :n_miss] = dst_rows.to(device=miss_dst.device, dtype=miss_dst.dtype)
            miss_count[g] = n_miss
    return out


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
    """Reference plan replay: for real row b and m < miss_count[b] (clamped
    to the plan width), device_kv[miss_dst[b, m]] = host_kv[miss_src[b, m]].
    (The grid and block shape move the same bytes.)"""
    del num_blocks, threads
    real = real_rows(num_real_reqs, miss_src.size(0))
    width = miss_src.size(1)
    counts = miss_count[:real].tolist()
    for b, n in enumerate(counts):
        n = max(0, min(int(n), width))
        if n:
            copy_rows(host_kv, miss_src[b, :n], device_kv, miss_dst[b, :n], layout)
