"""``validate_hisparse``: our replacement for SGLang 0.5.13's startup check.

SGLang calls ``sglang.srt.arg_groups.hisparse_hook.validate_hisparse(self)``
from ``ServerArgs.check_server_args`` (a function-local import, so the
HookRegistry REPLACE is what it finds), in the launcher process, before any
model weights load. This module only reads ``ServerArgs`` into plain values;
the rules are in :mod:`sglang_hisparse.arg_hooks.rules`.
"""

from __future__ import annotations

import os

from sglang_hisparse.arg_hooks.rules import (
    HiSparseArgumentError,
    HiSparseServerArgs,
    ModelFamily,
    find_problems,
)
from sglang_hisparse.config import env_problems


def model_family(hf_config) -> ModelFamily | None:
    from sglang.srt.configs.model_config import is_deepseek_dsa, is_deepseek_v4

    if is_deepseek_v4(hf_config):
        return ModelFamily.DEEPSEEK_V4
    if is_deepseek_dsa(hf_config):
        return ModelFamily.DSA
    return None


def model_index_topk(model_config) -> int | None:
    # Where SGLang's model runner reads the indexer's top-k from.
    return getattr(model_config.hf_text_config, "index_topk", None)


def hisparse_server_args(server_args) -> HiSparseServerArgs:
    model_config = server_args.get_model_config()
    hf_config = model_config.hf_config
    architectures = getattr(hf_config, "architectures", None) or [None]
    speculative_algorithm = server_args.speculative_algorithm
    if speculative_algorithm is not None and speculative_algorithm.upper() == "NONE":
        speculative_algorithm = None
    return HiSparseServerArgs(
        model_architecture=architectures[0],
        model_family=model_family(hf_config),
        model_index_topk=model_index_topk(model_config),
        hisparse_config=server_args.hisparse_config,
        disable_radix_cache=bool(server_args.disable_radix_cache),
        enable_mixed_chunk=bool(server_args.enable_mixed_chunk),
        pp_size=server_args.pp_size,
        page_size=server_args.page_size,
        kv_cache_dtype=server_args.kv_cache_dtype,
        dsa_prefill_backend=server_args.dsa_prefill_backend,
        dsa_decode_backend=server_args.dsa_decode_backend,
        speculative_algorithm=speculative_algorithm,
    )


def validate_hisparse(server_args) -> None:
    """REPLACE for ``sglang.srt.arg_groups.hisparse_hook.validate_hisparse``.

    Raises a ValueError (HiSparseArgumentError) listing every problem with
    the HiSparse arguments; does nothing without ``--enable-hisparse``.
    """
    if not server_args.enable_hisparse:
        return
    problems, _ = find_problems(hisparse_server_args(server_args))
    problems += env_problems(os.environ)
    if problems:
        raise HiSparseArgumentError(problems)
