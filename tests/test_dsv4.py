"""DeepSeek-V4 HiSparse on CPU: our C4 device pool and allocator inside SGLang's
real ``DeepSeekV4TokenToKVPool`` and ``SWATokenToKVPoolAllocator``, and the
coordinator's C4 flow on top of them.

Sizes: page 256 full tokens (C4 page 64 rows), SWA window 128, full space
8192 tokens (2048 compressed ids), C4 device pool 1024 rows (host ratio 2),
two C4 layers. Every test counts full, SWA, C4 and host slots back.
"""

import inspect

import pytest
import torch

from conftest import run_python
from dataplane_fixtures import (
    decode_step,
    dsv4_pool,
    kv_allocated_len,
    make_req,
    our_c4_pool_as_native,
    prefill,
    release,
    req_pool,
    set_kv_allocated_len,
    t64,
)
from sglang_hisparse.adapter import releases
from sglang_hisparse.pools.allocator_c4 import DSV4HiSparseAllocator
from sglang_hisparse.pools.device_c4 import C4_RATIO, DSV4C4DevicePool
from sglang_hisparse.kernels import reference

PS, SWA_PS, CPS = 256, 128, 64
FULL, SWA, C4_DEV = 8192, 4096, 1024
HOT, TOPK = 128, 16  # in C4 tokens
PADDED = HOT + CPS


def build(c4_dev=C4_DEV):
    """DeepSeekV4TokenToKVPool(enable_hisparse=True) with our C4 pool, SGLang's SWA
    allocator and our allocator around it (what the 0.5.13 mixin does)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    with our_c4_pool_as_native():
        pool = dsv4_pool(compression_ratios=[0, 4, 128, 4], swa_size=SWA, c4_size=c4_dev,
                         c128_size=FULL // 128, state_pool_size=16, page_size=PS,
                         swa_page_size=SWA_PS, enable_hisparse=True)
    swa = SWATokenToKVPoolAllocator(FULL, SWA, page_size=PS, dtype=torch.uint8, device="cpu",
                                    kvcache=pool, need_sort=False)
    return pool, DSV4HiSparseAllocator(swa)


def counts(alloc, host=None, r2t=None):
    swa = alloc.logical_attn_allocator
    d = dict(full=swa.full_available_size(), swa=swa.swa_available_size(),
             c4=alloc.physical_available_size())
    if host is not None:
        d["host"] = host.available_size()
    if r2t is not None:
        d["req"] = r2t.available_size()
    return d


def unmapped(alloc):
    return int(alloc.full_to_hisparse_device_index_mapping[:-1].abs().sum()) == 0


def tag(tokens, layer):
    """584 C4 bytes naming a compressed token and a layer (value and scale parts)."""
    tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    data = torch.zeros(tokens.numel(), reference.C4_ITEM_BYTES, dtype=torch.uint8)
    data[:, 0] = tokens % 256
    data[:, 1] = tokens // 256
    data[:, 2] = layer + 1
    data[:, reference.C4_VALUE_BYTES] = (tokens * 7 + layer) % 251  # in the scale run
    return data


def read_tag(buf, rows, layer):
    got = reference.read_rows(buf, torch.as_tensor(rows), layout="c4")
    ok = bool((got[:, 2] == layer + 1).all()) and bool(
        (got[:, reference.C4_VALUE_BYTES].long()
         == ((got[:, 0].long() + 256 * got[:, 1].long()) * 7 + layer) % 251).all()
    )
    assert ok, "C4 row bytes are not one token's value + scale"
    return (got[:, 0].long() + 256 * got[:, 1].long()).tolist()


def write_c4(pool, alloc, full_ids, first_token):
    """What the compressor does: C4 KV of every group closed by ``full_ids``."""
    c4 = pool.c4_kv_pool
    rows = c4.translate_loc_from_full_to_hisparse_device(full_ids)
    toks = torch.arange(first_token, first_token + rows.numel())
    for layer in range(c4.layer_num):
        reference.write_rows(c4.kv_buffer[layer], rows, tag(toks, layer), layout="c4")
    return rows


# ------------------------------------------------------------------ drop-in
def test_builds_real_sglang_pool_on_cpu_with_our_c4_pool():
    pool, alloc = build()
    c4 = pool.c4_kv_pool
    assert type(c4) is DSV4C4DevicePool
    assert c4.page_size == CPS and c4.size == C4_DEV and c4.layer_num == 2
    assert c4.kv_buffer[0].shape == (C4_DEV // CPS + 1, reference.C4_PAGE_BYTES)
    assert c4.kv_cache_total_dim == reference.C4_ITEM_BYTES
    assert c4.data_ptrs.tolist() == [b.data_ptr() for b in c4.kv_buffer]
    assert pool.c4_logical_size == FULL // C4_RATIO
    # mapping: one slot per compressed id + a padding page, then -1
    m = alloc.full_to_hisparse_device_index_mapping
    assert m.numel() == FULL // C4_RATIO + CPS + 1 and int(m[-1]) == -1
    assert c4.full_to_hisparse_device_index_mapping.numel() == m.numel()  # weakref proxy
    assert alloc.page_size == PS and alloc.hisparse_page_size == CPS
    assert alloc.size_full == FULL and alloc.size_swa == SWA and alloc.logical_capacity == FULL
    assert alloc.compress_ratio == 4 and alloc.get_kvcache() is pool
    assert alloc.available_size() == min(SWA, C4_DEV * 4)
    with pytest.raises(NotImplementedError):
        alloc.alloc(4)
    with pytest.raises(NotImplementedError):
        c4.get_cpu_copy(t64(1))


def test_drop_in_signatures_and_public_api():
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import HiSparseC4DevicePool
    from releases import installed_object

    NativeAlloc = installed_object(
        "sglang.srt.mem_cache.hisparse_memory_pool.DeepSeekV4HiSparseTokenToKVPoolAllocator")

    for ours, native in ((DSV4HiSparseAllocator, NativeAlloc), (DSV4C4DevicePool, HiSparseC4DevicePool)):
        assert inspect.signature(ours.__init__).parameters.keys() == \
            inspect.signature(native.__init__).parameters.keys()
        public = [n for n in vars(native) if not n.startswith("__")]
        missing = [n for n in public if not hasattr(ours, n)]
        assert missing == [n for n in NOT_OFFERED if n in public and ours is DSV4HiSparseAllocator], \
            (ours.__name__, missing)


# What the release's allocator has and ours leaves out on purpose.
# alloc_extend_swa_tail (0.5.17): a PD decode's prealloc allocates the SWA KV
# for the sliding-window tail only when the allocator has it
# (decode.py _uses_swa_tail_prealloc); without it the SWA is allocated at the
# full prompt length and the decode caps its tokens at the SWA pool, as on
# 0.5.15.post1. With HiSparse that path is a DeepSeek-V4 PD decode; ours keeps
# 0.5.15.post1's behaviour (a retracted request's window comes back into SWA
# slots that cover its whole length).
NOT_OFFERED = ("alloc_extend_swa_tail",)


def test_rejects_a_pool_without_hisparse_c4():
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    pool, _ = build()
    pool.c4_kv_pool = object()
    swa = SWATokenToKVPoolAllocator(FULL, SWA, page_size=PS, dtype=torch.uint8, device="cpu",
                                    kvcache=pool, need_sort=False)
    with pytest.raises(TypeError, match="enable_hisparse"):
        DSV4HiSparseAllocator(swa)


# --------------------------------------------------------------- allocation
def test_alloc_extend_allocates_c4_rows_per_four_tokens_across_chunks():
    pool, alloc = build()
    c4 = pool.c4_kv_pool
    start = counts(alloc)
    # chunk 1: 130 tokens -> 32 C4 tokens (one C4 page); 130 % 4 != 0 on purpose
    a = alloc.alloc_extend(t64(0), t64(0), t64(130), t64(130), t64(-1), 130)
    assert a.numel() == 130
    comp_a = c4.translate_loc_from_full_to_compressed(a)
    assert comp_a.numel() == 130 // 4 and comp_a.tolist() == (a[3::4] // 4).tolist()
    assert counts(alloc)["c4"] == start["c4"] - CPS
    # chunk 2 continues the last C4 page through get_last_loc_compressed
    b = alloc.alloc_extend(t64(130), t64(130), t64(300), t64(300), a[-1:], 170)
    full = torch.cat([a, b])
    comp = c4.translate_loc_from_full_to_compressed(full)
    assert comp.numel() == 300 // 4
    rows = alloc.translate_to_physical(comp)
    assert bool((rows > 0).all()) and rows.unique().numel() == 75
    # C4 token i sits at offset i % 64 of its page; pages are whole
    assert (rows % CPS).tolist() == [i % CPS for i in range(75)]
    assert bool((rows[1:CPS] - rows[: CPS - 1] == 1).all())
    assert counts(alloc)["c4"] == start["c4"] - 2 * CPS
    assert counts(alloc)["full"] == start["full"] - 2 * PS
    # a batch of two requests
    c = alloc.alloc_extend(t64(0, 0), t64(0, 0), t64(5, 64), t64(5, 64), t64(-1, -1), 69)
    assert c4.translate_loc_from_full_to_compressed(c).numel() == 1 + 16
    # the pool writes through the mapping: compressed id -> C4 row
    assert c4.translate_loc_to_hisparse_device(comp).dtype == torch.int32
    assert c4.translate_loc_to_hisparse_device(comp).tolist() == rows.tolist()
    assert c4.translate_loc_from_full_to_hisparse_device(full).tolist() == rows.tolist()


def test_alloc_extend_refuses_when_c4_rows_run_out():
    pool, alloc = build(c4_dev=256)  # 4 C4 pages
    start = counts(alloc)
    assert alloc.available_size() == 256 * 4  # C4 rows bound admission, in full tokens
    assert alloc.alloc_extend(t64(0), t64(0), t64(1100), t64(1100), t64(-1), 1100) is None
    assert counts(alloc) == start
    ok = alloc.alloc_extend(t64(0), t64(0), t64(1024), t64(1024), t64(-1), 1024)
    assert ok is not None and alloc.physical_available_size() == 0 and alloc.available_size() == 0
    alloc.free(ok)
    assert counts(alloc) == start and unmapped(alloc)


@pytest.mark.parametrize("owed,host_left_pages", [((0, 0), None), ((200, 0), None),
                                                   ((64, 64), 3), ((2000, 0), 8)])
def test_c4_budget_is_the_formula_in_c4_rows(owed, host_left_pages):
    from sglang_hisparse.engine.budget import admission_budgets
    from sglang_hisparse.pools.host import HiSparseC4HostPool

    pool, alloc = build()
    calls = []
    alloc.set_reservation_provider(lambda: calls.append(1) or owed)
    host = grab = None
    if host_left_pages is not None:
        host = HiSparseC4HostPool(pool.c4_kv_pool.kv_buffer, num_host_pages=32)
        grab = host.alloc_page(32 - host_left_pages)
    alloc.attach_host_pool(host, PADDED)
    full = alloc.alloc_extend(t64(0), t64(0), t64(40), t64(40), t64(-1), 40)  # 10 C4: 1 page
    assert alloc.pending_prefill_claim() == PADDED - CPS
    host_free = None if host is None else host_left_pages * CPS
    host_rows, rows = admission_budgets(C4_DEV - CPS, owed[0], PADDED - CPS, 0, None,
                                        host_free, owed[1])
    calls.clear()
    assert alloc.budgets() == (host_rows, rows) and len(calls) == 1
    c4 = rows if host_rows is None else min(rows, host_rows)
    # by hand: device rows less owed and claimed, capped by host headroom
    assert c4 == min(max(0, C4_DEV - CPS - owed[0] - (PADDED - CPS)),
                     max(0, host_free - owed[1]) if host else 10**9)
    # the C4 sub-allocator (PD decode prealloc budget) reports the same rows
    assert alloc.hisparse_attn_allocator.available_size() == rows
    swa = alloc.logical_attn_allocator
    assert alloc.available_size() == min(swa.available_size(), c4 * C4_RATIO)
    assert alloc.full_available_size() == min(swa.full_available_size(), c4 * C4_RATIO)
    alloc.free(full)
    assert alloc.pending_prefill_claim() == 0 and unmapped(alloc)
    if grab is not None:
        host.free(grab)


def test_get_last_loc_compressed():
    _, alloc = build()
    # -1 (no prefix) stays -1; a full id closing a group is its own group;
    # ids after it map to it until the next group closes
    locs = t64(-1, 256 + 3, 256 + 5, 256 + 7, 512 + 131)
    assert alloc.get_last_loc_compressed(locs).tolist() == [-1, 64, 64, 65, 128 + 32]
    assert int(alloc.get_last_loc_hisparse_device(t64(-1))) == -1


def _prefill(alloc, r2t, n, rid="r"):
    req = make_req(rid, n)
    return req, prefill(r2t, alloc, req, n)


def test_alloc_device_buffer_keeps_newest_in_slot_b_and_frees_outside_pages():
    pool, alloc = build()
    c4 = pool.c4_kv_pool
    start = counts(alloc)
    full = alloc.alloc_extend(t64(0), t64(0), t64(1000), t64(1000), t64(-1), 1000)  # 250 C4
    comp = c4.translate_loc_from_full_to_compressed(full)
    rows = alloc.translate_to_physical(comp).clone()
    assert counts(alloc)["c4"] == start["c4"] - 4 * CPS
    buf = alloc.alloc_device_buffer(comp, PADDED)
    assert buf.numel() == PADDED
    assert buf[:HOT].tolist() == rows[:HOT].tolist()  # slot i = token i
    assert int(buf[HOT]) == int(rows[249])  # slot B = newest C4 token
    # the buffer is exactly PADDED / 64 whole pages: tokens 0..127 and the newest's page
    pages = (buf // CPS).unique()
    assert pages.numel() == PADDED // CPS
    assert set(pages.tolist()) == {int(rows[0]) // CPS, int(rows[64]) // CPS, int(rows[249]) // CPS}
    assert buf.unique().numel() == PADDED
    # the page of tokens 128..191 lay wholly outside the buffer: freed
    assert counts(alloc)["c4"] == start["c4"] - 3 * CPS
    assert unmapped(alloc)
    alloc.free_hisparse_indices(buf)
    alloc.free(full)
    assert counts(alloc) == start


def test_alloc_device_buffer_newest_on_the_page_after_the_buffer():
    pool, alloc = build()
    c4 = pool.c4_kv_pool
    start = counts(alloc)
    full = alloc.alloc_extend(t64(0), t64(0), t64(720), t64(720), t64(-1), 720)  # 180 C4
    comp = c4.translate_loc_from_full_to_compressed(full)
    rows = alloc.translate_to_physical(comp).clone()
    buf = alloc.alloc_device_buffer(comp, PADDED)
    assert int(buf[HOT]) == int(rows[179])
    assert (buf // CPS).unique().numel() == 3 and counts(alloc)["c4"] == start["c4"] - 3 * CPS
    alloc.free_hisparse_indices(buf)
    alloc.free(full)
    assert counts(alloc) == start and unmapped(alloc)


@pytest.mark.parametrize("n_full", [0, 3, 90, 516])  # 0, 0, 22, 129 (= B + 1) C4 tokens
def test_alloc_device_buffer_short_requests_keep_rows_and_get_fresh_pages(n_full):
    pool, alloc = build()
    c4 = pool.c4_kv_pool
    start = counts(alloc)
    if n_full:
        full = alloc.alloc_extend(t64(0), t64(0), t64(n_full), t64(n_full), t64(-1), n_full)
    else:
        full = alloc.alloc_logical_only(t64(0), t64(0), t64(8), t64(8), t64(-1), 8)  # PD direct
        assert counts(alloc)["c4"] == start["c4"]
    comp = c4.translate_loc_from_full_to_compressed(full)
    rows = alloc.translate_to_physical(comp).clone()
    n = n_full // 4
    buf = alloc.alloc_device_buffer(comp, PADDED)
    assert buf.numel() == PADDED and buf.unique().numel() == PADDED
    assert buf[:n].tolist() == rows[:n].tolist()
    if n:  # the rest of the last owned page follows in order
        page_end = (int(rows[n - 1]) // CPS + 1) * CPS
        assert buf[n : n + page_end - int(rows[n - 1]) - 1].tolist() == list(range(int(rows[n - 1]) + 1, page_end))
    assert counts(alloc)["c4"] == start["c4"] - PADDED
    assert unmapped(alloc)
    alloc.free_hisparse_indices(buf)
    alloc.free(full)
    assert counts(alloc) == start


def test_alloc_device_buffer_without_free_rows_changes_nothing():
    pool, alloc = build(c4_dev=128)  # 2 C4 pages
    c4 = pool.c4_kv_pool
    full = alloc.alloc_extend(t64(0), t64(0), t64(300), t64(300), t64(-1), 300)  # 75 C4: 2 pages
    comp = c4.translate_loc_from_full_to_compressed(full)
    before = alloc.translate_to_physical(comp).clone()
    assert alloc.alloc_device_buffer(comp, PADDED) is None  # would need a 3rd page
    assert alloc.translate_to_physical(comp).tolist() == before.tolist()
    alloc.free(full)
    assert alloc.physical_available_size() == 128 and unmapped(alloc)


def test_free_returns_every_slot():
    pool, alloc = build()
    r2t = req_pool(8, 4096)
    start = counts(alloc, r2t=r2t)
    reqs = []
    for i, n in enumerate((1, 4, 77, 256, 1000)):
        reqs.append(_prefill(alloc, r2t, n, f"r{i}"))
    # a chunked one
    req, a = _prefill(alloc, r2t, 130, "chunked")
    b = alloc.alloc_extend(t64(130), t64(130), t64(600), t64(600), a[-1:], 470)
    r2t.req_to_token[req.req_pool_idx, 130:600] = b.to(torch.int32)
    set_kv_allocated_len(req, 600)
    reqs.append((req, None))
    # decode steps add full + SWA slots only
    for req, _ in reqs:
        seq = kv_allocated_len(req)
        last = r2t.req_to_token[req.req_pool_idx, seq - 1 : seq].to(torch.int64)
        out = alloc.alloc_decode(t64(seq + 1), t64(seq + 1), last)
        r2t.req_to_token[req.req_pool_idx, seq] = int(out)
        set_kv_allocated_len(req, kv_allocated_len(req) + 1)
    c4_used = sum(-(-((kv_allocated_len(r) - 1) // 4) // CPS) for r, _ in reqs)  # C4 pages
    assert counts(alloc)["c4"] == start["c4"] - c4_used * CPS
    assert alloc.swa_available_size() < SWA
    # release_kv_cache of requests that finished right after prefill: 0.5.13
    # leaked their C4 rows; a free group defers like SGLang's
    alloc.free_group_begin()
    for req, _ in reqs[:3]:
        alloc.free(r2t.req_to_token[req.req_pool_idx, : kv_allocated_len(req)].to(torch.int64))
    assert counts(alloc)["c4"] == start["c4"] - c4_used * CPS
    alloc.free_group_end()
    for req, _ in reqs[3:]:
        alloc.free(r2t.req_to_token[req.req_pool_idx, : kv_allocated_len(req)].to(torch.int64))
    for req, _ in reqs:
        r2t.free(req)
    assert counts(alloc, r2t=r2t) == start and unmapped(alloc)


def test_clear_and_merge():
    _, alloc = build()
    alloc.alloc_extend(t64(0), t64(0), t64(400), t64(400), t64(-1), 400)
    alloc.clear()
    alloc.merge_and_sort_free()
    assert alloc.physical_available_size() == C4_DEV
    assert alloc.available_size() == min(SWA, C4_DEV * 4) and unmapped(alloc)


def test_backup_restore_and_merge():
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    if not hasattr(SWATokenToKVPoolAllocator, "backup_state"):
        pytest.skip("sglang 0.5.17 dropped the allocators' backup_state/restore_state "
                    "(and alloc_paged_token_slots_extend's backup_state argument): "
                    "nothing calls ours there")
    _, alloc = build()
    state = alloc.backup_state()
    out = alloc.alloc_extend(t64(0), t64(0), t64(400), t64(400), t64(-1), 400)
    assert out is not None
    alloc.restore_state(state)
    assert alloc.physical_available_size() == C4_DEV
    assert alloc.logical_attn_allocator.full_available_size() == FULL
    alloc.clear()
    alloc.merge_and_sort_free()
    assert alloc.available_size() == min(SWA, C4_DEV * 4) and unmapped(alloc)


# --------------------------------------------------------------- coordinator
class Env:
    def __init__(self, c4_dev=C4_DEV, delay=0):
        from sglang_hisparse.adapter.model_runner import HiSparseCoordinator

        self.pool, self.alloc = build(c4_dev)
        self.c4 = self.pool.c4_kv_pool
        self.r2t = req_pool(8, 4096)
        self.coord = HiSparseCoordinator(self.r2t, self.alloc, TOPK, HOT, "cpu", None, 2)
        self.host = self.coord.mem_pool_host
        if delay:
            self.coord.set_cpu_staging_delay(lambda: delay)
        self.start = self.counts()

    def counts(self):
        return counts(self.alloc, self.host, self.r2t)

    def prefill(self, rid, n):
        req, full = _prefill(self.alloc, self.r2t, n, rid)
        write_c4(self.pool, self.alloc, full, 0)
        return req

    def staged(self, rid, n):
        req = self.prefill(rid, n)
        self.coord.admit_request_into_staging(req)
        return req

    def decode(self, reqs):
        rpi, seq, out = decode_step(self.r2t, self.alloc, self.coord, reqs)
        # "forward": the compressor writes the C4 token a step closes
        for i in range(len(reqs)):
            if int(seq[i]) % 4 == 0:
                write_c4(self.pool, self.alloc, out[i : i + 1], int(seq[i]) // 4 - 1)
        return rpi, seq // 4

    def finish(self, req):
        self.coord.request_finished(req)
        release(self.r2t, self.alloc, req)

    def drained(self):
        return (self.counts() == self.start and not self.coord.live_request_slots()
                and unmapped(self.alloc))


def test_coordinator_c4_staging_decode_swap_in_and_finish():
    env = Env()
    assert env.coord.is_dsv4_hisparse and env.coord.padded_buffer_size == PADDED
    assert env.coord.item_size_bytes == reference.C4_ITEM_BYTES
    long_req = env.staged("long", 1000)  # 250 C4 tokens
    short_req = env.staged("short", 90)  # 22 C4 tokens
    # staging copied every C4 token (value + scale) of every C4 layer to host
    li = long_req.req_pool_idx
    host_rows = env.coord.req_to_host_pool[li, :250]
    assert bool((host_rows >= 0).all())
    for layer in range(2):
        assert read_tag(env.host.kv_buffer[layer], host_rows, layer) == list(range(250))
    assert env.coord.collect_ready_reqs() == [long_req, short_req]
    assert int(env.coord.req_device_buffer_size[li]) == PADDED
    slot_b = int(env.coord.req_to_device_buffer[li, HOT])
    assert read_tag(env.c4.kv_buffer[0], [slot_b], 0) == [249]  # newest in slot B
    assert env.coord.req_device_buffer_tokens[0, li, :HOT].tolist() == list(range(HOT))
    # long: 3 pages of hot buffer; short: its page + 2 fresh
    assert env.alloc.physical_available_size() == C4_DEV - 2 * PADDED

    # decode: 1000 -> 1004 closes C4 token 250, written into slot B; token 249
    # is written through to host first
    for _ in range(4):
        rpi, c4_seq = env.decode([long_req, short_req])
    assert c4_seq.tolist() == [251, 23]
    assert read_tag(env.c4.kv_buffer[1], [slot_b], 1) == [250]
    assert int(env.alloc.translate_to_physical(
        env.alloc.get_last_loc_compressed(env.r2t.req_to_token[li, 1003:1004].long()))) == slot_b
    for _ in range(4):  # 1008 closes 251: 250 goes to host
        rpi, c4_seq = env.decode([long_req, short_req])
    host_250 = env.coord.req_to_host_pool[li, 250:251]
    assert read_tag(env.host.kv_buffer[0], host_250, 0) == [250]
    # short request: C4 token 23 in its own slot
    si = short_req.req_pool_idx
    assert read_tag(env.c4.kv_buffer[0], env.coord.req_to_device_buffer[si, 23:24], 0) == [23]

    # swap-in through the kernels package (torch reference, layout "c4")
    topk = torch.full((2, TOPK), -1, dtype=torch.int32)
    topk[0, :4] = torch.tensor([5, 200, 251, 250], dtype=torch.int32)  # hit, miss, newest, miss
    topk[1, :3] = torch.tensor([0, 23, 10], dtype=torch.int32)
    env.coord.num_real_reqs.fill_(2)
    for layer in range(2):
        out = env.coord.swap_in_selected_pages(rpi, c4_seq, topk, layer)
        assert read_tag(env.c4.kv_buffer[layer], out[0, :4], layer) == [5, 200, 251, 250]
        assert read_tag(env.c4.kv_buffer[layer], out[1, :3], layer) == [0, 23, 10]
        assert bool((out[0, 4:] == -1).all())
    assert env.coord.get_hisparse_stats()["misses"] == 4  # 2 per layer

    env.finish(long_req)
    env.finish(short_req)
    assert env.drained()


def test_coordinator_c4_finished_right_after_prefill_returns_c4_rows():
    env = Env()
    req = env.prefill("p", 500)
    env.coord.request_finished(req)  # never staged: a no-op for the coordinator
    env.finish(req)
    assert env.drained()


def test_coordinator_c4_retract_running():
    env = Env()
    req = env.staged("r", 700)
    env.coord.collect_ready_reqs()
    env.decode([req])
    env.coord.retract_req(req)
    env.alloc.free(env.r2t.req_to_token[req.req_pool_idx, : kv_allocated_len(req)].to(torch.int64))
    env.r2t.free(req)
    assert env.drained()


def test_coordinator_c4_direct_admission():
    env = Env()
    req = make_req("pd", 300)
    (idx,) = env.r2t.alloc([req])
    req.req_pool_idx = idx
    full = env.alloc.alloc_logical_only(t64(0), t64(0), t64(300), t64(300), t64(-1), 300)
    env.r2t.req_to_token[idx, :300] = full.to(torch.int32)
    releases.current.set_prefill_range(req, 0, 300)
    req.kv_committed_len = 300
    set_kv_allocated_len(req, 300)
    host = env.host.alloc_paged_token_slots(env.coord.req_to_host_pool,
                                            env.coord.req_to_host_pool_allocated_len, idx, 0,
                                            env.coord.host_token_len(300))
    assert host.numel() == 75
    for layer in range(2):  # the transfer engine writes host rows
        reference.write_rows(env.host.kv_buffer[layer], host, tag(torch.arange(75), layer), "c4")
    env.coord.admit_request_direct(req)  # 75 <= HOT: preloaded
    rows = env.coord.req_to_device_buffer[idx, :75]
    assert read_tag(env.c4.kv_buffer[1], rows, 1) == list(range(75))
    env.decode([req])
    env.finish(req)
    assert env.drained()


def test_coordinator_c4_admission_holds_back_hot_buffers():
    env = Env()
    req = env.prefill("s", 40)  # 10 C4 tokens: one page held
    claim = env.alloc.pending_prefill_claim()
    assert claim == PADDED - CPS
    assert env.alloc.available_size() == min(
        env.alloc.logical_attn_allocator.available_size(),
        (C4_DEV - CPS - claim) * 4,
    )
    env.coord.admit_request_into_staging(req)
    assert env.alloc.pending_prefill_claim() == 0
    env.coord.collect_ready_reqs()
    assert env.coord._owed_tokens()[0] == 0  # the padded buffer is held now
    assert env.alloc.available_size() == min(
        env.alloc.logical_attn_allocator.available_size(), (C4_DEV - PADDED) * 4)
    env.finish(req)
    assert env.drained()


def test_coordinator_c4_owed_rows_while_staging():
    env = Env(delay=5)
    req = env.staged("x", 300)  # 75 C4 tokens: 2 C4 pages held
    assert env.coord._owed_tokens()[0] == PADDED - 2 * CPS


def test_coordinator_c4_abort_while_staging():
    env = Env()
    other = env.prefill("other", 1024)  # full pages 1-4: compressed ids 64-319
    other_rows = env.alloc.translate_to_physical(
        env.c4.translate_loc_from_full_to_compressed(
            env.r2t.req_to_token[other.req_pool_idx, :1024].long())).clone()
    env.coord.set_cpu_staging_delay(lambda: 5)
    req = env.staged("x", 600)  # full pages 5-7: compressed ids 320-469
    assert env.coord.collect_ready_reqs() == []
    env.coord.retract_req(req)
    # the other request's C4 rows must still be mapped and allocated
    now = env.alloc.translate_to_physical(
        env.c4.translate_loc_from_full_to_compressed(
            env.r2t.req_to_token[other.req_pool_idx, :1024].long()))
    assert now.tolist() == other_rows.tolist()
    env.alloc.free(env.r2t.req_to_token[req.req_pool_idx, : kv_allocated_len(req)].to(torch.int64))
    env.r2t.free(req)
    env.finish(other)
    assert env.drained()


# ------------------------------------------------------------ plugin install
def test_class_replace_reaches_every_sglang_user():
    from releases import pool_builder_module

    proc = run_python(
        f"""
        import json, torch
        import sglang.srt.managers.schedule_policy as sp   # imported before: rebound by propagation
        from sglang_hisparse.plugin import activate
        act = activate()
        import sglang.srt.mem_cache.chunk_cache as cc       # may be imported after
        import importlib
        mx = importlib.import_module({pool_builder_module()!r})  # builds the allocator
        import sglang.srt.mem_cache.deepseek_v4_memory_pool as dp
        from sglang_hisparse import pins
        from sglang_hisparse.pinned_source import sglang_version
        # The allocator's own module, wherever the release keeps it.
        am = importlib.import_module(pins.release_target(
            "sglang.srt.mem_cache.hisparse_memory_pool.DeepSeekV4HiSparseTokenToKVPoolAllocator",
            sglang_version()).rsplit(".", 1)[0])
        from sglang_hisparse.pools.allocator_c4 import DSV4HiSparseAllocator
        from sglang_hisparse.pools.device_c4 import DSV4C4DevicePool
        print(json.dumps(dict(
            applied=act.applied, error=act.error,
            names=[m.DeepSeekV4HiSparseTokenToKVPoolAllocator is DSV4HiSparseAllocator
                   for m in (sp, cc, mx, am)],
            pool=[dp.HiSparseC4DevicePool is DSV4C4DevicePool,
                  am.HiSparseC4DevicePool is DSV4C4DevicePool],
        )))
        """
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["applied"], res["error"]
    assert res["names"] == [True] * 4 and res["pool"] == [True, True]


def test_isinstance_sites_accept_our_allocator():
    """SWAChunkCache and PrefillAdder build their isinstance tuples at call time."""
    import sglang.srt.managers.schedule_policy as sp
    import sglang.srt.mem_cache.chunk_cache as cc

    _, alloc = build()
    saved = (cc.DeepSeekV4HiSparseTokenToKVPoolAllocator, sp.DeepSeekV4HiSparseTokenToKVPoolAllocator)
    cc.DeepSeekV4HiSparseTokenToKVPoolAllocator = DSV4HiSparseAllocator  # what REPLACE rebinds
    sp.DeepSeekV4HiSparseTokenToKVPoolAllocator = DSV4HiSparseAllocator
    try:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams

        params = CacheInitParams(
            disable=True, req_to_token_pool=req_pool(4, 1024), token_to_kv_pool_allocator=alloc,
            page_size=PS, sliding_window_size=SWA_PS,
        )
        cache = cc.SWAChunkCache(params)
        assert cache.supports_swa()
        src = inspect.getsource(sp.PrefillAdder.__init__)
        assert "DeepSeekV4HiSparseTokenToKVPoolAllocator" in src  # looked up at call time
    finally:
        cc.DeepSeekV4HiSparseTokenToKVPoolAllocator, sp.DeepSeekV4HiSparseTokenToKVPoolAllocator = saved


def test_manifest_entries_check_out():
    from sglang_hisparse.manifest import ENTRIES, Kind, Scope
    from sglang_hisparse.pinned_source import sglang_version
    from sglang_hisparse.plugin import check_entry

    mine = [e for e in ENTRIES if (e.impl or "").startswith(
        ("sglang_hisparse.pools.allocator_c4:", "sglang_hisparse.pools.device_c4:"))]
    assert {e.target.rsplit(".", 1)[1] for e in mine} == {
        "DeepSeekV4HiSparseTokenToKVPoolAllocator", "HiSparseC4DevicePool"}
    for e in mine:
        assert e.kind is Kind.REPLACE and e.scope is Scope.DATA_PLANE
        c = check_entry(e, sglang_version())
        assert c.ok, (e.target, c.detail)
        assert isinstance(c.hook, type)
