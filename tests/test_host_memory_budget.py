"""The pinned host memory check: what every local rank's host KV pool will pin,
estimated with the server arguments (before any weight loads) against the
node's MemAvailable.

The arithmetic (sglang_hisparse.arg_rules) is checked against SGLang 0.5.13's
own sizing functions and against the bytes our real host pools allocate on
CPU; the inputs (sglang_hisparse.adapter.args) are read from real ServerArgs
with /proc/meminfo and the GPU capacity injected.
"""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dataplane_fixtures import PS, dsa_pool
from helpers_sglang import TINY_DSV32
from sglang_hisparse.arg_rules import (
    DEVICE_NON_KV_ALLOWANCE_BYTES,
    GIB,
    HiSparseServerArgs,
    HostKVLayout,
    HostMemoryInputs,
    ModelFamily,
    dsa_device_token_bytes,
    dsa_row_bytes,
    estimate_device_pool_tokens,
    estimate_host_memory,
    find_problems,
    host_bytes_per_rank,
    host_memory_problem,
)

# DeepSeek-V3.2 (bf16 KV): 61 layers, kv_lora_rank 512, qk_rope_head_dim 64,
# index_head_dim 128.
V32_LAYERS = 61
V32_BF16 = HostKVLayout(
    layers=V32_LAYERS, host_bytes_per_token_per_layer=1152, scales_with_ratio=True,
    device_token_bytes=dsa_device_token_bytes(512, 64, 128, "bfloat16", V32_LAYERS),
    description="1152 B rows x 61 layers",
)
H200_BYTES = 143771 * (1 << 20)  # nvidia-smi's memory.total of an H200, in bytes
V32_CHECKPOINT = 690 * 10**9  # DeepSeek-V3.2 FP8 safetensors, about 690 GB


def inputs(**changes) -> HostMemoryInputs:
    """DeepSeek-V3.2 at TP 8 on an 8 x H200 node with 2 TiB of RAM, 2000 GiB available."""
    base = HostMemoryInputs(
        layout=V32_BF16, ranks_per_node=8, available_bytes=2000 * GIB,
        reserve_bytes=10 * GIB, max_total_tokens=None, gpu_memory_bytes=H200_BYTES,
        mem_fraction_static=0.886, weight_bytes_per_rank=V32_CHECKPOINT // 8,
    )
    return replace(base, **changes)


# --- row and token sizes, against SGLang and our pools --------------------


def test_dsa_row_bytes():
    assert dsa_row_bytes(512, 64, "bfloat16") == dsa_row_bytes(512, 64, "bf16") == 1152
    assert dsa_row_bytes(512, 64, "fp8_e4m3") == 656
    assert dsa_row_bytes(512, 64, "auto") is None
    # SGLang's configurator counts the FP8 latent as 576 B (no scales) + indexer 132 B.
    assert dsa_device_token_bytes(512, 64, 128, "bfloat16", 1) == 1152 + 132
    assert dsa_device_token_bytes(512, 64, 128, "fp8_e4m3", 61) == (576 + 132) * 61


@pytest.fixture(scope="module")
def sglang_server_args():
    """Real 0.5.13 ServerArgs for the config-only DeepSeek-V3.2, as on SM90."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        from sglang.srt.server_args import ServerArgs

        def build(**kw):
            kw.setdefault("model_path", str(TINY_DSV32))
            return ServerArgs(device="cuda", enable_hisparse=True, disable_radix_cache=True,
                              **kw)

        yield build


@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16),
                                               ("fp8_e4m3", torch.float8_e4m3fn)])
def test_sizes_equal_sglangs_own(sglang_server_args, monkeypatch, dtype, torch_dtype, ratio):
    from sglang.srt.model_executor import pool_configurator
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    from sglang_hisparse.adapter.model_runner import hisparse_indexer_cell_size
    from sglang_hisparse.adapter.releases import current
    from sglang_hisparse.manifest import ENTRIES
    from sglang_hisparse.pinned_source import sglang_version

    args = sglang_server_args(kv_cache_dtype=dtype,
                              hisparse_config=json.dumps({"host_to_device_ratio": ratio}))
    mc = args.get_model_config()
    # ModelRunner (0.5.17: KVCacheConfigurator) cannot be built without a GPU;
    # the sizing reads only these fields of it.
    runner = SimpleNamespace(model_config=mc, kv_cache_dtype=torch_dtype, server_args=args,
                             use_mla_backend=True, is_draft_worker=False)
    row = current.mla_kv_cache_dim(mc, torch_dtype, args) * torch_dtype.itemsize
    assert dsa_row_bytes(mc.kv_lora_rank, mc.qk_rope_head_dim, dtype) == row
    # The attention TP size it asks for unconditionally (used only by the
    # non-MLA branch) needs a process group otherwise.
    if hasattr(pool_configurator, "get_parallel"):  # 0.5.17
        monkeypatch.setattr(pool_configurator, "get_parallel",
                            lambda: SimpleNamespace(attn_tp_size=1, attn_cp_size=1))
    else:
        monkeypatch.setattr(pool_configurator, "get_attention_tp_size", lambda: 1)
    # (an instance method that reads nothing of its instance)
    layers = mc.num_hidden_layers
    cell = DefaultPoolConfigurator._compute_cell_size(None, runner, layers)
    # Up to 0.5.15.post1 the release counts the indexer once and our AFTER hook
    # adds the (ratio - 1) copies the HiSparse pool holds beyond it (its
    # index_buf_size is host_to_device_ratio x the rows); 0.5.17 counts them.
    (entry,) = [e for e in ENTRIES if e.impl and e.impl.endswith(":hisparse_indexer_cell_size")]
    if entry.applies_to(sglang_version()):
        indexer = mc.hf_config.index_head_dim + mc.hf_config.index_head_dim // 128 * 4
        hooked = hisparse_indexer_cell_size(cell, None, runner, layers)
        assert hooked - cell == (ratio - 1) * indexer * layers
        # The draft's pool is not HiSparse: its count stays the release's.
        draft = SimpleNamespace(**{**vars(runner), "is_draft_worker": True})
        assert hisparse_indexer_cell_size(cell, None, draft, layers) is None
        cell = hooked
    assert dsa_device_token_bytes(mc.kv_lora_rank, mc.qk_rope_head_dim,
                                  mc.hf_config.index_head_dim, dtype, mc.num_hidden_layers,
                                  indexer_ratio=ratio, **current.dsa_cell_accounting()) == cell


@pytest.mark.parametrize("ratio", [2, 4])
def test_an_mtp_draft_pool_for_the_logical_space_is_charged(sglang_server_args, ratio):
    """Under MTP the draft's pool spans the logical space (ratio x the device
    rows, draft_pool_for_logical_ids): the cell-size hook charges its
    (ratio - 1) extra rows, latent as laid out plus indexer K, per NextN
    layer, and the host-memory estimate counts the same. Only where the
    release's verify seams are wired (elsewhere the rules refuse MTP)."""
    import copy

    from sglang_hisparse.adapter.model_runner import hisparse_indexer_cell_size
    from sglang_hisparse.adapter.releases import current
    from sglang_hisparse.adapter.speculative import hisparse_draft_layers
    from sglang_hisparse.manifest import ENTRIES
    from sglang_hisparse.pinned_source import sglang_version

    args = sglang_server_args(hisparse_config=json.dumps({"host_to_device_ratio": ratio}))
    spec = copy.copy(args)
    object.__setattr__(spec, "speculative_algorithm", "EAGLE")
    mc = args.get_model_config()
    assert hisparse_draft_layers(args, mc) == 0
    # The kit's config names no NextN layer: the one a NextN draft builds.
    assert mc.num_nextn_predict_layers in (0, None)
    draft_layers = hisparse_draft_layers(spec, mc)
    assert draft_layers == (1 if current.speculative_seams_wired() else 0)
    row = dsa_row_bytes(mc.kv_lora_rank, mc.qk_rope_head_dim, args.kv_cache_dtype)
    assert row in (1152, 656)  # SGLang resolved the dtype
    indexer = mc.hf_config.index_head_dim + mc.hf_config.index_head_dim // 128 * 4
    (entry,) = [e for e in ENTRIES if e.impl and e.impl.endswith(":hisparse_indexer_cell_size")]
    if entry.applies_to(sglang_version()):
        layers, cell = mc.num_hidden_layers, 1000
        runner = SimpleNamespace(model_config=mc, server_args=args, use_mla_backend=True,
                                 is_draft_worker=False)
        plain = hisparse_indexer_cell_size(cell, None, runner, layers)
        with_draft = hisparse_indexer_cell_size(
            cell, None, SimpleNamespace(**{**vars(runner), "server_args": spec}), layers)
        assert with_draft - plain == (ratio - 1) * (row + indexer) * draft_layers
    kw = dict(indexer_ratio=ratio, **current.dsa_cell_accounting())
    geometry = (mc.kv_lora_rank, mc.qk_rope_head_dim, mc.hf_config.index_head_dim,
                args.kv_cache_dtype, mc.num_hidden_layers)
    assert (dsa_device_token_bytes(*geometry, **kw, draft_layers=draft_layers)
            - dsa_device_token_bytes(*geometry, **kw)) == (ratio - 1) * (row + indexer) * draft_layers


@pytest.mark.parametrize("dtype,kv_dim,row", [(torch.bfloat16, 576, 1152),
                                              (torch.float8_e4m3fn, 656, 656)])
def test_estimate_is_what_our_dsa_host_pool_allocates(dtype, kv_dim, row):
    from sglang_hisparse.pools.host import HiSparseMLAHostPool

    size, layers, ratio = 512, 2, 3
    host = HiSparseMLAHostPool(dsa_pool(size, layers, dtype, kv_dim),
                               host_to_device_ratio=ratio, page_size=PS)
    layout = HostKVLayout(layers=layers, host_bytes_per_token_per_layer=row,
                          scales_with_ratio=True, device_token_bytes=None, description="")
    pinned = host.kv_buffer.numel() * host.kv_buffer.element_size()
    # HiCache rounds the host pool up by one page.
    assert pinned == host_bytes_per_rank(layout, size, ratio) + PS * row * layers


def test_estimate_is_what_our_c4_host_pool_allocates():
    from sglang_hisparse.pools.host import HiSparseC4HostPool, c4_page_bytes

    # A full pool of 1024 tokens with page size 256: 1024 / 4 C4 tokens in
    # pages of 64 (what build_host_pool allocates), for 2 C4 layers.
    full, c4_page, layers = 1024, 64, 2
    pages = -(-(full // 4) // c4_page)
    host = HiSparseC4HostPool(
        device_buffers=[torch.zeros(2, c4_page_bytes(c4_page), dtype=torch.uint8)] * layers,
        num_host_pages=pages, page_size=c4_page)
    layout = HostKVLayout(layers=layers,
                          host_bytes_per_token_per_layer=c4_page_bytes(c4_page) / (4 * c4_page),
                          scales_with_ratio=False, device_token_bytes=None, description="")
    pinned = sum(b.numel() for b in host.kv_buffer)
    for ratio in (1, 2, 8):  # the ratio shrinks the C4 device pool, not the host pool
        assert host_bytes_per_rank(layout, full, ratio) == pinned


# --- the device pool estimate ---------------------------------------------


def test_device_pool_from_gpu_memory_mirrors_sglangs_profile():
    tokens, source = estimate_device_pool_tokens(inputs())
    kv = H200_BYTES * 0.886 - V32_CHECKPOINT // 8 - DEVICE_NON_KV_ALLOWANCE_BYTES
    assert tokens == int(kv // ((1152 + 132) * V32_LAYERS)) == 549305
    assert "--mem-fraction-static 0.886" in source and "weights per rank" in source


def test_max_total_tokens_caps_the_estimate_and_stands_alone():
    assert estimate_device_pool_tokens(inputs(max_total_tokens=100_000))[0] == 100_000
    # A cap above the profiled pool does not raise it (SGLang takes the minimum).
    assert estimate_device_pool_tokens(inputs(max_total_tokens=10**8))[0] == 549305
    # Without a GPU (or without the weights' size) only the cap sizes the pool.
    no_gpu = inputs(gpu_memory_bytes=None, max_total_tokens=4096)
    assert estimate_device_pool_tokens(no_gpu) == (4096, "4096 tokens: --max-total-tokens")
    assert estimate_device_pool_tokens(inputs(gpu_memory_bytes=None)) is None
    assert estimate_device_pool_tokens(inputs(weight_bytes_per_rank=None)) is None
    assert estimate_device_pool_tokens(
        inputs(layout=replace(V32_BF16, device_token_bytes=None))) is None


def test_weights_larger_than_the_gpu_give_an_empty_pool_not_a_negative_one():
    too_big = inputs(weight_bytes_per_rank=200 * GIB)
    assert estimate_device_pool_tokens(too_big)[0] == 0
    # (SGLang itself then stops: "Not enough memory", --mem-fraction-static.)
    assert host_memory_problem(replace(too_big, available_bytes=0), 8) is None


# --- the check --------------------------------------------------------------


def test_deepseek_v32_tp8_ratio_8_on_a_2_tib_node_is_refused_with_the_figures():
    estimate = estimate_host_memory(inputs(), 8)
    assert estimate.per_rank_bytes == 549305 * 8 * 1152 * V32_LAYERS
    assert f"{estimate.node_bytes / GIB:.1f}" == "2300.8"
    message = host_memory_problem(inputs(), 8)
    for fragment in (
        "--hisparse-config: host_to_device_ratio 8 needs about 2300.8 GiB of pinned host "
        "memory on this node (287.6 GiB per rank x 8 ranks per node",
        "549305 tokens: (140.4 GiB GPU x --mem-fraction-static 0.886",
        "x host_to_device_ratio 8 x 1152 B rows x 61 layers",
        "only 1990.0 GiB is available (MemAvailable 2000.0 GiB less 10.0 GiB kept free)",
        "Set host_to_device_ratio of --hisparse-config to at most 6",
        "--max-total-tokens (at most 475106 fit)",
        "--mem-fraction-static",
    ):
        assert fragment in message, (fragment, message)
    # The suggested values fit.
    assert host_memory_problem(inputs(), 6) is None
    assert host_memory_problem(inputs(max_total_tokens=475106), 8) is None
    assert host_memory_problem(inputs(max_total_tokens=475107 + 64), 8) is not None


def test_readme_command_ratio_2_fits():
    assert estimate_host_memory(inputs(), 2).node_bytes < 600 * GIB
    assert host_memory_problem(inputs(), 2) is None


def test_without_room_for_even_ratio_1_only_the_pool_cap_is_suggested():
    message = host_memory_problem(inputs(available_bytes=200 * GIB), 2)
    assert "at most" in message and "Set host_to_device_ratio" not in message
    assert message.split(". ", 1)[1].startswith("Cap the device pool with --max-total-tokens")


def test_unknown_available_memory_or_pool_means_no_check():
    assert host_memory_problem(inputs(available_bytes=None), 8) is None
    assert host_memory_problem(inputs(gpu_memory_bytes=None), 8) is None


def test_deepseek_v4_layout_names_the_pool_cap_not_the_ratio():
    c4 = HostKVLayout(layers=30, host_bytes_per_token_per_layer=146.25, scales_with_ratio=False,
                      device_token_bytes=None, description="the C4 pages")
    args = inputs(layout=c4, max_total_tokens=10**9, gpu_memory_bytes=None)
    message = host_memory_problem(args, 8)
    assert message.startswith("--enable-hisparse: the host KV pools need about")
    assert "host_to_device_ratio" not in message and "--max-total-tokens (at most" in message
    assert host_memory_problem(args, 1) == message  # the ratio does not change the host pool


def test_the_rules_report_it_with_every_other_problem():
    args = HiSparseServerArgs(
        model_architecture="DeepseekV32ForCausalLM", model_family=ModelFamily.DSA,
        model_index_topk=2048, hisparse_config='{"host_to_device_ratio": 8}',
        disable_radix_cache=False, enable_mixed_chunk=False, pp_size=1,
        kv_cache_dtype="bfloat16", dsa_prefill_backend=None, dsa_decode_backend=None,
        speculative=None, disaggregation_mode="null", host_memory=inputs(),
    )
    problems, config = find_problems(args)
    assert config.host_to_device_ratio == 8
    assert len(problems) == 2
    assert "--disable-radix-cache" in problems[0] and "host_to_device_ratio 8 needs" in problems[1]
    # An unresolvable config (no ratio to check) reports only its own problem.
    problems, _ = find_problems(replace(args, hisparse_config="{bad"))
    assert not any("pinned host memory" in p for p in problems)


# --- inputs read from ServerArgs (adapter) -----------------------------------


def meminfo(gib: int):
    return lambda: f"MemTotal:       2113929216 kB\nMemAvailable:   {gib * 1024 * 1024} kB\n"


def test_mem_available_is_read_from_meminfo():
    from sglang_hisparse.adapter.args import mem_available_bytes

    assert mem_available_bytes(meminfo(2000)) == 2000 * GIB
    assert mem_available_bytes(lambda: "MemTotal: 1 kB\n") is None

    def unreadable():
        raise FileNotFoundError("/proc/meminfo")

    assert mem_available_bytes(unreadable) is None
    assert mem_available_bytes() > 0  # this machine's, as the server reads it


def test_ranks_per_node(sglang_server_args):
    from sglang_hisparse.adapter.args import ranks_per_node

    assert ranks_per_node(sglang_server_args(tp_size=8)) == 8
    assert ranks_per_node(sglang_server_args(tp_size=8, nnodes=2,
                                             dist_init_addr="127.0.0.1:5000")) == 4
    assert ranks_per_node(sglang_server_args(tp_size=4, dp_size=2)) == 8
    # DP attention groups the tp ranks; it adds none.
    assert ranks_per_node(sglang_server_args(tp_size=8, dp_size=8,
                                             enable_dp_attention=True)) == 8


def test_checkpoint_bytes(tmp_path):
    from sglang_hisparse.adapter.args import checkpoint_bytes

    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1234}, "weight_map": {}}))
    assert checkpoint_bytes(str(tmp_path)) == 1234
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").write_bytes(b"x" * 100)
    assert checkpoint_bytes(str(single)) == 100
    assert checkpoint_bytes(str(TINY_DSV32)) is None  # config only
    assert checkpoint_bytes("hisparse-tests/not-in-any-cache") is None  # nothing downloaded


@pytest.fixture
def v32_dir(tmp_path):
    """The tiny DeepSeek-V3.2 config with a checkpoint index of 8 GiB."""
    (tmp_path / "config.json").write_text((TINY_DSV32 / "config.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 8 * GIB}, "weight_map": {}}))
    return str(tmp_path)


def test_inputs_from_real_server_args(sglang_server_args, v32_dir):
    from sglang_hisparse.adapter.args import hisparse_server_args

    args = sglang_server_args(model_path=v32_dir, tp_size=8, kv_cache_dtype="fp8_e4m3")
    hs = hisparse_server_args(args, read_meminfo=meminfo(100),
                              device_memory_capacity=lambda device: 143771.0)
    assert hs.disaggregation_mode == "null"
    hm = hs.host_memory
    # What the release's configurator charges a token (test_sizes_equal_sglangs_own),
    # the indexer at the default ratio 2: 0.5.13 (576 + 132 x 2) x 4 layers (our
    # hook adds the second copy), 0.5.17 (656 + 132 x 2) x 4.
    from sglang_hisparse.adapter.releases import current

    assert hm.layout == HostKVLayout(
        layers=4, host_bytes_per_token_per_layer=656, scales_with_ratio=True,
        device_token_bytes=dsa_device_token_bytes(
            512, 64, 128, "fp8_e4m3", 4, indexer_ratio=2, **current.dsa_cell_accounting()),
        description="656 B rows x 4 layers")
    assert (hm.ranks_per_node, hm.available_bytes) == (8, 100 * GIB)
    assert hm.gpu_memory_bytes == H200_BYTES and hm.weight_bytes_per_rank == GIB
    assert hm.mem_fraction_static == args.mem_fraction_static and hm.max_total_tokens is None
    from sglang.srt.mem_cache.memory_pool_host import HICACHE_HOST_MEMORY_RESERVE_BYTES

    assert hm.reserve_bytes == HICACHE_HOST_MEMORY_RESERVE_BYTES


def test_the_check_through_real_server_args(sglang_server_args, v32_dir):
    from sglang_hisparse.adapter.args import hisparse_server_args

    args = sglang_server_args(model_path=v32_dir, tp_size=8,
                              hisparse_config='{"host_to_device_ratio": 8}')
    h200 = lambda device: 143771.0  # noqa: E731
    # 4 layers and 1 GiB of weights per rank leave an H200 pool of about 24.8M
    # tokens: 8 ranks at ratio 8 need about 6.8 TiB (0.5.17, whose configurator
    # charges the indexer at the ratio: about 14M tokens, 3.9 TiB).
    hm = hisparse_server_args(args, read_meminfo=meminfo(1), device_memory_capacity=h200).host_memory
    need_gib = (estimate_host_memory(hm, 8).node_bytes + hm.reserve_bytes) / GIB
    assert 3500 < need_gib < 7500, need_gib
    problems, _ = find_problems(hisparse_server_args(args, read_meminfo=meminfo(int(need_gib) + 1),
                                                     device_memory_capacity=h200))
    assert problems == []
    problems, _ = find_problems(hisparse_server_args(args, read_meminfo=meminfo(int(need_gib) - 1),
                                                     device_memory_capacity=h200))
    assert len(problems) == 1 and "host_to_device_ratio 8 needs" in problems[0]
    # Without a GPU (SGLang's helper gives None, or raises) nothing is estimated.
    for capacity in (lambda device: None, _raises):
        hs = hisparse_server_args(args, read_meminfo=meminfo(1), device_memory_capacity=capacity)
        assert hs.host_memory.gpu_memory_bytes is None and find_problems(hs)[0] == []


def _raises(device):
    raise RuntimeError("nvidia-smi not found")


def test_dp_attention_leaves_the_weights_unestimated(sglang_server_args, v32_dir):
    # Every rank then holds its attention weights whole: total / tp would err low.
    from sglang_hisparse.adapter.args import hisparse_server_args

    args = sglang_server_args(model_path=v32_dir, tp_size=8, dp_size=8,
                              enable_dp_attention=True)
    hs = hisparse_server_args(args, read_meminfo=meminfo(1),
                              device_memory_capacity=lambda device: 143771.0)
    assert hs.host_memory.weight_bytes_per_rank is None and find_problems(hs)[0] == []


# --- SGLANG_HISPARSE_SHARED_HOST_POOL=1: one host pool per node ---------------


def test_a_shared_host_pool_is_counted_once_per_node():
    shared = inputs(ranks_per_host_pool=8)
    estimate = estimate_host_memory(shared, 8)
    assert estimate.node_bytes == estimate.per_rank_bytes == estimate_host_memory(
        inputs(), 8).node_bytes // 8
    assert host_memory_problem(shared, 8) is None  # 8 private pools did not fit (above)
    message = host_memory_problem(replace(shared, available_bytes=200 * GIB), 8)
    assert ("287.6 GiB per host pool x 1 host pools per node, each shared by 8 TP ranks "
            "(SGLANG_HISPARSE_SHARED_HOST_POOL=1)") in message
    assert "Set host_to_device_ratio of --hisparse-config to at most 5" in message


def test_the_shared_count_through_real_server_args(sglang_server_args, v32_dir, monkeypatch):
    from sglang_hisparse.adapter.args import hisparse_server_args

    args = sglang_server_args(model_path=v32_dir, tp_size=8,
                              hisparse_config='{"host_to_device_ratio": 8}')
    h200 = lambda device: 143771.0  # noqa: E731
    # 3.5 to 7.5 TiB for 8 private pools (above); one shared pool is an eighth.
    problems, _ = find_problems(hisparse_server_args(args, read_meminfo=meminfo(3000),
                                                     device_memory_capacity=h200))
    assert len(problems) == 1 and "8 ranks per node" in problems[0]
    monkeypatch.setenv("SGLANG_HISPARSE_SHARED_HOST_POOL", "1")
    hs = hisparse_server_args(args, read_meminfo=meminfo(3000), device_memory_capacity=h200)
    assert hs.shared_host_pool and hs.host_memory.ranks_per_host_pool == 8
    assert find_problems(hs)[0] == []
    problems, _ = find_problems(hisparse_server_args(args, read_meminfo=meminfo(400),
                                                     device_memory_capacity=h200))
    assert len(problems) == 1 and "x 1 host pools per node, each shared by 8" in problems[0]
    monkeypatch.setenv("SGLANG_HISPARSE_SHARED_HOST_POOL", "0")
    assert hisparse_server_args(args, read_meminfo=meminfo(3000),
                                device_memory_capacity=h200).host_memory.ranks_per_host_pool == 1


def test_a_shared_host_pool_is_refused_where_it_cannot_share():
    base = HiSparseServerArgs(
        model_architecture="DeepseekV32ForCausalLM", model_family=ModelFamily.DSA,
        model_index_topk=2048, hisparse_config=None, disable_radix_cache=True,
        enable_mixed_chunk=False, pp_size=1, kv_cache_dtype="bfloat16",
        dsa_prefill_backend=None, dsa_decode_backend=None, speculative=None,
        disaggregation_mode="null", shared_host_pool=True)
    assert find_problems(base)[0] == []
    (problem,) = find_problems(replace(base, disaggregation_mode="decode"))[0]
    assert "SGLANG_HISPARSE_SHARED_HOST_POOL=1" in problem
    assert "--disaggregation-mode decode" in problem
    assert find_problems(replace(base, disaggregation_mode="decode",
                                 shared_host_pool=False))[0] == []
    (problem,) = find_problems(replace(base, nnodes=2))[0]
    assert "--nnodes 1" in problem
    (problem,) = find_problems(replace(base, enable_dp_attention=True))[0]
    assert "--enable-dp-attention" in problem
