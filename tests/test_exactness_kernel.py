"""The exactness check's torch reference (kernels/exactness.py), on CPU.

A swap-in by the reference leaves state the check must find exact over
every entry it looks at; then single faults are planted after the swap-in
(a corrupted device byte, an output pointing at another row, a resident or
newest row that is not the mapped one, a padding entry that is not -1, a
missing row) and the check must count each and name it in its
first-mismatch record.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import check_args, make_case, make_residency, pick_entry, refresh_top_k
from sglang_hisparse.kernels import exactness
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.limits import C4_SCALE_OFFSET, C4_TOKENS_PER_PAGE, C4_VALUE_BYTES

LAYER = 3


def _case(layout="rows", **kw):
    args = dict(seq_lens=[300, 40, 1500, 129], top_k=32, hot=64, page=4, miss_rate=0.5,
                seed=5, layout=layout, pad_top_k=3, duplicates=2, num_real=3)
    args.update(kw)
    case = make_case(**args)
    return case


def _swap_in(case, **extra):
    ref.swap_in(*case.args(), layout=case.layout, **extra)


def _check(case, state=None, **extra):
    counters, first = state or exactness.new_check_state("cpu")
    exactness.check_swap_in(**check_args(case, counters, first, layer_id=LAYER, **extra))
    return counters.tolist(), exactness.decode_first_mismatch(first)


def _real_entries(case) -> int:
    return int(case.num_real_reqs[0]) * case.top_k_tokens.size(1)


@pytest.mark.parametrize("layout", ["rows", "dsv4_c4"])
@pytest.mark.parametrize("seed", range(4))
def test_a_reference_swap_in_is_exact(layout, seed):
    case = _case(layout, seed=seed)
    state = exactness.new_check_state("cpu")
    for step in range(2):  # the second step starts from the first one's state
        _swap_in(case)
        counters, first = _check(case, state)
        assert counters == [(step + 1) * _real_entries(case), 0] and first is None
        refresh_top_k(case, seed=seed + 10 + step, miss_rate=0.6, pad_top_k=2)


def test_padding_rows_are_not_checked():
    case = _case(num_real=2)
    _swap_in(case)
    case.out[2:] = 12345  # padding rows: whatever they hold
    assert _check(case) == ([2 * 32, 0], None)


def test_a_corrupted_device_byte_is_a_bytes_mismatch():
    case = _case(duplicates=0)
    _swap_in(case)
    b, j = pick_entry(case, "cached", skip_rows=1)
    row, t = int(case.out[b, j]), int(case.top_k_tokens[b, j])
    r = int(case.req_pool_indices[b])
    case.device_kv[row, 7] ^= 0x10
    counters, first = _check(case)
    assert counters == [_real_entries(case), 1]
    assert (first["kind"], first["kind_name"]) == (exactness.KIND_BYTES, "bytes")
    assert (first["req_pool_idx"], first["batch_row"], first["position"], first["out_row"],
            first["expected"], first["layer_id"]) == (r, b, t, row, int(case.host_locs[r, t]), LAYER)
    assert f"position {t}" in first["message"] and f"device row {row}" in first["message"]


def test_an_output_pointing_at_another_row_is_caught():
    case = _case(duplicates=0)
    _swap_in(case)
    b, j = pick_entry(case, "cached")
    r, t = int(case.req_pool_indices[b]), int(case.top_k_tokens[b, j])
    want = ref.read_rows(case.host_kv, case.host_locs[r, t : t + 1])
    # another row of the same request whose bytes are not this position's
    other = next(int(x) for x in case.slot_locs[r].tolist()
                 if not torch.equal(ref.read_rows(case.device_kv, torch.tensor([x])), want))
    case.out[b, j] = other
    counters, first = _check(case)
    assert counters[1] == 1
    assert (first["kind"], first["batch_row"], first["position"], first["out_row"]) == \
        (exactness.KIND_BYTES, b, t, other)


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_a_missing_or_out_of_range_row_is_caught(bad):
    case = _case()
    _swap_in(case)
    b, j = pick_entry(case, "cached")
    case.out[b, j] = bad
    counters, first = _check(case)
    assert counters[1] == 1 and first["kind"] == exactness.KIND_MISSING_ROW
    assert (first["out_row"], first["position"]) == (bad, int(case.top_k_tokens[b, j]))


def test_a_host_row_missing_is_caught():
    case = _case(duplicates=0)
    _swap_in(case)
    b, j = pick_entry(case, "cached")
    r, t = int(case.req_pool_indices[b]), int(case.top_k_tokens[b, j])
    case.host_locs[r, t] = -1
    counters, first = _check(case)
    assert counters[1] == 1 and (first["kind"], first["expected"]) == (exactness.KIND_MISSING_ROW, -1)


def test_an_invalid_entry_must_be_minus_one():
    case = _case()
    _swap_in(case)
    b, j = pick_entry(case, "invalid")
    case.out[b, j] = 17
    counters, first = _check(case)
    assert counters[1] == 1
    assert (first["kind"], first["kind_name"], first["out_row"], first["expected"]) == \
        (exactness.KIND_INVALID_NOT_MINUS_ONE, "invalid_not_minus_one", 17, -1)


def test_the_newest_row_must_be_its_slot():
    case = _case()
    _swap_in(case)
    b, j = pick_entry(case, "newest")
    r, seq_len = int(case.req_pool_indices[b]), int(case.seq_lens[b])
    want = int(case.slot_locs[r, min(seq_len - 1, 64)])
    case.out[b, j] = want + 1
    counters, first = _check(case)
    assert counters[1] == 1
    assert (first["kind"], first["position"], first["out_row"], first["expected"]) == \
        (exactness.KIND_NEWEST, seq_len - 1, want + 1, want)


@pytest.mark.parametrize("seed", range(3))
def test_residents_and_the_mapping_are_exact_after_a_swap_in(seed):
    case = _case(seed=seed)
    res = make_residency(case, seed)
    _swap_in(case, **res)
    assert _check(case, **res) == ([_real_entries(case), 0], None)


def test_a_resident_row_that_is_not_the_mapped_one():
    case = _case(seq_lens=[900, 40, 1500, 70], seed=11)
    res = make_residency(case, seed=4, resident_rows=[1])
    _swap_in(case, **res)
    b, j = pick_entry(case, "resident", resident=res["resident"])
    r, t = int(case.req_pool_indices[b]), int(case.top_k_tokens[b, j])
    mapped = int(res["token_to_row"][res["req_to_token"][r, t]])
    case.out[b, j] = mapped + 3
    counters, first = _check(case, **res)
    assert counters == [_real_entries(case), 1]
    assert (first["kind"], first["kind_name"], first["req_pool_idx"], first["position"],
            first["out_row"], first["expected"]) == \
        (exactness.KIND_RESIDENT, "resident", r, t, mapped + 3, mapped)


def test_a_newest_row_the_write_path_did_not_map():
    """The out row is slot B's, but token_to_row sends the newest token elsewhere."""
    case = _case(seed=7)
    res = make_residency(case, seed=2, fraction=0.0)
    _swap_in(case, **res)
    assert _check(case, **res)[0][1] == 0
    b, j = pick_entry(case, "newest")
    r, seq_len = int(case.req_pool_indices[b]), int(case.seq_lens[b])
    res["token_to_row"][res["req_to_token"][r, seq_len - 1]] += 1
    counters, first = _check(case, **res)
    assert counters[1] == int((case.top_k_tokens[b] == seq_len - 1).sum())
    assert (first["kind"], first["batch_row"], first["position"]) == (exactness.KIND_NEWEST, b, seq_len - 1)


def test_c4_compares_a_tokens_value_and_scale_bytes_only():
    case = _case("dsv4_c4", duplicates=0, seed=3)
    res = make_residency(case, seed=1, fraction=0.0)
    mapping = dict(req_to_token=res["req_to_token"], token_to_row=res["token_to_row"] + 1)
    _swap_in(case)
    # C4's req_to_token holds full ids: the newest row's mapping is not compared
    assert _check(case, **mapping) == ([_real_entries(case), 0], None)
    b, j = pick_entry(case, "cached")
    row = int(case.out[b, j])
    page, slot = divmod(row, C4_TOKENS_PER_PAGE)
    # bytes that belong to no token (the page's padding) are not compared ...
    case.device_kv[page, C4_SCALE_OFFSET + C4_TOKENS_PER_PAGE * 8 + 1] ^= 1
    assert _check(case)[0][1] == 0
    # ... a token's scale byte is
    case.device_kv[page, C4_SCALE_OFFSET + slot * 8 + 7] ^= 1
    counters, first = _check(case)
    assert counters[1] == 1 and (first["kind"], first["out_row"]) == (exactness.KIND_BYTES, row)
    case.device_kv[page, C4_SCALE_OFFSET + slot * 8 + 7] ^= 1
    case.device_kv[page, slot * C4_VALUE_BYTES + 575] ^= 1  # and its last value byte
    assert _check(case)[0][1] == 1


def test_the_first_mismatch_is_recorded_once_and_counts_accumulate():
    case = _case(duplicates=0)
    _swap_in(case)
    b0, j0 = pick_entry(case, "cached")
    b1, j1 = pick_entry(case, "cached", skip_rows=b0 + 1)
    case.out[b0, j0] = -1
    case.out[b1, j1] = -1
    state = exactness.new_check_state("cpu")
    counters, first = _check(case, state)
    assert counters == [_real_entries(case), 2]
    assert (first["batch_row"], first["position"]) == (b0, int(case.top_k_tokens[b0, j0]))
    case.out[b0, j0] = 10**6  # a later launch (another layer) with other faults
    counters, again = _check(case, state)
    assert counters == [2 * _real_entries(case), 4] and again == first


def test_decode_first_mismatch():
    assert exactness.decode_first_mismatch([0] * 8) is None
    assert exactness.decode_first_mismatch(torch.zeros(8, dtype=torch.int64)) is None
    rec = exactness.decode_first_mismatch([1, 6, 12, 2, 4000, 77, 91, 3])
    assert rec == dict(req_pool_idx=6, layer_id=12, batch_row=2, position=4000, out_row=77,
                       expected=91, kind=3, kind_name="bytes", message=rec["message"])
    assert rec["message"] == ("HiSparse exactness check: layer 12, batch row 2 (request slot 6), "
                              "position 4000: device row 77 does not hold the bytes of host row 91")
    with pytest.raises(ValueError, match="expected 8 values"):
        exactness.decode_first_mismatch([1, 2])


def test_argument_rules():
    case = _case()
    _swap_in(case)
    counters, first = exactness.new_check_state("cpu")
    with pytest.raises(ValueError, match="resident needs req_to_token and token_to_row"):
        exactness.check_swap_in(**check_args(case, counters, first,
                                             resident=torch.zeros(7, dtype=torch.int32)))
    with pytest.raises(ValueError, match="req_to_token and token_to_row must be given together"):
        exactness.check_swap_in(**check_args(case, counters, first,
                                             req_to_token=torch.zeros((7, 9), dtype=torch.int32)))
    with pytest.raises(ValueError, match="layout must be one of"):
        exactness.check_swap_in(**{**check_args(case, counters, first), "layout": "paged"})


# --------------------------------------------------------------------------
# speculative verify rows (draft_tokens per request, the union swap-in)


def _verify_case(seed=0, **kw):
    from kernel_cases import make_verify_case

    # short, crossing the buffer's end, at it and long (B = 64 >= 4 x 16)
    return make_verify_case(committed=[20, 62, 64, 500], draft_tokens=4, top_k=16, hot=64,
                            seed=seed, miss_rate=0.5, num_real=kw.pop("num_real", 4), **kw)


def _verify_mapping(case):
    """req_to_token / token_to_row under which every verified position maps
    to its verify slot's row, as the verify step leaves them."""
    n, hot = case.draft_tokens, case.lru.size(1)
    max_reqs, ctx = case.lru.size(0), case.host_locs.size(1)
    req_to_token = torch.arange(max_reqs * ctx, dtype=torch.int32).reshape(max_reqs, ctx)
    token_to_row = torch.full((max_reqs * ctx,), -1, dtype=torch.int64)
    for g in range(case.req_pool_indices.numel()):
        r, s = int(case.req_pool_indices[g]), int(case.seq_lens[g * n]) - 1
        for j in range(n):
            slot = s + j if s < hot else hot + j
            token_to_row[r * ctx + s + j] = int(case.slot_locs[r, slot])
    return dict(req_to_token=req_to_token, token_to_row=token_to_row)


@pytest.mark.parametrize("seed", range(3))
def test_a_verify_step_is_exact(seed):
    case = _verify_case(seed)
    ref.swap_in(*case.args(), draft_tokens=4)
    counters, first = _check(case, **_verify_mapping(case))
    assert counters == [4 * 4 * 16, 0] and first is None
    # padding requests: none of their 4 rows is checked
    case = _verify_case(seed, num_real=3)
    ref.swap_in(*case.args(), draft_tokens=4)
    case.out[12:] = 777
    assert _check(case, **_verify_mapping(case)) == ([3 * 4 * 16, 0], None)


@pytest.mark.parametrize("fault", ["other_slot", "unmapped"])
def test_a_verified_position_read_or_mapped_wrong_is_caught(fault):
    case = _verify_case(1)
    ref.swap_in(*case.args(), draft_tokens=4)
    mapping = _verify_mapping(case)
    # request 3 (long, S = 500): its row 2 selects 502, read from slot B + 2
    b = 3 * 4 + 2
    (j,) = (case.top_k_tokens[b] == 502).nonzero()[0].tolist()
    r, right = int(case.req_pool_indices[3]), int(case.out[b, j])
    assert right == int(case.slot_locs[r, 64 + 2])
    if fault == "other_slot":
        case.out[b, j] = int(case.slot_locs[r, 64 + 1])  # the row of 501
    else:
        mapping["token_to_row"][r * case.host_locs.size(1) + 502] = 123456
    counters, first = _check(case, **mapping)
    assert counters[1] >= 1
    assert (first["kind_name"], first["position"], first["batch_row"]) == ("newest", 502, b)
