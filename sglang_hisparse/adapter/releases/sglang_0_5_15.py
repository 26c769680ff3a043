"""SGLang 0.5.15.post1.

What changed from 0.5.13 for us (read from the release's source):

* ``Req.fill_len`` is gone: a scheduled prefill is ``Req.extend_range``
  (``Range(start, end)``, set by ``Req.set_extend_range``), and the
  release's own coordinator reads ``req.extend_range.end`` where 0.5.13
  read ``fill_len``;
* ``SparseConfig`` has a ``swap_in_block_size`` field, which
  ``ModelRunner.alloc_memory_pool`` passes to the coordinator's constructor;
* the DSA backend defaults moved into the argument resolution pipeline:
  ``arg_groups/overrides.py:_dsa_split_backend_resolution`` asks
  ``hisparse_hook._hisparse_default_backend(kv_cache_dtype)`` for one backend
  and sets it for whichever of prefill/decode the user left unset;
* ``ModelRunner.max_token_pool_size`` falls back to the SWA size when a
  hybrid-SWA model has no full pool;
* ``DeepSeekV4TokenToKVPool`` can lay its KV out unified (one buffer per
  layer, the SWA window a ring per request slot; ``_unified_kv``, set from
  ``is_unified_kv_triton()``: HIP with
  ``SGLANG_HACK_FLASHMLA_BACKEND=unified_kv_triton`` only).
"""

from __future__ import annotations

import dataclasses
import os

from sglang_hisparse.adapter.releases import sglang_0_5_13
from sglang_hisparse.config import NATIVE_ENV
from sglang_hisparse.dsa_backends import dsa_backend_for
from sglang_hisparse.engine.index_share import RULES_0_5_15

# Unchanged from 0.5.13: the request's allocated length, the scheduler's
# prefill call, the pool construction seam.
from sglang_hisparse.adapter.releases.sglang_0_5_13 import (  # noqa: F401
    call_running_batch,
    dsa_cell_accounting,
    hisparse_ops,
    init_pools_sized,
    jit_include_dirs,
    jit_utils,
    kv_allocated_len,
    mla_host_pool_class,
    mla_kv_cache_dim,
    no_prefill,
    prefill_batch,
    set_kv_allocated_len,
)


def prefill_len(req) -> int:
    return req.extend_range.end


def set_prefill_range(req, start: int, end: int) -> None:
    # As PrefillAdder.add_one_req records a scheduled prefill (0.5.15.post1).
    req.set_extend_range(start, end)


def sparse_config(config):
    """0.5.13's SparseConfig (swap_in_block_size in sparse_extra_config) with
    the field set too: None unless configured, and our coordinator resolves
    None to the configured (or the kernel's default) block size. In the
    native comparison mode the release's own coordinator reads the field as
    its kernel's template argument, so unset means the release's default,
    what its own parser gives."""
    sparse = sglang_0_5_13.sparse_config(config)
    block = config.swap_in_block_size
    if block is None and os.environ.get(NATIVE_ENV) == "1":
        block = {f.name: f.default for f in dataclasses.fields(sparse)}["swap_in_block_size"]
    return dataclasses.replace(sparse, swap_in_block_size=block)


def native_max_token_pool_size(model_runner) -> int:
    # 0.5.15.post1 model_runner.py:2389-2395.
    if model_runner.is_hybrid_swa:
        return model_runner.full_max_total_num_tokens or model_runner.swa_max_total_num_tokens
    return model_runner.max_total_num_tokens


def dsa_backend_defaults(kv_cache_dtype: str):
    """REPLACE of ``hisparse_hook._hisparse_default_backend``: the backend
    from our table (:mod:`sglang_hisparse.dsa_backends`, the one
    validate_hisparse checks against). An unsupported dtype gets None, so the
    backends stay unset and validation names the dtype (the release would
    pick flashmla_sparse for it)."""
    return dsa_backend_for(kv_cache_dtype)


def override_server_args(server_args, source: str, fields: dict) -> None:
    """Change resolved server arguments: the fields, and the same values as
    the last declaration of the resolution's stash (``_resolved_overrides``),
    since the checks read a view in which the declarations win over the
    fields (0.5.15.post1 arg_groups/overrides.py ``resolved_view``)."""
    sglang_0_5_13.override_server_args(server_args, source, fields)
    stash = getattr(server_args, "_resolved_overrides", None)
    if stash is not None:
        stash.append((source, dict(fields)))


def speculative_v2_worker() -> bool:
    # SGLANG_ENABLE_SPEC_V2 is gone: speculative decoding always runs the V2
    # worker (0.5.15.post1 arg_groups/speculative_hook.py:73-80).
    return True


def speculative_seams_wired() -> bool:
    # 0.5.15 reshaped the spec reserve (speculative.eagle_utils.eagle_prepare_for_decode) and its
    # verify seams are not wired yet.
    return False


def dsv4_kv_mode(pool) -> str:
    # 0.5.15.post1 deepseek_v4_memory_pool.py:566: the pool's own switch.
    return "unified" if pool._unified_kv else "paged"


def decode_host_transfer_backends() -> tuple[str, ...]:
    # 0.5.15.post1 tells NIXL which KV buffers are host memory: the decode
    # marks HiSparse's host pool "DRAM" (decode.py:408-412, kv_data_mem_kinds,
    # sglang#27563) and the connector registers and transfers by that kind
    # (nixl/conn.py:1228-1245); it refuses heterogeneous TP into host memory
    # itself (nixl/conn.py:985-989). mori still registers every KV buffer as
    # GPU memory (mori/conn.py _register_local_buffers).
    return sglang_0_5_13.decode_host_transfer_backends() + ("nixl",)


def index_share_rules():
    """How the model code reads the IndexShare fields (0.5.15.post1's dsa_layer_skips_topk: layers past the pattern's end are anchors, a null freq is 1)."""
    return RULES_0_5_15
