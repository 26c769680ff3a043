"""Residency: a request keeps its whole KV on the GPU after prefill until rows
run short, then is demoted to a hot buffer. Real SGLang pools on CPU; every
test counts logical, physical, host and request slots back to the start."""

import pytest
import torch

from dataplane_fixtures import PS, get_tag, release
from test_coordinator import HOT, TOPK, Env
from sglang_hisparse.engine.state import ReqState

P = HOT + PS  # a hot buffer with its newest-token page


def resident_env(phys=1024):
    return Env(phys=phys, ratio=4, residency=True)


def swap(env, reqs, rpi, seq, picks):
    topk = torch.full((len(reqs), TOPK), -1, dtype=torch.int32)
    for i, toks in enumerate(picks):
        topk[i, : len(toks)] = torch.tensor(toks, dtype=torch.int32)
    env.coord.num_real_reqs.fill_(len(reqs))
    out = env.coord.swap_in_selected_pages(rpi, seq, topk, 1)
    return [get_tag(env.pool.kv_buffer[1], out[i, : len(t)]) for i, t in enumerate(picks)]


def test_lone_request_decodes_resident_without_host_io():
    env = resident_env()
    a = env.staged("a", 300)
    assert env.coord.collect_ready_reqs() == [a] and not a.hisparse_staging
    assert env.coord.req_resident[a.req_pool_idx] == 1
    free_after_prefill = env.alloc.physical_available_size()
    for _ in range(70):  # crosses a page boundary: a fresh page, then rows after it
        rpi, seq = env.decode([a])
    assert env.coord.host_bytes_written == 0
    assert env.host.available_size() == env.start["host"]  # not a host page taken
    assert env.alloc.physical_available_size() == free_after_prefill - PS
    picks = [[0, 5, 299, 300, 331, 369, 200]]
    assert swap(env, [a], rpi, seq, picks) == picks
    stats = env.coord.get_hisparse_stats()
    assert stats["misses"] == 0 and stats["resident_reqs"] == 1
    env.finish(a)
    assert env.drained()


def test_admission_demotes_the_largest_resident():
    env = resident_env(phys=1024)
    a = env.staged("a", 600)
    b = env.staged("b", 200)
    env.coord.collect_ready_reqs()
    rpi, seq = env.decode([a, b])
    # 1024 - 640 - 256 = 128 rows free; admission also counts what demoting
    # `a` gives back (640 + 64 held - P)
    assert env.alloc.available_size() >= 128 + 704 - P
    c = env.staged("c", 500)  # needs 512 rows: `a` is demoted to make room
    assert env.coord.demotions == 1
    assert env.coord.state_of(a) is ReqState.HOT
    assert env.coord.state_of(b).is_resident
    assert int(env.coord.req_device_buffer_size[a.req_pool_idx]) == P
    host_rows = env.coord.req_to_host_pool[a.req_pool_idx, :601]
    assert get_tag(env.host.kv_buffer[1], host_rows) == list(range(601))  # all it had
    env.coord.collect_ready_reqs()
    rpi, seq = env.decode([a, b, c])  # a: no write-through, the demotion copied it
    # a now serves old positions from host, the others stay resident
    picks = [[3, 450, 600, 601], [10, 199, 201], [0, 499, 500]]
    assert swap(env, [a, b, c], rpi, seq, picks) == picks
    assert env.coord.get_hisparse_stats()["misses"] == 2  # 450 and 600 for `a`
    rpi, seq = env.decode([a, b, c])
    assert get_tag(env.host.kv_buffer[1], env.coord.req_to_host_pool[a.req_pool_idx, 601:602]) == [601]
    for r in (a, b, c):
        env.finish(r)
    assert env.drained()


def test_growth_demotes_when_rows_run_out():
    env = resident_env(phys=512)
    a = env.staged("a", 320)  # 320 rows; P = 192
    b = env.staged("b", 120)  # 128 rows, may still grow to P (held back)
    env.coord.collect_ready_reqs()
    assert env.alloc.physical_available_size() == 512 - 320 - 128
    for _ in range(70):
        rpi, seq = env.decode([a, b])
    # a's next page did not fit beside b's reserved growth: a was demoted
    assert env.coord.demotions == 1 and not env.coord.state_of(a).is_resident
    picks = [[0, 319, 360, 389], [0, 150, 189]]
    assert swap(env, [a, b], rpi, seq, picks) == picks
    env.finish(a)
    env.finish(b)
    assert env.drained()


@pytest.mark.parametrize("state", ["ready", "running", "ready_demoted"])
def test_abort_and_retract_of_residents_return_everything(state):
    env = resident_env()
    a = env.staged("a", 700)
    if state == "ready_demoted":
        env.coord.reclaim_rows(1)  # demoted before it ever joined the batch
        assert env.coord.demotions == 1
    if state == "running":
        env.coord.collect_ready_reqs()
        env.decode([a])
        env.coord.retract_req(a)
    else:
        env.coord.abort_staging_request(a)
    release(env.r2t, env.alloc, a)
    assert not env.coord.has_ongoing_staging()
    assert env.drained()


def test_residency_off_stages_as_before(monkeypatch):
    monkeypatch.setenv("SGLANG_HISPARSE_RESIDENCY", "0")
    from dataplane_fixtures import dsa_pool, req_pool
    from sglang_hisparse.pools.allocator import HiSparseDualAllocator
    from sglang_hisparse.adapter.model_runner import HiSparseCoordinator

    pool = dsa_pool(1024)
    alloc = HiSparseDualAllocator(1024, PS, torch.bfloat16, "cpu", pool, False, 2)
    coord = HiSparseCoordinator(req_pool(8, 2048), alloc, TOPK, HOT, "cpu", None, 2)
    assert coord.residency.enabled is False


def test_available_size_is_the_composed_budget():
    # The one-walk available_size must equal the sub-allocators' own budgets.
    env = resident_env(phys=1024)
    a = env.staged("a", 600)
    b = env.staged("b", 60)
    env.coord.collect_ready_reqs()
    env.coord.reclaim_rows(1)  # a: hot buffer; b: short resident
    env.decode([a, b])
    alloc = env.alloc
    composed = min(alloc.logical_attn_allocator.available_size(),
                   alloc.hisparse_attn_allocator.available_size() + env.coord.reclaimable_rows())
    assert alloc.available_size() == composed
    env.finish(a)
    env.finish(b)
    assert env.drained()
