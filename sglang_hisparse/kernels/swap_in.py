"""CUDA swap-in kernels (``jit_csrc/swap_in.cuh``, ``jit_csrc/copy_planned.cuh``).

Thin wrappers: they check shapes, dtypes and devices (a ValueError names the
offending argument), pick the template variant, build it once through
SGLang's JIT loader and launch it. Semantics are those of
:mod:`sglang_hisparse.kernels.reference`; the tests hold the two equal.

Nothing here imports SGLang at module import time: the loader is imported
the first time a kernel is built.
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
from pathlib import Path
from typing import Iterable, Optional

import torch

from sglang_hisparse.kernels.reference import (
    C4_ITEM_BYTES,
    C4_PAGE_BYTES,
    LAYOUTS,
    layout_id as _layout_id,
)

_C4 = LAYOUTS["dsv4_c4"]

CSRC_DIR = Path(__file__).resolve().parent.parent / "jit_csrc"
SWAP_IN_SOURCE = CSRC_DIR / "swap_in.cuh"
COPY_PLANNED_SOURCE = CSRC_DIR / "copy_planned.cuh"

# The kernel keeps one bit per buffer position a thread owns, in 32-bit masks.
MAX_POSITIONS_PER_THREAD = 32
# LRU slots are int16.
MAX_HOT_BUFFER_SIZE = 32767
# Whole warps, at least two (two warps run the block's two scans at once).
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 64, 1024
# Copy-planned launcher limit (offsets of all rows live in shared memory).
_MAX_PLANNED_ROWS = 12000
_ARRIVALS_MIN_ROWS = 4096


# --------------------------------------------------------------------------
# variant selection


def default_block_size(hot_buffer_size: int) -> int:
    """Threads per swap-in block. The resolve is a chain of short per-thread
    loops between barriers, so its latency falls with every thread added:
    on an H200 (top_k 2048, hot buffer 4096) 1024 threads cut a 0%-miss
    call from 17.7 to 12.8 us and a batch-64 one from 25.6 to 19.3 us.
    (A full block also caps registers at 64 a thread; the kernel fits.)"""
    return 1024


# Mirrors SwapInSmem in swap_in.cuh; a block may use at most 227 KiB.
MAX_SMEM_BYTES = 227 * 1024


# Hash buckets per top-k entry (template kHashScale), widest first: the
# default is the first whose table fits a block's shared memory.
HASH_SCALES = (8, 4, 2)
MIN_HASH_SCALE = HASH_SCALES[-1]


def swap_in_smem_bytes(top_k: int, hot_buffer_size: int, hash_scale: int = MIN_HASH_SCALE) -> int:
    hash_size = 1 << max(1, (hash_scale * top_k - 1).bit_length())
    chunks = lambda n: -(-n // 32)  # noqa: E731
    return (
        8 * hash_size  # keys + values
        + 4 * top_k * 2  # resolution + miss tokens
        + 4 * (chunks(hot_buffer_size) + chunks(top_k) + 4)
        + 2 * hot_buffer_size  # slot owners, later the regrouped LRU
    )


@functools.cache  # read on every eager launch
def default_hash_scale(top_k: int, hot_buffer_size: int) -> int:
    """Buckets per top-k entry for the resolve's hash table: the widest of
    HASH_SCALES that fits shared memory. Fewer buckets mean longer probes;
    on an H200 (top_k 2048, buffer 4096) a 0%-miss call took 12.3 / 9.1 /
    8.7 us at batch 1 and 16.1 / 10.6 / 9.8 us at batch 64 with 2 / 4 / 8."""
    for scale in HASH_SCALES:
        if swap_in_smem_bytes(top_k, hot_buffer_size, scale) <= MAX_SMEM_BYTES:
            return scale
    return MIN_HASH_SCALE


def size_problem(
    top_k: int,
    hot_buffer_size: int,
    block_size: Optional[int] = None,
    *,
    hot_name: str = "hot_buffer_size",
    block_name: str = "block_size",
) -> Optional[str]:
    """Why the swap-in kernel cannot run these sizes, or None if it can.

    The one statement of the kernel's size limits, shared by the launch
    wrappers and by ``--hisparse-config`` validation, which passes its own
    names for the sizes (``device_buffer_size``, ``swap_in_block_size``) so
    the message names what the user wrote. ``block_size`` None: the default.
    """
    hot = hot_buffer_size
    if top_k < 1:
        return f"top_k must be >= 1, got {top_k}"
    if not top_k <= hot <= MAX_HOT_BUFFER_SIZE:
        return (f"{hot_name} must be in [top_k, {MAX_HOT_BUFFER_SIZE}] (lru is int16), "
                f"got {hot} with top_k {top_k}")
    smem = swap_in_smem_bytes(top_k, hot)
    if smem > MAX_SMEM_BYTES:
        fits = [b for b in range(top_k, MAX_HOT_BUFFER_SIZE + 1, 64)
                if swap_in_smem_bytes(top_k, b) <= MAX_SMEM_BYTES]
        hint = (f"{hot_name} must be <= {fits[-1]} with top_k {top_k}" if fits
                else f"top_k {top_k} is too large for the swap-in kernel")
        return (f"top_k {top_k} with {hot_name} {hot} needs {smem} B of shared memory "
                f"per block; the limit is {MAX_SMEM_BYTES}; {hint}")
    block = default_block_size(hot) if block_size is None else block_size
    if block % 32 or not MIN_BLOCK_SIZE <= block <= MAX_BLOCK_SIZE:
        return (f"{block_name} must be a multiple of 32 in [{MIN_BLOCK_SIZE}, "
                f"{MAX_BLOCK_SIZE}], got {block}")
    for name, size in ((hot_name, hot), ("top_k", top_k)):
        if math.ceil(size / block) > MAX_POSITIONS_PER_THREAD:
            least = 32 * math.ceil(math.ceil(size / MAX_POSITIONS_PER_THREAD) / 32)
            return (f"{block_name} {block} is too small for {name} {size}: at most "
                    f"{MAX_POSITIONS_PER_THREAD} slots per thread, so {block_name} "
                    f"must be >= {least}")
    return None


def _check_hash_scale(top_k: int, hot_buffer_size: int, hash_scale: Optional[int]) -> int:
    if hash_scale is None:
        return default_hash_scale(top_k, hot_buffer_size)
    if hash_scale not in (1, 2, 4, 8, 16):
        raise ValueError(f"hash_scale must be one of 1, 2, 4, 8, 16, got {hash_scale}")
    smem = swap_in_smem_bytes(top_k, hot_buffer_size, hash_scale)
    if smem > MAX_SMEM_BYTES:
        raise ValueError(f"hash_scale {hash_scale} with top_k {top_k} and hot_buffer_size "
                         f"{hot_buffer_size} needs {smem} B of shared memory; the limit is "
                         f"{MAX_SMEM_BYTES}")
    return hash_scale


def _check_sizes(top_k: int, hot_buffer_size: int, item_bytes: int, layout: str,
                 block_size: Optional[int] = None) -> int:
    layout_id = _layout_id(layout)
    problem = size_problem(top_k, hot_buffer_size, block_size)
    if problem:
        raise ValueError(problem)
    if layout_id == _C4:
        if item_bytes != C4_ITEM_BYTES:
            raise ValueError(
                f"item_bytes must be {C4_ITEM_BYTES} (576 B value + 8 B scale) for "
                f"layout 'dsv4_c4', got {item_bytes}"
            )
    elif item_bytes <= 0 or item_bytes % 4:
        raise ValueError(f"item_bytes must be a positive multiple of 4, got {item_bytes}")
    return layout_id


# --------------------------------------------------------------------------
# JIT modules


def _cuda_home_candidates() -> list[Path]:
    import glob

    found = [Path("/usr/local/cuda")] + [Path(p) for p in sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    nvcc = shutil.which("nvcc")
    if nvcc:
        found.insert(0, Path(nvcc).resolve().parent.parent)
    return found


def _ensure_cuda_home() -> None:
    """tvm-ffi derives the CUDA root from `which nvcc` when CUDA_HOME is unset,
    which breaks when nvcc on PATH is a wrapper script (no lib64 next to it)."""
    import os

    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for home in _cuda_home_candidates():
        if (home / "bin" / "nvcc").exists() and (home / "lib64").exists():
            os.environ["CUDA_HOME"] = str(home)
            return


def _load_jit():
    _ensure_cuda_home()
    from sglang.jit_kernel.utils import load_jit, make_cpp_args

    return load_jit, make_cpp_args


@functools.cache
def _swap_in_module(
    top_k: int,
    hot_buffer_size: int,
    item_bytes: int,
    layout_id: int,
    record_plan: bool,
    skip_io: bool,
    block_size: int,
    hash_scale: int,
):
    load_jit, make_cpp_args = _load_jit()
    args = make_cpp_args(
        top_k, hot_buffer_size, item_bytes, layout_id, record_plan, skip_io, block_size,
        hash_scale,
    )
    return load_jit(
        "hisparse_plugin_swap_in",
        *args,
        cuda_files=[str(SWAP_IN_SOURCE)],
        cuda_wrappers=[("swap_in", f"hisparse_plugin::SwapIn<{args}>::run")],
    )


@functools.cache
def _copy_planned_module(item_bytes: int, layout_id: int):
    load_jit, make_cpp_args = _load_jit()
    args = make_cpp_args(item_bytes, layout_id)
    return load_jit(
        "hisparse_plugin_copy_planned",
        *args,
        cuda_files=[str(COPY_PLANNED_SOURCE)],
        cuda_wrappers=[("copy_planned", f"hisparse_plugin::CopyPlanned<{args}>::run")],
    )


def _variant_name(kind: str, **kw) -> str:
    return kind + "(" + ", ".join(f"{k}={v}" for k, v in kw.items()) + ")"


def nvcc_available() -> bool:
    import os

    if shutil.which("nvcc"):
        return True
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    homes = [Path(home)] if home else _cuda_home_candidates()
    return any((h / "bin" / "nvcc").exists() for h in homes)


def _arch_context():
    """Without a visible GPU, build for Hopper (sm_90a), the production target."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from sglang.jit_kernel.utils import override_jit_cuda_arch

    return override_jit_cuda_arch(9, 0, "a")


def compile_variants(
    top_k: int = 2048,
    hot_buffer_size: Optional[int] = None,
    item_bytes: int = 1152,
    layout: str = "rows",
    *,
    record_plan: Iterable[bool] = (False, True),
    skip_io: Iterable[bool] = (False,),
    block_size: Optional[int] = None,
    copy_planned: bool = True,
    device_buffer_size: Optional[int] = None,
    swap_in_block_size: Optional[int] = None,
    hash_scale: Optional[int] = None,
    **_ignored,
) -> list[str]:
    """Build (or find in the JIT cache) every kernel variant a config needs.

    Works without a GPU as long as nvcc is installed (the target is then
    sm_90a). ``device_buffer_size`` and ``swap_in_block_size`` are the
    ``--hisparse-config`` spellings of ``hot_buffer_size`` and ``block_size``;
    other config keys are ignored, so ``doctor --kernels`` can pass the whole
    config through. The hot buffer defaults to 2 x top_k, like the config.
    Returns a readable name per variant.
    """
    hot_buffer_size = hot_buffer_size or device_buffer_size or 2 * top_k
    block_size = block_size or swap_in_block_size or default_block_size(hot_buffer_size)
    layout_id = _check_sizes(top_k, hot_buffer_size, item_bytes, layout, block_size)
    hash_scale = _check_hash_scale(top_k, hot_buffer_size, hash_scale)
    built = []
    with _arch_context():
        for rec in dict.fromkeys(bool(x) for x in record_plan):
            for skip in dict.fromkeys(bool(x) for x in skip_io):
                _swap_in_module(
                    top_k, hot_buffer_size, item_bytes, layout_id, rec, skip, block_size,
                    hash_scale,
                )
                built.append(
                    _variant_name(
                        "swap_in",
                        top_k=top_k,
                        hot_buffer_size=hot_buffer_size,
                        item_bytes=item_bytes,
                        layout=layout,
                        record_plan=rec,
                        skip_io=skip,
                        block_size=block_size,
                        hash_scale=hash_scale,
                    )
                )
        if copy_planned:
            _copy_planned_module(item_bytes, layout_id)
            built.append(_variant_name("copy_planned", item_bytes=item_bytes, layout=layout))
    return built


# --------------------------------------------------------------------------
# timing probe (mirrors struct Probe in swap_in.cuh)

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
    out["block0_total"] = (max(t[i] for i in range(11) if t[i]) - t[0]) / 1000.0 \
        if not t[PROBE_EARLY_EXIT] else out["early_exit"]
    out["grid_span"] = (t[PROBE_GRID_EXIT] - t[PROBE_GRID_ENTRY]) / 1000.0
    out["block0_start_lag"] = (t[0] - t[PROBE_GRID_ENTRY]) / 1000.0
    return out


# --------------------------------------------------------------------------
# launch helpers


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def default_blocks_per_req(
    device: torch.device, batch: int, top_k: int, block_size: int
) -> int:
    """Blocks per request: spread a small batch's misses over about one block
    per SM (one wave, so no block waits for a slot), but never more blocks
    than a 100%-miss step can keep busy (one miss per warp)."""
    sms = _sm_count(_device_index(device))
    warps = block_size // 32
    split = sms // max(batch, 1)
    return max(1, min(split, -(-top_k // warps), 65535))


# Arrival counters, one per batch row. They return to zero after every launch,
# so one zeroed buffer per device serves all layers on that device's stream.
# Buffers are never freed: a captured CUDA graph may still point at one.
_ARRIVALS: dict[int, torch.Tensor] = {}
_ARRIVALS_KEEP: list[torch.Tensor] = []


def arrivals_workspace(device: torch.device, rows: int) -> torch.Tensor:
    """The shared per-device arrival counters (int32, zeroed, >= ``rows``).

    Two swap-in launches that may run concurrently (different streams) must
    not share counters: give one of them its own ``torch.zeros(rows, int32)``.
    """
    index = _device_index(device)
    buf = _ARRIVALS.get(index)
    if buf is None or buf.numel() < rows:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"swap_in: the arrival workspace for {rows} rows must exist before "
                "CUDA graph capture; run one eager call with the largest batch first "
                "or pass workspace="
            )
        buf = torch.zeros(
            max(rows, _ARRIVALS_MIN_ROWS), dtype=torch.int32, device=f"cuda:{index}"
        )
        _ARRIVALS[index] = buf
        _ARRIVALS_KEEP.append(buf)
    return buf


def _fail(name: str, what: str) -> None:
    raise ValueError(f"{name}: {what}")


def _check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtypes: tuple[torch.dtype, ...],
    ndim: int,
    device: Optional[torch.device] = None,
    inner_contiguous: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        _fail(name, f"dtype must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != ndim:
        _fail(name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(name, f"must be on {device}, got {t.device}")
    if inner_contiguous and t.dim() and t.size(-1) > 1 and t.stride(-1) != 1:
        _fail(name, f"last dim must be contiguous, got strides {t.stride()}")


def _check_kv(
    layout: str, host_kv: torch.Tensor, device_kv: torch.Tensor, device: torch.device
) -> int:
    """Validates both KV pools; returns the row bytes (template item size)."""
    _check_tensor("host_kv", host_kv, dtypes=(torch.uint8,), ndim=2)
    _check_tensor("device_kv", device_kv, dtypes=(torch.uint8,), ndim=2, device=device)
    if host_kv.is_cuda:
        if host_kv.device != device:
            _fail("host_kv", f"must be pinned CPU memory or on {device}, got {host_kv.device}")
    elif not torch.cuda.is_current_stream_capturing() and not host_kv.is_pinned():
        # (the pointer query behind is_pinned is skipped while capturing)
        _fail("host_kv", "CPU tensor must be pinned (page-locked) for device access")
    if host_kv.size(1) != device_kv.size(1):
        _fail(
            "device_kv",
            f"row bytes {device_kv.size(1)} differ from host_kv's {host_kv.size(1)}",
        )
    if _layout_id(layout) == _C4:
        if host_kv.size(1) != C4_PAGE_BYTES:
            _fail("host_kv", f"dsv4_c4 pools are [pages, {C4_PAGE_BYTES}] bytes, got {tuple(host_kv.shape)}")
        item_bytes, vec = C4_ITEM_BYTES, 16
    else:
        item_bytes = host_kv.size(1)
        if item_bytes <= 0 or item_bytes % 4:
            _fail("host_kv", f"row bytes must be a positive multiple of 4, got {item_bytes}")
        vec = 16 if item_bytes % 16 == 0 else 8 if item_bytes % 8 == 0 else 4
    for name, t in (("host_kv", host_kv), ("device_kv", device_kv)):
        if t.data_ptr() % vec or (t.size(0) > 1 and t.stride(0) % vec):
            _fail(
                name,
                f"base address and row stride must be multiples of {vec} bytes "
                f"(stride {t.stride(0)})",
            )
    return item_bytes


def _given_together(**optional) -> bool:
    """True if every optional argument is given, False if none is; else an error."""
    given = [v is not None for v in optional.values()]
    if any(given) and not all(given):
        names = list(optional)
        raise ValueError(f"{', '.join(names[:-1])} and {names[-1]} must be given together")
    return all(given)


def _check_plan(
    miss_src, miss_dst, miss_count, bs: int, top_k: int, device: torch.device
) -> bool:
    if not _given_together(miss_src=miss_src, miss_dst=miss_dst, miss_count=miss_count):
        return False
    _check_tensor("miss_src", miss_src, dtypes=(torch.int64,), ndim=2, device=device)
    _check_tensor("miss_dst", miss_dst, dtypes=(torch.int32,), ndim=2, device=device)
    _check_tensor("miss_count", miss_count, dtypes=(torch.int32,), ndim=1, device=device)
    if miss_src.shape != miss_dst.shape:
        _fail("miss_dst", f"shape {tuple(miss_dst.shape)} differs from miss_src's {tuple(miss_src.shape)}")
    if miss_src.size(0) < bs or miss_src.size(1) < top_k:
        _fail("miss_src", f"needs shape >= [{bs}, {top_k}], got {tuple(miss_src.shape)}")
    if miss_count.size(0) < bs:
        _fail("miss_count", f"needs >= {bs} entries, got {miss_count.size(0)}")
    return True


def _check_residency(resident, req_to_token, token_to_row, max_reqs: int,
                     device: torch.device) -> bool:
    if not _given_together(resident=resident, req_to_token=req_to_token,
                           token_to_row=token_to_row):
        return False
    _check_tensor("resident", resident, dtypes=(torch.int32,), ndim=1, device=device)
    _check_tensor("req_to_token", req_to_token, dtypes=(torch.int32,), ndim=2, device=device)
    _check_tensor("token_to_row", token_to_row, dtypes=(torch.int64,), ndim=1, device=device)
    for name, t in (("resident", resident), ("req_to_token", req_to_token)):
        if t.size(0) != max_reqs:
            _fail(name, f"expected {max_reqs} rows (one per request slot), got {t.size(0)}")
    return True


# --------------------------------------------------------------------------
# public API


def swap_in(
    top_k_tokens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_real_reqs: torch.Tensor,
    slot_tokens: torch.Tensor,
    slot_locs: torch.Tensor,
    lru: torch.Tensor,
    host_locs: torch.Tensor,
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    *,
    layout: str = "rows",
    miss_src: Optional[torch.Tensor] = None,
    miss_dst: Optional[torch.Tensor] = None,
    miss_count: Optional[torch.Tensor] = None,
    skip_io: bool = False,
    blocks_per_req: Optional[int] = None,
    block_size: Optional[int] = None,
    workspace: Optional[torch.Tensor] = None,
    resident: Optional[torch.Tensor] = None,
    req_to_token: Optional[torch.Tensor] = None,
    token_to_row: Optional[torch.Tensor] = None,
    tally: Optional[torch.Tensor] = None,
    probe: Optional[torch.Tensor] = None,
    hash_scale: Optional[int] = None,
) -> torch.Tensor:
    """Resolve one layer's top-k against the hot buffers; load misses; fill ``out``.

    See :func:`sglang_hisparse.kernels.reference.swap_in` for the argument
    contract and semantics. CUDA-graph safe: no host sync and no allocation
    (after the first call on a device), and the grid depends only on the
    batch size. ``blocks_per_req``/``block_size`` tune the launch and
    ``workspace`` replaces the shared arrival counters (int32, zeroed,
    >= batch entries). ``skip_io`` resolves and updates state but moves no
    KV bytes (a timing probe). ``resident``/``req_to_token``/``token_to_row``
    (together) translate resident requests' positions instead (reference
    rule 8). ``tally`` (int64 [2]) accumulates valid entries and misses
    (rule 10) with one atomic add each per request, in place of counting
    ops after every launch. ``hash_scale`` overrides the resolve's hash
    buckets per top-k entry (a tuning knob; default
    :func:`default_hash_scale`). ``probe`` (int64 [PROBE_SLOTS], a benchmark
    aid) receives %globaltimer stamps of the kernel's phases; see
    :data:`PROBE_PHASES`.
    Returns ``out``.
    """
    _check_tensor("top_k_tokens", top_k_tokens, dtypes=(torch.int32,), ndim=2)
    if not top_k_tokens.is_cuda:
        _fail("top_k_tokens", f"must be a CUDA tensor, got {top_k_tokens.device}")
    device = top_k_tokens.device
    bs, top_k = top_k_tokens.shape
    if out is None:  # allocates: pass `out` under CUDA-graph capture
        out = torch.empty((bs, top_k), dtype=torch.int32, device=device)
    _check_tensor("out", out, dtypes=(torch.int32,), ndim=2, device=device)
    if tuple(out.shape) != (bs, top_k):
        _fail("out", f"expected shape {(bs, top_k)}, got {tuple(out.shape)}")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        _check_tensor(name, t, dtypes=(torch.int32, torch.int64), ndim=1, device=device)
        if t.size(0) != bs:
            _fail(name, f"expected {bs} entries (batch of top_k_tokens), got {t.size(0)}")
    _check_tensor("num_real_reqs", num_real_reqs, dtypes=(torch.int32,), ndim=1, device=device)
    if num_real_reqs.numel() != 1:
        _fail("num_real_reqs", f"expected 1 element, got {num_real_reqs.numel()}")
    _check_tensor("lru", lru, dtypes=(torch.int16,), ndim=2, device=device)
    hot = lru.size(1)
    max_reqs = lru.size(0)
    for name, t in (("slot_tokens", slot_tokens), ("slot_locs", slot_locs)):
        _check_tensor(name, t, dtypes=(torch.int32,), ndim=2, device=device)
        if t.size(0) != max_reqs or t.size(1) <= hot:
            _fail(
                name,
                f"expected shape [{max_reqs}, > {hot}] (hot buffer + newest page), "
                f"got {tuple(t.shape)}",
            )
    if slot_tokens.size(1) != slot_locs.size(1):
        _fail("slot_locs", f"width {slot_locs.size(1)} differs from slot_tokens' {slot_tokens.size(1)}")
    _check_tensor("host_locs", host_locs, dtypes=(torch.int64,), ndim=2, device=device)
    layout_id = _layout_id(layout)
    item_bytes = _check_kv(layout, host_kv, device_kv, device)
    threads = block_size if block_size is not None else default_block_size(hot)
    _check_sizes(top_k, hot, item_bytes, layout, threads)
    scale = _check_hash_scale(top_k, hot, hash_scale)
    record = _check_plan(miss_src, miss_dst, miss_count, bs, top_k, device)
    residency = _check_residency(resident, req_to_token, token_to_row, max_reqs, device)
    if tally is not None:
        _check_tensor("tally", tally, dtypes=(torch.int64,), ndim=1, device=device)
        if tally.numel() != 2:
            _fail("tally", f"expected 2 elements (valid entries, misses), got {tally.numel()}")

    if probe is not None:
        _check_tensor("probe", probe, dtypes=(torch.int64,), ndim=1, device=device)
        if probe.numel() != PROBE_SLOTS:
            _fail("probe", f"expected {PROBE_SLOTS} elements, got {probe.numel()}")

    if blocks_per_req is None:
        split = default_blocks_per_req(device, bs, top_k, threads)
    else:
        split = int(blocks_per_req)
        if not 1 <= split <= 65535:
            raise ValueError(f"blocks_per_req must be in [1, 65535], got {split}")
    if workspace is None:
        workspace = arrivals_workspace(device, bs)
    else:
        _check_tensor("workspace", workspace, dtypes=(torch.int32,), ndim=1, device=device)
        if workspace.size(0) < bs:
            _fail("workspace", f"needs >= {bs} entries, got {workspace.size(0)}")
    if bs == 0:
        return out

    empty = top_k_tokens.new_empty(0)
    module = _swap_in_module(top_k, hot, item_bytes, layout_id, record, bool(skip_io), threads, scale)
    module.swap_in(
        top_k_tokens,
        req_pool_indices,
        seq_lens,
        num_real_reqs,
        slot_tokens,
        slot_locs,
        lru,
        host_locs,
        host_kv,
        device_kv,
        out,
        miss_src if record else empty,
        miss_dst if record else empty,
        miss_count if record else empty,
        workspace,
        resident if residency else empty,
        req_to_token if residency else empty,
        token_to_row if residency else empty,
        tally if tally is not None else empty,
        probe if probe is not None else empty,
        split,
    )
    return out


def copy_planned(
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    num_real_reqs: torch.Tensor,
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    *,
    layout: str = "rows",
    num_blocks: Optional[int] = None,
) -> None:
    """Replay a recorded miss plan on another layer's pools: for each real row
    b and m < miss_count[b], copy host row miss_src[b, m] to device row
    miss_dst[b, m]. ``num_blocks`` fixes the grid (default: one per SM)."""
    _check_tensor("miss_src", miss_src, dtypes=(torch.int64,), ndim=2)
    if not miss_src.is_cuda:
        _fail("miss_src", f"must be a CUDA tensor, got {miss_src.device}")
    device = miss_src.device
    _check_tensor("miss_dst", miss_dst, dtypes=(torch.int32,), ndim=2, device=device)
    _check_tensor("miss_count", miss_count, dtypes=(torch.int32,), ndim=1, device=device)
    _check_tensor("num_real_reqs", num_real_reqs, dtypes=(torch.int32,), ndim=1, device=device)
    if num_real_reqs.numel() != 1:
        _fail("num_real_reqs", f"expected 1 element, got {num_real_reqs.numel()}")
    if miss_dst.shape != miss_src.shape:
        _fail("miss_dst", f"shape {tuple(miss_dst.shape)} differs from miss_src's {tuple(miss_src.shape)}")
    bs = miss_src.size(0)
    if miss_count.size(0) != bs:
        _fail("miss_count", f"expected {bs} entries, got {miss_count.size(0)}")
    if bs > _MAX_PLANNED_ROWS:
        _fail("miss_src", f"at most {_MAX_PLANNED_ROWS} rows, got {bs}")
    layout_id = _layout_id(layout)
    item_bytes = _check_kv(layout, host_kv, device_kv, device)
    if num_blocks is None:
        num_blocks = _sm_count(_device_index(device))
    if bs == 0:
        return
    _copy_planned_module(item_bytes, layout_id).copy_planned(
        miss_src, miss_dst, miss_count, num_real_reqs, host_kv, device_kv, int(num_blocks)
    )


def swap_in_selected(*args, **kwargs) -> torch.Tensor:
    """Data-plane entry, same arguments as :func:`swap_in`: the CUDA kernel
    when ``top_k_tokens`` is on a GPU, else the torch reference (same result)."""
    top_k_tokens = kwargs["top_k_tokens"] if "top_k_tokens" in kwargs else args[0]
    if top_k_tokens.is_cuda:
        return swap_in(*args, **kwargs)
    from sglang_hisparse.kernels.reference import swap_in as reference_swap_in

    return reference_swap_in(*args, **kwargs)
