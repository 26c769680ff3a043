"""Which DSA attention backend reads the HiSparse KV pool, per KV cache dtype.

One table serves both the defaults
(:func:`sglang_hisparse.adapter.args.apply_hisparse_dsa_backend_defaults`,
installed over SGLang's function of the same name) and the check in
:mod:`sglang_hisparse.arg_rules`, so the backend we pick is always one we
accept.

Only these two backends index the KV pool with the per-request hot-buffer
slots that HiSparse hands them: ``flashmla_sparse`` takes BF16 KV and
``flashmla_kv`` takes FP8 KV (it always reads FP8; quantising a BF16 pool on
the fly would throw away what HiSparse keeps on the GPU). This applies to DSA
models only; DeepSeek-V4 has its own attention backend (``dsv4``).
"""

from __future__ import annotations

DSA_BACKEND_BY_KV_CACHE_DTYPE: dict[str, str] = {
    "bfloat16": "flashmla_sparse",
    "fp8_e4m3": "flashmla_kv",
}
HISPARSE_KV_CACHE_DTYPES: tuple[str, ...] = tuple(DSA_BACKEND_BY_KV_CACHE_DTYPE)

# SGLang accepts "bf16" and rewrites it to "bfloat16" for DSA models.
_KV_CACHE_DTYPE_ALIASES = {"bf16": "bfloat16"}


def canonical_kv_cache_dtype(kv_cache_dtype: str) -> str:
    return _KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)


def dsa_backend_for(kv_cache_dtype: str) -> str | None:
    """The DSA backend that reads a HiSparse pool of this dtype (None: no such backend)."""
    return DSA_BACKEND_BY_KV_CACHE_DTYPE.get(canonical_kv_cache_dtype(kv_cache_dtype))
