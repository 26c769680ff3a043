"""The serving swap-in (``jit_csrc/swap_in.cuh``): validate, pick the variant, launch.

Semantics are those of :func:`sglang_hisparse.kernels.reference.swap_in`;
the tests hold the two equal. :func:`swap_in_selected` is the data plane's
one entry: this kernel when ``top_k_tokens`` is on a GPU, else the torch
reference.

Without CUDA graphs the coordinator launches once per sparse layer (61 times
a decode step on DeepSeek-V3.2), so a launch checks its arguments in full
only the first time it sees a combination of tensor geometries (shape,
stride, dtype, device; the KV pools also by address, and the host pool by
its storage, whose pinning was checked); later launches with the same
geometries reuse that verdict.

Arrival counters (the last block of a request commits its slot table and
LRU) are per (device, stream): two swap-ins on different streams, e.g. a
draft model's or a prefetch's, never share them.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional

import torch

from sglang_hisparse.kernels import _jit, reference
from sglang_hisparse.kernels._validate import (
    check_kv,
    check_miss_plan,
    check_selection,
    check_tensor,
    fail,
    given_together,
)
from sglang_hisparse.kernels.limits import (  # noqa: F401  (MIN/MAX_BLOCK_SIZE: read by tests)
    DEFAULT_BLOCK_SIZE,
    HASH_SCALES,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    default_hash_scale,
    hash_scale_problem,
    item_bytes_problem,
    layout_id,
    size_problem,
)

SWAP_IN_SOURCE = _jit.CSRC_DIR / "swap_in.cuh"


class SwapInVariant(NamedTuple):
    """One compiled swap-in: SwapIn's template arguments, in their order."""

    top_k: int
    hot_buffer_size: int
    item_bytes: int
    layout_id: int
    record_plan: bool = False  # write the miss plan (copy_planned replays it)
    skip_io: bool = False  # resolve and update state, move no bytes (a timing probe)
    block_size: int = DEFAULT_BLOCK_SIZE
    hash_scale: int = HASH_SCALES[0]  # the widest; default_hash_scale picks per size
    probe: bool = False  # phase stamps (kernels.bench)
    # Rows per request: > 1 resolves a speculative verify step's rows as one union.
    draft_tokens: int = 1

    def name(self, layout: str) -> str:
        # (draft_tokens is named only where it is not the decode step's 1)
        verify = {} if self.draft_tokens == 1 else {"draft_tokens": self.draft_tokens}
        return _jit.variant_name(
            "swap_in", top_k=self.top_k, hot_buffer_size=self.hot_buffer_size,
            item_bytes=self.item_bytes, layout=layout, record_plan=self.record_plan,
            skip_io=self.skip_io, block_size=self.block_size, hash_scale=self.hash_scale,
            probe=self.probe, **verify,
        )


def swap_in_module(variant: SwapInVariant):
    return _jit.load_module(
        "hisparse_plugin_swap_in", SWAP_IN_SOURCE.name, "swap_in", "hisparse_plugin::SwapIn",
        tuple(variant),
    )


def check_sizes(top_k: int, hot_buffer_size: int, item_bytes: int, layout: str,
                block_size: Optional[int] = None, draft_tokens: int = 1) -> int:
    """Raises on sizes the kernel cannot run; returns the layout id."""
    lid = layout_id(layout)
    problem = (size_problem(top_k, hot_buffer_size, block_size, draft_tokens=draft_tokens)
               or item_bytes_problem(item_bytes, layout))
    if problem:
        raise ValueError(problem)
    return lid


def resolve_hash_scale(top_k: int, hot_buffer_size: int, hash_scale: Optional[int],
                       draft_tokens: int = 1) -> int:
    """The hash table hashes a request's entries: draft_tokens x top_k."""
    entries = top_k * draft_tokens
    if hash_scale is None:
        return default_hash_scale(entries, hot_buffer_size)
    problem = hash_scale_problem(entries, hot_buffer_size, hash_scale)
    if problem:
        raise ValueError(problem)
    return hash_scale


def default_blocks_per_req(device: torch.device, batch: int, top_k: int, block_size: int) -> int:
    """Blocks per request: spread a small batch's misses over about one block
    per SM (one wave, so no block waits for a slot), but never more blocks
    than a 100%-miss step can keep busy (one miss per warp)."""
    sms = _jit.sm_count(_jit.device_index(device))
    warps = block_size // 32
    split = sms // max(batch, 1)
    return max(1, min(split, -(-top_k // warps), 65535))


# --------------------------------------------------------------------------
# arrival counters, per (device, stream)

# One counter per batch row. They return to zero after every launch, so one
# zeroed buffer serves every layer launched on its stream; launches on other
# streams may run at the same time and get their own. Buffers are never freed:
# a captured CUDA graph may still point at one.
ARRIVALS_MIN_ROWS = 4096
_ARRIVALS: dict[tuple[int, int], torch.Tensor] = {}
_ARRIVALS_KEEP: list[torch.Tensor] = []


def pick_workspace(table: dict, key, rows: int, *, capturing: bool,
                   allocate: Callable[[int], torch.Tensor], keep: list) -> torch.Tensor:
    """The buffer of ``table[key]`` if it has ``rows``, else a new one of at
    least ARRIVALS_MIN_ROWS (kept in ``keep`` for good). Allocating while a
    CUDA graph is being captured is refused: the zeroing would be captured
    too and the buffer would come from the graph's private pool."""
    buf = table.get(key)
    if buf is not None and buf.numel() >= rows:
        return buf
    if capturing:
        raise RuntimeError(
            f"swap_in: no arrival workspace of {rows} rows for stream {key[1]:#x} on "
            f"cuda:{key[0]} yet, and a CUDA graph is being captured; run one eager call "
            "with the largest batch on that stream before capture (SGLang's warm-up runs "
            "do), or pass workspace="
        )
    buf = allocate(max(rows, ARRIVALS_MIN_ROWS))
    table[key] = buf
    keep.append(buf)
    return buf


def _current_stream(index: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def arrivals_workspace(device: torch.device, rows: int) -> torch.Tensor:
    """Zeroed int32 arrival counters (>= ``rows``) for launches on the
    current stream of ``device``; allocated on that stream at first use."""
    index = _jit.device_index(device)
    key = (index, _current_stream(index))
    buf = _ARRIVALS.get(key)
    if buf is not None and buf.numel() >= rows:
        return buf
    return pick_workspace(
        _ARRIVALS, key, rows, capturing=torch.cuda.is_current_stream_capturing(),
        allocate=lambda n: torch.zeros(n, dtype=torch.int32, device=f"cuda:{index}"),
        keep=_ARRIVALS_KEEP,
    )


# --------------------------------------------------------------------------
# validation, cached by geometry


class _Verdict(NamedTuple):
    module: object
    split: int
    record: bool
    residency: bool
    host_storage: Optional[weakref.ref]  # the checked (pinned) host pool; None: on the GPU
    empty: torch.Tensor  # stands in for absent optional tensors
    reusable: bool  # False if checked while capturing (the pinning query was skipped)


_VERDICTS: dict = {}
_MAX_VERDICTS = 1024
# Arguments whose shape, strides, dtype and device the checks read; the KV
# pools' addresses too (alignment). Options are keyed as given.
_TENSORS = ("top_k_tokens", "req_pool_indices", "seq_lens", "num_real_reqs", "slot_tokens",
            "slot_locs", "lru", "host_locs", "out", "miss_src", "miss_dst", "miss_count",
            "workspace", "resident", "req_to_token", "token_to_row", "tally")
_OPTIONS = ("layout", "skip_io", "blocks_per_req", "block_size", "draft_tokens")


def _geom(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _key(a: dict, probe, hash_scale) -> tuple:
    pools = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
                  for t in (a["host_kv"], a["device_kv"]))
    return (tuple(_geom(a[n]) for n in _TENSORS), pools, tuple(a[n] for n in _OPTIONS),
            _geom(probe), hash_scale)


def _validate(a: dict, probe, hash_scale) -> _Verdict:
    top_k_tokens, out, lru = a["top_k_tokens"], a["out"], a["lru"]
    ndt = int(a["draft_tokens"])
    if ndt < 1:
        fail("draft_tokens", f"must be >= 1, got {ndt}")
    device, bs, top_k = check_selection(top_k_tokens, out, a["req_pool_indices"], a["seq_lens"],
                                        a["num_real_reqs"], ndt)
    check_tensor("lru", lru, dtypes=(torch.int16,), ndim=2, device=device)
    hot, max_reqs = lru.size(1), lru.size(0)
    slot_tokens, slot_locs = a["slot_tokens"], a["slot_locs"]
    for name, t in (("slot_tokens", slot_tokens), ("slot_locs", slot_locs)):
        check_tensor(name, t, dtypes=(torch.int32,), ndim=2, device=device)
        if t.size(0) != max_reqs or t.size(1) < hot + ndt:
            fail(name, f"expected shape [{max_reqs}, >= {hot + ndt}] (hot buffer + a newest page "
                       f"of >= draft_tokens={ndt} slots), got {tuple(t.shape)}")
    if slot_tokens.size(1) != slot_locs.size(1):
        fail("slot_locs", f"width {slot_locs.size(1)} differs from slot_tokens' {slot_tokens.size(1)}")
    check_tensor("host_locs", a["host_locs"], dtypes=(torch.int64,), ndim=2, device=device)
    host_kv = a["host_kv"]
    item_bytes = check_kv(a["layout"], host_kv, a["device_kv"], device)
    threads = DEFAULT_BLOCK_SIZE if a["block_size"] is None else a["block_size"]
    lid = check_sizes(top_k, hot, item_bytes, a["layout"], threads, ndt)
    scale = resolve_hash_scale(top_k, hot, hash_scale, ndt)

    miss_src, miss_dst, miss_count = a["miss_src"], a["miss_dst"], a["miss_count"]
    record = given_together(miss_src=miss_src, miss_dst=miss_dst, miss_count=miss_count)
    if record:
        check_miss_plan(miss_src, miss_dst, miss_count, device)
        if miss_src.size(0) < bs or miss_src.size(1) < ndt * top_k:
            fail("miss_src", f"needs shape >= [{bs}, {ndt * top_k}] (per request: draft_tokens x "
                             f"top_k), got {tuple(miss_src.shape)}")
        if miss_count.size(0) < bs:
            fail("miss_count", f"needs >= {bs} entries, got {miss_count.size(0)}")

    resident, req_to_token, token_to_row = a["resident"], a["req_to_token"], a["token_to_row"]
    residency = given_together(resident=resident, req_to_token=req_to_token, token_to_row=token_to_row)
    if residency:
        check_tensor("resident", resident, dtypes=(torch.int32,), ndim=1, device=device)
        check_tensor("req_to_token", req_to_token, dtypes=(torch.int32,), ndim=2, device=device)
        check_tensor("token_to_row", token_to_row, dtypes=(torch.int64,), ndim=1, device=device)
        for name, t in (("resident", resident), ("req_to_token", req_to_token)):
            if t.size(0) != max_reqs:
                fail(name, f"expected {max_reqs} rows (one per request slot), got {t.size(0)}")

    tally = a["tally"]
    if tally is not None:
        check_tensor("tally", tally, dtypes=(torch.int64,), ndim=1, device=device)
        if tally.numel() != 2:
            fail("tally", f"expected 2 elements (valid entries, misses), got {tally.numel()}")
    if a["blocks_per_req"] is None:
        split = default_blocks_per_req(device, bs, ndt * top_k, threads)
    else:
        split = int(a["blocks_per_req"])
        if not 1 <= split <= 65535:
            raise ValueError(f"blocks_per_req must be in [1, 65535], got {split}")
    workspace = a["workspace"]
    if workspace is not None:
        check_tensor("workspace", workspace, dtypes=(torch.int32,), ndim=1, device=device)
        if workspace.size(0) < bs:
            fail("workspace", f"needs >= {bs} entries, got {workspace.size(0)}")

    variant = SwapInVariant(top_k, hot, item_bytes, lid, record, bool(a["skip_io"]), threads,
                            scale, probe is not None, ndt)
    capturing = torch.cuda.is_current_stream_capturing()
    return _Verdict(
        module=swap_in_module(variant) if bs else None,
        split=split,
        record=record,
        residency=residency,
        host_storage=None if host_kv.is_cuda else weakref.ref(host_kv.untyped_storage()),
        empty=top_k_tokens.new_empty(0),
        reusable=not capturing,
    )


def launch(a: dict, *, probe: Optional[torch.Tensor] = None, hash_scale: Optional[int] = None):
    """Checks and launches one swap-in; ``a`` holds :func:`swap_in`'s
    arguments by name, ``probe`` and ``hash_scale`` are the benchmark-only
    template options (:mod:`sglang_hisparse.kernels.bench` documents and
    checks them). Returns ``out``."""
    top_k_tokens, out = a["top_k_tokens"], a["out"]
    if out is None and isinstance(top_k_tokens, torch.Tensor) and top_k_tokens.dim() == 2:
        # allocates: pass `out` under CUDA-graph capture
        a["out"] = out = torch.empty(tuple(top_k_tokens.shape), dtype=torch.int32,
                                     device=top_k_tokens.device)
    try:
        key = _key(a, probe, hash_scale)
        verdict = _VERDICTS.get(key)
        if verdict is not None and verdict.host_storage is not None \
                and verdict.host_storage() is not a["host_kv"].untyped_storage():
            verdict = None  # a new host pool at an old address: check its pinning again
    except (AttributeError, TypeError):  # not tensors: the full check names the argument
        key = verdict = None
    if verdict is None:
        verdict = _validate(a, probe, hash_scale)
        if key is not None and verdict.reusable:
            if len(_VERDICTS) >= _MAX_VERDICTS:
                _VERDICTS.clear()
            _VERDICTS[key] = verdict
    bs = top_k_tokens.size(0) // max(int(a["draft_tokens"]), 1)  # requests
    if bs == 0:
        return out

    empty, split = verdict.empty, verdict.split
    workspace = a["workspace"]
    if workspace is None:
        workspace = arrivals_workspace(top_k_tokens.device, bs) if split > 1 else empty
    plan = (a["miss_src"], a["miss_dst"], a["miss_count"]) if verdict.record else (empty,) * 3
    residency = (a["resident"], a["req_to_token"], a["token_to_row"]) if verdict.residency \
        else (empty,) * 3
    tally = a["tally"]
    verdict.module.swap_in(
        top_k_tokens, a["req_pool_indices"], a["seq_lens"], a["num_real_reqs"], a["slot_tokens"],
        a["slot_locs"], a["lru"], a["host_locs"], a["host_kv"], a["device_kv"], out,
        *plan, workspace, *residency,
        tally if tally is not None else empty,
        probe if probe is not None else empty,
        split,
    )
    return out


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
    draft_tokens: int = 1,
) -> torch.Tensor:
    """Resolve one layer's top-k against the hot buffers; load misses; fill ``out``.

    See :func:`sglang_hisparse.kernels.reference.swap_in` for the argument
    contract and semantics. CUDA-graph safe: no host sync and no allocation
    (after the first call on a stream), and the grid depends only on the
    batch size. ``blocks_per_req``/``block_size`` tune the launch and
    ``workspace`` replaces the stream's arrival counters (int32, zeroed,
    >= batch entries). ``skip_io`` resolves and updates state but moves no
    KV bytes (a timing probe; its own variant). The miss plan
    (``miss_src``/``miss_dst``/``miss_count``, together; its own variant)
    records what moved, for :func:`copy_planned.copy_planned` to replay.
    ``resident``/``req_to_token``/``token_to_row`` (together) translate
    resident requests' positions instead (reference rule 8). ``tally``
    (int64 [2]) accumulates valid entries and misses (rule 10) with one
    atomic add each per request. ``draft_tokens`` > 1 resolves a speculative
    verify step: that many rows per request, one union each (its own
    variant). Returns ``out``.
    """
    return launch(locals())


def swap_in_selected(*args, **kwargs) -> torch.Tensor:
    """Data-plane entry, same arguments as :func:`swap_in`: the CUDA kernel
    when ``top_k_tokens`` is on a GPU, else the torch reference (same result)."""
    top_k_tokens = kwargs["top_k_tokens"] if "top_k_tokens" in kwargs else args[0]
    if top_k_tokens.is_cuda:
        return swap_in(*args, **kwargs)
    return reference.swap_in(*args, **kwargs)
