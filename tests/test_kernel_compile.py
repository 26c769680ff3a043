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
        "record_plan=False, skip_io=False, block_size=1024, hash_scale=8)"
    ]
    mod = swap_in_mod._swap_in_module(2048, 4096, 1152, 0, False, False, 1024, 8)
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
        kernels.compile_variants(top_k=64, hot_buffer_size=30000, block_size=512)
    with pytest.raises(ValueError, match=r"needs \d+ B of shared memory per block; the limit is"):
        kernels.compile_variants(top_k=16384, hot_buffer_size=16384)
    with pytest.raises(ValueError, match="item_bytes must be 584"):
        kernels.compile_variants(top_k=64, layout="dsv4_c4", item_bytes=656)
    with pytest.raises(ValueError, match="layout must be one of"):
        kernels.compile_variants(top_k=64, layout="paged")


def test_default_block_size_is_a_full_block():
    # The resolve's latency falls with every thread (see default_block_size).
    for hot in (64, 4096, 16384, 30000):
        assert kernels.default_block_size(hot) == 1024


def test_hash_scale_is_the_widest_that_fits():
    assert swap_in_mod.default_hash_scale(2048, 4096) == 8
    assert swap_in_mod.default_hash_scale(2048, 32767) == 8
    assert swap_in_mod.default_hash_scale(4096, 4096) == 4
    # 8192 entries: a 4x table alone would be 256 KiB, so the 2x one serves
    assert swap_in_mod.default_hash_scale(8192, 8192) == 2
    assert swap_in_mod.swap_in_smem_bytes(8192, 8192, 2) <= swap_in_mod.MAX_SMEM_BYTES
    with pytest.raises(ValueError, match="hash_scale must be one of 1, 2, 4, 8, 16, got 3"):
        kernels.compile_variants(top_k=64, hash_scale=3)
    with pytest.raises(ValueError, match="hash_scale 4 with top_k 8192 .* shared memory"):
        kernels.compile_variants(top_k=8192, hot_buffer_size=8192, hash_scale=4)


def test_wrapper_rejects_cpu_tensors_by_name():
    cpu = torch.zeros((1, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="top_k_tokens: must be a CUDA tensor"):
        kernels.swap_in(cpu, *([None] * 10))
    with pytest.raises(ValueError, match="top_k_tokens: dtype must be torch.int32"):
        kernels.swap_in(cpu.long(), *([None] * 10))
    with pytest.raises(ValueError, match="miss_src: must be a CUDA tensor"):
        kernels.copy_planned(cpu.long(), cpu, cpu[0], cpu[0, :1], None, None)


def test_probe_phases_mirror_the_kernel_enum():
    """PROBE_PHASES names struct Probe's phase slots in swap_in.cuh, in order."""
    import re

    cuh = swap_in_mod.SWAP_IN_SOURCE.read_text()
    body = cuh[cuh.index("struct Probe {"):]
    body = body[: body.index("};")]
    slots = {re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower(): int(n)
             for name, n in re.findall(r"\bk(\w+) = (\d+),", body)}
    assert [slots[name] for name in kernels.PROBE_PHASES] == list(range(len(kernels.PROBE_PHASES)))
    assert slots["early_exit"] == swap_in_mod.PROBE_EARLY_EXIT
    assert (slots["grid_entry"], slots["grid_exit"]) == (swap_in_mod.PROBE_GRID_ENTRY, swap_in_mod.PROBE_GRID_EXIT)
    assert slots["slots"] == swap_in_mod.PROBE_SLOTS


def test_probe_phases_read_the_kernel_stamps():
    """The probe layout (struct Probe in swap_in.cuh) as the benchmark reads it."""
    probe = kernels.new_probe("cpu")
    assert probe.numel() == 16 and probe[14].item() == -1  # UINT64_MAX for atomicMin
    ns = [1000 * (i + 1) for i in range(len(kernels.PROBE_PHASES))]
    probe[: len(ns)] = torch.tensor(ns)
    probe[14], probe[15] = 500, 20000
    got = kernels.probe_phases_us(probe)
    assert [got[name] for name in kernels.PROBE_PHASES[1:]] == [1.0] * (len(ns) - 1)
    assert got["block0_total"] == 10.0 and got["grid_span"] == 19.5
    assert got["block0_start_lag"] == 0.5
    early = kernels.new_probe("cpu")
    early[0], early[11], early[14], early[15] = 100, 2100, 100, 2600
    got = kernels.probe_phases_us(early)
    assert got["early_exit"] == got["block0_total"] == 2.0 and got["grid_span"] == 2.5
