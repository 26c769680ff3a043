"""SGLang's admission and decode check under HiSparse: decode growth takes host rows.

Why. The adder admits a prompt only if the pool can also hold the tokens the
running requests will still decode. 0.5.13 to 0.5.17 charge that growth to
``available_size()``, which for our allocator is ``min(host side, device
side)`` (:func:`sglang_hisparse.engine.budget.admission_budgets`). But a
HiSparse request's device rows do not grow: from staging to finish it holds
its hot buffer (``B`` plus a page; a shorter prompt's growth into it is
already owed on the device side). Its new tokens take host rows (the written-through copy).
Charged to the device side, the growth held back prompts whose rows were
free. On 2026-12-06-s5 (16 x 32K prompts x 6144 out, ``ignore_eos``) ours
ran at most 11 requests, one more every ~5 s. This is why.

Three paths, three hooks:

* Every prompt: ``PrefillAdder.__init__`` adds the running requests'
  expected tokens (``G``, SGLang's own ``_get_running_request_total_token_offset``)
  to ``rem_total_token_offset``. :func:`adder_init_growth_on_host` (AFTER)
  credits it back on the device side. With the host side ``L`` and the device side ``P``:
  ``rem_total_tokens`` becomes ``min(L, P + G) - G - rest`` (``rest``: the
  batch's own prompts and clipped outputs), i.e. ``min(L - G - rest, P -
  rest)``. What a new prompt's output costs on the device side: below.
* Prompts that stop at EOS (real traffic): ``add_one_req`` charges the
  prompt ``input + its clipped output + a page`` against ``rem_total_tokens``.
  Its output takes host rows too, so :func:`adder_add_one_req` (AROUND)
  checks the whole charge against the host side (``L - G - rest``) and only
  ``input + a page`` against the device rows this batch's prompts leave
  (``P - cur_rem_token_offset``: SGLang's own running sum of prompts and
  pages, outputs not counted). Without it a prompt owed its clipped output
  (up to 4096 tokens) on the device side: refused where its prompt fit, and
  the prompts after it in the same pass refused rows that were free.
* ``ignore_eos`` prompts (benchmarks; HiSparse requires
  ``--disable-radix-cache``, which routes them here): ``add_one_req_ignore_eos``
  simulates every request to its end against ``cur_rem_tokens``.
  :func:`adder_add_one_req_ignore_eos` (AROUND) checks the prompt against both
  sides first (there the device side still holds the outputs of the
  pass's earlier prompts: a later prompt waits one pass). It then runs the
  simulation with ``cur_rem_tokens`` on the host side only (``L`` in place
  of ``min(L, P)``).

The first shifts the adder's offsets by an amount fixed while the adder
lives; the other two shift them only for the call they wrap. No
row is allocated during admission, so ``L`` and ``P`` do not move. Parking's
demand (``adapter.scheduler.scheduler_prefill_demand``) costs the next prompt
the same way, without the running requests' growth.

The decode step's own check, ``ScheduleBatch.check_decode_mem``, compares
the next step's tokens (a page for each request whose new token starts one)
with ``available_size()`` and retracts a running request when they do not
fit. Those tokens take logical slots and host rows, not device rows (a
resident's new page is the exception, and demoting residents gives rows back
before that allocation fails). So a full device side (a prompt's chunks,
or hot buffers up to what the rows allow) made 0.5.13 retract a decoding
request, which then prefilled its 32K prompt again: 3 retractions on
2026-12-06-s5 (``token usage: 1.00`` after the last chunk of a prompt, then
``KV cache pool is full``), and one 11.6 s gap in a stream.
:func:`batch_check_decode_mem` (AROUND) runs the check against the host
side (``HiSparseDualAllocator.host_side_only``). The admission hooks
make a full device side more common, so each needs the other.

Only our DSA allocator (``HiSparseDualAllocator``): DeepSeek-V4's C4 rows are
admitted through the SWA allocator's full-token sizes, and keep 0.5.13's
costing. ``SGLANG_HISPARSE_HOST_GROWTH=0`` keeps it for DSA as well, the
decode check included (for side by side runs).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

HOST_GROWTH_ENV = "SGLANG_HISPARSE_HOST_GROWTH"


def host_growth_enabled() -> bool:
    return os.environ.get(HOST_GROWTH_ENV, "1") != "0"


def _growth_allocator(owner):
    """``owner``'s allocator (an adder's or a batch's) where decode growth
    takes host rows; None where it stays where SGLang puts it."""
    from sglang_hisparse.pools.allocator import HiSparseDualAllocator

    alloc = owner.token_to_kv_pool_allocator
    if type(alloc) is not HiSparseDualAllocator or not host_growth_enabled():
        return None
    return alloc


class _AdderSides(NamedTuple):
    logical: int  # L: the host side
    physical: int  # P: the device side
    credit: float  # what moving the running requests' growth G off the device side gives back


def _sides(adder) -> Optional[_AdderSides]:
    """``L``, ``P`` and the growth credit of the adder's allocator, or None
    where the growth stays where SGLang puts it."""
    alloc = _growth_allocator(adder)
    if alloc is None:
        return None
    logical, physical = alloc.budgets()
    if logical is None:
        return None
    return _AdderSides(logical, physical, device_growth_credit(logical, physical, _running_growth(adder)))


_UNSEEN = object()


def _adder_sides(adder) -> Optional[_AdderSides]:
    """:func:`_sides`, worked out at the adder's first question and kept on
    it. No row is allocated while an adder lives and its running batch does
    not change, so none of them moves; each prompt tried would otherwise
    walk the live requests again (``budgets()``, ``G``)."""
    sides = getattr(adder, "_hisparse_sides", _UNSEEN)
    if sides is _UNSEEN:
        sides = adder._hisparse_sides = _sides(adder)
    return sides


def device_growth_credit(logical: int, physical: int, growth: float) -> float:
    """What moving ``growth`` off the device side gives back:
    ``min(L, P + G) - min(L, P)`` (0 when the host side binds)."""
    return min(logical, physical + growth) - min(logical, physical)


def adder_init_growth_on_host(result, self, *args, **kwargs):
    """AFTER ``PrefillAdder.__init__`` (0.5.13 ``schedule_policy.py:426``):
    the running requests' expected tokens stay charged to host rows only."""
    running = self.running_batch
    if running is None or not running.reqs:
        return result  # no growth to move: skip the budgets' walk of live requests
    sides = _adder_sides(self)
    if sides is not None:
        self.rem_total_token_offset -= sides.credit
    return result


def _running_growth(adder) -> float:
    """``G``: the running requests' expected tokens, as SGLang's adder adds
    them to ``rem_total_token_offset``."""
    running = adder.running_batch
    if running is None:
        return 0
    return sum(adder._get_running_request_total_token_offset(r) for r in running.reqs)


def adder_add_one_req(original, self, req, *args, **kwargs):
    """AROUND ``PrefillAdder.add_one_req`` (0.5.13 ``schedule_policy.py:858``):
    a prompt that stops at EOS is checked, with its clipped output, against
    the host side, and without it against the device rows left by this
    batch's prompts. ``ignore_eos`` prompts go through SGLang's dispatch to
    ``add_one_req_ignore_eos`` (hooked below) unchanged."""
    sides = _adder_sides(self)
    if sides is None or (req.sampling_params.ignore_eos and getattr(self.tree_cache, "disable", True)):
        return original(self, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    logical, physical, growth_credit = sides
    # The original's own charge for the output (0.5.13 to 0.5.17).
    max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
    # rem_total_tokens is min(L - G - rest, P - rest) after the __init__
    # hook (the offset holds G + rest less that hook's credit); the check
    # below wants the device side with no output in it but this prompt's,
    # which the original adds to the prompt it compares.
    host_left = logical - self.rem_total_token_offset - growth_credit
    device_left = physical - self.cur_rem_token_offset + max_new
    credit = max(0, min(host_left, device_left) - (min(logical, physical) - self.rem_total_token_offset))
    self.rem_total_token_offset -= credit
    try:
        return original(self, req, *args, **kwargs)
    finally:
        self.rem_total_token_offset += credit


def adder_add_one_req_ignore_eos(original, self, req, *args, **kwargs):
    """AROUND ``PrefillAdder.add_one_req_ignore_eos`` (0.5.13
    ``schedule_policy.py:757``): the prompt must fit both sides; the
    run-to-the-end simulation then sees the host side only."""
    sides = _adder_sides(self)
    if sides is None:
        return original(self, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    # As the original's first check (0.5.17's form of the prompt length; with
    # the radix cache off a new request has no prefix).
    paged = self.ceil_paged_tokens(len(req.full_untruncated_fill_ids) - len(req.prefix_indices))
    if paged > min(self.cur_rem_tokens, self.rem_total_tokens):
        return AddReqResult.NO_TOKEN
    host_view = max(0, sides.logical - sides.physical)  # L in place of min(L, P)
    self.cur_rem_token_offset -= host_view
    try:
        return original(self, req, *args, **kwargs)
    finally:
        self.cur_rem_token_offset += host_view


def batch_check_decode_mem(original, self, *args, **kwargs):
    """AROUND ``ScheduleBatch.check_decode_mem`` (0.5.13
    ``schedule_batch.py:2347``): the next decode step's tokens are checked
    against the host side; SGLang's own check runs, with ``available_size()``
    answering that side."""
    alloc = _growth_allocator(self)
    if alloc is None:
        return original(self, *args, **kwargs)
    with alloc.host_side_only():
        return original(self, *args, **kwargs)
