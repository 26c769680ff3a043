"""The kernel variants a configuration needs, built ahead of the first launch
(``python -m sglang_hisparse doctor --kernels``, the compile tests)."""

from __future__ import annotations

from typing import Iterable, Optional

from sglang_hisparse.kernels import _jit
from sglang_hisparse.kernels.limits import DEFAULT_BLOCK_SIZE


def compile_variants(
    top_k: int = 2048,
    hot_buffer_size: Optional[int] = None,
    item_bytes: int = 1152,
    layout: str = "rows",
    *,
    record_plan: Iterable[bool] = (False,),
    skip_io: Iterable[bool] = (False,),
    probe: Iterable[bool] = (False,),
    draft_tokens: Iterable[int] = (1,),
    block_size: Optional[int] = None,
    hash_scale: Optional[int] = None,
    copy_planned: bool = False,
    copy_planned_threads: Iterable[int] = (512,),
    exactness_check: bool = False,
    device_buffer_size: Optional[int] = None,
    swap_in_block_size: Optional[int] = None,
    **_ignored,
) -> list[str]:
    """Build (or find in the JIT cache) the kernel variants of a config.

    By default only what serving launches: the swap-in without plan
    recording, skip-IO or the probe. ``record_plan``/``skip_io``/``probe``
    list the values of those axes to build (their product is built; so
    does ``draft_tokens``, the rows per request: 1 decodes, n > 1 verifies
    n speculative tokens),
    ``copy_planned`` adds the plan replay (one build per block shape in
    ``copy_planned_threads``) and ``exactness_check`` the
    SGLANG_HISPARSE_CHECK kernel. Works without a GPU as long as nvcc is
    installed (the target is then sm_90a). ``device_buffer_size`` and
    ``swap_in_block_size`` are the ``--hisparse-config`` spellings of
    ``hot_buffer_size`` and ``block_size``; other config keys are ignored,
    so ``doctor --kernels`` can pass the whole config through. The hot
    buffer defaults to 2 x top_k, like the config. Returns a readable name
    per variant.
    """
    from sglang_hisparse.kernels import copy_planned as copy_mod
    from sglang_hisparse.kernels import exactness
    from sglang_hisparse.kernels import swap_in as swap_mod

    hot_buffer_size = hot_buffer_size or device_buffer_size or 2 * top_k
    block_size = block_size or swap_in_block_size or DEFAULT_BLOCK_SIZE
    built = []
    with _jit.arch_context():
        for ndt in dict.fromkeys(int(x) for x in draft_tokens):
            lid = swap_mod.check_sizes(top_k, hot_buffer_size, item_bytes, layout, block_size, ndt)
            scale = swap_mod.resolve_hash_scale(top_k, hot_buffer_size, hash_scale, ndt)
            for rec in dict.fromkeys(bool(x) for x in record_plan):
                for skip in dict.fromkeys(bool(x) for x in skip_io):
                    for stamp in dict.fromkeys(bool(x) for x in probe):
                        variant = swap_mod.SwapInVariant(
                            top_k, hot_buffer_size, item_bytes, lid, rec, skip, block_size,
                            scale, stamp, ndt,
                        )
                        swap_mod.swap_in_module(variant)
                        built.append(variant.name(layout))
        if copy_planned:
            for threads in dict.fromkeys(int(t) for t in copy_planned_threads):
                copy_mod.copy_planned_module(item_bytes, lid, threads)
                built.append(copy_mod.variant_name(item_bytes, layout, threads))
        if exactness_check:
            exactness.check_module(item_bytes, lid)
            built.append(exactness.variant_name(item_bytes, layout))
    return built
