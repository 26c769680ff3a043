"""Coordinator lifecycle on CPU with real SGLang pools and Req objects.

Every test counts logical, physical, host and request slots back to their
starting values after finish / abort (waiting, staging, running) / retract /
shutdown.
"""

import pytest
import torch

from dataplane_fixtures import (
    drained,
    PS, abort, abort_scheduler, decode_step, dsa_pool, free_counts, get_tag, make_req, pre_alloc,
    prefill, put_tag, release, req_pool,
)
from sglang_hisparse.pools.allocator import HiSparseDualAllocator
from sglang_hisparse.adapter.model_runner import HiSparseCoordinator

HOT, TOPK = 128, 16


class Env:
    def __init__(self, phys=1024, ratio=2, host_pool=None, residency=False, tp_group=None,
                 **coordinator):
        # Most tests follow the staged path; residency has its own tests.
        self.pool = dsa_pool(phys)
        self.r2t = req_pool(8, 2048)
        self.alloc = HiSparseDualAllocator(phys, PS, torch.bfloat16, "cpu", self.pool, False, ratio)
        self.coord = HiSparseCoordinator(self.r2t, self.alloc, TOPK, HOT, "cpu", tp_group, ratio,
                                         host_pool=host_pool, residency=residency, **coordinator)
        self.host = self.coord.mem_pool_host
        self.start = self.counts()

    def counts(self):
        return free_counts(self.alloc, self.host, self.r2t)

    def staged(self, rid, n):
        req = make_req(rid, n)
        prefill(self.r2t, self.alloc, req, n, pool=self.pool)
        self.coord.admit_request_into_staging(req)
        return req

    def admitted_from_host(self, rid, n):
        """PD decode: 0.5.13's _pre_alloc, the transfer engine writes the
        prompt's KV into the host rows, then direct admission."""
        req = make_req(rid, n)
        host = pre_alloc(self.r2t, self.alloc, self.coord, req)
        for layer in range(self.pool.layer_num):
            put_tag(self.host.kv_buffer[layer], host[:n], torch.arange(n))
        self.coord.admit_request_direct(req)
        return req

    def decode(self, reqs):
        rpi, seq, out = decode_step(self.r2t, self.alloc, self.coord, reqs)
        rows = self.alloc.translate_to_physical(out)
        for layer in range(self.pool.layer_num):  # "forward" writes the new token
            put_tag(self.pool.kv_buffer[layer], rows, seq - 1)
            self.pool.kv_buffer[layer][rows, 0, 1] = float(layer + 1)
        return rpi, seq

    def decode_and_finish(self, running, left):
        """One decode step of ``running``; a request whose count in ``left``
        (rid -> tokens still to decode) reaches 0 leaves it and finishes."""
        self.decode(running)
        for r in list(running):
            left[r.rid] -= 1
            if left[r.rid] == 0:
                running.remove(r)
                self.finish(r)

    def finish(self, req):
        self.coord.request_finished(req)
        release(self.r2t, self.alloc, req)

    def drained(self):
        return drained(self)


def test_drop_in_signature():
    import inspect

    from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator as Native

    ours = list(inspect.signature(HiSparseCoordinator.__init__).parameters)
    native = list(inspect.signature(Native.__init__).parameters)
    assert ours[: len(native)] == native
    for name in ("admit_request_into_staging", "admit_request_direct", "collect_ready_reqs",
                 "has_ongoing_staging", "alloc_device_buffer", "map_last_loc_to_buffer",
                 "swap_in_selected_pages", "request_finished", "retract_req",
                 "abort_staging_request", "get_token_stats", "set_decode_producer_stream",
                 "wait_for_pending_backup", "host_token_len"):
        assert callable(getattr(HiSparseCoordinator, name))


def test_staging_to_hot_buffer_and_finish():
    env = Env()
    long_req = env.staged("long", 300)
    short_req = env.staged("short", 60)
    assert env.coord.has_ongoing_staging()
    # staging copied every prefill row of every layer to host
    idx = long_req.req_pool_idx
    host_rows = env.coord.req_to_host_pool[idx, :300]
    assert bool((host_rows >= 0).all())
    assert get_tag(env.host.kv_buffer[1], host_rows) == list(range(300))
    ready = env.coord.collect_ready_reqs()
    assert ready == [long_req, short_req] and not env.coord.has_ongoing_staging()
    assert not long_req.hisparse_staging
    assert int(env.coord.req_device_buffer_size[idx]) == HOT + PS
    assert int(env.coord.req_device_buffer_size[short_req.req_pool_idx]) == PS
    # long request: only its padded hot buffer stays on the device
    assert env.alloc.physical_available_size() == 1024 - (HOT + PS) - PS
    toks = env.coord.req_device_buffer_tokens[0, idx]
    assert toks[:HOT].tolist() == list(range(HOT)) and int(toks[HOT]) == -1
    stats = env.coord.get_token_stats()
    assert stats.device_tokens == HOT + PS + PS and stats.host_tokens == 320 + PS
    env.finish(long_req)
    env.finish(short_req)
    assert env.drained()


def test_a_finish_inside_sglangs_free_group_releases_rows_when_the_group_ends():
    """0.5.13 frees a decode step's finished requests in a free group that
    ends after the step's tokens are streamed. A hot-buffer request that
    finishes inside the group leaves the batch at once, but its rows and host
    rows (whose free syncs the device) come back when the group ends, with
    SGLang's own frees; outside a group, at once (``Env.finish``)."""
    env = Env()
    req = env.staged("long", 300)
    other = env.staged("other", 300)
    assert env.coord.collect_ready_reqs() == [req, other]
    held = env.counts()
    env.alloc.free_group_begin()  # process_batch_result_decode
    env.coord.request_finished(req)
    release(env.r2t, env.alloc, req)  # SGLang's release_kv_cache, into the group
    assert env.coord.live_request_slots() == [other.req_pool_idx]
    assert env.coord.state_of(req) is None
    assert env.counts() == {**held, "req": held["req"] + 1}  # only SGLang's request slot is back
    env.alloc.free_group_end()  # after stream_output
    assert env.counts()["physical"] == held["physical"] + HOT + PS
    assert env.counts()["host"] > held["host"]
    env.finish(other)
    assert env.drained()


def test_decode_write_through_growth_and_swap_in():
    env = Env()
    a = env.staged("a", 300)
    b = env.staged("b", 60)
    env.coord.collect_ready_reqs()
    host_before = env.host.available_size()
    rpi, seq = env.decode([a, b])  # first step after staging: no write-through
    assert env.coord.host_bytes_written == 360 * 1152 * 2
    # newest token of the long request sits in slot HOT, short one in its own slot
    assert int(env.coord.req_device_buffer_token_locs[0, a.req_pool_idx, HOT]) == int(
        env.coord.req_to_device_buffer[a.req_pool_idx, HOT])
    rpi, seq = env.decode([a, b])  # now the previous token is written through
    assert env.coord.req_to_host_pool[a.req_pool_idx, 300] >= 0
    assert env.coord.req_to_host_pool[b.req_pool_idx, 60] >= 0
    assert env.host.available_size() == host_before  # both tokens land in owned pages
    host_row = int(env.coord.req_to_host_pool[a.req_pool_idx, 300])
    assert get_tag(env.host.kv_buffer[0], [host_row]) == [300]
    # swap-in through the kernels package (torch reference on CPU)
    topk = torch.full((2, TOPK), -1, dtype=torch.int32)
    topk[0, :4] = torch.tensor([5, 250, 301, 300], dtype=torch.int32)  # hit, miss, newest, miss
    topk[1, :3] = torch.tensor([0, 61, 30], dtype=torch.int32)
    env.coord.num_real_reqs.fill_(2)
    out = env.coord.swap_in_selected_pages(rpi, seq, topk, 0)
    kv = env.pool.kv_buffer[0]
    assert get_tag(kv, out[0, :4]) == [5, 250, 301, 300]
    assert get_tag(kv, out[1, :3]) == [0, 61, 30]
    assert bool((out[0, 4:] == -1).all())
    st = env.coord.get_hisparse_stats()
    assert st["misses"] == 2 and st["hits"] == 5 and st["host_bytes_read"] == 2 * 1152
    # short request grows one page at a time up to the padded buffer
    assert int(env.coord.req_device_buffer_size[b.req_pool_idx]) == PS
    for _ in range(10):
        env.decode([a, b])
    # seq 72 > one page: a hot buffer of HOT rows is full size, so + extra page
    assert int(env.coord.req_device_buffer_size[b.req_pool_idx]) == HOT + PS
    env.finish(a)
    env.finish(b)
    assert env.drained()


def test_skip_io_switch_resolves_without_copies(monkeypatch):
    monkeypatch.setenv("SGLANG_HISPARSE_SKIP_IO", "1")
    env = Env()
    assert env.coord.skip_io
    a = env.staged("a", 300)
    env.coord.collect_ready_reqs()
    rpi, seq = env.decode([a])
    topk = torch.full((1, TOPK), -1, dtype=torch.int32)
    topk[0, :2] = torch.tensor([5, 250], dtype=torch.int32)  # hit, miss
    env.coord.num_real_reqs.fill_(1)
    kv_before = env.pool.kv_buffer[0].clone()
    out = env.coord.swap_in_selected_pages(rpi, seq, topk, 0)
    assert bool((out[0, :2] >= 0).all())  # slots are still published
    assert torch.equal(env.pool.kv_buffer[0], kv_before)  # but nothing was copied
    assert env.coord.get_hisparse_stats()["misses"] == 1
    env.finish(a)
    assert env.drained()


def test_short_request_grows_to_padded_buffer():
    env = Env()
    r = env.staged("r", HOT - PS - 2)
    env.coord.collect_ready_reqs()
    assert int(env.coord.req_device_buffer_size[r.req_pool_idx]) == PS
    for _ in range(PS + 2):
        env.decode([r])  # grows on the step that crosses the page
    assert int(env.coord.req_device_buffer_size[r.req_pool_idx]) == HOT + PS
    rpi, seq = env.decode([r])  # first long step: newest token in slot HOT
    topk = torch.full((1, TOPK), -1, dtype=torch.int32)
    topk[0, :3] = torch.tensor([0, HOT - 1, HOT], dtype=torch.int32)
    env.coord.num_real_reqs.fill_(1)
    out = env.coord.swap_in_selected_pages(rpi, seq, topk, 1)
    kv = env.pool.kv_buffer[1]
    assert get_tag(kv, out[0, :3]) == [0, HOT - 1, HOT]
    env.finish(r)
    assert env.drained()


@pytest.mark.parametrize("state", ["staging_in_flight", "staging_done", "running", "waiting_host"])
def test_abort_in_every_state_returns_everything(state):
    env = Env()
    if state == "staging_in_flight":
        env.coord.set_cpu_staging_delay(lambda: 5)
    if state == "waiting_host":
        grab = env.host.alloc_page(env.host.free_page_count() - 1)
    req = env.staged("x", 200)
    if state == "waiting_host":
        assert env.coord.has_ongoing_staging() and env.coord.get_hisparse_stats()["host_wait_reqs"] == 1
        assert env.coord.collect_ready_reqs() == []
    if state == "staging_in_flight":
        assert env.coord.collect_ready_reqs() == [] and req.hisparse_staging
    if state == "running":
        env.coord.collect_ready_reqs()
        env.decode([req])
        env.decode([req])
    # the scheduler's abort / retract path
    env.coord.retract_req(req) if state != "running" else env.coord.request_finished(req)
    release(env.r2t, env.alloc, req)
    if state == "waiting_host":
        env.host.free(grab)
    assert not env.coord.has_ongoing_staging()
    assert env.drained()


def test_host_wait_never_crashes_and_resumes():
    env = Env()
    grab = env.host.alloc_page(env.host.free_page_count() - 2)
    a = env.staged("a", 100)  # 2 pages: fits
    b = env.staged("b", 100)  # waits for host pages
    assert env.coord.collect_ready_reqs() == [a]
    assert env.coord.collect_ready_reqs() == [] and env.coord.has_ongoing_staging()
    env.finish(a)
    assert env.coord.collect_ready_reqs() == [b]
    env.host.free(grab)
    env.finish(b)
    assert env.drained()


def test_admission_counts_hot_buffer_growth_and_host():
    env = Env(phys=512)
    r = env.staged("s", 10)
    env.coord.collect_ready_reqs()
    # short request holds one page but may grow to HOT + PS
    owed_phys, _ = env.coord._owed_tokens()
    assert owed_phys == HOT + PS - PS
    assert env.alloc.available_size() == 512 - PS - owed_phys
    env.finish(r)
    assert env.drained() and env.alloc.available_size() == 512


def test_finished_right_after_prefill_is_noop_for_coordinator():
    env = Env()
    req = make_req("p", 50)
    prefill(env.r2t, env.alloc, req, 50)
    env.coord.request_finished(req)
    release(env.r2t, env.alloc, req)
    assert env.drained() and env.alloc.pending_prefill_claim() == 0


def test_retract_running_then_readmit():
    env = Env()
    req = env.staged("r", 150)
    env.coord.collect_ready_reqs()
    env.decode([req])
    env.coord.retract_req(req)
    release(env.r2t, env.alloc, req)
    assert env.drained()
    req2 = env.staged("r", 150)
    env.coord.collect_ready_reqs()
    env.finish(req2)
    assert env.drained()


class _Clock:
    """The coordinator's clock, advanced by the test."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("residency", [False, True])
def test_join_wait_runs_from_prefill_end_to_the_collect_that_joins(residency):
    # A request's first inter-token gap holds its wait outside the batch:
    # the staging copy (here in flight for two polls), or none for a resident.
    env = Env(ratio=4, residency=True) if residency else Env()
    clock = env.coord.clock = _Clock()
    env.coord.set_cpu_staging_delay(lambda: 2)
    pd = env.admitted_from_host("pd", 90)  # joins from host: no prefill here, not counted
    a = env.staged("a", 300)
    clock.now += 0.004
    joined = env.coord.collect_ready_reqs()
    if residency:
        assert joined == [a]  # keeps its prefill rows: no copy to wait for
    else:
        assert joined == []  # the copy is in flight
        clock.now += 0.010
        assert env.coord.collect_ready_reqs() == []
        clock.now += 0.006
        assert env.coord.collect_ready_reqs() == [a]
    stats = env.coord.get_hisparse_stats()
    wait = 0.004 if residency else 0.020
    assert stats["joins"] == 1
    assert stats["join_wait_s"] == pytest.approx(wait) == stats["join_wait_max_s"]
    clock.now += 1.0  # later collects count nothing again
    assert env.coord.collect_ready_reqs() == []
    assert env.coord.get_hisparse_stats()["joins"] == 1
    for req in (a, pd):
        env.finish(req)
    assert env.drained()


@pytest.mark.parametrize("n", [90, 400])
def test_direct_admission_pd_decode(n):
    env = Env()
    req = env.admitted_from_host("pd", n)
    idx = req.req_pool_idx
    rows = env.coord.req_to_device_buffer[idx]
    if n <= HOT:  # preloaded
        assert get_tag(env.pool.kv_buffer[1], [int(rows[n - 1])]) == [n - 1]
    else:
        assert bool((env.coord.req_device_buffer_tokens[:, idx] == -1).all())
    env.decode([req])
    env.finish(req)
    assert env.drained()


def test_destroy_unpins_the_host_pool_once(monkeypatch):
    # Shutdown with a copy still in flight: the host pool's buffer is handed
    # back to host_memory (cudaHostUnregister where it was registered), once
    # however often destroy() runs.
    from sglang_hisparse.pools import host_memory

    env = Env()
    env.coord.set_cpu_staging_delay(lambda: 3)
    env.staged("a", 64)
    released = []
    unpin = host_memory.release
    monkeypatch.setattr(host_memory, "release", lambda t: (released.append(t), unpin(t))[1])
    env.coord.destroy()
    assert [t.data_ptr() for t in released] == [env.host.kv_buffer.data_ptr()]
    env.coord.destroy()
    assert len(released) == 1


def test_abort_hook_around_the_real_abort_request():
    # 0.5.13's own Scheduler.abort_request, wrapped by our AROUND hook, on a
    # PD decode node: a waiting request (KV on host, hot buffer held), a
    # staged one (in no queue 0.5.13 scans), a running one, and one that
    # does not match.
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    env = Env()
    waiting = env.admitted_from_host("pd-1", 90)
    other = env.admitted_from_host("x-1", 60)
    running = env.admitted_from_host("pd-3", 70)
    env.coord.set_cpu_staging_delay(lambda: 3)
    staged = env.staged("pd-2", 100)
    sched, sent = abort_scheduler(env.coord, env.r2t, env.alloc, decode=True,
                                  waiting=[waiting, other], running=[running])
    waiting_slot = waiting.req_pool_idx

    abort(sched, "pd")

    # 0.5.13: popped from the waiting queue, told the tokenizer, freed its KV
    assert sched.waiting_queue == [other]
    assert [type(o) for o in sent] == [AbortReq] and [o.rid for o in sent] == ["pd-1"]
    assert waiting.req_pool_idx is None
    # ours, first: its hot buffer and host rows went back too
    assert waiting_slot not in env.coord.live_request_slots()
    # a running request finishes on its next step (0.5.13), a staged one on
    # its first (ours)
    assert isinstance(running.to_finish, FINISH_ABORT)
    assert isinstance(staged.to_finish, FINISH_ABORT)
    assert other.to_finish is None
    env.coord.retract_req(staged)
    release(env.r2t, env.alloc, staged)
    for req in (running, other):
        env.finish(req)
    assert env.drained()


def test_max_token_pool_size_is_logical():
    from types import SimpleNamespace

    from sglang_hisparse.adapter.model_runner import model_runner_max_token_pool_size

    env = Env()
    mr = SimpleNamespace(enable_hisparse=True, token_to_kv_pool_allocator=env.alloc,
                         is_hybrid_swa=False, max_total_num_tokens=1024)
    assert model_runner_max_token_pool_size(mr) == 2048
    mr.enable_hisparse = False
    assert model_runner_max_token_pool_size(mr) == 1024


def test_manifest_entries_check_out():
    from sglang_hisparse.manifest import ENTRIES, Scope
    from sglang_hisparse.pinned_source import sglang_version
    from sglang_hisparse.plugin import check_entry

    mine = [e for e in ENTRIES if e.impl and e.impl.startswith(("sglang_hisparse.adapter.model_runner:",
                                                                 "sglang_hisparse.pools.allocator:",
                                                                 "sglang_hisparse.adapter.scheduler:"))]
    # The coordinator, the allocator and the scheduler hooks that drive them
    # (streaming's, the rebootstrap retraction's and the idle leak check's
    # included): each acts only while the data plane is ours.
    assert sorted(e.impl.rsplit(":", 1)[1] for e in mine) == [
        "HiSparseCoordinator", "HiSparseDualAllocator", "hisparse_indexer_cell_size",
        "model_runner_max_token_pool_size", "release_req_without_offload",
        "scheduler_abort_request", "scheduler_get_new_batch_prefill",
        "scheduler_get_next_batch_to_run", "scheduler_on_idle"]
    assert all(e.scope is Scope.DATA_PLANE for e in mine)
    for e in mine:
        if not e.applies_to(sglang_version()):
            continue  # a seam of earlier pins only (native later)
        c = check_entry(e, sglang_version())
        assert c.ok, (e.target, c.detail)


def test_real_request_count_writes_only_changes():
    from sglang_hisparse.engine.streams import RealRequestCount

    count = RealRequestCount("cpu")
    assert int(count.tensor[0]) == 0
    count.tensor = _CountingTensor()  # records the fills that reach the device
    for n in (3, 3, 3, 5, 5, 0, 0, 3):
        count.fill_(n)
        assert count.item() == n and count.tensor.value == n
    assert count.tensor.writes == [3, 5, 0, 3]


class _CountingTensor:
    def __init__(self):
        self.writes, self.value = [], 0

    def fill_(self, v):
        self.writes.append(v)
        self.value = v
        return self


def test_pinned_sglang_only_fills_num_real_reqs():
    # The coordinator's num_real_reqs is a RealRequestCount, not a tensor: the
    # pinned sources may only call fill_ on it.
    import re

    from sglang_hisparse.pinned_source import installed_sglang_root

    root = installed_sglang_root() / "sglang" / "srt"
    uses = []
    for path in root.rglob("*.py"):
        if "hisparse" in path.name:
            continue  # SGLang's own HiSparse, never called by ours
        uses += re.findall(r"num_real_reqs\b(\.?\w*\(?)", path.read_text())
    assert uses and set(uses) == {".fill_("}, uses


def test_pool_stats_set_in_place_match_sglang_copy():
    # SGLang asks for pool stats on every streamed output; ours sets the
    # HiSparse fields on the fresh PoolStats instead of copying it, and every
    # field must come out as 0.5.13's dataclasses.replace makes them.
    import dataclasses

    from sglang.srt.managers.scheduler_components.pool_stats_observer import (
        PoolStats, SchedulerPoolStatsObserver,
    )

    from sglang_hisparse.adapter.metrics import pool_stats_with_hisparse

    env = Env()
    req = env.staged("r", 300)
    env.coord.collect_ready_reqs()
    fields = {f.name: None for f in dataclasses.fields(SchedulerPoolStatsObserver)}
    observer = SchedulerPoolStatsObserver(**dict(
        fields, hisparse_coordinator=env.coord, enable_hisparse=True))
    fresh = lambda: PoolStats(full_num_used=7, full_token_usage=0.25,  # noqa: E731
                              full_available_size=9, full_evictable_size=0)
    h = env.coord.get_token_stats()
    sglang = dataclasses.replace(
        fresh(), is_hisparse=True, hisparse_device_tokens=h.device_tokens,
        hisparse_device_token_usage=h.device_token_usage, hisparse_host_tokens=h.host_tokens,
        hisparse_host_token_usage=h.host_token_usage)
    ours = pool_stats_with_hisparse(observer, fresh())
    assert dataclasses.asdict(ours) == dataclasses.asdict(sglang)
    assert ours.hisparse_host_tokens > 0 and ours.hisparse_device_tokens > 0
    off = SchedulerPoolStatsObserver(**dict(fields, enable_hisparse=False))
    plain = fresh()
    assert pool_stats_with_hisparse(off, plain) is plain and not plain.is_hisparse
    env.finish(req)
    assert env.drained()
