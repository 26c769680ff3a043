"""The benchmark-only synthetic top-k (SGLANG_HISPARSE_SYNTHETIC_TOPK): its
switch, the trace's shape, its calibration through the swap-in itself, that
the coordinator uses it, and (GPU) that the CUDA kernel equals the torch
version bit for bit."""

from __future__ import annotations

import pytest
import torch

from sglang_hisparse.config import env_problems
from sglang_hisparse.kernels import synthetic_top_k as st

TOPK = 2048


def test_switch_values():
    assert st.parse("") is None and st.parse("0") is None
    assert st.parse("calibrated") == st.CALIBRATED
    assert st.parse("period=3,recent=16,bias=1,seed=9") == st.SyntheticTrace(3, 16, 1, 9)
    for bad in ("yes", "period=3", "period=3,recent=1,bias=1,depth=2", "period=0,recent=1,bias=1",
                "period=3,period=4,recent=1,bias=1", "period=-1,recent=1,bias=1"):
        with pytest.raises(ValueError, match="SGLANG_HISPARSE_SYNTHETIC_TOPK"):
            st.parse(bad)
    # checked with the other switches, before any weights load
    assert env_problems({"SGLANG_HISPARSE_SYNTHETIC_TOPK": "calibrated"}) == []
    (problem,) = env_problems({"SGLANG_HISPARSE_SYNTHETIC_TOPK": "lots"})
    assert "SGLANG_HISPARSE_SYNTHETIC_TOPK='lots' is not valid; allowed: 0, calibrated" in problem


def test_trace_shape():
    trace = st.SyntheticTrace(period=4, recent=32, bias=2)
    rpi = torch.tensor([3, 5], dtype=torch.int64)
    seq = torch.tensor([20000, 100], dtype=torch.int32)
    a = st.reference(rpi, seq, 7, TOPK, trace)
    assert a.dtype == torch.int32 and a.shape == (2, TOPK)
    # the newest positions first
    assert a[0, :32].tolist() == list(range(19999, 19967, -1))
    # older entries inside the context before the window; a short sequence
    # has fewer older positions than entries: the rest are -1
    assert int(a[0, 32:].min()) >= 0 and int(a[0, 32:].max()) < 20000 - 32
    assert int(a[1, :32].min()) == 100 - 32 and int(a[1].max()) == 99
    assert int((a[1] >= 0).sum()) <= 100 and bool((a[1, 32 + 100:] == -1).all())
    # a pure function of (slot, length, layer): same inputs, same trace;
    # another layer or slot, another one
    assert torch.equal(a, st.reference(rpi, seq, 7, TOPK, trace))
    assert not torch.equal(a[0], st.reference(rpi, seq, 8, TOPK, trace)[0])
    assert not torch.equal(a[0], st.reference(rpi.flip(0), seq, 7, TOPK, trace)[1])
    # one step on: about 1/period of the older entries move, the window slides
    b = st.reference(rpi, seq + 1, 7, TOPK, trace)
    moved = int((a[0, 32:] != b[0, 32:]).sum())
    assert abs(moved - (TOPK - 32) / 4) < 0.2 * (TOPK - 32) / 4
    assert b[0, 0] == 20000
    # no position twice in a row, at any length
    for L in (100, 2100, 20000, 20001, 131072):
        row = st.reference(rpi[:1], torch.tensor([L]), 7, TOPK, trace)[0]
        valid = row[row >= 0]
        assert valid.unique().numel() == valid.numel(), L
    # bias leans the moved entries to recent positions
    flat = st.reference(rpi[:1], seq[:1], 7, TOPK, st.SyntheticTrace(4, 32, 1))
    lean = st.reference(rpi[:1], seq[:1], 7, TOPK, st.SyntheticTrace(4, 32, 4))
    assert float(lean[0, 32:].float().mean()) > float(flat[0, 32:].float().mean()) + 3000


def test_calibrated_trace_misses_like_the_paper():
    # Through the swap-in (the torch reference on CPU): ~13% at 32K contexts
    # with a hot buffer of 4096; a trace with no locality misses most entries.
    rate = st.simulate_miss_rate(st.CALIBRATED, seq_len=32768, steps=60, warmup=60)
    assert 0.11 <= rate <= 0.15, rate
    assert st.simulate_miss_rate(st.SyntheticTrace(1, 0, 1), steps=8, warmup=8) > 0.6


def test_coordinator_swaps_in_the_trace(monkeypatch):
    from test_coordinator import Env

    monkeypatch.setenv("SGLANG_HISPARSE_SYNTHETIC_TOPK", "period=2,recent=8,bias=1")
    env = Env()
    assert env.coord.synthetic_trace == st.SyntheticTrace(2, 8, 1)
    a = env.staged("a", 300)
    env.coord.collect_ready_reqs()
    rpi, seq = env.decode([a])
    ignored = torch.full((1, env.coord.top_k), -1, dtype=torch.int32)  # the indexer's choice
    env.coord.num_real_reqs.fill_(1)
    out = env.coord.swap_in_selected_pages(rpi, seq, ignored, 0)
    want = st.reference(rpi, seq, 0, env.coord.top_k, env.coord.synthetic_trace)
    from test_coordinator import get_tag

    valid = want[0] >= 0
    assert int(valid.sum()) > 8
    assert get_tag(env.pool.kv_buffer[0], out[0][valid]) == want[0][valid].tolist()
    env.finish(a)
    assert env.drained()


@pytest.mark.gpu
def test_kernel_equals_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for trace in (st.CALIBRATED, st.SyntheticTrace(5, 0, 3, 77), st.SyntheticTrace(1, 2048, 1)):
        for idx_dtype in (torch.int32, torch.int64):
            rpi = torch.tensor([0, 9, 31, 4], dtype=idx_dtype)
            seq = torch.tensor([40000, 1, 2100, 131072], dtype=idx_dtype)
            out = torch.full((4, TOPK + 64), 7, dtype=torch.int32, device="cuda")[:, :TOPK]
            st.synthetic_top_k(rpi.cuda(), seq.cuda(), 13, trace, out)
            assert torch.equal(out.cpu(), st.reference(rpi, seq, 13, TOPK, trace)), (trace, idx_dtype)


@pytest.mark.gpu
def test_calibration_on_the_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gpu = st.simulate_miss_rate(st.CALIBRATED, steps=60, warmup=60, device="cuda")
    cpu = st.simulate_miss_rate(st.CALIBRATED, steps=60, warmup=60)
    assert gpu == cpu


def test_native_comparison_mode_gets_the_same_trace(monkeypatch):
    """The NATIVE-scope AROUND hook on SGLang's own swap-in substitutes the
    trace (and only in that mode); without the switch it passes through."""
    from types import SimpleNamespace

    from sglang_hisparse.adapter import native
    from sglang_hisparse.manifest import Scope, entries_for

    (entry,) = [e for e in entries_for(native_only=True) if e.scope is Scope.NATIVE]
    assert entry.impl == "sglang_hisparse.adapter.native:native_swap_in_selected_pages"
    assert entry not in entries_for(native_only=False)

    seen = []

    def original(self, req_pool_indices, compressed_seq_lens, top_k_result, layer_id):
        seen.append(top_k_result.clone())
        return "rows"

    coord = SimpleNamespace(top_k_device_locs_buffer=torch.full((4, TOPK), -1, dtype=torch.int32))
    rpi, seq = torch.tensor([1, 2]), torch.tensor([30000, 9000])
    indexer = torch.zeros((2, TOPK), dtype=torch.int32)
    for spec, want in (("", indexer), ("calibrated", st.reference(rpi, seq, 5, TOPK, st.CALIBRATED))):
        monkeypatch.setenv("SGLANG_HISPARSE_SYNTHETIC_TOPK", spec)
        native._trace.cache_clear()
        got = native.native_swap_in_selected_pages(
            original, coord, req_pool_indices=rpi, compressed_seq_lens=seq, top_k_result=indexer,
            layer_id=5)
        assert got == "rows" and torch.equal(seen[-1], want), spec
    native._trace.cache_clear()
