"""The in-server exactness check through the coordinator (torch reference on
CPU): clean steps report 0 mismatches over many checked entries, for hot
buffers with misses and for residents; a planted fault is named."""

import torch

from dataplane_fixtures import release
from test_coordinator import HOT, TOPK, Env


def _checked_env(residency=False):
    env = Env(residency=residency)
    coord = env.coord
    # what SGLANG_HISPARSE_CHECK=1 turns on (the env var is read at construction)
    from sglang_hisparse.engine.exactness import ExactnessCheck

    coord.exactness = ExactnessCheck(coord)
    return env


def _step(env, reqs, gen):
    rpi, seq = env.decode(reqs)
    topk = torch.full((len(reqs), TOPK), -1, dtype=torch.int32)
    for b, n in enumerate(seq.tolist()):
        k = min(TOPK, n)
        topk[b, :k] = torch.randperm(n, generator=gen)[:k].to(torch.int32)
        topk[b, 0] = n - 1  # the newest token is always selected
    env.coord.num_real_reqs.fill_(len(reqs))
    for layer in range(env.pool.layer_num):
        env.coord.swap_in_selected_pages(rpi, seq, topk, layer)
    return rpi, seq, topk


def test_clean_steps_report_no_mismatch_and_host_misses_happen():
    env = _checked_env()
    gen = torch.Generator().manual_seed(0)
    a, b = env.staged("a", 700), env.staged("b", 90)  # a is longer than the hot buffer
    assert env.coord.collect_ready_reqs() == [a, b]
    for _ in range(6):
        _step(env, [a, b], gen)
    st = env.coord.get_hisparse_stats()
    assert st["exact_checked"] >= 6 * 2 * env.pool.layer_num * 8 and st["exact_mismatches"] == 0
    assert st["misses"] > 0  # host rows were read, and checked
    for req in (a, b):
        env.coord.request_finished(req)
        release(env.r2t, env.alloc, req)


def test_residents_are_checked_too():
    env = _checked_env(residency=True)
    gen = torch.Generator().manual_seed(1)
    a = env.staged("a", 500)
    assert env.coord.collect_ready_reqs() == [a] and env.coord.state_of(a).is_resident
    for _ in range(3):
        _step(env, [a], gen)
    st = env.coord.get_hisparse_stats()
    assert st["exact_checked"] > 0 and st["exact_mismatches"] == 0
    env.coord.request_finished(a)
    release(env.r2t, env.alloc, a)


def test_a_skipped_copy_is_caught_and_named(caplog):
    env = _checked_env()
    gen = torch.Generator().manual_seed(2)
    a = env.staged("a", 700)
    assert env.coord.collect_ready_reqs() == [a]
    _step(env, [a], gen)
    # Plant a fault: skip the host copies of one step (the skip-IO timing
    # probe), selecting a position no slot holds, so it must be copied.
    slots = env.coord.req_device_buffer_tokens[:, a.req_pool_idx]
    assert not bool((slots == 400).any())
    env.coord.skip_io = True
    rpi, seq = env.decode([a])
    topk = torch.full((1, TOPK), -1, dtype=torch.int32)
    topk[0, :3] = torch.tensor([int(seq[0]) - 1, 400, 3], dtype=torch.int32)
    for layer in range(env.pool.layer_num):
        env.coord.swap_in_selected_pages(rpi, seq, topk, layer)
    with caplog.at_level("ERROR"):
        st = env.coord.get_hisparse_stats()
    assert st["exact_mismatches"] >= env.pool.layer_num  # position 400 in every layer (3 may miss too)
    first = env.coord.exactness.first_mismatch
    assert first["req_pool_idx"] == a.req_pool_idx and first["layer_id"] == 0
    assert first["position"] == 400
    assert "first mismatch" in caplog.text
    env.coord.request_finished(a)
    release(env.r2t, env.alloc, a)


def test_graph_capture_warmup_rows_are_not_counted():
    # SGLang's capture warm-up runs the forward on dummy rows it declares
    # real (slot 0, seq_len 1) before any request: the check must start
    # counting only at the first decode step the scheduler prepares.
    env = _checked_env()
    coord = env.coord
    rpi = torch.zeros(2, dtype=torch.int64)
    seq = torch.ones(2, dtype=torch.int64)
    topk = torch.full((2, TOPK), -1, dtype=torch.int32)
    topk[:, 0] = 0
    coord.num_real_reqs.fill_(2)
    coord.swap_in_selected_pages(rpi, seq, topk, 0)
    assert coord.exactness.read()["exact_mismatches"] > 0  # what capture looked like
    a = env.staged("a", 300)
    assert coord.collect_ready_reqs() == [a]
    _step(env, [a], torch.Generator().manual_seed(3))
    st = coord.get_hisparse_stats()
    assert st["exact_checked"] > 0 and st["exact_mismatches"] == 0
    coord.request_finished(a)
    release(env.r2t, env.alloc, a)
