"""Benchmark-only synthetic top-k (``jit_csrc/synthetic_top_k.cuh``).

``SGLANG_HISPARSE_SYNTHETIC_TOPK`` replaces the indexer's top-k with a trace
of controllable locality before each swap-in. Outputs are invalid (attention
reads other rows than the model chose), timings are valid: it exists because
random weights select with almost no step-to-step locality (LRU hit rates of
0.25-0.47 at a hot buffer of 4096 on the H200), the worst case for host IO,
while real traces hit far more often (the HiSparse paper's LongBench-V2
figure: ~13% misses). The header describes the trace; it is a pure function
of (request slot, layer, sequence length), so it replays in CUDA graphs and
needs no state, and no two entries of a row name one position (SGLang's own
swap-in, the ``native`` comparison, assumes distinct entries).

Values of the switch: ``calibrated`` (:data:`CALIBRATED`: LRU at a hot
buffer of 4096 misses ~13% of the entries at 32K contexts, checked by
``tests/test_synthetic_top_k.py`` through the reference swap-in and on the
GPU by ``scripts/bench_kernels.py --trace``), or
``period=P,recent=R,bias=M[,seed=S]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from sglang_hisparse.config import SYNTHETIC_TOPK_ENV
from sglang_hisparse.kernels import _jit
from sglang_hisparse.kernels._validate import check_batch_index, check_tensor

SYNTHETIC_TOP_K_SOURCE = _jit.CSRC_DIR / "synthetic_top_k.cuh"
THREADS = 256
_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SyntheticTrace:
    period: int  # steps an entry keeps its position (1/period of them move each step)
    recent: int  # entries that are the newest positions
    bias: int  # recency lean of a moved entry: the max of `bias` uniforms (1: none)
    seed: int = 0

    def __post_init__(self):
        if self.period < 1 or self.recent < 0 or not 1 <= self.bias <= 16 or not 0 <= self.seed <= _M32:
            raise ValueError(f"synthetic trace needs period >= 1, recent >= 0, 1 <= bias <= 16 and "
                             f"0 <= seed < 2**32, got {self}")

    def layer_key(self, layer_id: int) -> int:
        return _mix(self.seed ^ _mix(layer_id))


# Calibrated through the reference swap-in (simulate_miss_rate, 100 warm-up
# and 200 timed steps, top-k 2048, hot buffer 4096): 11.2% of the entries
# miss at 16K contexts, 13.3% at 32K, 14.5% at 64K (the paper's ~13%).
# period 7 gives 11.4% at 32K, period 5 16.0%; bias 1 (no recency lean) 13.9%.
CALIBRATED = SyntheticTrace(period=6, recent=128, bias=2)
_FIELDS = ("period", "recent", "bias", "seed")


def parse(spec: str, name: str = SYNTHETIC_TOPK_ENV) -> Optional[SyntheticTrace]:
    """The switch's value: None when off ("" or "0"), else the trace; a
    ValueError names the switch and what it takes."""
    spec = (spec or "").strip()
    if spec in ("", "0"):
        return None
    if spec == "calibrated":
        return CALIBRATED
    allowed = "allowed: 0, calibrated, or period=P,recent=R,bias=M[,seed=S] (integers)"
    values = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _FIELDS or key in values or not value.strip().isdigit():
            raise ValueError(f"{name}={spec!r} is not valid; {allowed}")
        values[key] = int(value)
    if not {"period", "recent", "bias"} <= set(values):
        raise ValueError(f"{name}={spec!r} lacks {', '.join(sorted({'period', 'recent', 'bias'} - set(values)))}; "
                         f"{allowed}")
    try:
        return SyntheticTrace(**values)
    except ValueError as exc:
        raise ValueError(f"{name}={spec!r}: {exc}") from None


def from_env(name: str = SYNTHETIC_TOPK_ENV) -> Optional[SyntheticTrace]:
    return parse(os.environ.get(name, ""), name)


def _mix(x):
    """lowbias32 on a Python int or an int64 tensor holding 32-bit values
    (the product wraps in int64, its low 32 bits are exact)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def reference(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, layer_id: int,
              top_k: int, trace: SyntheticTrace, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The trace in torch (any device); the CUDA kernel's bits exactly."""
    dev = seq_lens.device
    L = seq_lens.to(torch.int64)[:, None]
    req = req_pool_indices.to(torch.int64)[:, None] & _M32
    j = torch.arange(top_k, dtype=torch.int64, device=dev)[None, :]
    lk = trace.layer_key(layer_id)
    entry_key = _mix(_mix(lk ^ req) ^ j)
    phase = _mix((lk ^ j) ^ 0x9E3779B9) % trace.period
    epoch = (L + phase) // trace.period
    span = epoch * trace.period - phase - trace.recent
    epoch_key = _mix(entry_key ^ (epoch & _M32))
    u = torch.zeros_like(epoch_key)
    for d in range(trace.bias):
        u = torch.maximum(u, _mix(epoch_key ^ d) >> 8)
    stride, i = max(top_k - trace.recent, 1), j - trace.recent  # unused when all are recent
    rows = torch.where(span > i, (span - i + stride - 1) // stride, torch.zeros_like(span))
    older = torch.where(rows > 0, i + stride * ((rows * u) >> 24), torch.full_like(span, -1))
    newest = L - 1 - j
    pos = torch.where(j < trace.recent, newest, older)
    pos = torch.where(pos >= 0, pos, torch.full_like(pos, -1)).to(torch.int32)
    if out is None:
        return pos
    out.copy_(pos)
    return out


def synthetic_top_k(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, layer_id: int,
                    trace: SyntheticTrace, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (int32 [bs, top_k]) with the trace for this layer: the
    CUDA kernel when ``out`` is on a GPU, else :func:`reference`."""
    check_tensor("out", out, dtypes=(torch.int32,), ndim=2)
    bs, top_k = out.shape
    check_batch_index("req_pool_indices", req_pool_indices, bs, out.device, batch_of="out")
    check_batch_index("seq_lens", seq_lens, bs, out.device, batch_of="out")
    if out.device.type != "cuda":
        return reference(req_pool_indices, seq_lens, layer_id, top_k, trace, out)
    if bs:
        _module().synthetic_top_k(req_pool_indices, seq_lens, out, trace.layer_key(layer_id),
                                  trace.period, trace.recent, trace.bias)
    return out


def _module():
    return _jit.load_module("hisparse_plugin_synthetic_top_k", SYNTHETIC_TOP_K_SOURCE.name,
                            "synthetic_top_k", "hisparse_plugin::SyntheticTopK", (THREADS,))


def simulate_miss_rate(trace: SyntheticTrace, *, seq_len: int = 32768, hot_buffer_size: int = 4096,
                       top_k: int = 2048, steps: int = 64, warmup: int = 64,
                       device: str = "cpu") -> float:
    """Share of valid entries that miss when one request decodes ``steps``
    tokens from ``seq_len`` under this trace (after ``warmup`` steps from an
    empty hot buffer), run through the swap-in itself (the torch reference
    on CPU, the kernel on a GPU) with one-byte rows."""
    from sglang_hisparse.kernels.swap_in import swap_in_selected

    B, page = hot_buffer_size, 64
    ctx = seq_len + warmup + steps + 1
    dev = torch.device(device)
    slot_tokens = torch.full((1, B + page), -1, dtype=torch.int32, device=dev)
    slot_locs = torch.arange(B + page, dtype=torch.int32, device=dev)[None, :].contiguous()
    lru = torch.arange(B, dtype=torch.int16, device=dev)[None, :].contiguous()
    host_locs = torch.arange(ctx, dtype=torch.int64, device=dev)[None, :].contiguous()
    host_kv = torch.zeros((ctx, 16), dtype=torch.uint8, device=dev)
    device_kv = torch.zeros((B + page, 16), dtype=torch.uint8, device=dev)
    req = torch.zeros(1, dtype=torch.int64, device=dev)
    num_real = torch.ones(1, dtype=torch.int32, device=dev)
    tally = torch.zeros(2, dtype=torch.int64, device=dev)
    top = torch.empty((1, top_k), dtype=torch.int32, device=dev)
    for step in range(warmup + steps):
        if step == warmup:
            tally.zero_()
        seq = torch.tensor([seq_len + step], dtype=torch.int64, device=dev)
        synthetic_top_k(req, seq, 0, trace, top)
        swap_in_selected(top_k_tokens=top, slot_tokens=slot_tokens, slot_locs=slot_locs, lru=lru,
                         host_locs=host_locs, host_kv=host_kv, device_kv=device_kv,
                         req_pool_indices=req, seq_lens=seq, num_real_reqs=num_real, tally=tally)
    valid, misses = (int(x) for x in tally.tolist())
    return misses / valid if valid else 0.0
