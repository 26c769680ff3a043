"""SGLang's output streamer under HiSparse's streaming policy.

Why. Prefill emits a request's first token, and 0.5.13 streams it at once.
Under HiSparse the request then stages its KV to host and may park before it
joins the decode batch; its client sees the first token, then waits (up to
194 ms, 47 x its median gap, with streaming on, on 2026-12-06-s5). With the
hold on (``SGLANG_HISPARSE_STREAMING`` = ``hold``, ``1`` or a cap), the
first token is sent with the second, once the request decodes in the batch
(:meth:`~sglang_hisparse.engine.policies.streaming.Streaming.outputs_to_send`
decides which requests wait and which are due). SGLang sends every token not
yet sent (``send_token_offset``), so nothing is lost: the client's first
event holds two tokens.

SGLang sends a streamed request's output when ``len(output_ids) % k == 1``
for ``stream_interval`` k > 1 (every step for k = 1), so a held first token
would next go out at k + 1 tokens, k - 1 steps late. For the requests whose
held token is due, this call reads an interval of 1: SGLang takes the
request's own ``sampling_params.stream_interval`` before the server's, and
nothing else reads it. It is set back when the call returns.

The seam is ``SchedulerOutputStreamer.stream_output`` (AROUND): the
streamer holds no reference to the scheduler, so the coordinator is the
process's registered one (``adapter.metrics.current_coordinator``).
"""

from __future__ import annotations

import contextlib

from sglang_hisparse.adapter import metrics


def streamer_stream_output(original, self, reqs, *args, **kwargs):
    """AROUND ``SchedulerOutputStreamer.stream_output`` (0.5.13
    ``scheduler_components/output_streamer.py:93``)."""
    coord = metrics.current_coordinator()
    if coord is None:
        return original(self, reqs, *args, **kwargs)
    out = coord.streaming.outputs_to_send(reqs)
    if not out.first_due:
        return original(self, out.reqs, *args, **kwargs)
    with _stream_interval_of_one(out.first_due):
        return original(self, out.reqs, *args, **kwargs)


@contextlib.contextmanager
def _stream_interval_of_one(reqs):
    saved = [r.sampling_params.stream_interval for r in reqs]
    for r in reqs:
        r.sampling_params.stream_interval = 1
    try:
        yield
    finally:
        for r, interval in zip(reqs, saved):
            r.sampling_params.stream_interval = interval
