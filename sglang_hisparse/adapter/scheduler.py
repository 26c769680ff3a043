"""SGLang's scheduler: the hooks that let our coordinator see its queues.

They translate between SGLang's ``Scheduler`` and the engine; the manifest
installs them (AROUND on ``Scheduler.abort_request``,
``Scheduler.get_next_batch_to_run`` and ``Scheduler.get_new_batch_prefill``).
"""

from __future__ import annotations


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


def scheduler_get_next_batch_to_run(original, self):
    """AROUND ``Scheduler.get_next_batch_to_run`` (0.5.13 ``scheduler.py:2415``),
    where ``collect_ready_reqs`` runs: on the first call, give the coordinator
    a view of what the scheduler still has to prefill, so a staged request
    waits on host while its hot buffer would starve a waiting prompt
    (``sglang_hisparse.engine.policies.parking``). PD decode runs another loop and never
    installs it: its requests are admitted straight from host."""
    coord = getattr(self, "hisparse_coordinator", None)
    if coord is not None and getattr(coord, "prefill_demand_installed", True) is False:
        coord.set_prefill_demand(lambda: scheduler_prefill_demand(self))
    return original(self)


def scheduler_get_new_batch_prefill(original, self):
    """AROUND ``Scheduler.get_new_batch_prefill`` (0.5.13 ``scheduler.py:2547``),
    which ``get_next_batch_to_run`` calls after ``collect_ready_reqs``: the
    streaming policy (``sglang_hisparse.engine.policies.streaming``) decides
    whether this call may form a prefill batch (None: the running batch
    decodes instead), whether it may admit waiting prompts and how many
    prompt tokens the batch may hold. Every input is the same on every TP
    rank: the running batch, the parked requests (collect agrees across
    ranks), the chunked request and the policy's own last decision."""
    coord = getattr(self, "hisparse_coordinator", None)
    streaming = getattr(coord, "streaming", None)
    if streaming is None or not streaming.enabled:
        return original(self)
    running = self.running_batch
    decoding = not running.is_empty() and not running.is_prefill_only
    plan = streaming.plan(decoding, parked=len(coord.parked_requests()))
    if not plan.run or (not plan.new_prompts and self.chunked_req is None):
        streaming.formed(None)
        return None
    if not plan.new_prompts:
        # SGLang's own "no more prompts" mark: the chunked request is still
        # added, the waiting queue is not looked at (0.5.13 resets it for
        # HiSparse at the next get_next_batch_to_run).
        running.batch_is_full = True
    own = self.chunked_prefill_size  # None: chunked prefill is off (nothing to cap)
    if plan.token_cap is not None and own is not None and own > plan.token_cap:
        self.chunked_prefill_size = plan.token_cap
    try:
        batch = original(self)
    finally:
        self.chunked_prefill_size = own
    streaming.formed(batch)
    return batch


def scheduler_prefill_demand(scheduler):
    """The scheduler's prefill work in the coordinator's terms. The next
    waiting request is costed as ``PrefillAdder`` costs it: prompt, clipped
    max_new_tokens, plus the running requests' expected future tokens."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    from sglang_hisparse.engine.policies.parking import PrefillDemand

    in_flight = 0
    chunked = scheduler.chunked_req
    if chunked is not None:
        total = len(chunked.origin_input_ids) + len(chunked.output_ids)
        in_flight = max(0, total - chunked.kv_allocated_len)
    running = scheduler.running_batch.reqs
    next_tokens = 0
    if scheduler.waiting_queue and scheduler.req_to_token_pool.available_size() > 0:
        req = scheduler.waiting_queue[0]
        ahead = sum(min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS)
                    for r in running)
        next_tokens = (len(req.origin_input_ids) + len(req.output_ids)
                       + min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS)
                       + int(ahead * scheduler.new_token_ratio_tracker.current) + 1)
    return PrefillDemand(in_flight, next_tokens, len(running), scheduler.max_running_requests)
