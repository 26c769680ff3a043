"""SGLang 0.5.13's speculative (EAGLE v2) worker, where it meets HiSparse.

The data plane's side of a verify step is :mod:`sglang_hisparse.engine.verify`
and the union swap-in (``draft_tokens`` rows per request). This module holds
the hooks on 0.5.13's speculative classes and model runner that feed them;
each is a manifest entry. A step runs through them in this order:

1. ``ScheduleBatch.prepare_for_decode`` -> :func:`eagle_prepare_for_decode`:
   the spec reserve takes logical slots only.
2. the draft model runs on its own pool, indexed by logical ids
   (:func:`draft_runner_without_hisparse`, :func:`draft_pool_for_logical_ids`).
3. ``prepare_for_v2_verify`` -> :func:`map_verify_slots`: the verify slots
   point at hot-buffer rows before the target's forward writes them.
4. the target's forward: ``get_indexer_metadata`` ->
   :func:`verify_indexer_metadata` keeps the top-k as token positions, and
   ``forward_extend`` (a source patch) resolves them with the union swap-in.
5. ``sample`` -> :func:`commit_verify_slots`: the verified tokens go through
   to host and the verify slots are unmapped.

The joining batch's draft state (the FutureMap hand-off) is in the
``_build_hisparse_decode_batch`` source patch. The argument rules accept
linear MTP/EAGLE with ``--enable-hisparse`` on the releases whose module says
these seams are wired (``releases.speculative_releases()``); without a
verify step the hooks are inert.
"""

from __future__ import annotations

import dataclasses

from sglang_hisparse.adapter import releases


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


def _verify_step(batch):
    coordinator = getattr(batch, "hisparse_coordinator", None)
    return None if coordinator is None else coordinator.verify


def map_verify_slots(result, self, req_to_token_pool, batch, target_worker):
    """AFTER ``EagleVerifyInputV2Mixin.prepare_for_v2_verify`` (0.5.13
    ``eagle_info_v2.py:376``): it has set ``out_cache_loc`` to the verify
    positions' logical slots (``seq_lens .. seq_lens + n``); the forward that
    writes them runs after it returns, on the same stream."""
    step = _verify_step(batch)
    if step is not None and not batch.forward_mode.is_idle():
        reqs = batch.reqs
        step.map_slots([r.req_pool_idx for r in reqs], [releases.current.kv_allocated_len(r) for r in reqs],
                       batch.seq_lens, batch.out_cache_loc)
    return None


def commit_verify_slots(result, self, batch, logits_output, vocab_mask=None):
    """AFTER ``EagleVerifyInputV2Mixin.sample`` (0.5.13 ``eagle_info_v2.py:445``,
    called right after the target's verify forward, ``eagle_worker_v2.py:1270``):
    the verified tokens' KV is written; the commit queues their write-through
    and unmaps the verify slots, whatever was accepted."""
    step = _verify_step(batch)
    if step is not None:
        step.commit()
    return None


def verify_indexer_metadata(result, self, layer_id, forward_batch):
    """AFTER ``DeepseekSparseAttnBackend.get_indexer_metadata`` (0.5.13
    ``dsa_backend.py:2326``): 0.5.13 forces the unfused top-k (token
    positions, which the swap-in resolves) for decode only; a verify step's
    rows need it as well, or the fused kernel returns logical slots."""
    if (self.hisparse_coordinator is None or result.force_unfused_topk
            or not forward_batch.forward_mode.is_target_verify()):
        return None
    return dataclasses.replace(result, force_unfused_topk=True)


def draft_runner_without_hisparse(self, *args, **kwargs):
    """BEFORE ``ModelRunner.initialize`` (0.5.13 ``model_runner.py:632``): the
    draft (NextN) runner copies ``enable_hisparse`` from the server args and
    would build a second coordinator and host pool over the target's shared
    allocator (sglang#23153). The draft keeps its whole KV on the GPU in its
    own pool (one layer), so it runs without HiSparse."""
    if getattr(self, "is_draft_worker", False):
        self.enable_hisparse = False
    return None


def hisparse_draft_layers(server_args, model_config) -> int:
    """Layers of the MTP draft whose pool :func:`draft_pool_for_logical_ids`
    sizes for the logical space: 0 unless speculative decoding runs with
    HiSparse on a release whose verify seams are wired (elsewhere the rules
    refuse it). The draft is the checkpoint's NextN layers
    (``num_nextn_predict_layers``, as 0.5.13's draft runner counts them;
    one where the config names none)."""
    if (not getattr(server_args, "enable_hisparse", False)
            or getattr(server_args, "speculative_algorithm", None) is None
            or not releases.current.speculative_seams_wired()):
        return 0
    nextn = getattr(model_config, "num_nextn_predict_layers", None)
    return int(nextn) if nextn else 1


def draft_pool_for_logical_ids(original, self, *args, **kwargs):
    """AROUND ``ModelRunnerKVCacheMixin._init_pools`` (0.5.13
    ``model_runner_kv_cache_mixin.py:292``; 0.5.17: ``KVCacheConfigurator._init_pools``,
    the sizes an argument): the draft runner sizes its pool
    with the target's device token count, but the shared allocator hands out
    logical slots up to the host-backed logical space, which the draft's
    writes index; its pool spans that space. (SGLang's profile never counts
    a draft's pool; the target's cell-size hook charges the (ratio - 1)
    extra copies, :func:`hisparse_draft_layers`.)"""
    alloc = getattr(self, "token_to_kv_pool_allocator", None)
    if not getattr(self, "is_draft_worker", False) or not hasattr(alloc, "logical_capacity"):
        return original(self, *args, **kwargs)
    return releases.current.init_pools_sized(original, self, args, kwargs, alloc.logical_capacity)
