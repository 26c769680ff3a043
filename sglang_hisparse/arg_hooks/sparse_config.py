"""``parse_hisparse_config``: SGLang's ``SparseConfig``, built from our parser.

SGLang 0.5.13 reads ``--hisparse-config`` through
``sglang.srt.mem_cache.sparsity.parse_hisparse_config(server_args)`` when it
builds the KV pool, the allocator and the coordinator (function-local imports
in the model runner and the pool configurator, in every scheduler process).
We replace that function so those readers get the config our startup check
accepted: same rules, same errors, and ``top_k`` already resolved to the
model's ``index_topk`` (0.5.13 defaults to 2048 and lets the model runner
override it).

``swap_in_block_size`` has no ``SparseConfig`` field in 0.5.13; it travels in
``sparse_extra_config`` (and :func:`resolved_hisparse_config` gives our own object to
code that wants it).
"""

from __future__ import annotations

from sglang_hisparse.arg_hooks.validation import model_index_topk
from sglang_hisparse.config import HiSparseConfig
from sglang_hisparse.config import parse_hisparse_config as parse_hisparse_config_text


def resolved_hisparse_config(server_args) -> HiSparseConfig:
    """The resolved HiSparse config for these server args (raises HiSparseConfigError)."""
    parsed = parse_hisparse_config_text(server_args.hisparse_config)
    return parsed.resolve(model_index_topk(server_args.get_model_config()))


def parse_hisparse_config(server_args):
    """REPLACE for ``sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config``."""
    from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import SparseConfig

    config = resolved_hisparse_config(server_args)
    # algorithm/backend/page_size/min_sparse_prompt_len belong to SGLang's
    # generic sparse coordinator, which HiSparse does not use: left at None.
    return SparseConfig(
        top_k=config.top_k,
        device_buffer_size=config.device_buffer_size,
        host_to_device_ratio=config.host_to_device_ratio,
        sparse_extra_config={"swap_in_block_size": config.swap_in_block_size},
    )
