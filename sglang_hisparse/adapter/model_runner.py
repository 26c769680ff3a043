"""SGLang's model runner: what it builds and reads for HiSparse.

* :class:`HiSparseCoordinator` - class REPLACE of 0.5.13's coordinator, built
  by ``ModelRunner`` (``model_runner.py:818``) with 0.5.13's fixed keyword
  set. It reads what that constructor cannot pass (the swap-in block size
  from ``--hisparse-config``, whether this is a PD decode node, the draft
  tokens of a speculative verify step, the IndexShare layer roles of the
  model config) from the process-wide server args and hands them to the engine's coordinator, which
  never touches SGLang itself.
* :func:`model_runner_max_token_pool_size` - PROPERTY getter for
  ``ModelRunner.max_token_pool_size``.
"""

from __future__ import annotations

from typing import Optional

from sglang_hisparse.adapter import metrics, releases
from sglang_hisparse.config import SHARED_HOST_POOL_ENV
from sglang_hisparse.engine.coordinator import Coordinator


def _server_args():
    try:
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except (ImportError, ValueError, AttributeError):
        return None  # no server (unit tests build the coordinator directly)


def configured_swap_in_block_size(server_args) -> Optional[int]:
    """``swap_in_block_size`` of --hisparse-config (None: the kernel's default)."""
    if server_args is None:
        return None
    from sglang_hisparse.adapter.args import resolved_hisparse_config

    try:
        return resolved_hisparse_config(server_args).swap_in_block_size
    except Exception:  # validated at startup; a server without a model config
        return None


def is_pd_decode(server_args) -> bool:
    """True on a PD decode node (``--disaggregation-mode decode``)."""
    return server_args is not None and str(getattr(server_args, "disaggregation_mode", "")) == "decode"


def pd_growth_clip() -> int:
    """How many new tokens a request is expected to need at most when the
    PD decode budget reserves for it: SGLang's own clip of max_new_tokens in
    its PD prealloc estimate (``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION``)."""
    from sglang.srt.environ import envs

    return int(envs.SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.get())


def configured_draft_tokens(server_args) -> int:
    """Rows per request of each swap-in: ``--speculative-num-draft-tokens``
    under speculative decoding (its verify steps), else 1."""
    if server_args is None:
        return 1
    from sglang_hisparse.adapter.args import speculative_args

    spec = speculative_args(server_args)
    return spec.draft_tokens if spec is not None else 1


def configured_index_roles(server_args, token_to_kv_pool_allocator):
    """The IndexShare role of every layer of this DSA model (engine/index_share.py),
    read from the model config the model code reads (``hf_text_config``);
    None for DeepSeek-V4, under pipeline parallelism (a stage's layer ids do
    not start at 0) and without server args."""
    if server_args is None or getattr(token_to_kv_pool_allocator, "compress_ratio", 1) != 1:
        return None
    if int(getattr(server_args, "pp_size", 1) or 1) > 1:
        return None
    from sglang_hisparse.adapter import releases
    from sglang_hisparse.engine.index_share import roles_from_config

    try:
        config = server_args.get_model_config().hf_text_config
    except Exception:  # a test's server args without a model
        return None
    return roles_from_config(config, token_to_kv_pool_allocator.get_kvcache().layer_num,
                             releases.current.index_share_rules())


def shared_host_buffer_allocator(tp_group):
    """With SGLANG_HISPARSE_SHARED_HOST_POOL=1 and more than one TP rank: the
    function that maps this rank's view of the node's one shared host buffer
    (pools/shared_host_memory.py); else None (a pinned pool per rank).

    The arg rules allow the switch on one node only, so the TP group (SGLang
    hands the coordinator its gloo ``cpu_group``) is the local ranks and TP
    rank 0 is the local leader. It makes the segment's name, unique per
    server instance, and sends it to the others over that group."""
    from sglang_hisparse.adapter.args import shared_host_pool_requested

    if not shared_host_pool_requested() or tp_group is None:
        return None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group=tp_group) < 2:
        return None
    from sglang_hisparse.pools import shared_host_memory

    rank, world = dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)
    names = [shared_host_memory.new_segment_name() if rank == 0 else None]
    dist.broadcast_object_list(names, group=tp_group, group_src=0)

    def open_for_this_rank(shape, dtype, pin=True):
        return shared_host_memory.open_shared_buffer(
            names[0], shape, dtype, local_rank=rank, local_ranks=world, pin=pin)

    return open_for_this_rank


def build_host_pool(allocator, host_to_device_ratio: int, tp_group=None):
    """The pinned host pool for this allocator's device pool: DSA rows, or
    DeepSeek-V4 C4 pages (``host_to_device_ratio`` x the device pool). DSA
    rows live in the node's shared buffer with SGLANG_HISPARSE_SHARED_HOST_POOL=1
    (the arg rules refuse the switch for DeepSeek-V4)."""
    from sglang_hisparse.pools.host import HiSparseC4HostPool, HiSparseMLAHostPool

    compress_ratio = getattr(allocator, "compress_ratio", 1)
    if compress_ratio != 1:
        device_pool = allocator.hisparse_kvcache  # the C4 physical pool
        page_size = device_pool.page_size
        pages = -(-(allocator.size_full // compress_ratio) // page_size)
        return HiSparseC4HostPool(device_buffers=device_pool.kv_buffer, num_host_pages=pages,
                                  page_size=page_size)
    device_pool = allocator.get_kvcache()
    try:
        return HiSparseMLAHostPool(
            device_pool=device_pool, host_to_device_ratio=host_to_device_ratio, host_size=0,
            page_size=device_pool.page_size, override_kv_cache_dim=device_pool.kv_cache_dim,
            alloc_host_buffer=shared_host_buffer_allocator(tp_group))
    except ValueError as exc:
        # HiCache's own check (memory_pool_host.py:269) names neither the key
        # nor the flag; the startup estimate should have refused this already.
        if "Not enough host memory" not in str(exc):
            raise
        raise ValueError(
            f"HiSparse host KV pool: {exc.args[0].split('. Please')[0]} for "
            f"{device_pool.size} device rows x host_to_device_ratio {host_to_device_ratio} "
            f"x {device_pool.layer_num} layers; every TP rank on this node pins its own pool "
            f"(unless {SHARED_HOST_POOL_ENV}=1). "
            "Lower host_to_device_ratio in --hisparse-config, or --max-total-tokens / "
            "--mem-fraction-static") from exc


def abort_for_drift(req, message: str) -> None:
    """The engine cannot serve this request any more: finish it with the
    reason (the client sees an abort with the message), keep serving."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if req.to_finish is None:
        req.to_finish = FINISH_ABORT(message)


class HiSparseCoordinator(Coordinator):
    """Drop-in for the release's ``HiSparseCoordinator`` (same constructor:
    0.5.15 adds ``swap_in_block_size``, which arrives in ``engine_options``)."""

    # Where the release keeps a request's prefill length and allocated length.
    prefill_len = staticmethod(releases.current.prefill_len)
    kv_allocated_len = staticmethod(releases.current.kv_allocated_len)

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, top_k: int,
                 device_buffer_size: int, device, tp_group, host_to_device_ratio: int = 2,
                 swap_in_block_size: Optional[int] = None, **engine_options):
        server_args = _server_args()
        # 0.5.15 passes SparseConfig.swap_in_block_size (ours: None unless
        # configured); 0.5.13 passes nothing. Unset: the configured one.
        if swap_in_block_size is None:
            swap_in_block_size = configured_swap_in_block_size(server_args)
        engine_options["swap_in_block_size"] = swap_in_block_size
        if engine_options.get("draft_tokens") is None:
            engine_options["draft_tokens"] = configured_draft_tokens(server_args)
        if engine_options.get("pd_decode") is None:
            engine_options["pd_decode"] = is_pd_decode(server_args)
        if engine_options.get("pd_growth_clip") is None and engine_options["pd_decode"]:
            engine_options["pd_growth_clip"] = pd_growth_clip()
        if "index_roles" not in engine_options:
            engine_options["index_roles"] = configured_index_roles(
                server_args, token_to_kv_pool_allocator)
        if server_args is not None and "pp_size" not in engine_options:
            engine_options["pp_size"] = int(getattr(server_args, "pp_size", 1) or 1)
        if engine_options.get("host_pool") is None:
            engine_options["host_pool"] = build_host_pool(
                token_to_kv_pool_allocator, host_to_device_ratio, tp_group)
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, top_k,
                         device_buffer_size, device, tp_group, host_to_device_ratio,
                         **engine_options)
        self.on_drift = abort_for_drift
        metrics.register_coordinator(self)


def model_runner_max_token_pool_size(self):
    """PROPERTY getter for ``ModelRunner.max_token_pool_size`` (0.5.13
    ``model_runner.py:2204``): with HiSparse the longest request is bounded by
    the host-backed logical space, not the GPU pool (0.5.23 MR:1516-1524).
    Feeds ``TpModelWorker.max_req_len`` and the PD prefill budget. Without
    HiSparse: the release's own answer."""
    alloc = getattr(self, "token_to_kv_pool_allocator", None)
    if getattr(self, "enable_hisparse", False) and hasattr(alloc, "logical_capacity"):
        return alloc.logical_capacity
    return releases.current.native_max_token_pool_size(self)


def hisparse_indexer_cell_size(cell_size, self, mr, num_layers):
    """AFTER ``DefaultPoolConfigurator._compute_cell_size`` (0.5.13
    ``pool_configurator.py:125``): the GPU bytes per token that the device
    pool is sized by (GPU memory left / cell size) count a DSA token's
    indexer K once, but under HiSparse the indexer's buffer spans the logical
    space, host_to_device_ratio x the device rows (pools/device_dsa.py: the
    indexer scores every token, host-backed ones included). Without the other
    (ratio - 1) copies an auto-sized pool takes more GPU memory than the
    configurator gave it, out of what it left for activations. 0.5.17 charges
    them itself. The draft's pool is not HiSparse and keeps the count, but
    under MTP it spans the logical space (speculative.draft_pool_for_logical_ids),
    so the target's cell also carries that pool's (ratio - 1) extra copies."""
    from sglang.srt.configs.model_config import get_dsa_index_head_dim, is_deepseek_dsa

    from sglang_hisparse.adapter.args import resolved_hisparse_config
    from sglang_hisparse.adapter.speculative import hisparse_draft_layers
    from sglang_hisparse.arg_rules import dsa_draft_extra_token_bytes, dsa_indexer_token_bytes

    server_args = mr.server_args
    if (not server_args.enable_hisparse or getattr(mr, "is_draft_worker", False)
            or not mr.use_mla_backend or not is_deepseek_dsa(mr.model_config.hf_config)):
        return None
    ratio = resolved_hisparse_config(server_args).host_to_device_ratio
    # The host-memory check's estimate (arg_rules.dsa_device_token_bytes)
    # charges the same bytes, so the two cannot drift apart.
    mc = mr.model_config
    index_head_dim = get_dsa_index_head_dim(mc.hf_config)
    per_token = dsa_indexer_token_bytes(index_head_dim)
    draft = dsa_draft_extra_token_bytes(
        mc.kv_lora_rank, mc.qk_rope_head_dim, index_head_dim, server_args.kv_cache_dtype,
        hisparse_draft_layers(server_args, mc), ratio)
    return cell_size + (ratio - 1) * per_token * num_layers + draft
