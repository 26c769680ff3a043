"""DeepSeek-V4 under PD disaggregation with a draft model: the draft's SWA state.

When prefill and decode both run EAGLE/MTP on DeepSeek-V4, the prefill also
computes the draft NextN layer's sliding-window KV for the prompt. The
transfer carries what ``setup_state_kv_args`` registers in ``kv_args``, and
up to 0.5.15.post1 it registers only the target pool's state (its SWA layers
and compress states). The draft's SWA buffers are in no component either
(an SWA-only pool has no contiguous KV buffers), so decode starts with the
draft's window missing or stale until new tokens refill it, and early
drafts are accepted less often. 0.5.16 registers them itself
(``disaggregation/utils.py:951-1025``); until then
:func:`register_draft_swa_state` does, as an AFTER hook (manifest entry
``disaggregation.utils.setup_state_kv_args``).

The draft's buffers become an SWA component of their own, after the
target's: prefill and decode match components by position, so both sides
need this plugin. The component is an SWA one so that both sides fill its
indices with the same window SWA pages as the target's (prefill's
``send_kv_chunk``, decode's ``pop_preallocated``) and the transfer backends
send it as they send the target's (``maybe_send_extra``). That is correct
only if the draft addresses its SWA buffer the way the target does, so the
pools are checked first and a start-up error names every difference.

HiSparse does not change the SWA pools (only the C4 pool), so the hook
does the same with ``--enable-hisparse`` or without: the plugin installs it
whenever it is loaded (scope ALWAYS), and nothing here asks whether HiSparse
is on.
"""

from __future__ import annotations

from sglang_hisparse.adapter import releases


def draft_swa_mismatches(target, draft) -> list[str]:
    """What keeps the draft's SWA buffers from travelling as a component
    beside the target's: one line per difference (empty: none)."""
    problems = []
    ratios = list(draft.compression_ratios)
    if not ratios or any(ratio != 0 for ratio in ratios):
        # A compressed draft layer would have C4/C128 state no component
        # describes.
        problems.append(f"the draft's layers are not SWA-only: compress ratios {ratios} "
                        "(every draft layer must be 0)")
    modes = releases.current.dsv4_kv_mode(target), releases.current.dsv4_kv_mode(draft)
    if modes[0] != modes[1]:
        problems.append(f"KV mode: target {modes[0]}, draft {modes[1]}")
    if modes != ("paged", "paged"):
        return problems
    # Both sides compute the component's indices from the target's mapping.
    mapping = getattr(target, "full_to_swa_index_mapping", None)
    if mapping is None or getattr(draft, "full_to_swa_index_mapping", None) is not mapping:
        problems.append("full-to-SWA index mapping: the draft does not share the target's "
                        "(the transfer addresses the draft's SWA pages through the target's)")
    # ... and page ids index the draft's buffer as they index the target's.
    for field in ("page_size", "swa_page_size", "swa_size"):
        want, got = getattr(target, field), getattr(draft, field)
        if want != got:
            problems.append(f"page geometry: {field} target {want}, draft {got}")
    return problems


def register_draft_swa_state(result, kv_args, token_to_kv_pool, draft_token_to_kv_pool=None,
                             *args, **kwargs):
    """AFTER ``disaggregation.utils.setup_state_kv_args(kv_args, token_to_kv_pool,
    draft_token_to_kv_pool, total_kv_layers, req_to_token_pool)``: when both
    pools are ``DeepSeekV4TokenToKVPool``, check the draft against the
    target (RuntimeError naming every difference) and append the draft's
    SWA buffers to ``kv_args`` as an SWA state component of their own."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.utils import is_npu

    # NPU's DeepSeek-V4 pool (0.5.15) lays its paged state out differently;
    # 0.5.16 leaves it alone too.
    if (is_npu() or not isinstance(token_to_kv_pool, DeepSeekV4TokenToKVPool)
            or not isinstance(draft_token_to_kv_pool, DeepSeekV4TokenToKVPool)):
        return None
    problems = draft_swa_mismatches(token_to_kv_pool, draft_token_to_kv_pool)
    if problems:
        raise RuntimeError(
            "DeepSeek-V4 PD transfer of the draft's SWA state: the draft KV pool does not "
            "match the target's: " + "; ".join(problems)
        )
    if releases.current.dsv4_kv_mode(token_to_kv_pool) != "paged":
        # Unified KV (0.5.14+, HIP only) keeps the window in a per-request
        # ring, which 0.5.16 sends as SWA_RING; left as the release has it.
        return None
    # An SWA-only draft's state is its SWA buffers, one per layer.
    ptrs, lens, item_lens = draft_token_to_kv_pool.get_state_buf_infos()
    if ptrs:
        append_state_component(kv_args, StateType.SWA, ptrs, lens, item_lens)
    return None
