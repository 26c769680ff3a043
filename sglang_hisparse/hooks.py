"""Method hooks on SGLang's scheduler and model runner for our data plane.

They translate between SGLang objects and the coordinator/allocator; the
manifest installs them (PROPERTY on ``ModelRunner.max_token_pool_size``,
AROUND on ``Scheduler.abort_request``).
"""

from __future__ import annotations


def model_runner_max_token_pool_size(self):
    """PROPERTY getter for ``ModelRunner.max_token_pool_size`` (0.5.13
    ``model_runner.py:2204``): with HiSparse the longest request is bounded by
    the host-backed logical space, not the GPU pool (0.5.23 MR:1516-1524).
    Feeds ``TpModelWorker.max_req_len`` and the PD prefill budget."""
    alloc = getattr(self, "token_to_kv_pool_allocator", None)
    if getattr(self, "enable_hisparse", False) and hasattr(alloc, "logical_capacity"):
        return alloc.logical_capacity
    if self.is_hybrid_swa:
        return self.full_max_total_num_tokens
    return self.max_total_num_tokens


def scheduler_abort_request(original, self, recv_req):
    """AROUND ``Scheduler.abort_request`` (0.5.13 ``scheduler.py:3618``).

    0.5.13 has a "todo hisparse" here and leaks in two cases:
    * PD decode: a waiting-queue request already holds a hot buffer and host
      rows (``admit_request_direct``); the original only releases its logical
      KV. Release the HiSparse side first (0.5.23 S:5708-5709).
    * PD decode: a retracted request keeps its host rows in ``kv_cache_cpu``
      (``sglang_hisparse.disaggregation``), which the original just drops.
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
    (``sglang_hisparse.parking``). PD decode runs another loop and never
    installs it: its requests are admitted straight from host."""
    coord = getattr(self, "hisparse_coordinator", None)
    if coord is not None and getattr(coord, "prefill_demand_installed", True) is False:
        coord.set_prefill_demand(lambda: scheduler_prefill_demand(self))
    return original(self)


def scheduler_prefill_demand(scheduler):
    """The scheduler's prefill work in the coordinator's terms. The next
    waiting request is costed as ``PrefillAdder`` costs it: prompt, clipped
    max_new_tokens, plus the running requests' expected future tokens."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    from sglang_hisparse.parking import PrefillDemand

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
