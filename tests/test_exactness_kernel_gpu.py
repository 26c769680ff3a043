"""The CUDA exactness check against its torch reference (needs a GPU).

Each case is swapped in by the reference on CPU, one fault is planted (or
none), and both checks run on the same state: the counters and the
first-mismatch record must be equal. Also under CUDA-graph capture and
replay, where the record and the counters must follow what the replays
see. Set HISPARSE_TEST_SEED to replay a failing seed.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kernel_cases import FAULTS, check_args, make_case, make_residency, plant_fault
from sglang_hisparse.kernels import exactness
from sglang_hisparse.kernels import reference as ref

pytestmark = pytest.mark.gpu


def _seed() -> int:
    fixed = os.environ.get("HISPARSE_TEST_SEED")
    return int(fixed) if fixed else random.SystemRandom().randrange(1 << 30)


def _state_after_swap_in(layout, seed, *, residency, big=False, **kw):
    shape = (dict(seq_lens=[70000, 3000, 9000, 4096, 20000], top_k=2048, hot=4096, page=64,
                  item_bytes=1152) if big else
             dict(seq_lens=[900, 40, 1500, 129, 300], top_k=64, hot=128, page=4, item_bytes=656))
    gen = random.Random(seed)
    case = make_case(**shape, layout=layout, seed=seed, miss_rate=0.5, pad_top_k=5,
                     duplicates=2, num_real=4, index_dtype=gen.choice((torch.int32, torch.int64)),
                     req_dtype=gen.choice((torch.int32, torch.int64)), **kw)
    # batch row 1 resident, row 0 not: both kinds of request take part
    res = make_residency(case, seed, resident_rows=[1], plain_rows=[0]) if residency else {}
    if layout == "dsv4_c4":  # never resident; the check gets the mapping only (and ignores it)
        ref.swap_in(*case.args(), layout=layout)
        return case, {k: v for k, v in res.items() if k != "resident"}
    ref.swap_in(*case.args(), layout=layout, **res)
    return case, res


def _both(case, res, layer_id=9):
    """(reference counters, first), (CUDA counters, first) on the same state."""
    want = exactness.new_check_state("cpu")
    exactness.check_swap_in(**check_args(case, *want, layer_id=layer_id, **res))
    gpu = case.clone("cuda", pin_host=True)
    got = exactness.new_check_state("cuda")
    exactness.check_swap_in(**check_args(gpu, *got, layer_id=layer_id,
                                         **{k: v.cuda() for k, v in res.items()}))
    torch.cuda.synchronize()
    return [t.tolist() for t in want], [t.cpu().tolist() for t in got]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("layout", ["rows", "dsv4_c4"])
def test_cuda_check_equals_the_reference(layout, fault):
    seed = _seed()
    residency = fault in ("resident", "newest_mapping") or seed % 2 == 0
    if layout == "dsv4_c4" and fault in ("resident", "newest_mapping"):
        pytest.skip("C4 requests are never resident, and its newest row's mapping is not compared")
    case, res = _state_after_swap_in(layout, seed, residency=residency)
    plant_fault(case, fault, res or None)
    want, got = _both(case, res)
    assert got == want, f"seed={seed} layout={layout} fault={fault}"
    assert want[0][0] == 4 * case.top_k_tokens.size(1)
    assert (want[0][1] == 0) == (fault in ("none", "padding_garbage")), (seed, want)


@pytest.mark.parametrize("fault", ["none", "device_byte", "resident"])
def test_production_sizes(fault):
    seed = _seed()
    case, res = _state_after_swap_in("rows", seed, residency=True, big=True)
    plant_fault(case, fault, res)
    want, got = _both(case, res)
    assert got == want, f"seed={seed} fault={fault}"


def test_several_mismatches_count_alike_and_one_is_recorded():
    seed = _seed()
    case, res = _state_after_swap_in("rows", seed, residency=False, big=True)
    bad = case.out[:4] >= 0
    case.out[:4][bad] = -1  # every valid entry of the real rows: missing
    want, got = _both(case, res)
    assert got[0] == want[0] and want[0][1] == int(bad.sum())
    rec = exactness.decode_first_mismatch(got[1])
    b, t = rec["batch_row"], rec["position"]
    assert rec["kind"] in (exactness.KIND_MISSING_ROW, exactness.KIND_NEWEST)
    assert t in case.top_k_tokens[b].tolist() and rec["out_row"] == -1, rec


def test_check_under_cuda_graph_replay():
    """Captured once, replayed three times on changing contents: the counts
    accumulate per replay, and the record keeps the first replay's fault."""
    seed = _seed()
    case, res = _state_after_swap_in("rows", seed, residency=True)
    gpu = case.clone("cuda", pin_host=True)
    res_gpu = {k: v.cuda() for k, v in res.items()}
    counters, first = exactness.new_check_state("cuda")
    args = check_args(gpu, counters, first, layer_id=5, **res_gpu)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: the build, the checks
        exactness.check_swap_in(**args)
    torch.cuda.synchronize()
    counters.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        exactness.check_swap_in(**args)
    entries = 4 * case.top_k_tokens.size(1)
    assert counters.tolist() == [0, 0]  # capture runs nothing

    graph.replay()
    torch.cuda.synchronize()
    assert counters.tolist() == [entries, 0] and exactness.decode_first_mismatch(first) is None

    want_state = [t.cpu() for t in exactness.new_check_state("cpu")]
    for fault in ("device_byte", "newest"):
        plant_fault(case, fault, res)
        gpu.out.copy_(case.out)
        gpu.device_kv.copy_(case.device_kv)
        exactness.check_swap_in(**check_args(case, *want_state, layer_id=5, **res))
        graph.replay()
    torch.cuda.synchronize()
    assert want_state[0][1].item() > 0
    assert counters.cpu().tolist() == [entries * 3, want_state[0][1].item()]
    assert first.cpu().tolist() == want_state[1].tolist()


def test_cuda_wrapper_names_bad_arguments():
    case, _ = _state_after_swap_in("rows", _seed(), residency=False)
    gpu = case.clone("cuda", pin_host=True)
    counters, first = exactness.new_check_state("cuda")
    args = check_args(gpu, counters, first)
    for change, message in (
        (dict(out=gpu.out[:1]), "out: expected shape"),
        (dict(hot_buffer_size=gpu.slot_locs.size(1)), "hot_buffer_size: must be in"),
        (dict(host_kv=case.host_kv.clone()), "host_kv: CPU tensor must be pinned"),
        (dict(first=first[:4]), "first: expected 8 elements"),
        (dict(seq_lens=gpu.seq_lens.float()), "seq_lens: dtype must be"),
    ):
        with pytest.raises(ValueError, match=message):
            exactness.check_swap_in(**{**args, **change})
    assert counters.cpu().tolist() == [0, 0]


@pytest.mark.parametrize("fault", ["none", "other_slot", "device_byte"])
def test_cuda_check_of_verify_rows_equals_the_reference(fault):
    """A speculative verify step's rows (4 per request, the union swap-in)."""
    from kernel_cases import make_verify_case

    seed = _seed()
    case = make_verify_case(committed=[20, 126, 128, 3000, 900], draft_tokens=4, top_k=32,
                            hot=128, page=64, seed=seed, miss_rate=0.5, item_bytes=656,
                            num_real=4)
    ref.swap_in(*case.args(), draft_tokens=4)
    if fault == "other_slot":  # a verified position read from its neighbour's slot
        r = int(case.req_pool_indices[3])
        b = 3 * 4 + 3
        (j,) = (case.top_k_tokens[b] == 3003).nonzero()[0].tolist()
        case.out[b, j] = int(case.slot_locs[r, 128 + 2])
    elif fault == "device_byte":
        row = case.top_k_tokens[12]
        b, j = 3 * 4, int(((row >= 0) & (row < 3000)).nonzero()[0, 0])
        case.device_kv[int(case.out[b, j]), 3] ^= 0x20
    want, got = _both(case, {})
    assert got[0] == want[0], f"seed={seed} fault={fault}"
    if fault == "device_byte":
        # The union gives every row of a request that selects position t the
        # same slot, so each of them reads the flipped byte; the CUDA check
        # records whichever row's lane gets there first (one atomicCAS), the
        # reference the lowest. Same request, position, slot, kind.
        row = want[1][3]
        assert got[1][3] // 4 == row // 4, f"seed={seed}"
        assert want[1][4] in case.top_k_tokens[got[1][3]].tolist(), f"seed={seed}"
        got[1][3] = row
    assert got == want, f"seed={seed} fault={fault}"
    assert want[0][0] == 4 * 4 * 32 and (want[0][1] == 0) == (fault == "none")
