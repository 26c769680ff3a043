"""The idle leak check that takes the place of the one SGLang skips under
HiSparse (``Coordinator.idle_leaks``, the AFTER hook on ``Scheduler.on_idle``).
Real SGLang pools on CPU, DSA and DeepSeek-V4; a leak is planted by taking a
row and not giving it back."""

import logging
from types import SimpleNamespace

import test_dsv4
from dataplane_fixtures import release
from test_coordinator import Env
from sglang_hisparse.adapter.scheduler import scheduler_on_idle


def idle_scheduler(coord, idle=True):
    """What the hook reads of 0.5.13's Scheduler after ``on_idle``."""
    return SimpleNamespace(hisparse_coordinator=coord, is_fully_idle=lambda: idle)


def test_quiet_after_requests_come_and_go_then_names_the_leaked_pool():
    env = Env()
    coord = env.coord
    assert coord.idle_leaks() == []  # the first idle check: the baseline
    a = env.staged("a", 300)
    assert coord.idle_leaks() == []  # holds a request: nothing compared
    assert coord.collect_ready_reqs() == [a]
    env.decode([a])
    env.finish(a)
    assert env.drained() and coord.idle_leaks() == []

    b = env.staged("b", 200)  # aborted while staging: the scheduler's abort path
    coord.retract_req(b)
    release(env.r2t, env.alloc, b)
    assert coord.idle_leaks() == []

    page = env.host.alloc_page(1)  # a host page nobody gives back
    leaks = coord.idle_leaks()
    assert len(leaks) == 1 and leaks[0].startswith("host rows: ")
    free_now = env.host.available_size()
    assert leaks[0] == f"host rows: {free_now} free ({env.start['host']} at the first idle check)"
    env.host.free(page)
    assert coord.idle_leaks() == []


def test_device_and_logical_rows_too():
    env = Env()
    coord = env.coord
    assert coord.idle_leaks() == []
    held = env.alloc.hisparse_attn_allocator.alloc(64)  # device rows outside any request
    assert [x.split(":")[0] for x in coord.idle_leaks()] == ["device rows"]
    env.alloc.hisparse_attn_allocator.free(held)
    assert coord.idle_leaks() == []


def test_deepseek_v4_counts_full_swa_and_c4():
    env = test_dsv4.Env()
    coord = env.coord
    assert set(coord.pool_free_counts()) == {"device rows", "host rows", "request slots",
                                             "full tokens", "swa tokens"}
    assert coord.idle_leaks() == []
    req = env.staged("v4", 1000)
    assert coord.collect_ready_reqs() == [req]
    env.decode([req])
    env.finish(req)
    assert env.drained() and coord.idle_leaks() == []


def test_the_hook_warns_with_sglangs_reporter_only_when_fully_idle(caplog):
    env = Env()
    sched = idle_scheduler(env.coord)
    assert scheduler_on_idle(None, sched) is None  # baseline, nothing to say
    page = env.host.alloc_page(1)
    with caplog.at_level(logging.WARNING):
        scheduler_on_idle(None, idle_scheduler(env.coord, idle=False))  # busy: not checked
        assert not caplog.records
        for _ in range(3):
            assert scheduler_on_idle(None, sched) is None  # warns, never raises
    # SGLang's reporter: the first time, then every 1000th
    assert [r.getMessage() for r in caplog.records] == [
        f"HiSparse pool memory leak detected! host rows: {env.host.available_size()} free "
        f"({env.start['host']} at the first idle check)"]
    assert sched.count_hisparse_leak_warnings == 3
    env.host.free(page)
    assert scheduler_on_idle(None, SimpleNamespace(is_fully_idle=lambda: True)) is None  # no HiSparse
