"""SGLang 0.5.13 and 0.5.13.post1."""

from __future__ import annotations

from sglang_hisparse.adapter.args import apply_hisparse_dsa_backend_defaults
from sglang_hisparse.arg_rules import HOST_TRANSFER_BACKENDS
from sglang_hisparse.engine.index_share import RULES_0_5_13


def prefill_len(req) -> int:
    # 0.5.13 keeps it as Req.fill_len (prefix + this prefill's tokens).
    return req.fill_len


def kv_allocated_len(req) -> int:
    # 0.5.13 and 0.5.15 keep it on the request (Req.kv_allocated_len).
    return req.kv_allocated_len


def set_kv_allocated_len(req, n: int) -> None:
    # What the allocation paths record (tests and the soak build requests
    # through it).
    req.kv_allocated_len = n


def set_prefill_range(req, start: int, end: int) -> None:
    # As PrefillAdder.add_one_req records a scheduled prefill (0.5.13
    # schedule_policy.py: fill_len, then set_extend_input_len).
    req.fill_len = end
    req.set_extend_input_len(end - start)


def sparse_config(config):
    """0.5.13's SparseConfig has no swap_in_block_size field: it travels in
    sparse_extra_config (our coordinator reads it from the server args)."""
    from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import SparseConfig

    return SparseConfig(
        top_k=config.top_k,
        device_buffer_size=config.device_buffer_size,
        host_to_device_ratio=config.host_to_device_ratio,
        sparse_extra_config={"swap_in_block_size": config.swap_in_block_size},
    )


def native_max_token_pool_size(model_runner) -> int:
    # 0.5.13 model_runner.py:2204-2210.
    if model_runner.is_hybrid_swa:
        return model_runner.full_max_total_num_tokens
    return model_runner.max_total_num_tokens


# REPLACE of hisparse_hook.apply_hisparse_dsa_backend_defaults(server_args,
# user_set_prefill, user_set_decode, kv_cache_dtype) -> bool.
dsa_backend_defaults = apply_hisparse_dsa_backend_defaults


def override_server_args(server_args, source: str, fields: dict) -> None:
    """Change resolved server arguments: 0.5.13's ServerArgs is a plain
    dataclass, its checks read the fields (``source`` names the change in
    the releases that record one)."""
    for name, value in fields.items():
        setattr(server_args, name, value)


def dsa_cell_accounting() -> dict:
    """How the pool configurator charges a DSA token's latent when it sizes
    the device pool from GPU memory (``arg_rules.dsa_device_token_bytes``
    keywords): 0.5.13 and 0.5.15.post1 DefaultPoolConfigurator.
    _compute_cell_size count it without its FP8 scales. (The indexer K is
    charged at host_to_device_ratio on every pin: here by our AFTER hook on
    that method, adapter/model_runner.py hisparse_indexer_cell_size.)"""
    return dict(latent_with_scales=False)


def speculative_v2_worker() -> bool:
    # SGLANG_ENABLE_SPEC_V2 (default on) picks the V2 worker; 0 is spec v1.
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_ENABLE_SPEC_V2.get())


def speculative_seams_wired() -> bool:
    # the verify step's seams are wired for 0.5.13's EAGLE v2 worker (adapter/speculative.py).
    return True


def dsv4_kv_mode(pool) -> str:
    # 0.5.13 has one DeepSeek-V4 layout: paged SWA, C4 and C128 pools
    # (unified KV arrived in 0.5.14).
    return "paged"


def decode_host_transfer_backends() -> tuple[str, ...]:
    """--disaggregation-transfer-backend values a HiSparse PD decode node can
    receive its KV with (into the pinned host pool). 0.5.13's NIXL registers
    every KV buffer as VRAM (nixl/conn.py:901) and builds VRAM-to-VRAM
    transfers (1082-1083); mori registers them as MemoryLocationType.GPU
    (mori/conn.py:368-375): neither is among them."""
    return HOST_TRANSFER_BACKENDS


def index_share_rules():
    """How the model code reads the IndexShare fields (0.5.13 indexes index_topk_pattern by layer id (a short pattern fails) and computes with index_topk_freq as given)."""
    return RULES_0_5_13


def call_running_batch(scheduler, args, kwargs):
    """The running batch a ``Scheduler.get_next_batch_to_run`` or
    ``get_new_batch_prefill`` call works on: 0.5.13 and 0.5.15 take no
    arguments and read ``self.running_batch``."""
    return scheduler.running_batch


def prefill_batch(result):
    """The prefill batch a ``get_new_batch_prefill`` call returned (None: none)."""
    return result


def no_prefill(running_batch):
    """What ``get_new_batch_prefill`` returns when it forms no batch."""
    return None


def init_pools_sized(original, configurator, args, kwargs, max_total_num_tokens: int):
    """Run the release's pool construction (``ModelRunnerKVCacheMixin._init_pools``)
    with the token pool sized ``max_total_num_tokens``: it reads the runner's
    ``max_total_num_tokens``, which is set for the call and restored after."""
    device_tokens = configurator.max_total_num_tokens
    configurator.max_total_num_tokens = max_total_num_tokens
    try:
        return original(configurator, *args, **kwargs)
    finally:
        configurator.max_total_num_tokens = device_tokens


def mla_kv_cache_dim(model_config, kv_cache_dtype, server_args) -> int:
    """The release's own MLA row width in elements (0.5.13 and 0.5.15: a
    method of the model runner's KV-cache mixin, reading three of its fields)."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.model_runner_kv_cache_mixin import ModelRunnerKVCacheMixin

    runner = SimpleNamespace(model_config=model_config, kv_cache_dtype=kv_cache_dtype,
                             server_args=server_args)
    return ModelRunnerKVCacheMixin.calculate_mla_kv_cache_dim(runner)


def mla_host_pool_class():
    """SGLang's MLA host pool class (our DSA host pool derives from it)."""
    from sglang.srt.mem_cache.memory_pool_host import MLATokenToKVPoolHost

    return MLATokenToKVPoolHost


def jit_utils():
    """SGLang's JIT loader (``load_jit``, ``make_cpp_args``,
    ``override_jit_cuda_arch``, ``get_jit_cuda_arch``), which builds our
    kernels against its headers."""
    import sglang.jit_kernel.utils as utils

    return utils


def jit_include_dirs() -> list:
    """The include directories the JIT loader compiles with (``sgl_kernel/``)."""
    from sglang.jit_kernel.utils import DEFAULT_INCLUDE

    return list(DEFAULT_INCLUDE)


def hisparse_ops():
    """SGLang's HiSparse kernel wrappers (``transfer_cache_dsv4_mla``: the
    plain C4 copy our DeepSeek-V4 host pool calls)."""
    import sglang.jit_kernel.hisparse as ops

    return ops
