"""The admission budget of a HiSparse allocator: one formula, over plain ints.

SGLang admits work against ``allocator.available_size()`` (``PrefillAdder``,
``ScheduleBatch.check_decode_mem``) and, on a PD decode node, against the
sub-allocators' own ``available_size()`` (``hisparse_attn_allocator``: the
prealloc budget; ``logical_attn_allocator``: the token budget). HiSparse
cannot answer with free slots alone, because an admitted request keeps
claiming rows after admission: its hot buffer grows, the page of its newest
token is needed from its first decode step, and its logical tokens each need
a host row when they are written through. Upstream's HiSparse answered with
free slots and ran the host pool dry after admission (sglang#23704); this
module is what both of our allocators (``pools/allocator.py`` for DSA,
``pools/allocator_c4.py`` for DeepSeek-V4's C4 rows) answer with instead.

:func:`admission_budgets` takes, all in one pool's units (tokens = rows for
DSA; C4 rows for DeepSeek-V4):

``free_rows``
    Free rows of the GPU pool (its free and released pages).
``owed_rows``
    Rows that requests already admitted may still take without asking
    again, from the coordinator's reservation provider: for every live
    request that holds fewer rows than a padded hot buffer (``B + page``:
    the buffer plus the page whose first slot holds the newest token), the
    difference. A short prompt grows into it while it decodes; a request
    still staging holds only its prefill rows until its buffer is built.
``prefill_claims``
    The same claim for a request that has started prefill but is not staged
    yet: its padded hot buffer less the rows its prompt already holds,
    registered at its first chunk and dropped when it is staged, finishes or
    is released. Without it, a batch of short prompts admitted together
    could not all get their hot buffers.
``reclaimable``
    Rows that demoting resident requests would give back. Allocation demotes
    before it fails (``make_rows_available``), so admission may count them.
    They are added after the clamp: they are rows outside what the free list
    shows. When free rows already fall short of what is owed (a drift, or a
    prefill claim registered past the budget) the shortfall is not taken out
    of them.
``free_logical``
    Free slots of the host-backed (logical) id space, in the host pool's
    units; None where the allocator has no such free list in those units
    (DeepSeek-V4: the compressed ids follow the full ids, whose free list
    the SWA allocator checks in full tokens).
``host_free``, ``host_owed``
    Free host rows (None: no host pool attached yet), and the host rows
    admitted requests will still need for logical tokens they already own
    (tokens not yet on host, rounded up to pages): each logical token is
    backed by a host row once it is written through.

and returns ``(logical, physical)``:

* ``physical = max(0, free_rows - owed_rows - prefill_claims) + reclaimable``;
* ``logical = min(free_logical, max(0, host_free - host_owed))`` with a host
  pool, ``free_logical`` without one (``max(0, host_free - host_owed)`` when
  ``free_logical`` is None; None when both are).

``available_size()`` is ``min(logical, physical)`` (DeepSeek-V4: the C4 side
in full tokens, also capped by the SWA allocator). The sub-allocators report
the same formula with the other side's terms neutral:
``hisparse_attn_allocator.available_size()`` is ``physical`` with
``reclaimable = 0`` (what the free list can give without demoting), and
``logical_attn_allocator.available_size()`` is ``logical``. So
``available_size() == min(logical_attn.available_size(),
hisparse_attn.available_size() + reclaimable)`` by construction.

The scheduler asks several times a step, so the formula is one flat
function (no helpers, no allocation); callers read their pool sizes and the
reservation provider once and make one call. No torch, no SGLang.
"""

from __future__ import annotations

from typing import Optional, Tuple


def admission_budgets(
    free_rows: int,
    owed_rows: int,
    prefill_claims: int,
    reclaimable: int,
    free_logical: Optional[int],
    host_free: Optional[int],
    host_owed: int,
) -> Tuple[Optional[int], int]:
    """``(logical, physical)`` tokens admission may still use (see the module)."""
    physical = free_rows - owed_rows - prefill_claims
    if physical < 0:
        physical = 0
    physical += reclaimable
    if host_free is not None:
        head = host_free - host_owed
        if head < 0:
            head = 0
        if free_logical is None or head < free_logical:
            free_logical = head
    return free_logical, physical
