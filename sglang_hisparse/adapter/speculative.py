"""SGLang 0.5.13's speculative (EAGLE v2) worker, where it meets HiSparse.

The data plane's side of a verify step is :mod:`sglang_hisparse.engine.verify`
and the union swap-in (``draft_tokens`` rows per request). This module holds
the hooks on 0.5.13's speculative classes that feed them; each is a
manifest entry. Speculative decoding with ``--enable-hisparse`` is still
refused by the argument rules until every seam of the verify step is wired
(``arg_rules.speculative_problems``), so these hooks are inert in serving
today; their tests drive SGLang's own functions on CPU.
"""

from __future__ import annotations


def eagle_prepare_for_decode(original, self, batch):
    """AROUND ``EagleDraftInputV2Mixin.prepare_for_decode`` (0.5.13
    ``speculative/eagle_info_v2.py:128``): its reserve for the next draft
    and verify positions goes through ``alloc_paged_token_slots_extend``,
    i.e. our allocator's ``alloc_extend``, which would give each position a
    device row too; under HiSparse the verify step maps them to hot-buffer
    slots instead, so the reserve takes logical slots only."""
    alloc = batch.token_to_kv_pool_allocator
    if batch.hisparse_coordinator is None or not hasattr(alloc, "logical_only"):
        return original(self, batch)
    with alloc.logical_only():
        return original(self, batch)
