"""SGLang's output streamer under HiSparse's streaming policy.

Why. Prefill emits a request's first token, and 0.5.13 streams it at once.
Under HiSparse the request then stages its KV to host and may park before it
joins the decode batch; its client sees the first token, then waits (up to
194 ms, 47 x its median gap, with streaming on, on 2026-12-06-s5). With
streaming on (``SGLANG_HISPARSE_STREAMING``), the first token is sent with
the second, once the request decodes in the batch
(:meth:`~sglang_hisparse.engine.policies.streaming.Streaming.outputs_to_send`
decides which requests wait). SGLang sends every token not yet sent
(``send_token_offset``), so nothing is lost: the client's first event holds
two tokens. With ``stream_interval`` k > 1 the first event comes at k + 1
tokens, where SGLang's own rule (``len(output_ids) % k == 1``) next sends.

The seam is ``SchedulerOutputStreamer.stream_output`` (AROUND): the
streamer holds no reference to the scheduler, so the coordinator is the
process's registered one (``adapter.metrics.current_coordinator``).
"""

from __future__ import annotations

from sglang_hisparse.adapter import metrics


def streamer_stream_output(original, self, reqs, *args, **kwargs):
    """AROUND ``SchedulerOutputStreamer.stream_output`` (0.5.13
    ``scheduler_components/output_streamer.py:93``)."""
    coord = metrics.current_coordinator()
    if coord is not None:
        reqs = coord.streaming.outputs_to_send(reqs)
    return original(self, reqs, *args, **kwargs)
