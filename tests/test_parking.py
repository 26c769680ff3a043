"""Parking: a staged request waits on host, holding no device row, while a
waiting prompt needs the rows; it joins later with a fresh hot buffer.
Real SGLang pools on CPU; every test counts every pool back to the start."""

import inspect
import re
from array import array
from types import SimpleNamespace

import pytest

from dataplane_fixtures import PS, get_tag, make_req, release, req_pool, set_kv_allocated_len
from test_coordinator import HOT, Env
from test_residency import swap
from sglang_hisparse.engine.policies.parking import PrefillDemand

P = HOT + PS


def parking_env(demand, phys=1024, residency=False):
    # Streaming off: these tests hold rows for the waiting prompt
    # (prefill-ahead); with streaming on it waits instead (test_streaming.py).
    env = Env(phys=phys, ratio=4, residency=residency, streaming="0")
    env.coord.set_prefill_demand(lambda: demand[0])
    return env


def park(env, **prompts):
    """Stage requests (name=prompt length) that all end up parked."""
    reqs = [env.staged(rid, n) for rid, n in prompts.items()]
    assert env.coord.collect_ready_reqs() == [] and env.coord.parked_requests() == reqs
    return reqs


def test_parks_while_a_prompt_needs_the_rows_then_joins_from_host():
    demand = [PrefillDemand(0, 900, 1, 8)]  # one request decoding elsewhere
    env = parking_env(demand)
    a = env.staged("a", 300)  # 320 rows; joining would leave 1024 - 192 = 832 < 900
    assert env.coord.collect_ready_reqs() == []
    assert a.hisparse_staging and env.coord.staged_requests() == [a]
    assert env.coord.has_ongoing_staging()
    assert env.alloc.physical_available_size() == 1024  # holds no device row
    assert env.alloc.available_size() == 1024  # and is owed none
    host_rows = env.coord.req_to_host_pool[a.req_pool_idx, :300]
    assert get_tag(env.host.kv_buffer[1], host_rows) == list(range(300))
    assert env.coord.get_hisparse_stats()["parked_reqs"] == 1
    assert env.coord.get_hisparse_stats()["joins"] == 0  # parked is not joined

    demand[0] = PrefillDemand(0, 0, 1, 8)  # the queue is prefilled
    assert env.coord.collect_ready_reqs() == [a] and not a.hisparse_staging
    assert env.coord.get_hisparse_stats()["joins"] == 1  # its wait ends here, parked time included
    assert int(env.coord.req_device_buffer_size[a.req_pool_idx]) == P
    assert bool((env.coord.req_device_buffer_tokens[:, a.req_pool_idx] == -1).all())
    rpi, seq = env.decode([a])  # no write-through: staging covered token 299
    picks = [[0, 150, 299, 300]]
    assert swap(env, [a], rpi, seq, picks) == picks
    assert env.coord.get_hisparse_stats()["misses"] == 3  # all but the newest token
    env.decode([a])
    assert get_tag(env.host.kv_buffer[1], env.coord.req_to_host_pool[a.req_pool_idx, 300:301]) == [300]
    env.finish(a)
    assert env.drained()


def test_a_short_parked_request_is_loaded_whole():
    demand = [PrefillDemand(0, 1000, 1, 8)]
    env = parking_env(demand)
    (a,) = park(env, a=60)
    demand[0] = PrefillDemand(0, 0, 1, 8)
    assert env.coord.collect_ready_reqs() == [a]
    rpi, seq = env.decode([a])
    picks = [[0, 30, 59, 60]]
    assert swap(env, [a], rpi, seq, picks) == picks
    assert env.coord.get_hisparse_stats()["misses"] == 0  # preloaded from host
    env.finish(a)
    assert env.drained()


def test_room_caps_joins():
    demand = [PrefillDemand(0, 0, 8, 8)]  # the running batch is at max_running_requests
    env = parking_env(demand)
    (a,) = park(env, a=300)
    demand[0] = PrefillDemand(0, 0, 7, 8)
    assert env.coord.collect_ready_reqs() == [a]
    env.finish(a)
    assert env.drained()


def test_an_aborted_parked_request_joins_first_and_aborts_return_everything():
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    demand = [PrefillDemand(0, 900, 1, 8)]
    env = parking_env(demand)
    a, b, c = park(env, a=300, b=400, c=200)
    b.to_finish = FINISH_ABORT()  # the abort hook's mark
    assert env.coord.collect_ready_reqs() == [b]  # one step finishes it
    env.finish(b)
    env.coord.abort_staging_request(a)  # aborted while parked: released at once
    release(env.r2t, env.alloc, a)
    assert env.coord.parked_requests() == [c]
    env.coord.retract_req(c)
    release(env.r2t, env.alloc, c)
    assert not env.coord.has_ongoing_staging()
    assert env.drained()


def test_an_empty_batch_takes_the_oldest_parked_request_whatever_waits():
    # Liveness: with nothing decoding, waiting for a prompt that may never be
    # admitted (host full, too long) could stall everything. One joins.
    demand = [PrefillDemand(0, 900, 1, 8)]
    env = parking_env(demand)
    a, b = park(env, a=300, b=300)
    demand[0] = PrefillDemand(0, 900, 0, 8)
    assert env.coord.collect_ready_reqs() == [a]  # b would leave the prompt too few rows
    assert env.coord.parked_requests() == [b]
    demand[0] = PrefillDemand(600, 0, 0, 8)  # a prefill in flight keeps its rows
    env.finish(a)
    assert env.coord.collect_ready_reqs() == [b]
    env.finish(b)
    assert env.drained()


def test_no_rows_are_held_for_a_prompt_the_device_cannot_hold():
    env = parking_env([PrefillDemand(0, 2000, 1, 8)])  # 2000 > 1024 rows
    a = env.staged("a", 300)
    assert env.coord.collect_ready_reqs() == [a]
    env.finish(a)
    assert env.drained()


def _serve(env, prompts, steps, parking):
    """A scheduler in miniature: prefill has priority (one prompt per
    iteration when its rows are available), else one decode step of the
    running batch; each request decodes ``steps`` tokens."""
    waiting = [make_req(f"r{i}", n) for i, n in enumerate(prompts)]
    page_up = lambda n: -(-n // PS) * PS
    need = lambda r: page_up(len(r.origin_input_ids)) + PS
    if parking:
        env.coord.set_prefill_demand(
            lambda: PrefillDemand(0, need(waiting[0]) if waiting else 0, len(running), 8))
    running, left, most = [], {}, 0
    from dataplane_fixtures import prefill

    while waiting or running or env.coord.has_ongoing_staging():
        for r in env.coord.collect_ready_reqs():
            running.append(r)
            left[r.rid] = steps
        most = max(most, len(running))
        if waiting and env.r2t.available_size() and env.alloc.available_size() >= need(waiting[0]):
            req = waiting.pop(0)
            prefill(env.r2t, env.alloc, req, len(req.origin_input_ids), pool=env.pool)
            # The request is no longer waiting when prefill ends.
            env.coord.admit_request_into_staging(req)
            continue
        if running:
            env.decode_and_finish(running, left)
    return most


@pytest.mark.parametrize("residency", [False, True])
@pytest.mark.parametrize("parking", [True, False])
def test_the_batch_grows_to_what_hot_buffers_allow(parking, residency):
    # 1024 rows, 600-token prompts admitted at 704 rows, 192-row hot
    # buffers. Without parking a prompt can only be admitted beside
    # (1024 - 704) // 192 = 1 hot buffer, so at most 2 run; with it the
    # prompts are prefilled first and 1024 // 192 = 5 run at once.
    env = Env(phys=1024, ratio=8, residency=residency, streaming="0")
    most = _serve(env, [600] * 8, steps=6, parking=parking)
    assert most == (5 if parking else 2)
    assert env.drained() and not env.coord.has_ongoing_staging()


@pytest.mark.parametrize("host_growth", ["1", "0"])
def test_scheduler_demand_costs_the_next_prompt_like_prefill_adder(monkeypatch, host_growth):
    # Default: the running requests' expected tokens take host rows
    # (adapter/prefill_adder.py), so the next prompt's device cost leaves
    # them out; SGLANG_HISPARSE_HOST_GROWTH=0: 0.5.13's costing, with them.
    monkeypatch.setenv("SGLANG_HISPARSE_HOST_GROWTH", host_growth)
    from sglang_hisparse.adapter.scheduler import scheduler_prefill_demand

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
        NewTokenRatioTracker,
    )

    chunked = make_req("chunked", 1000)
    set_kv_allocated_len(chunked, 512)
    runner = make_req("running", 50)
    runner.output_ids = array("q", [1, 2, 3, 4])  # 16 - 4 = 12 tokens still to come
    waiting = make_req("waiting", 600)
    slots = req_pool(1, 2048)  # one free request slot
    # The Scheduler itself cannot be built on CPU: a namespace with what the
    # hook reads of it, each a real SGLang object.
    scheduler = SimpleNamespace(
        chunked_req=chunked, running_batch=ScheduleBatch(reqs=[runner]),
        waiting_queue=[waiting],
        new_token_ratio_tracker=NewTokenRatioTracker(init=0.5, min=0.5, decay=0.0, current=0.5),
        max_running_requests=4, req_to_token_pool=slots,
    )
    ahead = 6 if host_growth == "0" else 0  # 12 tokens to come x ratio 0.5
    assert scheduler_prefill_demand(scheduler) == PrefillDemand(488, 600 + 16 + ahead + 1, 1, 4)
    slots.alloc([make_req("holder", 1)])  # no request slot: the waiting prompt cannot be admitted
    scheduler.chunked_req = None
    assert scheduler_prefill_demand(scheduler) == PrefillDemand(0, 0, 1, 4)


def test_parking_off_joins_at_once(monkeypatch):
    monkeypatch.setenv("SGLANG_HISPARSE_PARKING", "0")
    demand = [PrefillDemand(0, 900, 1, 8)]
    env = parking_env(demand)
    a = env.staged("a", 300)
    assert env.coord.collect_ready_reqs() == [a]  # the waiting prompt is ignored
    env.finish(a)
    assert env.drained()


def test_scheduler_demand_reads_attributes_the_pinned_scheduler_sets():
    # The namespace above holds these; the real Scheduler cannot be built on CPU.
    from sglang_hisparse.pinned_source import installed_sglang_root

    managers = installed_sglang_root() / "sglang" / "srt" / "managers"
    text = "".join(p.read_text() for p in managers.glob("scheduler*.py"))
    for name in ("chunked_req", "running_batch", "waiting_queue", "new_token_ratio_tracker",
                 "max_running_requests", "req_to_token_pool"):
        # assigned alone, annotated, or unpacked from a tuple
        assert re.search(rf"self\.{name}\s*[=:,]", text), name


@pytest.mark.parametrize("parking", ["1", "0"])
def test_the_hook_installs_the_scheduler_view_once(monkeypatch, parking):
    from sglang_hisparse.adapter.scheduler import scheduler_get_next_batch_to_run

    monkeypatch.setenv("SGLANG_HISPARSE_PARKING", parking)
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    # 0.5.17 passes the batches (running_batch, last_batch); earlier releases
    # read self.running_batch inside the call.
    passes_batches = "running_batch" in inspect.signature(Scheduler.get_next_batch_to_run).parameters

    def call(original, running):
        scheduler.running_batch = running
        kwargs = {"running_batch": running, "last_batch": None} if passes_batches else {}
        return scheduler_get_next_batch_to_run(original, scheduler, **kwargs)

    env = Env(phys=1024, ratio=4)
    scheduler = SimpleNamespace(hisparse_coordinator=env.coord)
    first_batch, second_batch = ScheduleBatch(reqs=[]), ScheduleBatch(reqs=[])
    assert call(lambda s, **kw: "batch", first_batch) == "batch"
    first = env.coord.prefill_demand_provider
    assert (first is not None) == (parking == "1") and env.coord.prefill_demand_installed
    call(lambda s, **kw: None, second_batch)
    assert env.coord.prefill_demand_provider is first  # not rebuilt every step
    if first is not None:  # it reads the running batch of the call in progress
        assert first.running_batch is second_batch
