"""SGLang's real ``PrefillAdder`` and ``ScheduleBatch.check_decode_mem`` over
our allocator, with and without the hooks of ``adapter/prefill_adder.py``:
the running requests' decode growth takes host rows, not device rows.

Three requests of 300 tokens run (each holds its padded hot buffer, HOT + PS
= 192 device rows: 448 of 1024 stay free); the host holds 8 x 1024 rows.
0.5.13 charges their expected tokens to min(host, device) and refuses a
prompt the device can hold; with the hooks it is admitted, while a prompt the
device cannot hold, or growth the host cannot hold, is still refused. The
hooks are installed the way ``HookRegistry`` installs AFTER and AROUND hooks.
"""

import functools

import pytest

from dataplane_fixtures import PS, chunk_cache, decode_batch, make_req, prefill, sglang_server_args
from test_coordinator import HOT, Env
from sglang_hisparse.adapter import prefill_adder as hooks


@pytest.fixture
def adder_cls(request, monkeypatch):
    """``PrefillAdder``, hooked when the test is parametrized with "hooked"
    (then its ``hooked`` attribute is set for the test)."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    if request.param == "hooked":
        init, ignore_eos = PrefillAdder.__init__, PrefillAdder.add_one_req_ignore_eos
        add_one = PrefillAdder.add_one_req

        @functools.wraps(init)
        def after_init(self, *args, **kwargs):
            return hooks.adder_init_growth_on_host(init(self, *args, **kwargs), self, *args, **kwargs)

        @functools.wraps(ignore_eos)
        def around_ignore_eos(self, *args, **kwargs):
            return hooks.adder_add_one_req_ignore_eos(ignore_eos, self, *args, **kwargs)

        @functools.wraps(add_one)
        def around_add_one(self, *args, **kwargs):
            return hooks.adder_add_one_req(add_one, self, *args, **kwargs)

        monkeypatch.setattr(PrefillAdder, "__init__", after_init)
        monkeypatch.setattr(PrefillAdder, "add_one_req", around_add_one)
        monkeypatch.setattr(PrefillAdder, "add_one_req_ignore_eos", around_ignore_eos)
    monkeypatch.setattr(PrefillAdder, "hooked", request.param == "hooked", raising=False)
    with sglang_server_args():
        yield PrefillAdder


def _req(rid, n, max_new, ignore_eos):
    req = make_req(rid, n)
    req.sampling_params.max_new_tokens = max_new
    req.sampling_params.ignore_eos = ignore_eos
    return req


def _running(env, max_new, ignore_eos=True):
    reqs = [env.staged(f"run{i}", 300) for i in range(3)]
    assert env.coord.collect_ready_reqs() == reqs
    for r in reqs:
        r.sampling_params.max_new_tokens = max_new
        r.sampling_params.ignore_eos = ignore_eos
    return reqs


def _admit(adder_cls, env, running, *reqs):
    """One adder pass: ``add_one_req`` for each of ``reqs`` while it answers
    CONTINUE, as the scheduler calls it (SGLang's own dispatch to the
    ignore_eos path). Returns the last answer and the requests admitted."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult

    adder = adder_cls(PS, chunk_cache(env.r2t, env.alloc), env.alloc, ScheduleBatch(reqs=running),
                      0.5, 10**6, None)
    for req in reqs:
        req.init_next_round_input()
        result = adder.add_one_req(req, False, None)
        if result != AddReqResult.CONTINUE:
            break
    return result.name, [r.rid for r in adder.can_run_list]


def _finish(env, reqs):
    for r in reqs:
        env.finish(r)
    assert env.drained()


@pytest.mark.parametrize("adder_cls", ["sglang", "hooked"], indirect=True)
def test_ignore_eos_prompt_waits_for_device_rows_only_without_the_hooks(adder_cls):
    env = Env(phys=1024, ratio=8)
    running = _running(env, max_new=1000)
    logical, physical = env.alloc.budgets()
    assert physical == 1024 - 3 * (HOT + PS) and logical > 5000
    got = _admit(adder_cls, env, running, _req("w", 256, 1000, ignore_eos=True))
    # 0.5.13 simulates 4 requests x 1000 tokens against 448 device rows. The
    # hooks simulate them against the host's rows and admit it; the prompt
    # and its own clipped output (256 + 1000 + a page) then use up the
    # batch's device budget, so no further prompt joins this batch.
    assert got == (("NO_TOKEN", ["w"]) if adder_cls.hooked else ("NO_TOKEN", []))
    _finish(env, running)


@pytest.mark.parametrize("adder_cls", ["sglang", "hooked"], indirect=True)
def test_clipped_ratio_path_charges_running_growth_to_host_only_with_the_hooks(adder_cls):
    # Without ignore_eos: 3 x 1000 x 0.5 = 1500 expected tokens ahead.
    env = Env(phys=1024, ratio=8)
    running = _running(env, max_new=1000, ignore_eos=False)
    got = _admit(adder_cls, env, running, _req("w", 256, 100, ignore_eos=False))
    assert got == (("CONTINUE", ["w"]) if adder_cls.hooked else ("NO_TOKEN", []))
    _finish(env, running)


@pytest.mark.parametrize("adder_cls", ["sglang", "hooked"], indirect=True)
def test_a_prompts_own_output_takes_host_rows_only_with_the_hooks(adder_cls):
    # Prompts that stop at EOS, 128 tokens each, costed at 1000 output
    # tokens, against 448 free device rows. 0.5.13 charges 128 + 1000 + a
    # page to min(host, device) and admits none; hooked, each charges its
    # prompt and a page (192 rows) to the device side, and its output to the
    # host's: two fit beside each other, a third does not (64 rows left).
    env = Env(phys=1024, ratio=8)
    running = _running(env, max_new=10, ignore_eos=False)
    prompts = [_req(f"w{i}", 128, 1000, ignore_eos=False) for i in range(3)]
    got = _admit(adder_cls, env, running, *prompts)
    assert got == (("NO_TOKEN", ["w0", "w1"]) if adder_cls.hooked else ("NO_TOKEN", []))
    _finish(env, running)


@pytest.mark.parametrize("adder_cls", ["hooked"], indirect=True)
def test_a_prompts_output_the_host_cannot_hold_is_still_refused(adder_cls):
    # Host rows 3 x 1024, 3 x 320 held, 15 owed to the running requests'
    # growth: 128 + 1000 + a page fit once, not twice (the device holds both).
    env = Env(phys=1024, ratio=3)
    running = _running(env, max_new=10, ignore_eos=False)
    logical, physical = env.alloc.budgets()
    assert 1192 < logical - 15 < 2 * 1192 and physical == 448
    prompts = [_req(f"w{i}", 128, 1000, ignore_eos=False) for i in range(2)]
    assert _admit(adder_cls, env, running, *prompts) == ("NO_TOKEN", ["w0"])
    _finish(env, running)


@pytest.mark.parametrize("adder_cls", ["hooked"], indirect=True)
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_a_prompt_the_device_cannot_hold_is_still_refused(adder_cls, ignore_eos):
    env = Env(phys=1024, ratio=8)
    running = _running(env, max_new=1000, ignore_eos=ignore_eos)
    # 512 rows of prompt against 448 free device rows
    assert _admit(adder_cls, env, running, _req("w", 512, 10, ignore_eos)) == ("NO_TOKEN", [])
    _finish(env, running)


@pytest.mark.parametrize("adder_cls", ["hooked"], indirect=True)
def test_growth_the_host_cannot_hold_is_still_refused(adder_cls):
    # 4 requests x 2000 tokens to come exceed the host's free rows.
    env = Env(phys=1024, ratio=8)
    running = _running(env, max_new=2000)
    logical, _ = env.alloc.budgets()
    assert logical - 256 < 4 * 2000
    assert _admit(adder_cls, env, running, _req("w", 256, 2000, True)) == ("NO_TOKEN", [])
    _finish(env, running)


@pytest.mark.parametrize("adder_cls", ["hooked"], indirect=True)
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_host_growth_off_keeps_sglangs_costing(adder_cls, monkeypatch, ignore_eos):
    # Both admit the prompt with the hooks on (the tests above).
    monkeypatch.setenv(hooks.HOST_GROWTH_ENV, "0")
    env = Env(phys=1024, ratio=8)
    running = _running(env, max_new=1000 if ignore_eos else 10, ignore_eos=ignore_eos)
    prompt = _req("w", 256 if ignore_eos else 128, 1000, ignore_eos)
    assert _admit(adder_cls, env, running, prompt) == ("NO_TOKEN", [])
    _finish(env, running)


def test_device_growth_credit():
    # host binds: nothing to give back; device binds: up to the growth
    assert hooks.device_growth_credit(100, 500, 300) == 0
    assert hooks.device_growth_credit(1000, 500, 300) == 300
    assert hooks.device_growth_credit(600, 500, 300) == 100


def _serve(adder_cls, env, prompts, steps, max_new):
    """A scheduler in miniature whose prefill admission is SGLang's own
    ``PrefillAdder`` (ratio 0.5) and whose parking sees our
    ``scheduler_prefill_demand``: one prompt per iteration when the adder
    admits it, else one decode step of the running batch. Requests stop
    after ``steps`` tokens (as at an EOS) while ``max_new`` is what the
    adder costs them at. Before each decode step the batch runs SGLang's
    ``check_decode_mem`` (hooked where the test's ``decode_check`` fixture
    hooks it); a ``False`` there would retract a request. Returns (the
    largest running batch, the decode steps whose check said no)."""
    from types import SimpleNamespace

    from dataplane_fixtures import prefill
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
        NewTokenRatioTracker,
    )
    from sglang_hisparse.adapter.scheduler import scheduler_prefill_demand

    waiting = [_req(f"p{i}", n, max_new, ignore_eos=True) for i, n in enumerate(prompts)]
    running, left, most, refused = [], {}, 0, 0
    scheduler = SimpleNamespace(
        chunked_req=None, running_batch=ScheduleBatch(reqs=running), waiting_queue=waiting,
        new_token_ratio_tracker=NewTokenRatioTracker(init=0.5, min=0.5, decay=0.0, current=0.5),
        max_running_requests=8, req_to_token_pool=env.r2t)
    env.coord.set_prefill_demand(lambda: scheduler_prefill_demand(scheduler))
    cache = chunk_cache(env.r2t, env.alloc)
    while waiting or running or env.coord.has_ongoing_staging():
        for r in env.coord.collect_ready_reqs():
            running.append(r)
            left[r.rid] = steps
        most = max(most, len(running))
        if waiting:
            req = waiting[0]
            req.init_next_round_input()
            adder = adder_cls(PS, cache, env.alloc, ScheduleBatch(reqs=list(running)), 0.5, 10**6, None)
            adder.add_one_req(req, False, None)
            if adder.can_run_list == [req]:
                waiting.pop(0)
                prefill(env.r2t, env.alloc, req, len(req.origin_input_ids), pool=env.pool)
                env.coord.admit_request_into_staging(req)
                continue
        assert running, "nothing runs and the adder admits nothing"
        with sglang_server_args():
            refused += not decode_batch(env.r2t, env.alloc, env.coord, running).check_decode_mem()
        env.decode_and_finish(running, left)
    return most, refused


@pytest.mark.parametrize("adder_cls", ["sglang", "hooked"], indirect=True)
def test_long_outputs_no_longer_cap_the_batch_below_what_hot_buffers_allow(adder_cls):
    # 1024 device rows, 600-token prompts, 192-row hot buffers, outputs
    # costed at 100 tokens each. Parking prefills the queue while staged
    # requests wait on host, so hot buffers allow 1024 // 192 = 5 at once.
    # 0.5.13's adder simulates every running request's 100 tokens on the
    # device rows a prompt leaves, and admits a prompt only once the batch
    # has (nearly) drained: 2026-12-06-s5's 11 of 16, in miniature.
    env = Env(phys=1024, ratio=8, streaming="0")
    most, _ = _serve(adder_cls, env, [600] * 8, steps=6, max_new=100)
    assert most == (5 if adder_cls.hooked else 1)
    assert env.drained() and not env.coord.has_ongoing_staging()


@pytest.fixture
def decode_check(request, monkeypatch):
    """``ScheduleBatch.check_decode_mem``, hooked when the test is
    parametrized with "hooked" (as HookRegistry installs an AROUND hook)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    check = ScheduleBatch.check_decode_mem
    if request.param == "hooked":
        @functools.wraps(check)
        def around(self, *args, **kwargs):
            return hooks.batch_check_decode_mem(check, self, *args, **kwargs)

        monkeypatch.setattr(ScheduleBatch, "check_decode_mem", around)
    return request.param


def _full_device(env, prompt, inflight):
    """Three requests of ``prompt`` tokens decode from their hot buffers and
    a prompt of ``inflight`` tokens, mid-prefill, holds the device's other rows."""
    running = []
    for i in range(3):  # one at a time: a staging request holds its prompt's rows
        running.append(env.staged(f"run{i}", prompt))
        assert env.coord.collect_ready_reqs() == running[-1:]
    busy = make_req("inflight", inflight)
    prefill(env.r2t, env.alloc, busy, inflight)
    return running, busy


@pytest.mark.parametrize("decode_check", ["sglang", "hooked"], indirect=True)
def test_a_full_device_side_retracts_no_hot_request_with_the_hook(decode_check):
    env = Env(phys=1024, ratio=8)
    # 3 x 192 rows of hot buffer + 448 rows of prompt: nothing left on the
    # device; each request's next token (320 % 64 == 0) starts a page.
    running, busy = _full_device(env, 320, 448)
    logical, physical = env.alloc.budgets()
    assert physical == 0 and logical >= 3 * PS
    batch = decode_batch(env.r2t, env.alloc, env.coord, running)
    with sglang_server_args():
        fits = batch.check_decode_mem()
    # 0.5.13 would retract one (scheduler.update_running_batch); hooked, the
    # step runs, and takes no device row.
    assert fits is (decode_check == "hooked")
    free_rows = env.alloc.hisparse_attn_allocator.raw_available_size()
    env.decode(running)
    assert env.alloc.hisparse_attn_allocator.raw_available_size() == free_rows
    assert env.alloc.budgets()[1] == 0
    _finish(env, [busy, *running])


@pytest.mark.parametrize("decode_check", ["hooked"], indirect=True)
def test_a_full_host_side_still_retracts(decode_check):
    # Host rows 2 x 1024: 3 x 512 staged + 448 owed to the prompt in flight
    # leave 64, less than the 3 pages the next step starts.
    env = Env(phys=1024, ratio=2)
    running, busy = _full_device(env, 512, 448)
    logical, physical = env.alloc.budgets()
    assert physical == 0 and logical == PS
    with sglang_server_args():
        assert not decode_batch(env.r2t, env.alloc, env.coord, running).check_decode_mem()
        # one request fewer (what retract_decode tries next) fits
        assert decode_batch(env.r2t, env.alloc, env.coord, running[:1]).check_decode_mem()
    _finish(env, [busy, *running])


@pytest.mark.parametrize("decode_check", ["hooked"], indirect=True)
def test_host_growth_off_keeps_sglangs_decode_check(decode_check, monkeypatch):
    monkeypatch.setenv(hooks.HOST_GROWTH_ENV, "0")
    env = Env(phys=1024, ratio=8)
    running, busy = _full_device(env, 320, 448)
    with sglang_server_args():
        assert not decode_batch(env.r2t, env.alloc, env.coord, running).check_decode_mem()
    _finish(env, [busy, *running])


@pytest.mark.parametrize("adder_cls", ["hooked"], indirect=True)
@pytest.mark.parametrize("decode_check", ["sglang", "hooked"], indirect=True)
def test_the_hooked_adder_needs_the_hooked_decode_check(adder_cls, decode_check):
    # Longer outputs than above (64 steps, 640-token prompts): the batch
    # reaches what hot buffers allow, 5 x 192 rows, and 64 of the device's
    # 1024 rows stay free. When two requests' next tokens start a page,
    # 0.5.13's check asks 128 rows of min(host, device) and would retract
    # a request (twice in this run); those pages take host rows only, and
    # the hooked check, which asks the host side, never refuses.
    env = Env(phys=1024, ratio=8, streaming="0")
    most, refused = _serve(adder_cls, env, [640] * 8, steps=64, max_new=100)
    assert most == 5
    assert refused == (0 if decode_check == "hooked" else 2)
    assert env.drained() and not env.coord.has_ongoing_staging()
