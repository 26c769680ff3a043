"""What ``--enable-hisparse`` can run with, as pure checks on plain values.

:class:`HiSparseServerArgs` holds the few server-argument values (and model
facts) the rules need; :mod:`sglang_hisparse.adapter.args` fills it
from SGLang's ``ServerArgs``. Nothing here imports SGLang.

Every problem is reported, not just the first, in one
:class:`HiSparseArgumentError` (a ValueError); each line names the flag, the
value given and what is allowed.

The pinned host memory check (:func:`host_memory_problem`) estimates, before
any weight loads, what every local rank's host KV pool will pin and compares
it with the node's available memory; its arithmetic is here, its inputs
(:class:`HostMemoryInputs`) are read by the adapter.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from sglang_hisparse.dsa_backends import (
    HISPARSE_KV_CACHE_DTYPES,
    canonical_kv_cache_dtype,
    dsa_backend_for,
)
from sglang_hisparse.config import (
    FLAG,
    SHARED_HOST_POOL_ENV,
    HiSparseConfig,
    HiSparseConfigError,
    parse_hisparse_config,
)


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


# The --disaggregation-transfer-backend values whose decode side receives
# into whatever memory it is given, in every pinned release: Mooncake
# registers plain pointers and finds where each lives (0.5.13
# mooncake/conn.py:241-262; mooncake_tcp is it over TCP), fake moves nothing.
HOST_TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "fake")
# Those whose metadata carries a HiSparse DeepSeek-V4 decode's device-tail
# page indices (Mooncake's; fake moves nothing).
DEVICE_INDEX_TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp", "fake")


@dataclass(frozen=True)
class HiSparseServerArgs:
    model_architecture: str | None
    model_family: ModelFamily | None  # None: HiSparse does not support the model
    model_index_topk: int | None
    hisparse_config: str | None  # the raw --hisparse-config text
    disable_radix_cache: bool
    enable_mixed_chunk: bool
    pp_size: int
    kv_cache_dtype: str
    dsa_prefill_backend: str | None
    dsa_decode_backend: str | None
    speculative: SpeculativeArgs | None  # None: no speculative decoding
    disaggregation_mode: str  # --disaggregation-mode: "null", "prefill" or "decode"
    # What sizes this node's pinned host pools (None: not estimated, no check).
    host_memory: HostMemoryInputs | None = None
    # --disaggregation-transfer-backend (as SGLang resolved it: mooncake_tcp
    # reads mooncake), and the backends whose decode side this release lets
    # receive into host memory (adapter/releases: decode_host_transfer_backends).
    transfer_backend: str = "mooncake"
    decode_host_transfer_backends: tuple[str, ...] = HOST_TRANSFER_BACKENDS
    # SGLANG_HISPARSE_SHARED_HOST_POOL=1: one host pool per node for the local
    # TP ranks (pools/shared_host_memory.py), and what it must run with.
    shared_host_pool: bool = False
    nnodes: int = 1
    enable_dp_attention: bool = False


@dataclass(frozen=True)
class SpeculativeArgs:
    """The speculative-decoding settings, as SGLang resolved them (its
    defaults for DeepSeek-V3.2 are 3 steps, top-k 1, 4 draft tokens)."""

    algorithm: str  # --speculative-algorithm as given (NEXTN is SGLang's alias of EAGLE)
    eagle_topk: int | None
    num_draft_tokens: int | None
    adaptive: bool  # --speculative-adaptive
    multi_layer_eagle: bool  # --enable-multi-layer-eagle
    overlap_schedule: bool  # not --disable-overlap-schedule
    spec_v2: bool  # the V2 worker (0.5.13: SGLANG_ENABLE_SPEC_V2; always from 0.5.15)
    overlap_plan_stream: bool  # SGLANG_ENABLE_OVERLAP_PLAN_STREAM
    page_size: int  # --page-size (SGLang forces 64 on DSA models)
    # Whether the installed release's verify-step seams are wired
    # (adapter/speculative.py), and the supported releases where they are.
    seams_wired: bool = True
    wired_releases: tuple[str, ...] = ()

    @property
    def draft_tokens(self) -> int:
        return self.num_draft_tokens or 1


# What --speculative-algorithm may be with --enable-hisparse: linear MTP.
SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN")


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
    draft_tokens = args.speculative.draft_tokens if args.speculative else 1
    try:
        parsed = parse_hisparse_config(args.hisparse_config)
        if args.model_family is not None:
            config = parsed.resolve(args.model_index_topk, draft_tokens)
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
    if args.speculative is not None:
        problems += speculative_problems(args)
    # A PD decode node retracts under memory pressure; 0.5.13 retracts by
    # snapshotting the device KV (get_cpu_copy), which the HiSparse pools
    # cannot do (hot buffers hold a moving subset of the tokens). Ours keeps
    # the host rows where they are and copies what the forward keeps on the
    # device (DeepSeek-V4: C4 indexer keys and C128 KV by logical page, SWA
    # window and compressor states by SWA page, from 0.5.15 the C128 state by
    # request slot) to the CPU and back (policies/retain_on_retract.py,
    # engine/retained_device_state.py).
    if args.model_family is ModelFamily.DEEPSEEK_V4 and args.disaggregation_mode == "decode":
        # The device tail's page indices travel in Mooncake's metadata only
        # (ours up to 0.5.15.post1, the release's own from 0.5.17).
        if args.transfer_backend not in DEVICE_INDEX_TRANSFER_BACKENDS:
            problems.append(
                "--enable-hisparse on a DeepSeek-V4 PD decode node needs "
                f"--disaggregation-transfer-backend in {list(DEVICE_INDEX_TRANSFER_BACKENDS)}, "
                f"got {args.transfer_backend}: the C4 indexer and C128 pages are sent beside "
                "the host pages in Mooncake's transfer metadata only"
            )
    # A HiSparse PD decode node receives the prefill's KV straight into the
    # pinned host pool (0.5.13 decode.py:392-399). A connector that registers
    # every KV buffer as GPU memory (0.5.13's NIXL: "VRAM", sglang#27563;
    # mori: MemoryLocationType.GPU) would hand the NIC a host address as
    # device memory: refused here, before anything is registered.
    if (args.disaggregation_mode == "decode"
            and args.transfer_backend not in args.decode_host_transfer_backends):
        problems.append(
            "--enable-hisparse on a PD decode node (--disaggregation-mode decode) needs "
            f"--disaggregation-transfer-backend in {list(args.decode_host_transfer_backends)}, "
            f"got {args.transfer_backend}: the KV arrives in HiSparse's pinned host pool, "
            f"which this release's {args.transfer_backend} connector registers as GPU memory"
        )
    if args.shared_host_pool:
        problems += shared_host_pool_problems(args)
    if args.model_family is ModelFamily.DSA:
        problems += _dsa_kv_problems(args)
    if config is not None and args.host_memory is not None:
        problem = host_memory_problem(args.host_memory, config.host_to_device_ratio)
        if problem:
            problems.append(problem)
    return problems, config


def shared_host_pool_problems(args: HiSparseServerArgs) -> list[str]:
    """What one host pool shared by a node's TP ranks can run with."""
    problems = []
    lead = f"{SHARED_HOST_POOL_ENV}=1 (one host pool per node for the local TP ranks)"
    # A PD decode node's KV lands in the host pool, sent to every TP rank: into
    # a shared pool it would land TP times, into the same rows.
    if args.disaggregation_mode == "decode":
        problems.append(
            f"{lead} does not support --disaggregation-mode decode: every TP rank would "
            f"receive the same KV into the same shared rows (TP transfers each); unset "
            f"{SHARED_HOST_POOL_ENV} on a PD decode node")
    # DeepSeek-V4's C4 host pool is built per rank (not wired to the shared buffer).
    if args.model_family is ModelFamily.DEEPSEEK_V4:
        problems.append(f"{lead} supports DSA models only (DeepSeek-V3.2, GLM-5), "
                        "not DeepSeek-V4")
    # The TP group is the set of ranks that share: it must be all on one node.
    if args.nnodes > 1:
        problems.append(f"{lead} needs --nnodes 1 (a TP group on one node), got "
                        f"{args.nnodes}")
    # DP attention gives each attention-TP group its own requests (other KV).
    if args.enable_dp_attention:
        problems.append(f"{lead} does not support --enable-dp-attention")
    return problems


def speculative_problems(args: HiSparseServerArgs) -> list[str]:
    """What linear MTP/EAGLE with HiSparse needs (the draft-token count the
    buffer must hold is checked with --hisparse-config, by resolve)."""
    spec = args.speculative
    assert spec is not None
    problems = []
    if spec.algorithm.upper() not in SPECULATIVE_ALGORITHMS:
        problems.append(
            f"--enable-hisparse supports --speculative-algorithm "
            f"{' or '.join(SPECULATIVE_ALGORITHMS)} (MTP), got {spec.algorithm}")
    if spec.eagle_topk not in (None, 1):
        problems.append(
            "--enable-hisparse supports linear drafts only: --speculative-eagle-topk "
            f"must be 1, got {spec.eagle_topk}")
    if spec.adaptive:
        problems.append(
            "--enable-hisparse does not support --speculative-adaptive: the swap-in is "
            "built for a fixed --speculative-num-draft-tokens")
    if spec.multi_layer_eagle:
        problems.append("--enable-hisparse does not support --enable-multi-layer-eagle")
    # A request waiting on host (staging, parked) keeps the draft state its
    # prefill made in the overlap scheduler's FutureMap; the non-overlap path
    # hands it to the next batch directly, which HiSparse's rebuilt batches skip.
    if not (spec.overlap_schedule and spec.spec_v2):
        problems.append(
            "--enable-hisparse with speculative decoding needs the overlap scheduler: "
            "remove --disable-overlap-schedule and leave SGLANG_ENABLE_SPEC_V2 at 1")
    if spec.overlap_plan_stream:
        problems.append(
            "--enable-hisparse with speculative decoding needs "
            "SGLANG_ENABLE_OVERLAP_PLAN_STREAM unset or 0 (a planned batch would read "
            "slots before the previous verify step commits them)")
    ndt = spec.draft_tokens
    if ndt > spec.page_size:
        problems.append(
            f"--enable-hisparse: --speculative-num-draft-tokens {ndt} exceeds --page-size "
            f"{spec.page_size}; tokens verified past the hot buffer sit in its newest-token "
            "page, so it must be <= the page size")
    if args.model_family is ModelFamily.DEEPSEEK_V4:
        problems.append(
            "--enable-hisparse on DeepSeek-V4 does not support speculative decoding yet; "
            "supported: DSA models (DeepSeek-V3.2, GLM-5)")
    if args.disaggregation_mode == "decode":
        problems.append(
            "--enable-hisparse does not support speculative decoding on a PD decode node "
            "(--disaggregation-mode decode) yet")
    # The verify step's seams (adapter/speculative.py: the verify slots, the
    # union swap-in in forward_extend, the commit, the draft runner and its
    # pool, the FutureMap hand-off) are written per release; proven on the
    # H200 for 0.5.13 (docs/gpu-runs/2026-12-04-s3). A release without them
    # would run the verify step past the data plane.
    if not spec.seams_wired:
        wired = " and ".join(spec.wired_releases) or "none"
        problems.append(
            "--enable-hisparse supports speculative decoding (MTP/EAGLE) only on the sglang "
            f"releases whose verify step it wires ({wired}), not on this one: "
            f"--speculative-algorithm must be unset, got {spec.algorithm}")
    return problems


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


# --- pinned host memory -------------------------------------------------------
#
# Every TP rank builds its own host pool (the MLA latent is replicated across
# TP ranks), pinned when the model runner builds the pools, after the weights
# load. HiCache's own check there (HostKVCache.__init__) compares one rank's
# request with what is free at that moment and names neither the key nor the
# flag. This estimate runs with the server arguments instead, for all ranks of
# the node at once. It may err low (the precise check still follows) but must
# not err high, or a configuration that would run is refused.

GIB = 1 << 30

# Bytes per element of the DSA latent KV.
_KV_ELEMENT_BYTES = {"bfloat16": 2, "fp8_e4m3": 1}
# 0.5.13 DSATokenToKVPool: FP8 rows keep one float32 scale per 128 latent
# values and the rope part in bf16 (calculate_mla_kv_cache_dim); the indexer
# K cache (uint8) holds index_head_dim values plus one float32 scale per 128.
DSA_QUANT_BLOCK = 128
DSA_SCALE_BYTES = 4
DSA_FP8_ROPE_BYTES = 2

# What a GPU loses before the KV pool beyond the weights SGLang's profile
# subtracts: CUDA context and NCCL buffers (the profile starts from free
# memory, this estimate from capacity) and weights tensor parallelism does
# not split. Generous on purpose, so that the estimate errs low.
DEVICE_NON_KV_ALLOWANCE_BYTES = 4 * GIB


def dsa_row_bytes(kv_lora_rank: int, qk_rope_head_dim: int, kv_cache_dtype: str) -> int | None:
    """Bytes of one token's latent row in one layer, on the GPU and on host
    (bf16: (512 + 64) x 2 = 1152; fp8_e4m3: 512 + 512 / 128 x 4 + 64 x 2 = 656).
    None for a dtype HiSparse does not serve."""
    dtype = canonical_kv_cache_dtype(kv_cache_dtype)
    if dtype == "bfloat16":
        return (kv_lora_rank + qk_rope_head_dim) * _KV_ELEMENT_BYTES[dtype]
    if dtype == "fp8_e4m3":
        return (kv_lora_rank + kv_lora_rank // DSA_QUANT_BLOCK * DSA_SCALE_BYTES
                + qk_rope_head_dim * DSA_FP8_ROPE_BYTES)
    return None


def dsa_indexer_token_bytes(index_head_dim: int) -> int:
    """Bytes of one token's indexer K in one layer (GPU only): FP8 values plus
    one float32 scale per quant block, as 0.5.13's DSATokenToKVPool and its
    pool configurator count it."""
    return index_head_dim + index_head_dim // DSA_QUANT_BLOCK * DSA_SCALE_BYTES


def dsa_draft_extra_token_bytes(kv_lora_rank: int, qk_rope_head_dim: int, index_head_dim: int,
                                kv_cache_dtype: str, draft_layers: int, ratio: int) -> int:
    """GPU bytes a HiSparse MTP draft adds per device-pool token beyond what
    its base pool takes: the draft's (non-HiSparse) DSA pool spans the
    logical space, ratio x the device rows (adapter/speculative.py
    draft_pool_for_logical_ids), each row a latent as laid out plus the
    indexer K, in ``draft_layers`` layers. SGLang's pool configurator never
    counts the draft (base's draft pool comes out of the activation
    headroom too), so only the (ratio - 1) extra copies are charged."""
    row = dsa_row_bytes(kv_lora_rank, qk_rope_head_dim, kv_cache_dtype) or 0
    return (ratio - 1) * (row + dsa_indexer_token_bytes(index_head_dim)) * draft_layers


def dsa_device_token_bytes(kv_lora_rank: int, qk_rope_head_dim: int, index_head_dim: int,
                           kv_cache_dtype: str, layers: int, indexer_ratio: int = 1,
                           latent_with_scales: bool = False, draft_layers: int = 0) -> int | None:
    """GPU bytes SGLang's pool configurator charges one token, all layers: the
    latent (kv_lora_rank + qk_rope_head_dim elements of the KV dtype; 0.5.13
    does not count the FP8 scales, 0.5.17 counts the row as the pool lays it
    out: ``latent_with_scales``) plus the indexer K cache, which stays on the
    GPU only (0.5.13 DefaultPoolConfigurator._compute_cell_size), times
    ``indexer_ratio`` (0.5.17 charges the HiSparse indexer, sized for the
    logical space, at host_to_device_ratio), plus a HiSparse MTP draft's
    extra copies (:func:`dsa_draft_extra_token_bytes`; ``draft_layers`` 0
    without one)."""
    dtype = canonical_kv_cache_dtype(kv_cache_dtype)
    if dtype not in _KV_ELEMENT_BYTES:
        return None
    latent = (dsa_row_bytes(kv_lora_rank, qk_rope_head_dim, dtype) if latent_with_scales
              else (kv_lora_rank + qk_rope_head_dim) * _KV_ELEMENT_BYTES[dtype])
    return ((latent + dsa_indexer_token_bytes(index_head_dim) * indexer_ratio) * layers
            + dsa_draft_extra_token_bytes(kv_lora_rank, qk_rope_head_dim, index_head_dim,
                                          kv_cache_dtype, draft_layers, indexer_ratio))


@dataclass(frozen=True)
class HostKVLayout:
    """What one rank's host pool pins per token of its device KV pool."""

    layers: int  # layers whose KV has a host copy on every rank
    # Host bytes per device-pool token and layer: DSA a latent row; DeepSeek-V4
    # a C4 page's bytes over the full tokens it covers.
    host_bytes_per_token_per_layer: float
    # DSA: the host pool holds host_to_device_ratio x the device pool's rows.
    # DeepSeek-V4: it holds the C4 rows of every full-pool token whatever the
    # ratio (the ratio shrinks the C4 device pool instead).
    scales_with_ratio: bool
    # GPU bytes SGLang's pool configurator charges a token (all layers); None:
    # the device pool is not estimated from GPU memory (only --max-total-tokens).
    device_token_bytes: int | None
    # How the message names a host row (e.g. "1152 B rows x 61 layers").
    description: str


@dataclass(frozen=True)
class HostMemoryInputs:
    layout: HostKVLayout
    ranks_per_node: int  # ranks of this server on this node
    available_bytes: int | None  # the node's MemAvailable (None: unknown -> no check)
    reserve_bytes: int  # kept free: HiCache's own check subtracts this from available memory
    max_total_tokens: int | None  # --max-total-tokens: an upper bound of the device pool
    gpu_memory_bytes: int | None  # one GPU's capacity (None: unknown)
    mem_fraction_static: float | None
    weight_bytes_per_rank: int | None  # None: unknown -> the pool is not estimated from GPU memory
    # Local ranks that map one host pool: 1 (each rank pins its own), or the
    # TP size with SGLANG_HISPARSE_SHARED_HOST_POOL=1.
    ranks_per_host_pool: int = 1


@dataclass(frozen=True)
class HostMemoryEstimate:
    pool_tokens: int  # device KV pool tokens per rank
    pool_source: str  # where pool_tokens comes from, for messages
    per_rank_bytes: int  # one host pool (what each rank maps)
    ranks_per_node: int
    ranks_per_host_pool: int = 1

    @property
    def host_pools_per_node(self) -> int:
        return -(-self.ranks_per_node // max(1, self.ranks_per_host_pool))

    @property
    def node_bytes(self) -> int:
        return self.per_rank_bytes * self.host_pools_per_node


def estimate_device_pool_tokens(inputs: HostMemoryInputs) -> tuple[int, str] | None:
    """Tokens of one rank's device KV pool and how they were obtained; None if unknown.

    Mirrors 0.5.13's sizing: (free GPU memory before loading x
    mem_fraction_static - weights) / configurator bytes per token, capped by
    --max-total-tokens. Capacity stands in for the free memory and
    DEVICE_NON_KV_ALLOWANCE_BYTES for what loading takes besides the weights.
    """
    layout = inputs.layout
    profiled = None
    if (inputs.gpu_memory_bytes and inputs.mem_fraction_static
            and inputs.weight_bytes_per_rank is not None and layout.device_token_bytes):
        kv_bytes = (inputs.gpu_memory_bytes * inputs.mem_fraction_static
                    - inputs.weight_bytes_per_rank - DEVICE_NON_KV_ALLOWANCE_BYTES)
        profiled = max(0, int(kv_bytes // layout.device_token_bytes))
        profiled_source = (
            f"{profiled} tokens: ({_gib(inputs.gpu_memory_bytes)} GiB GPU x "
            f"--mem-fraction-static {inputs.mem_fraction_static} - "
            f"{_gib(inputs.weight_bytes_per_rank)} GiB weights per rank - "
            f"{_gib(DEVICE_NON_KV_ALLOWANCE_BYTES)} GiB allowance) / "
            f"{layout.device_token_bytes} B per token"
        )
    cap = inputs.max_total_tokens
    if cap is not None and (profiled is None or cap <= profiled):
        return cap, f"{cap} tokens: --max-total-tokens"
    if profiled is None:
        return None
    return profiled, profiled_source


def host_bytes_per_token(layout: HostKVLayout, host_to_device_ratio: int) -> float:
    """Pinned bytes one device-pool token costs one rank (DSA: ratio x row bytes x layers)."""
    ratio = host_to_device_ratio if layout.scales_with_ratio else 1
    return ratio * layout.host_bytes_per_token_per_layer * layout.layers


def host_bytes_per_rank(layout: HostKVLayout, pool_tokens: int, host_to_device_ratio: int) -> int:
    """Pinned bytes of one rank's host pool for a device pool of ``pool_tokens``
    (DSA: pool rows x host_to_device_ratio x row bytes x layers)."""
    return math.ceil(pool_tokens * host_bytes_per_token(layout, host_to_device_ratio))


def estimate_host_memory(inputs: HostMemoryInputs,
                         host_to_device_ratio: int) -> HostMemoryEstimate | None:
    """The pinned host memory of all local ranks' host pools; None if the
    device pool cannot be estimated."""
    pool = estimate_device_pool_tokens(inputs)
    if pool is None:
        return None
    tokens, source = pool
    return HostMemoryEstimate(
        pool_tokens=tokens, pool_source=source,
        per_rank_bytes=host_bytes_per_rank(inputs.layout, tokens, host_to_device_ratio),
        ranks_per_node=inputs.ranks_per_node,
        ranks_per_host_pool=inputs.ranks_per_host_pool,
    )


def host_memory_problem(inputs: HostMemoryInputs, host_to_device_ratio: int) -> str | None:
    """A message naming the figures and what to change, if the node's host
    pools will not fit its available memory; None if they fit or cannot be
    estimated."""
    if inputs.available_bytes is None:
        return None
    estimate = estimate_host_memory(inputs, host_to_device_ratio)
    if estimate is None:
        return None
    usable = inputs.available_bytes - inputs.reserve_bytes
    if estimate.node_bytes == 0 or estimate.node_bytes <= usable:
        return None
    layout, pools = inputs.layout, estimate.host_pools_per_node
    room = max(usable, 0)
    fixes = []
    if layout.scales_with_ratio:
        lead = f"{FLAG}: host_to_device_ratio {host_to_device_ratio} needs"
        pool = (f"its device KV pool ({estimate.pool_source}) x host_to_device_ratio "
                f"{host_to_device_ratio} x {layout.description}")
        max_ratio = int(room // (host_bytes_per_rank(layout, estimate.pool_tokens, 1) * pools))
        if max_ratio >= 1:
            fixes.append(f"set host_to_device_ratio of {FLAG} to at most {max_ratio}")
    else:
        lead = "--enable-hisparse: the host KV pools need"
        pool = f"{layout.description} of its device KV pool ({estimate.pool_source})"
    max_tokens = int(room // (host_bytes_per_token(layout, host_to_device_ratio) * pools))
    fixes.append(f"cap the device pool with --max-total-tokens (at most {max_tokens} fit) "
                 "or a lower --mem-fraction-static")
    fix = "; or ".join(fixes)
    if estimate.ranks_per_host_pool > 1:
        per = (f"{_gib(estimate.per_rank_bytes)} GiB per host pool x {pools} host pools per "
               f"node, each shared by {estimate.ranks_per_host_pool} TP ranks "
               f"({SHARED_HOST_POOL_ENV}=1); each")
    else:
        per = f"{_gib(estimate.per_rank_bytes)} GiB per rank x {pools} ranks per node; each rank's"
    return (
        f"{lead} about {_gib(estimate.node_bytes)} GiB of pinned host memory on this node "
        f"({per} host pool holds {pool}), but only {_gib(usable)} GiB is available (MemAvailable "
        f"{_gib(inputs.available_bytes)} GiB less {_gib(inputs.reserve_bytes)} GiB kept free). "
        f"{fix[0].upper()}{fix[1:]}."
    )


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"
