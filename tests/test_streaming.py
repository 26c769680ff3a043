"""Streaming: a request that has emitted a token does not wait for other
prompts' prefill (engine/policies/streaming.py, the get_new_batch_prefill
hook in adapter/scheduler.py). Real SGLang pools, requests and batches on
CPU; the timeline counts scheduler batches, not time, and every run drains
every pool back to where it started."""

from statistics import median
from types import SimpleNamespace

import pytest

from dataplane_fixtures import PS, make_req, prefill, scheduler_passes_batches, sglang_server_args
from test_coordinator import Env
from sglang_hisparse.adapter.scheduler import (
    scheduler_get_new_batch_prefill,
    scheduler_get_next_batch_to_run,
    scheduler_prefill_demand,
)
from sglang_hisparse.config import STREAMING_ENV, env_problems
from sglang_hisparse.engine.policies.streaming import DEFAULT_PREFILL_TOKENS, parse


def test_the_switch_values():
    assert parse("1", STREAMING_ENV) == (DEFAULT_PREFILL_TOKENS, True)
    assert parse(None, STREAMING_ENV) == parse("0", STREAMING_ENV) == (None, False)  # off by default
    assert parse("hold", STREAMING_ENV) == (None, True)  # 0.5.13's order, first token held
    assert parse("512", STREAMING_ENV) == (512, True)
    for bad in ("on", "-64", "100", "0.5", "", "HOLD"):
        with pytest.raises(ValueError, match=rf"{STREAMING_ENV}=.*allowed: 0 \(off, the default\), hold"):
            parse(bad, STREAMING_ENV)
    # checked with the server arguments, before any weights load
    assert env_problems({STREAMING_ENV: "100"}) and not env_problems({STREAMING_ENV: "2048"})


def _scheduler(env, running=(), chunked=None, chunk=8192):
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    return SimpleNamespace(hisparse_coordinator=env.coord, chunked_req=chunked,
                           running_batch=ScheduleBatch(reqs=list(running)),
                           chunked_prefill_size=chunk)


def get_new_batch_prefill(original, s):
    """Our hook, called as the installed release's scheduler calls
    ``get_new_batch_prefill`` around ``original(s)`` (0.5.13's shape: the
    batch or None); the batch formed. 0.5.17 passes the running batch and
    gets a NextBatchPlan back, whose running batch must be the one passed."""
    if not scheduler_passes_batches():
        return scheduler_get_new_batch_prefill(original, s)
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    def plan(self, running_batch):
        assert running_batch is getattr(self, "running_batch", None)
        return NextBatchPlan(batch_to_run=original(self), running_batch=running_batch)

    running = getattr(s, "running_batch", None)
    result = scheduler_get_new_batch_prefill(plan, s, running)
    assert result.running_batch is running
    return result.batch_to_run


def get_next_batch_to_run(original, s):
    """Our hook, called as the installed release's scheduler calls
    ``get_next_batch_to_run`` around ``original(s)``."""
    if not scheduler_passes_batches():
        return scheduler_get_next_batch_to_run(original, s)
    return scheduler_get_next_batch_to_run(
        lambda self, running_batch, last_batch: original(self), s, s.running_batch, None)


class Original:
    """Stands in for 0.5.13's get_new_batch_prefill; records what it saw."""

    def __init__(self, result="prefill batch"):
        self.result, self.seen = result, []

    def __call__(self, s):
        self.seen.append((s.chunked_prefill_size, s.running_batch.batch_is_full))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_one_capped_prefill_batch_per_decode_step_while_requests_decode():
    env = Env(streaming="512")
    s = _scheduler(env)
    orig = Original()
    # Nothing decodes: SGLang's own chunk size, back to back.
    assert get_new_batch_prefill(orig, s) == "prefill batch"
    assert get_new_batch_prefill(orig, s) == "prefill batch"
    assert orig.seen == [(8192, False)] * 2
    s.running_batch.reqs = [make_req("decoding", 100)]
    assert get_new_batch_prefill(orig, s) is None  # the decode step's turn
    assert len(orig.seen) == 2  # SGLang was not asked
    assert get_new_batch_prefill(orig, s) == "prefill batch"
    assert orig.seen[-1] == (512, False) and s.chunked_prefill_size == 8192  # cap, restored
    assert get_new_batch_prefill(orig, s) is None
    orig.result = None  # SGLang formed nothing: the next call may try again
    assert get_new_batch_prefill(orig, s) is None and len(orig.seen) == 4
    assert get_new_batch_prefill(orig, s) is None and len(orig.seen) == 5
    orig.result = RuntimeError("boom")
    with pytest.raises(RuntimeError):
        get_new_batch_prefill(orig, s)
    assert s.chunked_prefill_size == 8192  # restored on the way out
    s.chunked_prefill_size = None  # chunked prefill off: nothing to cap
    orig.result = "prefill batch"
    assert get_new_batch_prefill(orig, s) == "prefill batch"
    assert orig.seen[-1] == (None, False)
    assert env.coord.streaming.decode_turns == 2


def test_no_new_prompt_while_a_streamed_request_is_parked():
    from sglang_hisparse.engine.policies.parking import PrefillDemand

    env = Env(streaming="1")
    # 900 rows still to come for the chunked prompt: a staged request parks.
    env.coord.set_prefill_demand(lambda: PrefillDemand(900, 0, 1, 8))
    a = env.staged("a", 300)
    assert env.coord.collect_ready_reqs() == [] and env.coord.parked_requests() == [a]
    orig = Original()
    s = _scheduler(env, chunked=make_req("chunked", 2000))
    # The chunked prompt goes on (it holds its rows); the waiting queue is not looked at.
    assert get_new_batch_prefill(orig, s) == "prefill batch"
    assert orig.seen == [(8192, True)]
    s.chunked_req = None
    s.running_batch.batch_is_full = False
    assert get_new_batch_prefill(orig, s) is None and len(orig.seen) == 1
    assert env.coord.streaming.prompts_held == 2
    env.coord.retract_req(a)
    from dataplane_fixtures import release

    release(env.r2t, env.alloc, a)
    assert env.drained()


@pytest.mark.parametrize("streaming", ["0", "hold"])
def test_off_leaves_sglang_alone(streaming):
    """Off, and the hold alone: 0.5.13's prefill order, untouched."""
    env = Env(streaming=streaming)
    s = _scheduler(env, running=[make_req("decoding", 100)])
    orig = Original()
    for _ in range(3):
        assert get_new_batch_prefill(orig, s) == "prefill batch"
    assert orig.seen == [(8192, False)] * 3
    # Without HiSparse the hook is a pass-through too.
    assert get_new_batch_prefill(lambda s: "prefill batch", SimpleNamespace()) \
        == "prefill batch"


class Timeline:
    """0.5.13's colocated HiSparse loop in miniature, around our two hooks:
    ``get_next_batch_to_run`` (collect_ready_reqs, then
    ``get_new_batch_prefill``, else a decode step of the running batch).
    The prefill former below does what 0.5.13's does for one prompt per
    batch: the chunked request first, no new prompt while the batch is
    full, a new one only while the allocator's budget admits it, each batch
    at most ``chunked_prefill_size`` tokens. A prompt's rows are taken whole
    when it is admitted (its remaining chunks owe none). Time is counted in
    batches; a request's first token comes with its last prefill chunk."""

    def __init__(self, env, prompts, steps, chunk):
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
            NewTokenRatioTracker,
        )

        self.env, self.steps = env, steps
        self.s = SimpleNamespace(
            hisparse_coordinator=env.coord, chunked_req=None, chunked_prefill_size=chunk,
            running_batch=ScheduleBatch(reqs=[]),
            waiting_queue=[make_req(f"r{i}", n) for i, n in enumerate(prompts)],
            new_token_ratio_tracker=NewTokenRatioTracker(init=0.5, min=0.5, decay=0.0,
                                                         current=0.5),
            max_running_requests=8, req_to_token_pool=env.r2t)
        self.s.get_new_batch_prefill = lambda: get_new_batch_prefill(
            self._form_prefill, self.s)
        self.tokens = {}  # rid -> batch numbers at which it emitted a token
        self.prefill_tokens = []  # per batch: prompt tokens it prefilled (0: decode)
        self.left = {}
        self.most = 0

    def _form_prefill(self, s):
        env = self.env
        if s.chunked_req is None:
            if s.running_batch.batch_is_full or not s.waiting_queue:
                return None
            req = s.waiting_queue[0]
            n = len(req.origin_input_ids)
            if not env.r2t.available_size():
                return None
            # PrefillAdder's cost of the prompt, as parking's mirror of it costs it.
            if env.alloc.available_size() < scheduler_prefill_demand(s).next_tokens:
                return None
            s.waiting_queue.pop(0)
            prefill(env.r2t, env.alloc, req, n, pool=env.pool)
            req.sim_left = n
            s.chunked_req = req
        req = s.chunked_req
        chunk = min(req.sim_left, s.chunked_prefill_size or req.sim_left)
        req.sim_left -= chunk
        if req.sim_left == 0:
            s.chunked_req = None
        return ("prefill", req, chunk)

    def _next_batch(self, s):
        for r in self.env.coord.collect_ready_reqs():
            s.running_batch.reqs.append(r)
            self.left[r.rid] = self.steps
        s.running_batch.batch_is_full = False  # 0.5.13 resets it for HiSparse
        batch = s.get_new_batch_prefill()
        if batch is not None:
            return batch
        return ("decode",) if s.running_batch.reqs else None

    def run(self):
        env, s = self.env, self.s
        t = 0
        while (s.waiting_queue or s.chunked_req or s.running_batch.reqs
               or env.coord.has_ongoing_staging()):
            batch = get_next_batch_to_run(self._next_batch, s)
            t += 1
            assert t < 1000, "no progress"
            running = s.running_batch.reqs
            self.most = max(self.most, len(running))
            if batch is None:
                self.prefill_tokens.append(0)
                continue
            if batch[0] == "prefill":
                _, req, chunk = batch
                self.prefill_tokens.append(chunk)
                if req.sim_left == 0:  # its last chunk: the first token streams
                    self.tokens[req.rid] = [t]
                    env.coord.admit_request_into_staging(req)
                continue
            self.prefill_tokens.append(0)
            env.decode(running)
            for r in list(running):
                self.tokens[r.rid].append(t)
                self.left[r.rid] -= 1
                if self.left[r.rid] == 0:
                    running.remove(r)
                    env.finish(r)
        return self

    def gaps(self, rid):
        ts = self.tokens[rid]
        return [b - a for a, b in zip(ts, ts[1:])]

    def prefill_between(self, rid):
        """The most prompt tokens prefilled between two of the request's tokens."""
        ts = self.tokens[rid]
        return max(sum(self.prefill_tokens[a:b - 1]) for a, b in zip(ts, ts[1:]))

    def worst_over_median(self):
        return max(max(g) / median(g) for g in map(self.gaps, self.tokens))


@pytest.mark.parametrize("parking", [True, False])
def test_timeline_the_worst_gap_is_one_capped_prefill_batch(monkeypatch, parking):
    # 1024 rows, five 600-token prompts (640 rows each while they prefill),
    # 192-row hot buffers, SGLang chunks of 512 tokens, a cap of 128: every
    # prompt is 5 prefill batches.
    monkeypatch.setenv("SGLANG_HISPARSE_PARKING", "1" if parking else "0")
    on = Timeline(Env(phys=1024, ratio=8, streaming="128"), [600] * 5, steps=6, chunk=512).run()
    assert on.env.drained() and not on.env.coord.has_ongoing_staging()
    for rid in on.tokens:
        assert len(on.tokens[rid]) == 1 + 6
        # Between two tokens: at most one decode step and one capped prefill batch.
        assert max(on.gaps(rid)) <= 2, (rid, on.gaps(rid))
        assert on.prefill_between(rid) <= 128
    assert on.worst_over_median() <= 2
    assert not on.env.coord.parked_requests()

    off = Timeline(Env(phys=1024, ratio=8, streaming="0"), [600] * 5, steps=6, chunk=512).run()
    assert off.env.drained()
    # 0.5.13's order: a request that streamed waits while other prompts
    # prefill whole (with parking: the whole queue, parked on host).
    assert off.worst_over_median() > 2
    assert max(off.prefill_between(r) for r in off.tokens) >= 600
    if parking:
        # What streaming trades for it: parking's prefill-ahead batch (the
        # whole queue prefilled, then five hot buffers at once).
        assert off.most == 5 > on.most


def test_timeline_a_long_queue_interleaves_from_the_first_token_on():
    # Six short prompts, a cap of one page: requests join and finish while
    # the queue drains, and no gap exceeds two batches.
    env = Env(phys=1024, ratio=8, streaming="64")
    on = Timeline(env, [200] * 6, steps=4, chunk=512).run()
    assert env.drained()
    assert max(max(on.gaps(r)) for r in on.tokens) <= 2
    assert max(on.prefill_between(r) for r in on.tokens) <= 64


def test_the_scheduler_demand_is_installed_through_the_timeline():
    # The timeline runs both hooks: parking's view of the queue came from
    # scheduler_prefill_demand on the same namespace.
    env = Env(phys=1024, ratio=8, streaming="1")
    t = Timeline(env, [600], steps=1, chunk=512)
    assert env.coord.prefill_demand_installed is False
    t.run()
    assert env.coord.prefill_demand_installed
    assert scheduler_prefill_demand(t.s).next_tokens == 0  # the queue is empty
    assert env.drained()


def _output_streamer():
    """SGLang's own ``SchedulerOutputStreamer`` of a one-rank colocated
    server, sending to a recording socket. Returns (streamer, what it sent)."""
    import dataclasses

    from dataplane_fixtures import _RecordingSocket, _default_server_args
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState
    from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    one_rank = {f.name: (1 if f.name.endswith("_size") else 0)
                for f in dataclasses.fields(ParallelState)}
    socket = _RecordingSocket()
    fields = {f.name for f in dataclasses.fields(SchedulerOutputStreamer)}
    # (0.5.13 reads the scheduler's load for each output; 0.5.17 does not)
    load = {"load_inquirer_get_loads": lambda req: None} if "load_inquirer_get_loads" in fields else {}
    streamer = SchedulerOutputStreamer(
        send_to_detokenizer=SenderWrapper(socket), tree_cache=None,
        ps=ParallelState(**one_rank), server_args=_default_server_args(),
        is_generation=True, spec_algorithm=SpeculativeAlgorithm.NONE,
        disaggregation_mode=DisaggregationMode.NULL,
        enable_hicache_storage=lambda: False, **load)
    return streamer, socket.sent


def _stream(streamer, reqs):
    """``stream_output`` through our AROUND hook, as the scheduler calls it."""
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    from sglang_hisparse.adapter.output_streamer import streamer_stream_output

    streamer_stream_output(SchedulerOutputStreamer.stream_output, streamer, reqs, False)


def _sent_tokens(sent):
    """rid -> the output token ids of every event sent, in order."""
    events = {}
    for out in sent:
        for rid, ids in zip(out.rids, out.output_ids):
            events.setdefault(rid, []).append(list(ids))
    return events


@pytest.mark.parametrize("interval", [None, 4])
@pytest.mark.parametrize("streaming", ["1", "hold", "0"])
def test_the_first_token_goes_out_when_the_request_decodes(streaming, interval):
    """Prefill's result streams while the request stages (outside the batch):
    with the hold on (the interleave's, or alone) its first token is held,
    and the first decode step that holds the request sends both tokens, also
    under a ``stream_interval`` of 4 (SGLang's own rule would send at 5
    tokens; the request's interval is its own again afterwards); a request
    that finished at prefill still goes out at once. Off: 0.5.13's order,
    token by token (every 4th from the first under the interval)."""
    from sglang_hisparse.adapter import metrics

    env = Env(phys=1024, ratio=8, streaming=streaming)
    metrics.register_coordinator(env.coord)
    streamer, sent = _output_streamer()
    reqs = []
    for rid in ("a", "b"):
        req = make_req(rid, 300)
        req.stream = True
        req.sampling_params.stream_interval = interval  # None: the server's (1)
        prefill(env.r2t, env.alloc, req, 300, pool=env.pool)
        env.coord.admit_request_into_staging(req)  # as 0.5.13's prefill result does
        req.output_ids.append(7)
        reqs.append(req)
    done = make_req("one-token", 64)
    done.stream = True
    done.output_ids.append(9)
    done.sampling_params.max_new_tokens = 1
    done.update_finish_state()
    assert done.finished()
    with sglang_server_args():
        _stream(streamer, reqs + [done])  # the prefill batch's output
        assert all(r.hisparse_staging for r in reqs)
        held = {"1": {"one-token": [[9]]}, "hold": {"one-token": [[9]]},
                "0": {"a": [[7]], "b": [[7]], "one-token": [[9]]}}
        assert _sent_tokens(sent) == held[streaming]
        assert env.coord.collect_ready_reqs() == reqs
        env.decode(reqs)
        for r in reqs:
            r.output_ids.append(8)
        _stream(streamer, reqs)  # the decode batch's output
    first_events = {"1": [[7, 8]], "hold": [[7, 8]],
                    "0": [[7], [8]] if interval is None else [[7]]}[streaming]
    assert _sent_tokens(sent) == {"a": first_events, "b": first_events, "one-token": [[9]]}
    assert env.coord.streaming.first_tokens_held == (0 if streaming == "0" else 2)
    assert [r.sampling_params.stream_interval for r in reqs] == [interval, interval]
    for r in reqs:
        env.finish(r)
    assert env.drained()


def test_the_hold_keeps_a_first_token_until_the_request_decodes_in_the_batch():
    """Under 0.5.13's prefill-first order a request that joined the batch at
    once (resident: a short prompt) still waits while other prompts prefill;
    with the hold its first token goes out with its second, not before."""
    from sglang_hisparse.adapter import metrics

    env = Env(phys=1024, ratio=8, streaming="hold")
    metrics.register_coordinator(env.coord)
    streamer, sent = _output_streamer()
    req = make_req("short", 2 * PS)
    req.stream = True
    prefill(env.r2t, env.alloc, req, 2 * PS, pool=env.pool)
    env.coord.admit_request_into_staging(req)
    req.output_ids.append(7)
    with sglang_server_args():
        assert env.coord.collect_ready_reqs() == [req]  # in the batch, not decoded
        assert not req.hisparse_staging
        _stream(streamer, [req])  # the prefill batch's output
        assert _sent_tokens(sent) == {}
        env.decode([req])
        req.output_ids.append(8)
        _stream(streamer, [req])
    assert _sent_tokens(sent) == {"short": [[7, 8]]}
    env.finish(req)
    assert env.drained()
