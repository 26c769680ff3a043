"""Benchmark-only swap-in features (``scripts/bench_kernels.py``), kept out of
what serving compiles.

- The timing probe: a swap-in variant built with kProbe (``jit_csrc/probe.cuh``)
  stamps %globaltimer at each phase of block (0, 0) and the grid's first
  entry and last exit into an int64 [PROBE_SLOTS] buffer. The serving variant
  contains no stamping code.
- Hash-scale overrides: the resolve's hash buckets per top-k entry other
  than :func:`~sglang_hisparse.kernels.limits.default_hash_scale`'s choice.
- :func:`compile_bench_variants`: every variant a benchmark run times (plan
  recording for the gather floor, skip-IO for the resolve alone, the probe,
  other block sizes and hash scales), built in parallel.

Skip-IO and plan recording are reachable from serving as well (the
SGLANG_HISPARSE_SKIP_IO probe; the plan for a replay), each as its own
variant, built only when used.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch

from sglang_hisparse.kernels import _jit, swap_in as _swap_in
from sglang_hisparse.kernels._validate import check_tensor, fail

PROBE_SOURCE = _jit.CSRC_DIR / "probe.cuh"

# Mirrors struct Probe in probe.cuh.
PROBE_SLOTS = 16
# Phase boundaries stamped by block (0, 0), in kernel order.
PROBE_PHASES = (
    "entry", "hash_ready", "hashed", "owners", "claimed", "miss_known",
    "ranked", "placed", "published", "copied", "exit",
)
PROBE_EARLY_EXIT, PROBE_GRID_ENTRY, PROBE_GRID_EXIT = 11, 14, 15


def new_probe(device) -> torch.Tensor:
    """A probe buffer ready for one launch (grid min/max slots primed)."""
    probe = torch.zeros(PROBE_SLOTS, dtype=torch.int64, device=device)
    probe[PROBE_GRID_ENTRY] = -1  # reads as UINT64_MAX in the kernel's atomicMin
    return probe


def probe_phases_us(probe: torch.Tensor) -> dict:
    """Durations (us) between consecutive phase stamps, plus the grid span."""
    t = [int(x) & ((1 << 64) - 1) for x in probe.cpu().tolist()]
    out = {}
    prev = t[0]
    for i, name in enumerate(PROBE_PHASES[1:], start=1):
        if t[i]:
            out[name] = (t[i] - prev) / 1000.0
            prev = t[i]
    if t[PROBE_EARLY_EXIT]:
        out["early_exit"] = (t[PROBE_EARLY_EXIT] - t[0]) / 1000.0
    out["block0_total"] = (max(t[i] for i in range(len(PROBE_PHASES)) if t[i]) - t[0]) / 1000.0 \
        if not t[PROBE_EARLY_EXIT] else out["early_exit"]
    out["grid_span"] = (t[PROBE_GRID_EXIT] - t[PROBE_GRID_ENTRY]) / 1000.0
    out["block0_start_lag"] = (t[0] - t[PROBE_GRID_ENTRY]) / 1000.0
    return out


_SWAP_IN_SIGNATURE = inspect.signature(_swap_in.swap_in)


def swap_in_bench(*args, probe: Optional[torch.Tensor] = None, hash_scale: Optional[int] = None,
                  **kwargs) -> torch.Tensor:
    """:func:`sglang_hisparse.kernels.swap_in.swap_in` (same arguments) with
    the benchmark-only options: ``probe`` (int64 [PROBE_SLOTS], from
    :func:`new_probe`) receives the phase stamps, through the kProbe variant;
    ``hash_scale`` overrides the resolve's buckets per top-k entry (1, 2, 4,
    8 or 16, if its table fits shared memory). Without either it is the
    serving call."""
    bound = _SWAP_IN_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    if probe is not None:
        check_tensor("probe", probe, dtypes=(torch.int64,), ndim=1,
                     device=bound.arguments["top_k_tokens"].device)
        if probe.numel() != PROBE_SLOTS:
            fail("probe", f"expected {PROBE_SLOTS} elements, got {probe.numel()}")
    return _swap_in.launch(dict(bound.arguments), probe=probe, hash_scale=hash_scale)


def compile_bench_variants(
    top_k: int,
    hot_buffer_size: int,
    item_bytes: int,
    layout: str = "rows",
    *,
    jobs: Sequence[dict],
    also: Sequence[Callable[[], object]] = (),
) -> list[str]:
    """Builds what a benchmark run times, all at once: one thread per job
    (each build is an nvcc subprocess), a job being keyword arguments of
    :func:`~sglang_hisparse.kernels.variants.compile_variants` (e.g.
    ``dict(skip_io=(True,))``, ``dict(probe=(True,), block_size=256)``,
    ``dict(record_plan=(), copy_planned=True)``); ``also`` are further builds
    for the same pool (another kernel under comparison). Returns our
    variants' names."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from sglang_hisparse.adapter import releases
    from sglang_hisparse.kernels.variants import compile_variants

    get_jit_cuda_arch = releases.current.jit_utils().get_jit_cuda_arch

    # The target (sm_90a without a GPU) and the loader's TVM_FFI_CUDA_ARCH_LIST
    # are fixed for the whole pool, so the per-build set/restore of each
    # cannot race between threads.
    env = "TVM_FFI_CUDA_ARCH_LIST"
    with _jit.arch_context():
        had = env in os.environ
        os.environ.setdefault(env, get_jit_cuda_arch().target_name)
        try:
            with ThreadPoolExecutor(max(1, len(jobs) + len(also))) as pool:
                others = [pool.submit(fn) for fn in also]
                names = list(pool.map(
                    lambda kw: compile_variants(top_k, hot_buffer_size, item_bytes, layout, **kw), jobs))
                for f in others:
                    f.result()
        finally:
            if not had:
                os.environ.pop(env, None)
    return [name for group in names for name in group]
