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

Two paths, two hooks:

* Every prompt: ``PrefillAdder.__init__`` adds the running requests'
  expected tokens (``G``, SGLang's own ``_get_running_request_total_token_offset``)
  to ``rem_total_token_offset``. :func:`adder_init_growth_on_host` (AFTER)
  credits it back on the device side. With the host side ``L`` and the device side ``P``:
  ``rem_total_tokens`` becomes ``min(L, P + G) - G - rest`` (``rest``: the
  batch's own prompts and clipped outputs, which still pay on both sides),
  i.e. ``min(L - G - rest, P - rest)``.
* ``ignore_eos`` prompts (benchmarks; HiSparse requires
  ``--disable-radix-cache``, which routes them here): ``add_one_req_ignore_eos``
  simulates every request to its end against ``cur_rem_tokens``.
  :func:`adder_add_one_req_ignore_eos` (AROUND) checks the prompt against both
  sides first. It then runs the simulation with ``cur_rem_tokens`` on the host
  side only (``L`` in place of ``min(L, P)``).

Both shift the adder's offsets by amounts fixed while the adder lives. No
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
from typing import Optional, Tuple

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


def _sides(adder) -> Optional[Tuple[int, int]]:
    """``(host side, device side)`` of the adder's allocator, or None where
    the growth stays where SGLang puts it."""
    alloc = _growth_allocator(adder)
    if alloc is None:
        return None
    logical, physical = alloc.budgets()
    if logical is None:
        return None
    return logical, physical


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
    sides = _sides(self)
    if sides is None:
        return result
    growth = sum(self._get_running_request_total_token_offset(r) for r in running.reqs)
    self.rem_total_token_offset -= device_growth_credit(*sides, growth)
    return result


def adder_add_one_req_ignore_eos(original, self, req, *args, **kwargs):
    """AROUND ``PrefillAdder.add_one_req_ignore_eos`` (0.5.13
    ``schedule_policy.py:757``): the prompt must fit both sides; the
    run-to-the-end simulation then sees the host side only."""
    sides = _sides(self)
    if sides is None:
        return original(self, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    # As the original's first check (0.5.17's form of the prompt length; with
    # the radix cache off a new request has no prefix).
    paged = self.ceil_paged_tokens(len(req.full_untruncated_fill_ids) - len(req.prefix_indices))
    if paged > min(self.cur_rem_tokens, self.rem_total_tokens):
        return AddReqResult.NO_TOKEN
    logical, physical = sides
    host_view = max(0, logical - physical)  # L in place of min(L, P)
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
