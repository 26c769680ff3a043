"""Semantics of the torch swap-in reference (CPU, fast).

Hand-made cases pin down each rule of the reference's docstring; a
randomized sweep compares it with a deliberately naive per-token model that
moves slots around a Python list, one token at a time.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import check_rows_served, make_case
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.reference import C4_PAGE_BYTES, read_rows


# --------------------------------------------------------------------------
# a tiny hand-made world: B = 4 slots + a 2-slot newest page, rows of 8 bytes


def _world(seq_len: int, top: list[list[int]], *, reqs=(1,), lens=None, num_real=None):
    bs = len(top)
    width = 6  # B = 4 hot slots + a 2-slot newest page
    slot_tokens = torch.full((3, width), -1, dtype=torch.int32)
    slot_locs = torch.arange(3 * width, dtype=torch.int32).reshape(3, width) + 100
    lru = torch.arange(4, dtype=torch.int16).repeat(3, 1)
    host_locs = torch.arange(3 * 64, dtype=torch.int64).reshape(3, 64)
    host_kv = torch.arange(3 * 64, dtype=torch.int64).to(torch.uint8)[:, None].repeat(1, 8)
    device_kv = torch.zeros(200, 8, dtype=torch.uint8)
    case = dict(
        top_k_tokens=torch.tensor(top, dtype=torch.int32),
        req_pool_indices=torch.tensor(list(reqs), dtype=torch.int64),
        seq_lens=torch.tensor(lens or [seq_len] * bs, dtype=torch.int64),
        num_real_reqs=torch.tensor([bs if num_real is None else num_real], dtype=torch.int32),
        slot_tokens=slot_tokens,
        slot_locs=slot_locs,
        lru=lru,
        host_locs=host_locs,
        host_kv=host_kv,
        device_kv=device_kv,
        out=torch.full((bs, len(top[0])), -7, dtype=torch.int32),
    )
    return case


def _run(case, **kw):
    return ref.swap_in(**case, **kw)


def test_fast_path_reads_slot_equals_position():
    case = _world(3, [[2, -1, 0, 7]])
    before = {k: case[k].clone() for k in ("slot_tokens", "lru", "device_kv")}
    out = _run(case)
    # request 1: slot s of row 1 has device row 100 + 6 + s
    assert out.tolist() == [[108, -1, 106, -1]]  # 7 >= seq_len: invalid
    for k, v in before.items():
        assert torch.equal(case[k], v), f"{k} changed on the fast path"


def test_fast_path_boundary_seq_len_equals_buffer():
    case = _world(4, [[3, 0]])
    assert _run(case).tolist() == [[109, 106]]


def _long_world(top):
    """Request 1 (row base 106): slots 0..3 hold tokens 10..13, slot 4 the
    newest token 20, LRU order slots [2, 0, 3, 1]; seq_len 21."""
    case = _world(21, top)
    case["slot_tokens"][1, :5] = torch.tensor([10, 11, 12, 13, 20], dtype=torch.int32)
    case["lru"][1] = torch.tensor([2, 0, 3, 1], dtype=torch.int16)
    return case


def test_hits_newest_and_a_miss_into_the_lru_victim():
    case = _long_world([[13, 20, 5]])
    plan = dict(
        miss_src=torch.full((1, 3), -9, dtype=torch.int64),
        miss_dst=torch.full((1, 3), -9, dtype=torch.int32),
        miss_count=torch.full((1,), -9, dtype=torch.int32),
    )
    out = _run(case, **plan)
    # 13 hits slot 3; 20 is the newest -> slot 4; 5 misses into the least
    # recent non-hit slot, slot 2.
    assert out.tolist() == [[109, 110, 108]]
    assert case["slot_tokens"][1, :5].tolist() == [10, 11, 5, 13, 20]
    # untouched [0, 1], then the miss slot 2, then the hit slot 3
    assert case["lru"][1].tolist() == [0, 1, 2, 3]
    assert case["device_kv"][108].tolist() == [64 + 5] * 8  # host row 64 + 5
    assert plan["miss_count"].tolist() == [1]
    assert plan["miss_src"][0, :1].tolist() == [64 + 5]
    assert plan["miss_dst"][0, :1].tolist() == [108]
    assert plan["miss_src"][0, 1:].tolist() == [-9, -9]  # past the count: untouched


def test_misses_take_victims_in_lru_order_and_hits_go_last():
    case = _long_world([[1, 11, 2, 3]])
    out = _run(case)
    # LRU positions: slot2 (12), slot0 (10), slot3 (13), slot1 (11, hit).
    # Misses 1, 2, 3 in top-k order take slots 2, 0, 3.
    assert out.tolist() == [[108, 107, 106, 109]]
    assert case["slot_tokens"][1, :4].tolist() == [2, 11, 1, 3]
    assert case["lru"][1].tolist() == [2, 0, 3, 1]


def test_untouched_slots_keep_their_order_at_the_front():
    case = _long_world([[11, 6]])
    _run(case)
    # evictable in LRU order: 2, 0, 3; the miss takes 2; hit 1 goes last
    assert case["lru"][1].tolist() == [0, 3, 2, 1]


def test_padding_inside_top_k_outputs_minus_one_and_costs_nothing():
    case = _long_world([[-1, 12, -1, 30, 25]])  # 30, 25 >= seq_len 21: invalid too
    out = _run(case)
    assert out.tolist() == [[-1, 108, -1, -1, -1]]
    assert case["slot_tokens"][1, :4].tolist() == [10, 11, 12, 13]
    assert case["lru"][1].tolist() == [0, 3, 1, 2]


def test_duplicates_follow_their_first_occurrence():
    case = _long_world([[5, 13, 5, 13, 20, 20]])
    out = _run(case)
    assert out.tolist() == [[108, 109, 108, 109, 110, 110]]
    assert case["slot_tokens"][1, :4].tolist() == [10, 11, 5, 13]


def test_position_held_twice_served_by_most_recent_copy():
    case = _long_world([[10, 4]])
    case["slot_tokens"][1, 1] = 10  # slots 0 and 1 both claim token 10
    out = _run(case)
    # LRU positions 1 (slot 0) and 3 (slot 1) hold 10: position 3 serves it.
    # Both are hits, so the miss gets the first evictable, slot 2.
    assert out.tolist() == [[107, 108]]
    assert case["lru"][1].tolist() == [3, 2, 0, 1]


def test_padded_rows_output_minus_one_and_change_nothing():
    case = _world(21, [[13, 5], [13, 5]], reqs=(1, 2), num_real=1)
    case["slot_tokens"][1:3, :5] = torch.tensor([10, 11, 12, 13, 20], dtype=torch.int32)
    before = case["slot_tokens"][2].clone(), case["lru"][2].clone()
    plan = dict(
        miss_src=torch.zeros((2, 2), dtype=torch.int64),
        miss_dst=torch.zeros((2, 2), dtype=torch.int32),
        miss_count=torch.full((2,), -9, dtype=torch.int32),
    )
    out = _run(case, **plan)
    assert out[1].tolist() == [-1, -1]
    assert torch.equal(case["slot_tokens"][2], before[0])
    assert torch.equal(case["lru"][2], before[1])
    assert plan["miss_count"].tolist() == [1, 0]


def test_tally_counts_valid_entries_and_misses_of_real_rows():
    # row 0: request 1, long: 13 hit, 20 newest, 5 and 6 miss, -1 and 99 invalid;
    # row 1: request 2, short (fast path), 2 valid entries; row 2: padding.
    case = _world(21, [[13, 20, 5, 6, -1, 99], [2, 0, -1, -1, -1, -1], [1, 2, 3, 4, 5, 6]],
                  reqs=(1, 2, 0), lens=[21, 3, 21], num_real=2)
    case["slot_tokens"][1, :5] = torch.tensor([10, 11, 12, 13, 20], dtype=torch.int32)
    tally = torch.tensor([100, 10], dtype=torch.int64)
    _run(case, tally=tally)
    assert tally.tolist() == [100 + 4 + 2, 10 + 2]


def test_multi_request_rows_are_independent():
    case = _world(21, [[13, 5], [2, 0]], reqs=(1, 2), lens=[21, 3])
    case["slot_tokens"][1, :5] = torch.tensor([10, 11, 12, 13, 20], dtype=torch.int32)
    case["lru"][1] = torch.tensor([2, 0, 3, 1], dtype=torch.int16)
    out = _run(case)
    assert out.tolist() == [[109, 108], [114, 112]]
    assert case["lru"][2].tolist() == [0, 1, 2, 3]


def test_int32_index_tensors_give_the_same_result():
    a = make_case(seq_lens=[3, 40, 17, 90], top_k=8, hot=16, seed=3)
    b = a.clone()
    b.seq_lens = b.seq_lens.to(torch.int32)
    b.req_pool_indices = b.req_pool_indices.to(torch.int32)
    ref.swap_in(*a.args())
    ref.swap_in(*b.args())
    for k in ("out", "slot_tokens", "lru", "device_kv"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k


def test_out_is_allocated_when_omitted():
    case = make_case(seq_lens=[40], top_k=8, hot=16, seed=4)
    args = case.args()[:-1]
    out = ref.swap_in(*args)
    assert out.shape == (1, 8) and out.dtype == torch.int32


def test_skip_io_updates_state_but_moves_no_bytes():
    a = make_case(seq_lens=[60, 70], top_k=8, hot=16, seed=5, miss_rate=0.8)
    b = a.clone()
    ref.swap_in(*a.args())
    kv_before = b.device_kv.clone()
    ref.swap_in(*b.args(), skip_io=True)
    assert torch.equal(a.out, b.out) and torch.equal(a.lru, b.lru)
    assert torch.equal(a.slot_tokens, b.slot_tokens)
    assert torch.equal(b.device_kv, kv_before)
    assert not torch.equal(a.device_kv, kv_before)


@pytest.mark.parametrize("layout", ["rows", "dsv4_c4"])
def test_plan_replay_reproduces_the_copies(layout):
    case = make_case(seq_lens=[300, 5, 200], top_k=16, hot=32, seed=6, layout=layout, miss_rate=0.7)
    bs, k = case.top_k_tokens.shape
    plan = dict(
        miss_src=torch.zeros((bs, k), dtype=torch.int64),
        miss_dst=torch.zeros((bs, k), dtype=torch.int32),
        miss_count=torch.zeros((bs,), dtype=torch.int32),
    )
    fresh = case.device_kv.clone()
    ref.swap_in(*case.args(), layout=layout, **plan)
    assert plan["miss_count"][1] == 0 and plan["miss_count"][0] > 0
    # replaying the plan on the untouched pool yields the same bytes
    ref.copy_planned(**plan, num_real_reqs=case.num_real_reqs, host_kv=case.host_kv,
                     device_kv=fresh, layout=layout)
    assert torch.equal(fresh, case.device_kv)
    check_rows_served(case)


def test_c4_layout_moves_value_and_scale_and_nothing_else():
    host = torch.randint(0, 256, (2, C4_PAGE_BYTES), dtype=torch.uint8)
    dev = torch.zeros((2, C4_PAGE_BYTES), dtype=torch.uint8)
    ref.copy_rows(host, torch.tensor([70]), dev, torch.tensor([3]), "dsv4_c4")
    # token 70 = page 1 slot 6; token 3 = page 0 slot 3
    assert torch.equal(dev[0, 3 * 576 : 4 * 576], host[1, 6 * 576 : 7 * 576])
    assert torch.equal(dev[0, 36864 + 24 : 36864 + 32], host[1, 36864 + 48 : 36864 + 56])
    assert int(dev.count_nonzero()) == int(
        torch.cat([host[1, 6 * 576 : 7 * 576], host[1, 36864 + 48 : 36864 + 56]]).count_nonzero()
    )
    assert torch.equal(read_rows(dev, torch.tensor([3]), "dsv4_c4"),
                       read_rows(host, torch.tensor([70]), "dsv4_c4"))


def test_selected_dispatches_to_reference_on_cpu():
    from sglang_hisparse.kernels import swap_in_selected

    a = make_case(seq_lens=[50, 9], top_k=8, hot=16, seed=8)
    b = a.clone()
    kw = dict(zip(
        ["top_k_tokens", "req_pool_indices", "seq_lens", "num_real_reqs", "slot_tokens",
         "slot_locs", "lru", "host_locs", "host_kv", "device_kv", "out"], a.args()))
    swap_in_selected(**kw)
    ref.swap_in(*b.args())
    assert torch.equal(a.out, b.out) and torch.equal(a.device_kv, b.device_kv)


# --------------------------------------------------------------------------
# randomized: reference vs a naive per-token model


def naive_swap_in(case):
    """Per token, with Python lists; no vector ops, no unique/sort tricks.
    A verify step (``case.draft_tokens`` rows per request) resolves the
    request's rows together, as one list of wanted positions."""
    n = case.draft_tokens
    top = case.top_k_tokens.tolist()
    reqs = case.req_pool_indices.tolist()
    lens = case.seq_lens.tolist()
    st = case.slot_tokens.tolist()
    sl = case.slot_locs.tolist()
    lru = case.lru.tolist()
    hl = case.host_locs.tolist()
    hot = case.lru.size(1)
    max_ctx = case.host_locs.size(1)
    real = int(case.num_real_reqs[0])
    out = [[-1] * len(row) for row in top]
    copies = []  # (host row, device row)
    for g in range(min(real, len(reqs))):
        r = reqs[g]
        rows = range(g * n, (g + 1) * n)
        first = lens[g * n] - 1  # the first position this step writes
        valid = {b: [0 <= t < min(lens[b], max_ctx) for t in top[b]] for b in rows}
        if first < hot:
            for b in rows:
                out[b] = [sl[r][t] if v else -1 for t, v in zip(top[b], valid[b])]
            continue
        order = list(lru[r])
        served = {}  # position -> device row
        hits = []
        wanted = []
        for b in rows:
            for t, v in zip(top[b], valid[b]):
                if not v or t >= first or t in wanted:
                    continue
                wanted.append(t)
        for t in wanted:
            holder = None
            for s in order:  # last LRU position that holds t wins
                if st[r][s] == t:
                    holder = s
            if holder is not None:
                served[t] = sl[r][holder]
        for s in order:
            if st[r][s] in served:
                hits.append(s)
        used = []
        for t in wanted:
            if t in served:
                continue
            victim = next((s for s in order if s not in hits and s not in used), None)
            if victim is None:
                served[t] = -1
                continue
            used.append(victim)
            copies.append((hl[r][t], sl[r][victim]))
            st[r][victim] = t
            served[t] = sl[r][victim]
        for s in used:  # misses become more recent than everything untouched
            order.remove(s)
            order.append(s)
        for s in hits:  # hits become the most recent, in their old order
            order.remove(s)
            order.append(s)
        lru[r] = order
        for b in rows:
            for j, (t, v) in enumerate(zip(top[b], valid[b])):
                if v:
                    out[b][j] = sl[r][hot + t - first] if t >= first else served[t]
    kv = case.device_kv.clone()
    for src, dst in copies:
        kv[dst] = case.host_kv[src]
    return out, st, lru, kv


@pytest.mark.parametrize("seed", range(30))
def test_reference_matches_naive_model(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    hot = int(torch.randint(8, 40, (1,), generator=g))
    top_k = int(torch.randint(1, hot + 1, (1,), generator=g))
    bs = int(torch.randint(1, 6, (1,), generator=g))
    lens = [int(torch.randint(0, 4 * hot, (1,), generator=g)) for _ in range(bs)]
    case = make_case(
        seq_lens=lens,
        top_k=top_k,
        hot=hot,
        seed=seed,
        miss_rate=float(torch.rand(1, generator=g)),
        pad_top_k=int(torch.randint(0, max(1, top_k // 4), (1,), generator=g)),
        duplicates=int(torch.randint(0, 3, (1,), generator=g)) if top_k > 4 else 0,
        include_newest=bool(seed % 2),
        empty_slots=int(torch.randint(0, 3, (1,), generator=g)),
        num_real=max(0, bs - int(seed % 3 == 0)),
        item_bytes=8,
    )
    want_out, want_st, want_lru, want_kv = naive_swap_in(case)
    for _ in range(2):  # two steps: the second starts from the updated state
        ref.swap_in(*case.args())
        assert case.out.tolist() == want_out
        assert case.slot_tokens.tolist() == want_st
        assert case.lru.tolist() == want_lru
        assert torch.equal(case.device_kv, want_kv)
        check_rows_served(case)
        want_out, want_st, want_lru, want_kv = naive_swap_in(case)


def test_resident_requests_translate_positions_and_leave_state_alone():
    from kernel_cases import make_case

    case = make_case(seq_lens=[900, 40, 1500], top_k=64, hot=128, page=4, seed=3)
    plain = case.clone()
    max_reqs, ctx = case.lru.size(0), case.host_locs.size(1)
    resident = torch.zeros(max_reqs, dtype=torch.int32)
    r0 = int(case.req_pool_indices[0])
    resident[r0] = 1
    req_to_token = torch.arange(max_reqs * ctx, dtype=torch.int32).reshape(max_reqs, ctx)
    token_to_row = torch.arange(max_reqs * ctx, dtype=torch.int64) * 10 + 3
    slot_tokens0, lru0, kv0 = case.slot_tokens.clone(), case.lru.clone(), case.device_kv.clone()
    count = torch.full((3,), -5, dtype=torch.int32)
    ref.swap_in(*case.args(), resident=resident, req_to_token=req_to_token,
                token_to_row=token_to_row, miss_src=torch.zeros((3, 64), dtype=torch.int64),
                miss_dst=torch.zeros((3, 64), dtype=torch.int32), miss_count=count)
    ref.swap_in(*plain.args())

    toks = case.top_k_tokens[0].to(torch.int64)
    valid = (toks >= 0) & (toks < 900)
    want = torch.where(valid, (r0 * ctx + toks) * 10 + 3, torch.full_like(toks, -1))
    assert torch.equal(case.out[0].to(torch.int64), want)
    assert int(count[0]) == 0
    # the resident request's slot tables, LRU and rows are untouched ...
    assert torch.equal(case.slot_tokens[r0], slot_tokens0[r0])
    assert torch.equal(case.lru[r0], lru0[r0])
    # ... and every other request resolves exactly as without residency
    assert torch.equal(case.out[1:], plain.out[1:])
    own_rows = case.slot_locs[r0][case.slot_locs[r0] >= 0].to(torch.int64)
    assert torch.equal(case.device_kv[own_rows], kv0[own_rows])  # no bytes moved
    assert not torch.equal(case.out[0], plain.out[0])


def test_residency_arguments_come_together():
    from kernel_cases import make_case

    case = make_case(seq_lens=[300], top_k=16, hot=32, page=4, seed=1)
    with pytest.raises(ValueError, match="together"):
        ref.swap_in(*case.args(), resident=torch.zeros(4, dtype=torch.int32))


# --------------------------------------------------------------------------
# speculative verify: a request's draft_tokens rows resolve as one union


def _verify(case, **kw):
    return ref.swap_in(*case.args(), draft_tokens=case.draft_tokens, **kw)


@pytest.mark.parametrize("seed", range(24))
def test_verify_union_matches_naive_model(seed):
    from kernel_cases import make_verify_case

    g = torch.Generator().manual_seed(2000 + seed)
    n = int(torch.randint(2, 5, (1,), generator=g))
    top_k = int(torch.randint(2, 12, (1,), generator=g))
    hot = n * top_k + int(torch.randint(0, 8, (1,), generator=g))  # B >= n * K
    bs = int(torch.randint(1, 5, (1,), generator=g))
    # short, at the buffer's edge (the rows cross it), and long requests
    kinds = [hot - 3 * n, hot - 1, hot - n // 2, hot, 3 * hot]
    committed = [max(1, kinds[int(torch.randint(0, len(kinds), (1,), generator=g))])
                 for _ in range(bs)]
    case = make_verify_case(
        committed=committed, draft_tokens=n, top_k=top_k, hot=hot, seed=seed,
        miss_rate=float(torch.rand(1, generator=g)),
        pad_top_k=int(torch.randint(0, max(1, top_k // 4), (1,), generator=g)),
        num_real=max(0, bs - int(seed % 4 == 0)), item_bytes=8,
        overlap=float(torch.rand(1, generator=g)))
    want_out, want_st, want_lru, want_kv = naive_swap_in(case)
    _verify(case)
    assert case.out.tolist() == want_out
    assert case.slot_tokens.tolist() == want_st
    assert case.lru.tolist() == want_lru
    assert torch.equal(case.device_kv, want_kv)
    check_rows_served(case)
    # padding requests' rows output -1
    real = int(case.num_real_reqs[0])
    assert (case.out[real * n:] == -1).all()


def test_one_draft_token_is_the_decode_step():
    # The same case through draft_tokens=1 and through the decode path.
    a = make_case(seq_lens=[300, 5, 200, 33], top_k=16, hot=32, seed=9, miss_rate=0.6,
                  duplicates=2, pad_top_k=2)
    b = a.clone()
    ref.swap_in(*a.args())
    ref.swap_in(*b.args(), draft_tokens=1)
    for k in ("out", "slot_tokens", "lru", "device_kv"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k


def test_rows_of_one_request_share_hits_and_never_evict_each_other():
    # B = 4 (+ a 2-slot page), request 1 committed 20 tokens and verifies
    # 20 and 21. Slots hold 10, 11, 12, 13 (LRU order 0..3).
    case = _world(21, [[10, 5, 20], [5, 12, 21]], reqs=(1,), lens=[21, 22])
    case["slot_tokens"][1, :4] = torch.tensor([10, 11, 12, 13], dtype=torch.int32)
    plan = dict(miss_src=torch.zeros((1, 6), dtype=torch.int64),
                miss_dst=torch.zeros((1, 6), dtype=torch.int32),
                miss_count=torch.zeros((1,), dtype=torch.int32))
    out = ref.swap_in(**case, draft_tokens=2, **plan)
    # 5 misses once (both rows read its one copy) into the least recent slot
    # no row reads (11, slot 1); 10 and 12 are hits for either row; the
    # verified tokens sit in the page: 20 at slot 4, 21 at slot 5.
    assert out.tolist() == [[106, 107, 110], [107, 108, 111]]
    assert plan["miss_count"].tolist() == [1]
    assert plan["miss_dst"][0, 0] == 107 and plan["miss_src"][0, 0] == 64 + 5
    assert case["slot_tokens"][1, :4].tolist() == [10, 5, 12, 13]
    assert case["lru"][1].tolist() == [3, 1, 0, 2]


def test_verify_shapes_are_checked():
    case = _world(21, [[10, 5], [5, 12], [1, 2]], reqs=(1,), lens=[21, 22, 23])
    with pytest.raises(ValueError, match="draft_tokens=2: top_k_tokens needs 1 x 2 rows"):
        ref.swap_in(**case, draft_tokens=2)
    case = _world(21, [[10], [5], [1]], reqs=(1,), lens=[21, 22, 23])
    with pytest.raises(ValueError, match="does not fit the 2-slot newest page"):
        ref.swap_in(**case, draft_tokens=3)
