"""SGLang's server arguments: our handling of ``--enable-hisparse`` and ``--hisparse-config``.

SGLang 0.5.13 declares both flags; the three functions here replace what it
does with them (manifest entries, scope ALWAYS):

* :func:`validate_hisparse` - run by ``ServerArgs.check_server_args`` before
  weights load; the rules themselves are pure, in :mod:`sglang_hisparse.arg_rules`.
* :func:`apply_hisparse_dsa_backend_defaults` - DSA backends that can read the
  HiSparse pool, picked by KV dtype (:mod:`sglang_hisparse.dsa_backends`).
* :func:`parse_hisparse_config` - SGLang's ``SparseConfig`` from our parser
  (:mod:`sglang_hisparse.config`) for the pool/coordinator code.

SGLang calls ``sglang.srt.arg_groups.hisparse_hook.validate_hisparse(self)``
from ``ServerArgs.check_server_args`` (a function-local import, so the
HookRegistry REPLACE is what it finds), in the launcher process, before any
model weights load. This module only reads ``ServerArgs`` into plain values;
the rules are in :mod:`sglang_hisparse.arg_rules`. For the pinned host memory
check it also reads, without loading or downloading anything, the node's
``MemAvailable`` (/proc/meminfo), one GPU's capacity (SGLang's
``get_device_memory_capacity``) and the checkpoint's size (its safetensors
index, from a local model directory or the Hugging Face cache).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable, Optional

from sglang_hisparse.arg_rules import (
    HiSparseArgumentError,
    HiSparseServerArgs,
    HostKVLayout,
    HostMemoryInputs,
    ModelFamily,
    SpeculativeArgs,
    dsa_device_token_bytes,
    dsa_row_bytes,
    find_problems,
)
from sglang_hisparse.config import (
    SHARED_HOST_POOL_ENV,
    HiSparseConfig,
    HiSparseConfigError,
    env_problems,
)
from sglang_hisparse.config import parse_hisparse_config as parse_hisparse_config_text
from sglang_hisparse.dsa_backends import dsa_backend_for

logger = logging.getLogger(__name__)


def model_family(hf_config) -> ModelFamily | None:
    from sglang.srt.configs.model_config import is_deepseek_dsa, is_deepseek_v4

    if is_deepseek_v4(hf_config):
        return ModelFamily.DEEPSEEK_V4
    if is_deepseek_dsa(hf_config):
        return ModelFamily.DSA
    return None


def model_index_topk(model_config) -> int | None:
    # Where SGLang's model runner reads the indexer's top-k from.
    return getattr(model_config.hf_text_config, "index_topk", None)


def hisparse_server_args(
    server_args,
    *,
    read_meminfo: Optional[Callable[[], str]] = None,
    device_memory_capacity: Optional[Callable[[str], Optional[float]]] = None,
) -> HiSparseServerArgs:
    """Plain values for the rules. ``read_meminfo`` (the text of /proc/meminfo)
    and ``device_memory_capacity`` (one GPU's capacity in MiB, SGLang's
    ``get_device_memory_capacity``) are injectable for tests."""
    from sglang_hisparse.adapter import releases

    model_config = server_args.get_model_config()
    hf_config = model_config.hf_config
    architectures = getattr(hf_config, "architectures", None) or [None]
    family = model_family(hf_config)
    return HiSparseServerArgs(
        model_architecture=architectures[0],
        model_family=family,
        model_index_topk=model_index_topk(model_config),
        hisparse_config=server_args.hisparse_config,
        disable_radix_cache=bool(server_args.disable_radix_cache),
        enable_mixed_chunk=bool(server_args.enable_mixed_chunk),
        pp_size=server_args.pp_size,
        kv_cache_dtype=server_args.kv_cache_dtype,
        dsa_prefill_backend=server_args.dsa_prefill_backend,
        dsa_decode_backend=server_args.dsa_decode_backend,
        speculative=speculative_args(server_args),
        disaggregation_mode=str(server_args.disaggregation_mode),
        transfer_backend=str(server_args.disaggregation_transfer_backend),
        decode_host_transfer_backends=releases.current.decode_host_transfer_backends(),
        shared_host_pool=shared_host_pool_requested(),
        nnodes=int(server_args.nnodes),
        enable_dp_attention=bool(server_args.enable_dp_attention),
        host_memory=host_memory_inputs(
            server_args, model_config, family,
            read_meminfo=read_meminfo, device_memory_capacity=device_memory_capacity,
        ),
    )


def speculative_args(server_args) -> SpeculativeArgs | None:
    """The speculative settings SGLang resolved (``__post_init__`` fills the
    steps / top-k / draft tokens before ``check_server_args`` runs)."""
    from sglang.srt.environ import envs

    from sglang_hisparse.adapter import releases

    algorithm = server_args.speculative_algorithm
    if algorithm is None or algorithm.upper() == "NONE":
        return None
    return SpeculativeArgs(
        algorithm=algorithm,
        eagle_topk=server_args.speculative_eagle_topk,
        num_draft_tokens=server_args.speculative_num_draft_tokens,
        adaptive=bool(server_args.speculative_adaptive),
        multi_layer_eagle=bool(server_args.enable_multi_layer_eagle),
        overlap_schedule=not server_args.disable_overlap_schedule,
        spec_v2=releases.current.speculative_v2_worker(),
        overlap_plan_stream=bool(envs.SGLANG_ENABLE_OVERLAP_PLAN_STREAM.get()),
        page_size=int(server_args.page_size or 1),
        seams_wired=releases.current.speculative_seams_wired(),
        wired_releases=releases.speculative_releases(),
    )


def validate_hisparse(server_args) -> None:
    """REPLACE for ``sglang.srt.arg_groups.hisparse_hook.validate_hisparse``.

    Raises a ValueError (HiSparseArgumentError) listing every problem with
    the HiSparse arguments; does nothing without ``--enable-hisparse``.
    """
    if not server_args.enable_hisparse:
        return
    problems, _ = find_problems(hisparse_server_args(server_args))
    problems += env_problems(os.environ)
    problems += index_share_problems(server_args.get_model_config())
    if problems:
        raise HiSparseArgumentError(problems)


def index_share_problems(model_config) -> list[str]:
    """The model config's index sharing (``index_topk_pattern`` /
    ``index_topk_freq`` / ``index_skip_topk_offset``) as the swap-in's
    IndexShare prefetch reads it: a line per field the model code cannot
    run, before any weight loads."""
    from sglang_hisparse.adapter import releases
    from sglang_hisparse.engine.index_share import IndexShareConfigError, roles_from_config

    if model_family(model_config.hf_config) is not ModelFamily.DSA:
        return []
    text = model_config.hf_text_config
    try:
        roles_from_config(text, int(getattr(text, "num_hidden_layers", 0) or 0),
                          releases.current.index_share_rules())
    except IndexShareConfigError as exc:
        return [f"model config: {exc}"]
    return []


# --- what the host pools will pin (inputs of arg_rules.host_memory_problem)

MEMINFO = "/proc/meminfo"


def _read_proc_meminfo() -> str:
    return Path(MEMINFO).read_text()


def mem_available_bytes(read_meminfo: Optional[Callable[[], str]] = None) -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (what psutil, and so HiCache's
    own check, calls available); None where it cannot be read."""
    try:
        text = (read_meminfo or _read_proc_meminfo)()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "MemAvailable":
            parts = value.split()
            if parts and parts[0].isdigit():
                unit = parts[1].lower() if len(parts) > 1 else "b"
                return int(parts[0]) * (1024 if unit == "kb" else 1)
    return None


def shared_host_pool_requested() -> bool:
    return os.environ.get(SHARED_HOST_POOL_ENV) == "1"


def ranks_per_host_pool(server_args) -> int:
    """Local ranks mapping one host pool: the TP group with
    SGLANG_HISPARSE_SHARED_HOST_POOL=1 (allowed on one node only), else 1."""
    return max(1, int(server_args.tp_size)) if shared_host_pool_requested() else 1


def ranks_per_node(server_args) -> int:
    """Scheduler processes of this server on this node, each building its own
    host pool: tp x pp over the nodes, times dp replicas without DP attention
    (DP attention splits the tp ranks into groups, it adds none)."""
    dp = 1 if server_args.enable_dp_attention else max(1, int(server_args.dp_size))
    ranks = dp * int(server_args.tp_size) * int(server_args.pp_size)
    return max(1, ranks // max(1, int(server_args.nnodes)))


def checkpoint_bytes(model_path: str, revision: Optional[str] = None) -> Optional[int]:
    """Bytes of the model's safetensors checkpoint: ``metadata.total_size`` of
    ``model.safetensors.index.json`` (or a single ``model.safetensors``), from
    a local model directory or the Hugging Face cache; None if neither has it
    (nothing is downloaded)."""
    local = Path(model_path)
    if local.is_dir():
        index, single = local / "model.safetensors.index.json", local / "model.safetensors"
    else:
        index = _hf_cached(model_path, "model.safetensors.index.json", revision)
        single = None if index else _hf_cached(model_path, "model.safetensors", revision)
    try:
        if index is not None and index.is_file():
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            return int(total) if isinstance(total, (int, float)) and total > 0 else None
        if single is not None and single.is_file():
            return single.stat().st_size
    except (OSError, ValueError):
        pass
    return None


def _hf_cached(repo_id: str, filename: str, revision: Optional[str]) -> Optional[Path]:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, filename, revision=revision)
    except Exception:  # not a repo id, no hub client, a broken cache
        return None
    return Path(found) if isinstance(found, str) else None


def _device_memory_mib(device: str) -> Optional[float]:
    # The helper ServerArgs sizes mem_fraction_static with (MiB; None where
    # unknown, e.g. without a GPU; raises where CUDA is there but unusable).
    from sglang.srt.utils import get_device_memory_capacity

    return get_device_memory_capacity(device)


def _host_reserve_bytes() -> int:
    try:
        from sglang.srt.mem_cache.memory_pool_host import HICACHE_HOST_MEMORY_RESERVE_BYTES
    except ImportError:
        return 0
    return int(HICACHE_HOST_MEMORY_RESERVE_BYTES)


def host_kv_layout(server_args, model_config, family: ModelFamily) -> Optional[HostKVLayout]:
    """What one rank's host pool pins per device-pool token (None: unknown)."""
    text = model_config.hf_text_config
    layers = int(model_config.num_hidden_layers)
    if family is ModelFamily.DSA:
        from sglang.srt.configs.model_config import get_dsa_index_head_dim

        from sglang_hisparse.adapter import releases
        from sglang_hisparse.adapter.speculative import hisparse_draft_layers

        row = dsa_row_bytes(model_config.kv_lora_rank, model_config.qk_rope_head_dim,
                            server_args.kv_cache_dtype)
        if row is None:
            return None  # the dtype rule reports it
        # Every pin charges the indexer K at host_to_device_ratio (0.5.17
        # itself, earlier ones through our cell-size hook); the releases
        # differ in how they count the latent.
        try:
            ratio = parse_hisparse_config_text(server_args.hisparse_config).host_to_device_ratio
        except HiSparseConfigError:
            ratio = None  # the config rule reports it
        return HostKVLayout(
            layers=layers, host_bytes_per_token_per_layer=row, scales_with_ratio=True,
            device_token_bytes=None if ratio is None else dsa_device_token_bytes(
                model_config.kv_lora_rank, model_config.qk_rope_head_dim,
                get_dsa_index_head_dim(model_config.hf_config), server_args.kv_cache_dtype,
                layers, indexer_ratio=ratio, **releases.current.dsa_cell_accounting(),
                draft_layers=hisparse_draft_layers(server_args, model_config)),
            description=f"{row} B rows x {layers} layers",
        )
    if family is ModelFamily.DEEPSEEK_V4:
        from sglang_hisparse.pools.host import c4_page_bytes

        # The host pool holds C4 pages of (page_size / 4) compressed tokens,
        # one per 4 full tokens, for every C4 layer (build_host_pool). The
        # device pool is not estimated from GPU memory here: DeepSeek-V4 splits
        # it across SWA, C4, C128 and state pools (SGLang's DSV4 configurator,
        # which needs the model runner), so only --max-total-tokens sizes it.
        c4_layers = sum(1 for r in (getattr(text, "compress_ratios", None) or [])[:layers]
                        if r == 4)
        c4_page = max(1, int(server_args.page_size or 256) // 4)
        page_bytes = c4_page_bytes(c4_page)
        return HostKVLayout(
            layers=c4_layers, host_bytes_per_token_per_layer=page_bytes / (4 * c4_page),
            scales_with_ratio=False, device_token_bytes=None,
            description=f"the C4 pages ({page_bytes} B per {4 * c4_page} tokens x "
                        f"{c4_layers} C4 layers)",
        )
    return None


def host_memory_inputs(
    server_args,
    model_config,
    family: Optional[ModelFamily],
    *,
    read_meminfo: Optional[Callable[[], str]] = None,
    device_memory_capacity: Optional[Callable[[str], Optional[float]]] = None,
) -> Optional[HostMemoryInputs]:
    """Inputs of the pinned host memory check; None where it cannot apply."""
    if family is None:
        return None
    layout = host_kv_layout(server_args, model_config, family)
    if layout is None:
        return None
    try:
        gpu_mib = (device_memory_capacity or _device_memory_mib)(server_args.device)
    except Exception:  # SGLang raises where CUDA is present but unusable
        gpu_mib = None
    weights = None
    # Weights per rank: the checkpoint split over tp x pp ranks. With DP
    # attention every rank holds its attention weights whole, which this
    # would underestimate (and so overestimate the KV pool): not estimated.
    if gpu_mib and not server_args.enable_dp_attention:
        total = checkpoint_bytes(server_args.model_path, getattr(server_args, "revision", None))
        if total is not None:
            weights = total // (int(server_args.tp_size) * int(server_args.pp_size))
    return HostMemoryInputs(
        layout=layout,
        ranks_per_node=ranks_per_node(server_args),
        available_bytes=mem_available_bytes(read_meminfo),
        reserve_bytes=_host_reserve_bytes(),
        max_total_tokens=server_args.max_total_tokens,
        gpu_memory_bytes=int(gpu_mib * (1 << 20)) if gpu_mib else None,
        mem_fraction_static=server_args.mem_fraction_static,
        weight_bytes_per_rank=weights,
        ranks_per_host_pool=ranks_per_host_pool(server_args),
    )


def apply_hisparse_dsa_backend_defaults(
    server_args,
    user_set_prefill: bool,
    user_set_decode: bool,
    kv_cache_dtype: str,
) -> bool:
    """REPLACE for ``sglang.srt.arg_groups.hisparse_hook.apply_hisparse_dsa_backend_defaults``.

    Called from ``ServerArgs._set_default_dsa_backends`` once the DSA KV dtype
    is resolved ("auto" is already bfloat16 or fp8_e4m3 here). Sets the DSA
    prefill/decode backends the user left unset and returns True so that
    SGLang skips its own (non-HiSparse) defaults. A backend the user chose is
    kept; ``validate_hisparse`` rejects it later if it cannot read the pool.
    """
    if not server_args.enable_hisparse:
        return False
    backend = dsa_backend_for(kv_cache_dtype)
    if backend is None:
        # Unsupported dtype: leave the backends alone; validation names the dtype.
        return True
    if not user_set_prefill:
        server_args.dsa_prefill_backend = backend
    if not user_set_decode:
        server_args.dsa_decode_backend = backend
    logger.info(
        "HiSparse (--kv-cache-dtype %s): DSA backends prefill=%s, decode=%s",
        kv_cache_dtype,
        server_args.dsa_prefill_backend,
        server_args.dsa_decode_backend,
    )
    return True


# --- parse_hisparse_config
# ``parse_hisparse_config``: SGLang's ``SparseConfig``, built from our parser.
#
# SGLang 0.5.13 reads ``--hisparse-config`` through
# ``sglang.srt.mem_cache.sparsity.parse_hisparse_config(server_args)`` when it
# builds the KV pool, the allocator and the coordinator (function-local imports
# in the model runner and the pool configurator, in every scheduler process).
# We replace that function so those readers get the config our startup check
# accepted: same rules, same errors, and ``top_k`` already resolved to the
# model's ``index_topk`` (0.5.13 defaults to 2048 and lets the model runner
# override it).
#
# ``swap_in_block_size`` has no ``SparseConfig`` field in 0.5.13; it travels in
# ``sparse_extra_config`` (0.5.15 adds the field: the release module builds
# the dataclass, ``adapter/releases/``), and :func:`resolved_hisparse_config`
# gives our own object to code that wants it.


def resolved_hisparse_config(server_args) -> HiSparseConfig:
    """The resolved HiSparse config for these server args (raises HiSparseConfigError)."""
    parsed = parse_hisparse_config_text(server_args.hisparse_config)
    spec = speculative_args(server_args)
    return parsed.resolve(model_index_topk(server_args.get_model_config()),
                          spec.draft_tokens if spec else 1)


def parse_hisparse_config(server_args):
    """REPLACE for ``sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config``."""
    from sglang_hisparse.adapter import releases

    # algorithm/backend/page_size/min_sparse_prompt_len belong to SGLang's
    # generic sparse coordinator, which HiSparse does not use: left at None.
    return releases.current.sparse_config(resolved_hisparse_config(server_args))
