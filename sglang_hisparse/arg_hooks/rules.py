"""What ``--enable-hisparse`` can run with, as pure checks on plain values.

:class:`HiSparseServerArgs` holds the few server-argument values (and model
facts) the rules need; :mod:`sglang_hisparse.arg_hooks.validation` fills it
from SGLang's ``ServerArgs``. Nothing here imports SGLang.

Every problem is reported, not just the first, in one
:class:`HiSparseArgumentError` (a ValueError); each line names the flag, the
value given and what is allowed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sglang_hisparse.arg_hooks.backends import (
    HISPARSE_KV_CACHE_DTYPES,
    canonical_kv_cache_dtype,
    dsa_backend_for,
)
from sglang_hisparse.config import HiSparseConfig, HiSparseConfigError, parse_hisparse_config


class ModelFamily(str, enum.Enum):
    # DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5 (SGLang's is_deepseek_dsa).
    DSA = "dsa"
    # DeepSeek-V4 (SGLang's is_deepseek_v4): own attention backend and KV layout.
    DEEPSEEK_V4 = "deepseek_v4"


class HiSparseArgumentError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(problems) == 1:
            message = problems[0]
        else:
            message = f"{len(problems)} problems with --enable-hisparse:\n" + "\n".join(
                f"  - {p}" for p in problems
            )
        super().__init__(message)


@dataclass(frozen=True)
class HiSparseServerArgs:
    model_architecture: str | None
    model_family: ModelFamily | None  # None: HiSparse does not support the model
    model_index_topk: int | None
    hisparse_config: str | None  # the raw --hisparse-config text
    disable_radix_cache: bool
    enable_mixed_chunk: bool
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str
    dsa_prefill_backend: str | None
    dsa_decode_backend: str | None
    speculative_algorithm: str | None  # None: no speculative decoding


def check_hisparse_server_args(args: HiSparseServerArgs) -> HiSparseConfig:
    """Raise HiSparseArgumentError listing every problem; else return the resolved config."""
    problems, config = find_problems(args)
    if problems:
        raise HiSparseArgumentError(problems)
    assert config is not None  # only missing alongside a problem
    return config


def find_problems(args: HiSparseServerArgs) -> tuple[list[str], HiSparseConfig | None]:
    """Every problem (empty if none) and the resolved config (None if unresolvable)."""
    problems: list[str] = []
    config: HiSparseConfig | None = None

    if args.model_family is None:
        problems.append(
            "--enable-hisparse supports DSA models (DeepSeek-V3.2, GLM-5: "
            "architectures with an index_topk) and DeepSeek-V4 only; got "
            f"architecture {args.model_architecture!r}"
        )
    try:
        parsed = parse_hisparse_config(args.hisparse_config)
        if args.model_family is not None:
            config = parsed.resolve(args.model_index_topk)
    except HiSparseConfigError as exc:
        problems.append(str(exc))

    # The hot device buffer is private to one request; a radix cache would
    # hand the same KV slots to several requests.
    if not args.disable_radix_cache:
        problems.append("--enable-hisparse requires --disable-radix-cache")
    # A mixed batch (prefill chunk + decode) cannot take in the decode batch
    # that HiSparse builds for requests leaving host staging.
    if args.enable_mixed_chunk:
        problems.append("--enable-hisparse does not support --enable-mixed-chunk")
    if args.pp_size > 1:
        problems.append(
            f"--enable-hisparse does not support pipeline parallelism yet: "
            f"--pp-size must be 1, got {args.pp_size}"
        )
    # 0.5.13's MTP/EAGLE steps allocate, write and read KV on paths that never
    # reach the HiSparse data plane: draft tokens get no row mapping and verify
    # reads the logical page table through the mapping, so a request whose KV
    # is on host would attend to rows it does not own. Refused until the data
    # plane has a multi-token swap-in (upstream wired one in 0.5.22).
    if args.speculative_algorithm is not None:
        problems.append(
            f"--enable-hisparse does not support speculative decoding (MTP/EAGLE) yet: "
            f"--speculative-algorithm must be unset, got {args.speculative_algorithm}"
        )
    if args.model_family is ModelFamily.DSA:
        problems += _dsa_kv_problems(args)
    return problems, config


def _dsa_kv_problems(args: HiSparseServerArgs) -> list[str]:
    dtype = canonical_kv_cache_dtype(args.kv_cache_dtype)
    backend = dsa_backend_for(dtype)
    if backend is None:
        # "auto" only gets here where SGLang did not resolve it (not CUDA/ROCm).
        return [
            f"--enable-hisparse on a DSA model needs --kv-cache-dtype in "
            f"{list(HISPARSE_KV_CACHE_DTYPES)}, got {args.kv_cache_dtype}"
        ]
    problems = []
    for stage, chosen in (
        ("prefill", args.dsa_prefill_backend),
        ("decode", args.dsa_decode_backend),
    ):
        if chosen is not None and chosen != backend:
            problems.append(
                f"--enable-hisparse with --kv-cache-dtype {dtype} needs "
                f"--dsa-{stage}-backend {backend} (the backend that reads the "
                f"HiSparse pool), got {chosen}"
            )
    return problems
