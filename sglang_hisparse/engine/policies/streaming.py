"""Streaming: a request that has emitted a token keeps streaming while prompts prefill.

Why. 0.5.13 runs a prefill batch whenever one can be formed and decodes
the running batch only when none can; each chunk of a long prompt is a
prefill batch of its own. Without HiSparse the device fills after a prompt
or two and prefill stops by itself. With HiSparse the admission budget is
host space, so every queued prompt is admitted and the running batch waits
until all of them have prefilled (16 x 32K prompts on the 61-layer model:
a request that emitted its first token then waited 2247 x its median
inter-token gap). Parking made it worse for the requests it parks: they
have streamed their first token and wait on host until the whole queue is
prefilled.

What bounds the gap. A request that has streamed is either in the running
batch or waits outside it (staging, parked). Two rules, each needed:

* Interleave: while the running batch has requests to decode, at most one
  prefill batch runs between two decode steps, and that batch holds at most
  ``prefill_tokens`` prompt tokens (SGLang's chunked prefill then cuts a
  long prompt into more chunks). A running request's gap is then at most
  one decode step plus one capped prefill batch, whatever the queue holds:
  a bound in tokens, the same on every TP rank. Capping alone would not do
  (back-to-back chunks still run while any prompt waits), nor alternating
  alone (one 8K chunk of the 61-layer model is ~35 decode steps).
* First token first: while a request that has streamed waits parked, no
  new prompt starts prefilling (the prompt in flight finishes: it holds its
  rows). Parking holds no rows back for prompts that have not started, so a
  parked request joins as soon as the rows its hot buffer needs are free
  (at the latest when the prompt in flight has been staged), and the next
  prompt starts only after that. Interleaving alone would leave parked
  requests waiting for the whole queue, longer than before.

* First token on decoding: a streamed request's first token (prefill
  emits it) is sent with its second, at its first decode step (whatever the
  ``stream_interval``), not when prefill ends. The wait between the two
  (staging, parking, other prompts' prefill: up to 194 ms, 47 x the median
  gap, with the interleave on 2026-12-06-s5) is then spent before the
  first token, in time to first token, where a client already expects to
  wait, rather than between two tokens (2026-12-07-s4: the first gap's p50
  27.8 ms, an ordinary prefill-lengthened gap). Only streamed requests that
  have sent nothing and hold only their prefill token are held; a finished
  request (one output token, an abort) always goes out. The hook is an
  AROUND of ``SchedulerOutputStreamer.stream_output``
  (``adapter/output_streamer.py``). The hold also works alone, with
  0.5.13's prefill-first order (``hold`` below): a burst of prompts is then
  prefilled before any of them streams, so nobody who has a token waits
  for the queue, and nothing else changes.

The cost. Prefill no longer runs ahead of the decode batch: a prompt is
admitted only beside the hot buffers already running, so while prompts
wait the batch is bounded by ``1 + (rows - prompt) / hot buffer`` (what
``SGLANG_HISPARSE_PARKING=0`` gives) rather than by hot buffers alone;
with parking's prefill-ahead, the larger batch came only after every
request admitted earlier had stalled for the whole queue. Each prompt's
prefill also takes longer (a decode step after every capped chunk), so
time to first token grows under load. Total GPU work is the same; what
moves is when it runs. The option rejected: stopping prefill only when the
prompt could not join the batch soon (the rows-ahead test) still lets one
whole prompt's chunks run back to back, ~70 decode steps for a 32K prompt.

Switch: ``SGLANG_HISPARSE_STREAMING`` = ``0`` (default, off: 0.5.13's
prefill-first order and parking's prefill-ahead, first tokens as 0.5.13
sends them), ``hold`` (that order, the first token held until the request
decodes), ``1`` (interleave, prefill batches of at most
:data:`DEFAULT_PREFILL_TOKENS` while requests decode, with the hold), or a
positive multiple of 64 (the same with that many prefill tokens per batch).
Off by default: the hold moves a burst's wait into time to first token,
which an operator measures against its own targets, and the interleave
costs throughput. On 8 layers of DeepSeek-V3.2's geometry (16 x 32K x
2048, one H100, 2026-12-07-s4) the interleave ran 10 requests instead of
16, at 0.68x the output tok/s, for a worst gap of 22.2 x the request's
median instead of 2123.6 x; its p99 gap, 4.80 x TPOT, misses the 3 x target
at the 1024-token cap (a prefill batch then costs ~6 decode steps;
docs/gpu-runs/2026-12-07-s4 has the bound). ``hold`` on the same
workload (2026-12-07-s5): worst gap 19.7 x the median against 2116.5 x,
p99 1.51 x TPOT, 16 running, 0.96x the output tok/s, the median time to
first token 10.3 s against 5.2 s; its gaps over 10 x fall where 8 and 16
requests finish in one step, after the scheduler has sent the tokens.
Colocated serving only: a PD decode node prefills nothing.

The seam is ``Scheduler.get_new_batch_prefill`` (an AROUND hook in
``adapter/scheduler.py``): :meth:`Streaming.plan` decides from the
scheduler's rank-identical state whether this call may form a prefill
batch, may admit new prompts and how many tokens it may hold. Its only
state is whether the last call formed a prefill batch: a call that returns
none is followed by a decode step of the running batch (0.5.13
``get_next_batch_to_run``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

# Prefill tokens per batch while requests decode. The 61-layer
# DeepSeek-V3.2-geometry model prefills ~6K tokens/s on the H200 and
# decodes a step in 15-40 ms, so 1024 tokens (~170 ms, more late in a 32K
# prompt) keep a gap within the 10 x median target; 2048 would be at its
# edge. A multiple of every page size SGLang serves DSA with.
DEFAULT_PREFILL_TOKENS = 1024
_TOKEN_QUANTUM = 64


class StreamingMode(NamedTuple):
    """What the switch asks for."""

    prefill_tokens: Optional[int]  # the interleave's cap; None: 0.5.13's prefill-first order
    hold_first_token: bool  # a streamed first token goes out with the second


OFF = StreamingMode(None, False)
HOLD = "hold"


def parse(value: Optional[str], name: str) -> StreamingMode:
    """The mode the switch asks for (:data:`OFF` when unset, the default).
    Raises ValueError naming the switch and the allowed values."""
    if value is None or value == "0":
        return OFF
    if value == HOLD:
        return StreamingMode(None, True)
    if value == "1":
        return StreamingMode(DEFAULT_PREFILL_TOKENS, True)
    allowed = (f"allowed: 0 (off, the default), {HOLD} (0.5.13's prefill order, the first token held "
               f"until the request decodes), 1 (on, {DEFAULT_PREFILL_TOKENS} prefill tokens per batch "
               f"while requests decode), or a positive multiple of {_TOKEN_QUANTUM} (on, that cap)")
    try:
        tokens = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not valid; {allowed}") from None
    if tokens <= 0 or tokens % _TOKEN_QUANTUM:
        raise ValueError(f"{name}={value!r} is not valid; {allowed}")
    return StreamingMode(tokens, True)


class PrefillPlan(NamedTuple):
    """What one ``get_new_batch_prefill`` call may do."""

    run: bool  # form a prefill batch at all (False: the running batch decodes)
    new_prompts: bool  # admit prompts from the waiting queue (the chunked one always continues)
    token_cap: Optional[int]  # cap on the batch's prompt tokens; None: SGLang's own chunk size


_UNCHANGED = PrefillPlan(True, True, None)


class StreamOutputs(NamedTuple):
    """What one ``stream_output`` call passes on to SGLang."""

    reqs: list  # the requests to stream (the call's own list when none waits)
    first_due: list  # among them, those whose held first token goes out now


class Streaming:
    def __init__(self, mode: StreamingMode = OFF):
        """``mode``: see :func:`parse`."""
        self.prefill_tokens = mode.prefill_tokens
        # The interleave and first-token-first rules (the parking and
        # get_new_batch_prefill hooks ask this); the hold is on with them.
        self.enabled = mode.prefill_tokens is not None
        self.holds_first_token = mode.hold_first_token
        self._prefill_ran = False  # the last call formed a prefill batch
        # Counters (tests, the decode log): decode turns forced, calls that
        # kept new prompts out for parked requests, first tokens held.
        self.decode_turns = 0
        self.prompts_held = 0
        self.first_tokens_held = 0

    def plan(self, decoding: bool, parked: int) -> PrefillPlan:
        """``decoding``: the running batch has requests to decode;
        ``parked``: requests that streamed and wait outside the batch on host."""
        if not self.enabled:
            return _UNCHANGED
        if decoding and self._prefill_ran:
            self._prefill_ran = False
            self.decode_turns += 1
            return PrefillPlan(False, False, None)
        if parked:
            self.prompts_held += 1
        return PrefillPlan(True, not parked, self.prefill_tokens if decoding else None)

    def formed(self, batch) -> None:
        """What the call the plan was for returned (None: no prefill batch)."""
        self._prefill_ran = batch is not None

    def outputs_to_send(self, reqs) -> StreamOutputs:
        """``reqs`` less the requests whose first token waits for their first
        decode step, and the requests whose held first token is due: they
        have sent nothing and hold more than that token. SGLang's interval
        rule would send those at its next multiple (``len(output_ids) % k ==
        1`` for ``stream_interval`` k > 1: at k + 1 tokens), so the caller
        sends them now."""
        if not self.holds_first_token:
            return StreamOutputs(reqs, [])
        # One pass: this runs on every output of every decode step; after its
        # first event a request stops at ``send_token_offset`` (tokens already
        # sent). A request that has only its prefill token has not decoded:
        # it stages, parks, or waits in a batch that prefills first.
        sent, due = [], []
        for r in reqs:
            if r.stream and r.send_token_offset == 0 and not r.finished():
                if len(r.output_ids) <= 1:
                    continue  # not decoded yet: its first token waits
                due.append(r)
            sent.append(r)
        if len(sent) == len(reqs):
            return StreamOutputs(reqs, due)
        self.first_tokens_held += len(reqs) - len(sent)
        return StreamOutputs(sent, due)
