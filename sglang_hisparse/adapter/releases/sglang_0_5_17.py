"""SGLang 0.5.17.

What changed from 0.5.15.post1 for us (read from the release's source):

* a request's allocation bookkeeping moved into ``Req.kv`` (a ``ReqKvInfo``:
  ``kv_allocated_len``, ``swa_evicted_seqlen``), None until the request's
  KV is allocated and again once it is released (``release_kv_cache``);
  ``Req.kv_committed_len`` stays on the request. The release's coordinator
  reads ``req.kv.kv_allocated_len``;
* the scheduler passes its batches around instead of reading
  ``self.running_batch`` inside the call: ``get_next_batch_to_run(self,
  running_batch, last_batch)`` and ``get_new_batch_prefill(self,
  running_batch)`` return a ``NextBatchPlan(batch_to_run, running_batch)``,
  and the event loop stores the plan's running batch after the call (until
  then ``self.running_batch`` may be a batch the call has replaced);
* pool construction moved out of the model runner into
  ``mem_cache/kv_cache_configurator.py``: ``KVCacheConfigurator._init_pools``
  takes the token counts as ``sizes`` (a frozen ``_PoolSizes``), and the MLA
  row width is the module function ``calculate_mla_kv_cache_dim``;
* the JIT kernel loader moved from ``sglang.jit_kernel`` to
  ``sglang.kernels.jit`` (headers under ``kernels/jit/include``) and the
  HiSparse kernel wrappers to ``sglang.kernels.ops.kvcache.hisparse``;
* ``MLATokenToKVPoolHost`` moved to ``mem_cache/pool_host/mla.py``;
* ``DeepseekV2AttentionMLA.__init__`` reads ``cli_factor`` before the
  IndexShare fields (``RULES_0_5_17``);
* the pool configurator's DSA cell size counts the FP8 latent with its
  scales and the HiSparse indexer K at ``host_to_device_ratio``
  (``dsa_cell_accounting``);
* ``ServerArgs`` is read-only once resolved (``__setattr__`` raises after
  ``materialize_declarations``): a change after resolution goes through
  ``ServerArgs.override(source, **fields)``. Ours assign nothing there: the
  DSA backend defaults are a declaration of the resolution pipeline
  (``dsa_backend_defaults`` returns the backend), and ``validate_hisparse``
  reads the ``ResolvedView`` that ``check_server_args`` hands its
  ``_hisparse_validation`` pass.
"""

from __future__ import annotations

from sglang_hisparse.engine.index_share import RULES_0_5_17

# Unchanged from 0.5.15.post1.
from sglang_hisparse.adapter.releases.sglang_0_5_15 import (  # noqa: F401
    decode_host_transfer_backends,
    dsa_backend_defaults,
    dsv4_kv_mode,
    native_max_token_pool_size,
    prefill_len,
    set_prefill_range,
    sparse_config,
    speculative_seams_wired,
    speculative_v2_worker,
)


def kv_allocated_len(req) -> int:
    # No ReqKvInfo: nothing allocated (a waiting request, or one released).
    kv = req.kv
    return 0 if kv is None else kv.kv_allocated_len


def set_kv_allocated_len(req, n: int) -> None:
    # As alloc_for_extend records a first allocation (mem_cache/allocation.py).
    from sglang.srt.managers.schedule_batch import ReqKvInfo

    if req.kv is None:
        req.kv = ReqKvInfo(kv_allocated_len=n, swa_evicted_seqlen=0)
    else:
        req.kv.kv_allocated_len = n


def override_server_args(server_args, source: str, fields: dict) -> None:
    """Change resolved server arguments through the release's one
    post-resolution mutation point (server_args.py ``ServerArgs.override``:
    resolvable fields also join the declaration stash the checks' view
    reads, every change is recorded with its ``source``)."""
    server_args.override(source, **fields)


def dsa_cell_accounting() -> dict:
    """How the pool configurator charges a DSA token's latent (0.5.17
    pool_configurator.py:183-239): the row as the pool lays it out
    (``calculate_mla_kv_cache_dim``: with the FP8 scales). It charges the
    HiSparse indexer K at host_to_device_ratio itself."""
    return dict(latent_with_scales=True)


def call_running_batch(scheduler, args, kwargs):
    """The running batch a ``get_next_batch_to_run(self, running_batch,
    last_batch)`` or ``get_new_batch_prefill(self, running_batch)`` call
    works on: its first argument (``self.running_batch`` is stale once
    ``get_next_batch_to_run`` replaced an empty running batch, and under PP
    it is not the micro-batch's)."""
    return args[0] if args else kwargs["running_batch"]


def prefill_batch(result):
    return result.batch_to_run


def no_prefill(running_batch):
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    return NextBatchPlan(batch_to_run=None, running_batch=running_batch)


def init_pools_sized(original, configurator, args, kwargs, max_total_num_tokens: int):
    """``KVCacheConfigurator._init_pools(*, sizes, ...)``: the token count
    arrives in ``sizes``, which is frozen; the call gets a copy with ours."""
    import msgspec

    kwargs = dict(kwargs, sizes=msgspec.structs.replace(
        kwargs["sizes"], max_total_num_tokens=max_total_num_tokens))
    return original(configurator, *args, **kwargs)


def mla_host_pool_class():
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    return MLATokenToKVPoolHost


def mla_kv_cache_dim(model_config, kv_cache_dtype, server_args) -> int:
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim

    return calculate_mla_kv_cache_dim(model_config=model_config, kv_cache_dtype=kv_cache_dtype,
                                      server_args=server_args)


def index_share_rules():
    """How the model code reads the IndexShare fields (0.5.17: ``cli_factor`` > 1
    first, then 0.5.15.post1's ``dsa_layer_skips_topk``)."""
    return RULES_0_5_17


def jit_utils():
    import sglang.kernels.jit.utils as utils

    return utils


def jit_include_dirs() -> list:
    from sglang.kernels.jit.utils.compile import DEFAULT_INCLUDE

    return list(DEFAULT_INCLUDE)


def hisparse_ops():
    import sglang.kernels.ops.kvcache.hisparse as ops

    return ops
