"""The CUDA swap-in kernels compile through SGLang's JIT loader (nvcc, no GPU needed).

Three variants cover every template axis at least once: the production
shape (DSA bf16 rows), the C4 layout with plan recording and skipped IO at
a small size, and the plan-replay kernel. Without a GPU the target is sm_90a.
Also checks the wrappers' argument validation, which needs neither.
"""

from __future__ import annotations

import importlib
import time

import pytest
import torch

from sglang_hisparse import kernels

# the package re-exports a function named like the submodule
swap_in_mod = importlib.import_module("sglang_hisparse.kernels.swap_in")


@pytest.mark.jit
def test_compile_production_variant():
    t0 = time.monotonic()
    names = kernels.compile_variants(
        top_k=2048, hot_buffer_size=4096, item_bytes=1152, layout="rows",
        record_plan=(False,), copy_planned=False,
    )
    assert names == [
        "swap_in(top_k=2048, hot_buffer_size=4096, item_bytes=1152, layout=rows, "
        "record_plan=False, skip_io=False, block_size=512)"
    ]
    mod = swap_in_mod._swap_in_module(2048, 4096, 1152, 0, False, False, 512)
    assert callable(getattr(mod, "swap_in"))
    print(f"production variant: {time.monotonic() - t0:.1f}s")


@pytest.mark.jit
def test_compile_c4_plan_skip_io_and_replay():
    t0 = time.monotonic()
    names = kernels.compile_variants(
        top_k=64, hot_buffer_size=200, item_bytes=584, layout="dsv4_c4",
        record_plan=(True,), skip_io=(True,), block_size=64, copy_planned=True,
    )
    assert len(names) == 2 and names[1].startswith("copy_planned(")
    mod = swap_in_mod._copy_planned_module(584, 1)
    assert callable(getattr(mod, "copy_planned"))
    print(f"c4 variants: {time.monotonic() - t0:.1f}s")


def test_compile_variants_accepts_a_hisparse_config():
    """doctor --kernels passes the --hisparse-config object through."""
    with pytest.raises(ValueError, match="hot_buffer_size must be in"):
        kernels.compile_variants(top_k=2048, device_buffer_size=1024, host_to_device_ratio=2)
    with pytest.raises(ValueError, match="block_size must be a multiple of 32"):
        kernels.compile_variants(top_k=64, swap_in_block_size=100)
    with pytest.raises(ValueError, match="too small for hot_buffer_size"):
        kernels.compile_variants(top_k=64, hot_buffer_size=32767, block_size=512)
    with pytest.raises(ValueError, match="item_bytes must be 584"):
        kernels.compile_variants(top_k=64, layout="dsv4_c4", item_bytes=656)
    with pytest.raises(ValueError, match="layout must be one of"):
        kernels.compile_variants(top_k=64, layout="paged")


def test_default_block_size_keeps_slots_per_thread_small():
    assert kernels.default_block_size(4096) == 512
    assert kernels.default_block_size(8192) == 512
    assert kernels.default_block_size(16384) == 1024


def test_wrapper_rejects_cpu_tensors_by_name():
    cpu = torch.zeros((1, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="top_k_tokens: must be a CUDA tensor"):
        kernels.swap_in(cpu, *([None] * 10))
    with pytest.raises(ValueError, match="top_k_tokens: dtype must be torch.int32"):
        kernels.swap_in(cpu.long(), *([None] * 10))
    with pytest.raises(ValueError, match="miss_src: must be a CUDA tensor"):
        kernels.copy_planned(cpu.long(), cpu, cpu[0], cpu[0, :1], None, None)
