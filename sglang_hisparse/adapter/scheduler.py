"""SGLang's scheduler: the hooks that let our coordinator see its queues.

They translate between SGLang's ``Scheduler`` and the engine; the manifest
installs them (AROUND on ``Scheduler.abort_request``,
``Scheduler.get_next_batch_to_run`` and ``Scheduler.get_new_batch_prefill``;
from 0.5.17 AROUND on ``schedule_batch.release_req``).
"""

from __future__ import annotations

from sglang_hisparse.adapter import releases


def scheduler_abort_request(original, self, recv_req):
    """AROUND ``Scheduler.abort_request`` (0.5.13 ``scheduler.py:3618``).

    0.5.13 has a "todo hisparse" here and leaks in two cases:
    * PD decode: a waiting-queue request already holds a hot buffer and host
      rows (``admit_request_direct``); the original only releases its logical
      KV. Release the HiSparse side first (0.5.23 S:5708-5709).
    * PD decode: a retracted request keeps its host rows in ``kv_cache_cpu``
      (``sglang_hisparse.engine.policies.retain_on_retract``), which the original just drops.
      Free them first.
    * Colocated: a request in the staging queue is in no queue the original
      scans, so the abort is lost and it runs to completion. Mark it
      ``to_finish`` so it finishes (and is released) on its first decode step.
    """
    coord = getattr(self, "hisparse_coordinator", None)
    if coord is not None and getattr(self, "enable_hisparse", False):
        def hit(req):
            return recv_req.abort_all or req.rid.startswith(recv_req.rid)

        from sglang.srt.disaggregation.utils import DisaggregationMode

        if self.disaggregation_mode == DisaggregationMode.DECODE:
            for req in self.waiting_queue:
                if hit(req):
                    coord.request_finished(req)
            for req in self.disagg_decode_prealloc_queue.retracted_queue:
                if hit(req):
                    coord.release_retained(getattr(req, "kv_cache_cpu", None))
        staged = coord.staged_requests()
        if staged:
            from sglang.srt.managers.schedule_batch import FINISH_ABORT

            for req in staged:
                if hit(req) and not req.finished():
                    req.to_finish = FINISH_ABORT()
    return original(self, recv_req)


class SchedulerDemand:
    """Parking's view of the scheduler (installed once): what it still has to
    prefill, against the running batch of the ``get_next_batch_to_run`` call
    in progress (``collect_ready_reqs`` asks from inside that call)."""

    __slots__ = ("scheduler", "running_batch")

    def __init__(self, scheduler, running_batch):
        self.scheduler = scheduler
        self.running_batch = running_batch

    def __call__(self):
        return scheduler_prefill_demand(self.scheduler, self.running_batch)


def scheduler_get_next_batch_to_run(original, self, *args, **kwargs):
    """AROUND ``Scheduler.get_next_batch_to_run`` (0.5.13 ``scheduler.py:2415``;
    0.5.17 passes the running and last batch and returns a plan), where
    ``collect_ready_reqs`` runs: on the first call, give the coordinator a
    view of what the scheduler still has to prefill, so a staged request
    waits on host while its hot buffer would starve a waiting prompt
    (``sglang_hisparse.engine.policies.parking``); every call points the view
    at the call's running batch. PD decode runs another loop and never
    installs it: its requests are admitted straight from host."""
    coord = getattr(self, "hisparse_coordinator", None)
    if coord is not None:
        view = getattr(coord, "prefill_demand_provider", None)
        if type(view) is SchedulerDemand:
            view.running_batch = releases.current.call_running_batch(self, args, kwargs)
        elif getattr(coord, "prefill_demand_installed", True) is False:
            coord.set_prefill_demand(SchedulerDemand(
                self, releases.current.call_running_batch(self, args, kwargs)))
    return original(self, *args, **kwargs)


def scheduler_get_new_batch_prefill(original, self, *args, **kwargs):
    """AROUND ``Scheduler.get_new_batch_prefill`` (0.5.13 ``scheduler.py:2547``;
    0.5.17 passes the running batch and returns a plan), which
    ``get_next_batch_to_run`` calls after ``collect_ready_reqs``: the
    streaming policy (``sglang_hisparse.engine.policies.streaming``) decides
    whether this call may form a prefill batch (none: the running batch
    decodes instead), whether it may admit waiting prompts and how many
    prompt tokens the batch may hold. Every input is the same on every TP
    rank: the running batch, the parked requests (collect agrees across
    ranks), the chunked request and the policy's own last decision."""
    coord = getattr(self, "hisparse_coordinator", None)
    streaming = getattr(coord, "streaming", None)
    if streaming is None or not streaming.enabled:
        return original(self, *args, **kwargs)
    release = releases.current
    running = release.call_running_batch(self, args, kwargs)
    decoding = not running.is_empty() and not running.is_prefill_only
    plan = streaming.plan(decoding, parked=len(coord.parked_requests()))
    if not plan.run or (not plan.new_prompts and self.chunked_req is None):
        streaming.formed(None)
        return release.no_prefill(running)
    if not plan.new_prompts:
        # SGLang's own "no more prompts" mark: the chunked request is still
        # added, the waiting queue is not looked at (0.5.13 resets it for
        # HiSparse at the next get_next_batch_to_run).
        running.batch_is_full = True
    own = self.chunked_prefill_size  # None: chunked prefill is off (nothing to cap)
    if plan.token_cap is not None and own is not None and own > plan.token_cap:
        self.chunked_prefill_size = plan.token_cap
    try:
        result = original(self, *args, **kwargs)
    finally:
        self.chunked_prefill_size = own
    streaming.formed(release.prefill_batch(result))
    return result


def scheduler_prefill_demand(scheduler, running_batch=None):
    """The scheduler's prefill work in the coordinator's terms. The next
    waiting request is costed as ``PrefillAdder`` costs it on the device
    side: prompt and clipped max_new_tokens. The running requests' expected
    tokens (``running_batch``'s; None: the scheduler's own) take host rows
    (:mod:`.prefill_adder`) and are added only where 0.5.13's costing is kept
    (``SGLANG_HISPARSE_HOST_GROWTH=0``)."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    from sglang_hisparse.adapter.prefill_adder import host_growth_enabled
    from sglang_hisparse.engine.policies.parking import PrefillDemand

    in_flight = 0
    chunked = scheduler.chunked_req
    if chunked is not None:
        total = len(chunked.origin_input_ids) + len(chunked.output_ids)
        in_flight = max(0, total - releases.current.kv_allocated_len(chunked))
    if running_batch is None:
        running_batch = scheduler.running_batch
    running = running_batch.reqs
    next_tokens = 0
    if scheduler.waiting_queue and scheduler.req_to_token_pool.available_size() > 0:
        req = scheduler.waiting_queue[0]
        next_tokens = (len(req.origin_input_ids) + len(req.output_ids)
                       + min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS) + 1)
        if not host_growth_enabled():
            ahead = sum(min(r.sampling_params.max_new_tokens - len(r.output_ids),
                            CLIP_MAX_NEW_TOKENS) for r in running)
            next_tokens += int(ahead * scheduler.new_token_ratio_tracker.current)
    return PrefillDemand(in_flight, next_tokens, len(running), scheduler.max_running_requests)


def release_req_without_offload(original, *args, **kwargs):
    """AROUND ``schedule_batch.release_req`` (0.5.17 ``schedule_batch.py:1835``).

    0.5.17's PD decode retraction by ``pause_generation(mode="retract")``
    rebootstraps: the prefill recomputes the request's KV, so it calls
    ``release_req(..., offload_kv=False)`` and never asks for a CPU copy.
    Our ``retract_req`` would keep the request's host rows for that copy
    (``RetainOnRetract``): nobody would take them, and the next retraction
    would find the hand-off slot full. Without an offload the retraction
    releases every row instead. (``retract_all`` passes keywords.)"""
    coord = kwargs.get("hisparse_coordinator")
    retain = getattr(coord, "retain", None)
    if kwargs.get("offload_kv", True) or retain is None:
        return original(*args, **kwargs)
    with retain.releasing():
        return original(*args, **kwargs)


def scheduler_on_idle(result, self, *args, **kwargs):
    """AFTER ``Scheduler.on_idle``: the idle leak check SGLang skips under
    HiSparse (0.5.13 to 0.5.17 run ``_check_all_pools`` only without it), on
    our pools instead (``Coordinator.idle_leaks``). Reported with SGLang's
    own reporter, as a warning (the first time, then every 1000th). SGLang
    raises on its own idle leaks by default
    (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``); this check only warns
    until GPU runs have shown it quiet on every serving path (colocated,
    PD decode, DeepSeek-V4, MTP): a false leak must not stop a server."""
    coord = getattr(self, "hisparse_coordinator", None)
    if coord is None or not self.is_fully_idle():
        return None
    leaks = coord.idle_leaks()
    if leaks:
        from sglang.srt.utils.common import raise_error_or_warn

        raise_error_or_warn(self, False, "count_hisparse_leak_warnings",
                            "HiSparse pool memory leak detected! " + "; ".join(leaks))
    return None
