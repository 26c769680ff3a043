"""Builders of consistent swap-in inputs, shared by the kernel test modules.

A case is a batch of requests with hot-buffer state that a real HiSparse
step could have left behind: distinct device rows per slot, resident slots
holding their token's bytes (so hits are byte-correct in place), the newest
token at slot B, an LRU permutation, and a top-k mixing hits, misses, the
newest token, -1 padding and (optionally) duplicates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang_hisparse.kernels.reference import (
    C4_PAGE_BYTES,
    C4_TOKENS_PER_PAGE,
    read_rows,
    write_rows,
)

STATE = ("slot_tokens", "lru", "device_kv", "out")


@dataclass
class SwapInCase:
    top_k_tokens: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    num_real_reqs: torch.Tensor
    slot_tokens: torch.Tensor
    slot_locs: torch.Tensor
    lru: torch.Tensor
    host_locs: torch.Tensor
    host_kv: torch.Tensor
    device_kv: torch.Tensor
    out: torch.Tensor
    layout: str = "rows"
    # Rows per request: > 1 for a speculative verify step (make_verify_case).
    draft_tokens: int = 1

    def args(self) -> tuple:
        return (
            self.top_k_tokens,
            self.req_pool_indices,
            self.seq_lens,
            self.num_real_reqs,
            self.slot_tokens,
            self.slot_locs,
            self.lru,
            self.host_locs,
            self.host_kv,
            self.device_kv,
            self.out,
        )

    def clone(self, device: Optional[str] = None, pin_host: bool = False) -> "SwapInCase":
        """Deep copy; ``device`` moves everything but host_kv (kept on CPU)."""
        fields = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                if f.name == "host_kv":
                    v = v.clone().pin_memory() if pin_host else v.clone()
                else:
                    v = v.to(device).clone() if device is not None else v.clone()
            fields[f.name] = v
        return SwapInCase(**fields)


def _row_bytes(layout: str, item_bytes: int) -> int:
    return C4_PAGE_BYTES if layout == "dsv4_c4" else item_bytes


def _pool(n_rows: int, layout: str, item_bytes: int, gen: torch.Generator) -> torch.Tensor:
    if layout == "dsv4_c4":
        n_pages = -(-n_rows // C4_TOKENS_PER_PAGE)
        return torch.randint(0, 256, (n_pages, C4_PAGE_BYTES), dtype=torch.uint8, generator=gen)
    return torch.randint(0, 256, (n_rows, item_bytes), dtype=torch.uint8, generator=gen)


def make_case(
    *,
    seq_lens: Sequence[int],
    top_k: int,
    hot: int,
    page: int = 4,
    miss_rate: float = 0.3,
    item_bytes: int = 64,
    layout: str = "rows",
    num_real: Optional[int] = None,
    seed: int = 0,
    index_dtype: torch.dtype = torch.int64,
    req_dtype: torch.dtype = torch.int64,
    pad_top_k: int = 0,
    duplicates: int = 0,
    include_newest: bool = True,
    empty_slots: int = 0,
    host_rows: Optional[int] = None,
    spare_reqs: int = 3,
) -> SwapInCase:
    """A random but self-consistent batch (all tensors on CPU).

    ``pad_top_k`` -1 entries and ``duplicates`` repeated entries are placed
    at random top-k indices of long requests; ``empty_slots`` buffer slots
    per long request hold no token. Host rows are drawn from a pool of
    ``host_rows`` rows (shared between tokens, which the kernel allows);
    device rows are distinct for every slot.
    """
    gen = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    width = hot + page
    max_reqs = bs + spare_reqs
    max_ctx = max(max(seq_lens), 1) + 5
    n_host = host_rows or min(max_ctx * 2, 1 << 16)
    if layout == "dsv4_c4":
        item_bytes = 584

    reqs = torch.randperm(max_reqs, generator=gen)[:bs]
    n_dev = max_reqs * width + 17
    dev_perm = torch.randperm(n_dev, generator=gen).to(torch.int32)
    slot_locs = dev_perm[: max_reqs * width].reshape(max_reqs, width).clone()
    slot_tokens = torch.full((max_reqs, width), -1, dtype=torch.int32)
    lru = torch.stack([torch.randperm(hot, generator=gen) for _ in range(max_reqs)]).to(torch.int16)
    host_locs = torch.randint(0, n_host, (max_reqs, max_ctx), generator=gen, dtype=torch.int64)
    host_kv = _pool(n_host, layout, item_bytes, gen)
    device_kv = _pool(n_dev, layout, item_bytes, gen)

    def place(r: int, slots: torch.Tensor, toks: torch.Tensor) -> None:
        """Slots hold these tokens, with the right bytes in their device rows."""
        slot_tokens[r, slots] = toks.to(torch.int32)
        rows = read_rows(host_kv, host_locs[r, toks.long()], layout)
        write_rows(device_kv, slot_locs[r, slots].long(), rows, layout)

    for b, seq_len in enumerate(seq_lens):
        r = int(reqs[b])
        if seq_len <= hot:
            toks = torch.arange(seq_len)
            place(r, toks, toks)
            lru[r] = torch.arange(hot, dtype=torch.int16)
            continue

        newest = seq_len - 1
        older = torch.randperm(newest, generator=gen)
        n_res = hot - empty_slots
        slots = torch.randperm(hot, generator=gen)[:n_res]
        place(r, slots, older[:n_res])
        place(r, torch.tensor([hot]), torch.tensor([newest]))

    top = torch.full((bs, top_k), -1, dtype=torch.int32)
    case = SwapInCase(
        top_k_tokens=top,
        req_pool_indices=reqs.to(req_dtype),
        seq_lens=torch.tensor(seq_lens, dtype=index_dtype),
        num_real_reqs=torch.tensor([bs if num_real is None else num_real], dtype=torch.int32),
        slot_tokens=slot_tokens,
        slot_locs=slot_locs,
        lru=lru,
        host_locs=host_locs,
        host_kv=host_kv,
        device_kv=device_kv,
        out=torch.full((bs, top_k), -7, dtype=torch.int32),
        layout=layout,
    )
    refresh_top_k(
        case,
        seed=seed + 1,
        miss_rate=miss_rate,
        pad_top_k=pad_top_k,
        duplicates=duplicates,
        include_newest=include_newest,
    )
    return case


def graph_case(seed: int, hot: int = 1024, top_k: int = 512) -> SwapInCase:
    """The batch the CUDA-graph tests capture: 8 requests, short and long,
    int32 indices as SGLang's graph runner passes them."""
    lens = [hot * 6, hot // 2, hot * 3, hot + 1, hot * 10, hot, 5000, 7000]
    return make_case(seq_lens=lens, top_k=top_k, hot=hot, page=64, miss_rate=0.5,
                     item_bytes=1152, seed=seed, index_dtype=torch.int32, req_dtype=torch.int32)


def refresh_top_k(
    case: SwapInCase,
    *,
    seed: int,
    miss_rate: float = 0.3,
    pad_top_k: int = 0,
    duplicates: int = 0,
    include_newest: bool = True,
) -> None:
    """Draw a new top-k for every row from the case's current slot state:
    ``miss_rate`` of the selected positions are not resident."""
    gen = torch.Generator().manual_seed(seed)
    bs, top_k = case.top_k_tokens.shape
    hot = case.lru.size(1)
    top = torch.full((bs, top_k), -1, dtype=torch.int32)
    st = case.slot_tokens.cpu()
    for b in range(bs):
        r, seq_len = int(case.req_pool_indices[b]), int(case.seq_lens[b])
        if seq_len <= hot:
            n = min(top_k, seq_len)
            pick = torch.randperm(seq_len, generator=gen)[:n].to(torch.int32)
            at = torch.randperm(top_k, generator=gen)[:n]
            top[b, at] = pick
            continue
        newest = seq_len - 1
        held = st[r, :hot].long()
        resident = held[(held >= 0) & (held < newest)]
        is_res = torch.zeros(seq_len, dtype=torch.bool)
        is_res[resident] = True
        is_res[newest] = True
        absent = (~is_res).nonzero().squeeze(1)
        n_res = resident.numel()

        n_sel = top_k - pad_top_k - duplicates
        n_new = 1 if include_newest and n_sel > 0 else 0
        n_miss = min(int(round(miss_rate * (n_sel - n_new))), absent.numel())
        n_hit = min(n_sel - n_new - n_miss, n_res)
        n_miss = min(n_sel - n_new - n_hit, absent.numel())
        chosen = torch.cat(
            [
                resident[torch.randperm(n_res, generator=gen)[:n_hit]],
                absent[torch.randperm(absent.numel(), generator=gen)[:n_miss]],
                torch.full((n_new,), newest, dtype=torch.int64),
            ]
        )
        chosen = chosen[torch.randperm(chosen.numel(), generator=gen)]
        if duplicates and chosen.numel():
            dup = chosen[torch.randint(0, chosen.numel(), (duplicates,), generator=gen)]
            chosen = torch.cat([chosen, dup])
        at = torch.randperm(top_k, generator=gen)[: chosen.numel()]
        top[b, at] = chosen.to(torch.int32)
    case.top_k_tokens.copy_(top.to(case.top_k_tokens.device))


def make_verify_case(*, committed: Sequence[int], draft_tokens: int, top_k: int, hot: int,
                     overlap: float = 0.6, seed: int = 0, **kw) -> SwapInCase:
    """A speculative verify step: request ``b`` has committed ``committed[b]``
    tokens (S) and verifies positions ``S .. S + n - 1``, one batch row each
    (row ``j`` of length ``S + j + 1``). The verified tokens' KV is in
    place, as the verify forward leaves it: at slot = position for a short
    request (``S < hot``), at slot ``hot + j`` past the buffer, with the
    host's bytes (so check_rows_served holds). Row 0's top-k is make_case's;
    row ``j`` keeps about ``overlap`` of row 0's entries (the rows of one
    step select mostly the same positions), redraws the rest from
    ``0 .. S + j`` and always selects ``S + j``. ``kw`` goes to make_case."""
    n = draft_tokens
    kw.setdefault("page", max(4, n))
    base = make_case(seq_lens=[s + 1 for s in committed], top_k=top_k, hot=hot, seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed + 7)
    bs = len(committed)
    for b, s_b in enumerate(committed):
        r = int(base.req_pool_indices[b])
        slots = torch.arange(1, n) + (s_b if s_b < hot else hot)
        toks = torch.arange(s_b + 1, s_b + n)
        if toks.numel():
            base.slot_tokens[r, slots] = toks.to(torch.int32)
            rows = read_rows(base.host_kv, base.host_locs[r, toks], base.layout)
            write_rows(base.device_kv, base.slot_locs[r, slots].long(), rows, base.layout)
    top = base.top_k_tokens.repeat_interleave(n, dim=0)
    for b, s_b in enumerate(committed):
        for j in range(1, n):
            row = top[b * n + j]
            redraw = (torch.rand(top_k, generator=gen) > overlap) & (row >= 0)
            row[redraw] = torch.randint(0, s_b + j + 1, (int(redraw.sum()),), generator=gen,
                                        dtype=torch.int32)
            row[int(torch.randint(0, top_k, (1,), generator=gen))] = s_b + j
    lens = torch.tensor([s + j + 1 for s in committed for j in range(n)], dtype=base.seq_lens.dtype)
    return dataclasses.replace(
        base, top_k_tokens=top, seq_lens=lens, draft_tokens=n,
        out=torch.full((bs * n, top_k), -7, dtype=torch.int32))


def check_rows_served(case: SwapInCase) -> None:
    """Every valid selected token's device row holds its host bytes."""
    n = case.draft_tokens
    real = int(case.num_real_reqs[0]) * n
    max_ctx = case.host_locs.size(1)
    for b in range(min(real, case.top_k_tokens.size(0))):
        r, seq_len = int(case.req_pool_indices[b // n]), int(case.seq_lens[b])
        toks = case.top_k_tokens[b].cpu().long()
        out = case.out[b].cpu().long()
        valid = (toks >= 0) & (toks < min(seq_len, max_ctx))
        assert (out[~valid] == -1).all(), f"row {b}: invalid entries must output -1"
        if valid.any():
            want = read_rows(case.host_kv, case.host_locs[r].cpu()[toks[valid]], case.layout)
            got = read_rows(case.device_kv.cpu(), out[valid], case.layout)
            bad = (want != got).any(1).nonzero().squeeze(1)
            assert bad.numel() == 0, f"row {b}: {bad.numel()} selected tokens have wrong bytes"


def make_residency(case: SwapInCase, seed: int, fraction: float = 0.5, *,
                   resident_rows: Sequence[int] = (), plain_rows: Sequence[int] = ()) -> dict:
    """``resident`` flags (about ``fraction`` of the request slots, and the
    requests of batch rows ``resident_rows``, but not of ``plain_rows``) and a
    ``req_to_token``/``token_to_row`` mapping that agrees with the case: every
    (request, position) has its own logical slot, and the newest position of
    each batch request that is not resident maps to the row slot_locs gives it
    (as the attention write path maps it). All on the case's device."""
    gen = torch.Generator().manual_seed(seed)
    max_reqs, ctx = case.lru.size(0), case.host_locs.size(1)
    hot = case.lru.size(1)
    resident = (torch.rand(max_reqs, generator=gen) < fraction).to(torch.int32)
    for rows, flag in ((resident_rows, 1), (plain_rows, 0)):
        for b in rows:
            resident[int(case.req_pool_indices[b])] = flag
    width = ctx + 3
    req_to_token = torch.randperm(max_reqs * width, generator=gen).to(torch.int32).reshape(max_reqs, width)
    token_to_row = torch.randint(0, 1 << 20, (max_reqs * width,), dtype=torch.int64, generator=gen)
    slot_locs = case.slot_locs.cpu()
    for r, seq_len in zip(case.req_pool_indices.tolist(), case.seq_lens.tolist()):
        if not resident[r] and seq_len > 0:
            token_to_row[req_to_token[r, seq_len - 1]] = int(slot_locs[r, min(seq_len - 1, hot)])
    dev = case.top_k_tokens.device
    return dict(resident=resident.to(dev), req_to_token=req_to_token.to(dev),
                token_to_row=token_to_row.to(dev))


def check_args(case: SwapInCase, counters: torch.Tensor, first: torch.Tensor, *,
               layer_id: int = 3, **extra) -> dict:
    """Keyword arguments of ``kernels.exactness.check_swap_in`` for a case
    after its swap-in (``extra``: residency / mapping)."""
    return dict(
        top_k_tokens=case.top_k_tokens, out=case.out, req_pool_indices=case.req_pool_indices,
        seq_lens=case.seq_lens, num_real_reqs=case.num_real_reqs, slot_locs=case.slot_locs,
        host_locs=case.host_locs, host_kv=case.host_kv, device_kv=case.device_kv,
        hot_buffer_size=case.lru.size(1), layer_id=layer_id, counters=counters, first=first,
        layout=case.layout, draft_tokens=case.draft_tokens, **extra,
    )


def pick_entry(case: SwapInCase, kind: str, *, resident: Optional[torch.Tensor] = None,
               skip_rows: int = 0) -> tuple[int, int]:
    """(batch row, top-k index) of the first real entry of a kind, from batch
    row ``skip_rows`` on: "cached" - valid, not the newest, in a request that
    is not resident (its bytes come from host); "newest"; "invalid" (-1
    padding); "resident" - valid, in a resident request."""
    real = int(case.num_real_reqs[0])
    max_ctx = case.host_locs.size(1)
    for b in range(skip_rows, min(real, case.top_k_tokens.size(0))):
        r, seq_len = int(case.req_pool_indices[b]), int(case.seq_lens[b])
        is_res = resident is not None and int(resident[r]) != 0
        for j, t in enumerate(case.top_k_tokens[b].tolist()):
            valid = 0 <= t < min(seq_len, max_ctx)
            if kind == "invalid":
                if not valid:
                    return b, j
                continue
            if not valid or (kind == "resident") != is_res:
                continue
            if kind == "resident" or (kind == "newest") == (t == seq_len - 1):
                return b, j
    raise LookupError(f"no {kind} entry in the case")


FAULTS = ("none", "device_byte", "missing_row", "invalid", "newest", "newest_mapping", "resident",
          "padding_garbage")


def plant_fault(case: SwapInCase, fault: str, residency: Optional[dict] = None) -> None:
    """After a swap-in, break one thing the exactness check must catch (or,
    for "none" and "padding_garbage", nothing it may count)."""
    if fault == "none":
        return
    if fault == "padding_garbage":
        case.out[int(case.num_real_reqs[0]):] = 12345
        return
    kind = {"device_byte": "cached", "missing_row": "cached", "newest_mapping": "newest"}.get(fault, fault)
    b, j = pick_entry(case, kind, resident=(residency or {}).get("resident"))
    r, seq_len = int(case.req_pool_indices[b]), int(case.seq_lens[b])
    if fault == "device_byte":
        rows = case.out[b, j : j + 1].long()
        data = read_rows(case.device_kv, rows, case.layout)
        data[0, -1] ^= 0x40  # the last byte: C4's last scale byte
        write_rows(case.device_kv, rows, data, case.layout)
    elif fault == "missing_row":
        case.out[b, j] = -1
    elif fault in ("invalid", "newest", "resident"):
        case.out[b, j] += 1 if fault != "invalid" else 18
    elif fault == "newest_mapping":
        residency["token_to_row"][residency["req_to_token"][r, seq_len - 1]] += 1
    else:
        raise ValueError(f"unknown fault {fault!r}")
