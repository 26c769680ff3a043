"""HiSparseDualAllocator on the real SGLang paged allocators (Triton kernels
interpreted on CPU)."""

import pytest
import torch

from dataplane_fixtures import PS, dsa_pool, free_counts, make_req, prefill, release, req_pool, t64
from sglang_hisparse.pools.allocator import HiSparseDualAllocator


@pytest.fixture
def setup():
    pool = dsa_pool(1024)
    alloc = HiSparseDualAllocator(1024, PS, torch.bfloat16, "cpu", pool, False,
                                  host_to_device_ratio=2)
    return pool, alloc, req_pool()


def test_sizes_and_mapping_sentinel(setup):
    _, alloc, _ = setup
    assert alloc.size == alloc.size_full == alloc.logical_capacity == 2048
    assert alloc.physical_size == 1024
    m = alloc.full_to_hisparse_device_index_mapping
    assert m.numel() == 2048 + PS + 1 and int(m[-1]) == -1 and int(m[:-1].abs().sum()) == 0
    assert alloc.available_size() == 1024  # min(logical 2048, physical 1024)


def test_subclasses_generic_base_only(setup):
    from sglang.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator
    from releases import installed_object

    HiSparseTokenToKVPoolAllocator = installed_object(
        "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseTokenToKVPoolAllocator")

    _, alloc, _ = setup
    assert isinstance(alloc, BaseTokenToKVPoolAllocator)
    assert not isinstance(alloc, HiSparseTokenToKVPoolAllocator)
    assert isinstance(alloc.hisparse_attn_allocator, PagedTokenToKVPoolAllocator)


def test_extend_maps_both_spaces_and_free_returns_all(setup):
    _, alloc, r2t = setup
    start = free_counts(alloc)
    a, b = make_req("a", 100), make_req("b", 130)
    la = prefill(r2t, alloc, a, 100)
    lb = prefill(r2t, alloc, b, 130)
    pa, pb = alloc.translate_to_physical(la), alloc.translate_to_physical(lb)
    assert bool((pa > 0).all()) and bool((pb > 0).all())
    assert len(set(pa.tolist()) | set(pb.tolist())) == 230
    assert int(pa[0]) % PS == 0 and int(la[0]) % PS == 0  # page aligned starts
    assert free_counts(alloc)["physical"] == 1024 - 5 * PS
    release(r2t, alloc, a)
    release(r2t, alloc, b)
    assert free_counts(alloc) == start
    assert int(alloc.full_to_hisparse_device_index_mapping[:-1].abs().sum()) == 0


def test_chunked_extend_continues_pages(setup):
    _, alloc, r2t = setup
    req = make_req("c", 150)
    (idx,) = r2t.alloc([req])
    req.req_pool_idx = idx
    first = alloc.alloc_extend(t64(0), t64(0), t64(40), t64(40), t64(-1), 40)
    second = alloc.alloc_extend(t64(40), t64(40), t64(150), t64(150), first[-1:], 110)
    logical = torch.cat([first, second])
    phys = alloc.translate_to_physical(logical)
    assert logical[:64].tolist() == list(range(int(logical[0]), int(logical[0]) + 64))
    assert phys[:64].tolist() == list(range(int(phys[0]), int(phys[0]) + 64))
    assert alloc.physical_available_size() == 1024 - 3 * PS


def test_decode_is_logical_only(setup):
    _, alloc, r2t = setup
    req = make_req("d", 64)
    logical = prefill(r2t, alloc, req, 64)
    phys_free = alloc.physical_available_size()
    out = alloc.alloc_decode(t64(65), t64(65), logical[-1:])
    assert out is not None and int(out[0]) % PS == 0  # new logical page
    assert alloc.physical_available_size() == phys_free
    assert int(alloc.translate_to_physical(out)[0]) == 0


def test_logical_only_alloc(setup):
    _, alloc, _ = setup
    out = alloc.alloc_logical_only(t64(0), t64(0), t64(200), t64(200), t64(-1), 200)
    assert out.numel() == 200
    assert alloc.physical_available_size() == 1024
    assert alloc.logical_available_size() == 2048 - 4 * PS
    alloc.free(out)
    assert alloc.logical_available_size() == 2048


@pytest.mark.parametrize("prompt,need,kept_from_prefill", [(300, 192, 192), (100, 128, 128), (70, 128, 128)])
def test_device_buffer_keeps_first_rows(setup, prompt, need, kept_from_prefill):
    _, alloc, r2t = setup
    req = make_req("h", prompt)
    logical = prefill(r2t, alloc, req, prompt)
    phys = alloc.translate_to_physical(logical).clone()
    rows = alloc.alloc_device_buffer(logical, need)
    assert rows.numel() == need
    n = min(prompt, need)
    assert rows[:n].tolist() == phys[:n].tolist()  # slot i holds token i
    assert int(alloc.translate_to_physical(logical).abs().sum()) == 0
    # Physical usage is now exactly the hot buffer.
    assert alloc.physical_available_size() == 1024 - need
    alloc.free_hisparse_indices(rows)
    release(r2t, alloc, req)
    assert free_counts(alloc) == dict(logical=2048, physical=1024)


def test_device_buffer_direct_path_allocates_fresh(setup):
    _, alloc, _ = setup
    logical = alloc.alloc_logical_only(t64(0), t64(0), t64(90), t64(90), t64(-1), 90)
    rows = alloc.alloc_device_buffer(logical, 128)
    assert rows.numel() == 128 and alloc.physical_available_size() == 1024 - 128
    alloc.free_hisparse_indices(rows)
    alloc.free(logical)
    assert free_counts(alloc) == dict(logical=2048, physical=1024)


def test_device_buffer_none_when_exhausted(setup):
    _, alloc, _ = setup
    grab = alloc.hisparse_attn_allocator.alloc(1024)
    logical = alloc.alloc_logical_only(t64(0), t64(0), t64(10), t64(10), t64(-1), 10)
    assert alloc.alloc_device_buffer(logical, 64) is None
    alloc.free_hisparse_indices(grab)


def test_free_group_defers(setup):
    _, alloc, r2t = setup
    req = make_req("g", 64)
    logical = prefill(r2t, alloc, req, 64)
    alloc.free_group_begin()
    alloc.free(logical)
    assert alloc.logical_available_size() == 2048 - 64
    alloc.free_group_end()
    assert alloc.logical_available_size() == 2048 and alloc.physical_available_size() == 1024


def test_available_size_holds_back_reservations(setup):
    _, alloc, r2t = setup
    alloc.set_reservation_provider(lambda: (256, 0))
    assert alloc.available_size() == 1024 - 256
    assert alloc.hisparse_attn_allocator.available_size() == 1024 - 256  # PD budget view
    # A new short request claims its future hot buffer at its first chunk.
    alloc.attach_host_pool(None, 192)
    req = make_req("s", 10)
    logical = prefill(r2t, alloc, req, 10)
    assert alloc.pending_prefill_claim() == 192 - PS
    assert alloc.available_size() == 1024 - PS - 256 - (192 - PS)
    release(r2t, alloc, req)  # finished right after prefill: claim returned
    assert alloc.pending_prefill_claim() == 0


def test_available_size_bounded_by_host(setup):
    pool, alloc, _ = setup
    from sglang_hisparse.pools.host import HiSparseMLAHostPool

    host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
    alloc.attach_host_pool(host, 192)
    alloc.set_reservation_provider(lambda: (0, 0))
    grab = host.alloc_page(host.free_page_count() - 4)  # leave 4 pages
    assert alloc.available_size() == 4 * PS
    assert alloc.logical_attn_allocator.available_size() == 4 * PS  # PD decode token budget
    alloc.set_reservation_provider(lambda: (0, 2 * PS))  # live requests still owed 2 pages
    assert alloc.available_size() == 2 * PS
    host.free(grab)


def test_page_size_one_refused_and_alloc_refused(setup):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    # 0.5.13 calls alloc() only with page_size 1 (mem_cache/common.py
    # alloc_token_slots); HiSparse serves paged allocation only.
    pool = MLATokenToKVPool(size=256, page_size=1, dtype=torch.bfloat16, kv_lora_rank=512,
                            qk_rope_head_dim=64, layer_num=1, device="cpu",
                            enable_memory_saver=False)
    with pytest.raises(ValueError, match="--page-size"):
        HiSparseDualAllocator(256, 1, torch.bfloat16, "cpu", pool, False, 2)
    _, alloc, _ = setup
    with pytest.raises(NotImplementedError, match="alloc_extend"):
        alloc.alloc(PS)


# ------------------------------------------------------------------ budget
@pytest.mark.parametrize("args,want", [
    # free_rows, owed_rows, prefill_claims, reclaimable, free_logical, host_free, host_owed
    ((1000, 200, 100, 0, 5000, None, 0), (5000, 700)),
    ((1000, 200, 100, 64, 5000, None, 0), (5000, 764)),   # reclaimable on top
    ((100, 200, 50, 30, 5000, None, 0), (5000, 30)),      # clamp before reclaimable
    ((1000, 0, 0, 0, 5000, 800, 300), (500, 1000)),       # host headroom bounds logical
    ((1000, 0, 0, 0, 400, 800, 300), (400, 1000)),        # logical slots bound it
    ((1000, 0, 0, 0, 400, 300, 800), (0, 1000)),          # host over-owed: 0, not negative
    ((1000, 0, 0, 0, None, 800, 300), (500, 1000)),       # no logical list (C4): host alone
    ((1000, 0, 0, 0, None, None, 0), (None, 1000)),       # neither
])
def test_budget_formula(args, want):
    from sglang_hisparse.engine.budget import admission_budgets

    assert admission_budgets(*args) == want


def test_budget_module_imports_neither_torch_nor_sglang():
    from conftest import run_python

    proc = run_python(
        """
        import sys
        import sglang_hisparse.engine.budget
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "sglang")))
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def _composed(alloc, reclaimable):
    """What SGLang's two PD decode budgets and demotion add up to."""
    return min(alloc.logical_attn_allocator.available_size(),
               alloc.hisparse_attn_allocator.available_size() + reclaimable)


@pytest.mark.parametrize("owed,reclaim,host_left_pages", [
    ((256, 0), 0, None),          # no host pool: logical slots alone
    ((256, 2 * PS), 128, 12),     # host headroom is the bound
    ((2048, 0), 192, None),       # owed beyond the free rows: clamp, then reclaimable
    ((0, 3 * PS), 0, 2),          # host over-owed: nothing admissible
])
def test_available_size_is_the_formula_and_the_sub_allocators_agree(
        setup, owed, reclaim, host_left_pages):
    from sglang_hisparse.engine.budget import admission_budgets
    from sglang_hisparse.pools.host import HiSparseMLAHostPool

    pool, alloc, r2t = setup
    calls = []
    alloc.set_reservation_provider(lambda: calls.append(1) or owed)
    alloc.set_residency(lambda: reclaim, lambda need: 0)
    host = grab = None
    if host_left_pages is not None:
        host = HiSparseMLAHostPool(pool, host_to_device_ratio=2, page_size=PS)
        grab = host.alloc_page(host.free_page_count() - host_left_pages)
    alloc.attach_host_pool(host, 192)
    req = make_req("s", 10)
    prefill(r2t, alloc, req, 10)  # one page, and a prefill claim of 192 - PS
    assert alloc.pending_prefill_claim() == 192 - PS

    free_rows, free_logical = 1024 - PS, 2048 - PS
    host_free = None if host is None else host_left_pages * PS
    want = admission_budgets(free_rows, owed[0], 192 - PS, reclaim, free_logical,
                             host_free, owed[1])
    calls.clear()
    assert alloc.budgets() == want
    assert len(calls) == 1  # one walk of the live requests for both budgets
    calls.clear()
    assert alloc.available_size() == min(want) and len(calls) == 1
    # By hand, so a wrong formula fails too, not only a wrong plumbing.
    physical = max(0, free_rows - owed[0] - (192 - PS)) + reclaim
    logical = free_logical if host is None else min(free_logical, max(0, host_free - owed[1]))
    assert want == (logical, physical)
    # PD decode's budgets (sub-allocators) and demotion compose to the same.
    assert alloc.available_size() == _composed(alloc, reclaim)
    assert alloc.hisparse_attn_allocator.available_size() == physical - reclaim
    assert alloc.logical_attn_allocator.available_size() == logical
    release(r2t, alloc, req)
    if grab is not None:
        host.free(grab)
