"""--enable-hisparse / --hisparse-config through SGLang's real argument path.

Every case goes through ``prepare_server_args(argv)`` + ``check_server_args()``
of the installed SGLang 0.5.13, in two fresh interpreters: one with our plugin
activated, one without it (to show what 0.5.13 lets through on its own). All
cases of one interpreter share one SGLang import (see helpers_sglang).
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers_sglang import TINY_DSV32, check_server_args_cases

HISPARSE = ["--device", "cuda", "--enable-hisparse", "--disable-radix-cache"]
EAGLE = ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"]
# SGLang asserts top-k and draft tokens come with the steps.
LINEAR = [*EAGLE, "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]


def dsv32(*extra: str) -> dict:
    return {"argv": ["--model-path", str(TINY_DSV32), *HISPARSE, *extra]}


def config(obj) -> list[str]:
    return ["--hisparse-config", obj if isinstance(obj, str) else json.dumps(obj)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Config-only DeepSeek-V4 and DeepSeek-V3 (no DSA indexer) model dirs."""
    base = json.loads((TINY_DSV32 / "config.json").read_text())
    v3 = {k: v for k, v in base.items() if not k.startswith("index_")}
    v3.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    v4 = dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
        hidden_size=1024, num_hidden_layers=4, num_attention_heads=64,
        num_key_value_heads=1, vocab_size=32768, n_routed_experts=8,
        num_experts_per_tok=2, torch_dtype="bfloat16", head_dim=512,
        qk_rope_head_dim=64, qk_nope_head_dim=448, v_head_dim=512,
        kv_lora_rank=512, q_lora_rank=1024, sliding_window=128,
        index_head_dim=128, index_n_heads=64, index_topk=512,
        compress_ratios=[0, 4, 128, 4], max_position_embeddings=65536,
    )
    dirs = {}
    for name, cfg in (("v3", v3), ("v4", v4)):
        d = tmp_path_factory.mktemp(f"tiny-{name}")
        (d / "config.json").write_text(json.dumps(cfg))
        dirs[name] = str(d)
    return dirs


def cases_with_plugin(dirs) -> dict:
    v4 = lambda *extra: {"argv": ["--model-path", dirs["v4"], *HISPARSE, *extra]}  # noqa: E731
    return {
        # Happy paths.
        "default": dsv32(),
        "fp8": dsv32("--kv-cache-dtype", "fp8_e4m3",
                     *config({"device_buffer_size": 3072, "host_to_device_ratio": 4})),
        "explicit_top_k_equal_to_model": dsv32(*config({"top_k": 2048})),
        "deepseek_v4": v4(),
        "hisparse_off": {"argv": ["--model-path", str(TINY_DSV32), "--device", "cuda",
                                  *config("{bad")]},
        # One rule each.
        "invalid_json": dsv32(*config("{bad")),
        "non_object_json": dsv32(*config("[2048]")),
        "unknown_key": dsv32(*config({"topk": 64})),
        "bool_size": dsv32(*config({"host_to_device_ratio": True})),
        "buffer_below_top_k": dsv32(*config({"top_k": 2048, "device_buffer_size": 1024})),
        "buffer_below_model_top_k": dsv32(*config({"device_buffer_size": 1024})),
        "top_k_differs_from_model": dsv32(*config({"top_k": 64, "device_buffer_size": 128})),
        "model_not_dsa": {"argv": ["--model-path", dirs["v3"], *HISPARSE]},
        "radix_cache_on": {"argv": ["--model-path", str(TINY_DSV32), "--device", "cuda",
                                    "--enable-hisparse"]},
        "mixed_chunk": dsv32("--enable-mixed-chunk"),
        # SGLang's own assert rejects this dtype for DSA in prepare_server_args;
        # set it afterwards to reach our check (as under python -O).
        "kv_dtype": {**dsv32(), "set": {"kv_cache_dtype": "fp8_e5m2"}},
        "kv_dtype_native_assert_first": dsv32("--kv-cache-dtype", "fp8_e5m2"),
        "decode_backend_for_bf16": dsv32("--dsa-decode-backend", "tilelang"),
        "prefill_backend_for_fp8": dsv32("--kv-cache-dtype", "fp8_e4m3",
                                         "--dsa-prefill-backend", "flashmla_sparse"),
        "speculative_linear": dsv32(*EAGLE, "--speculative-num-steps", "3",
                                    "--speculative-num-draft-tokens", "4"),
        # SGLang rejects topk > 1 with page_size > 1 itself unless the attention
        # backend can draft trees over pages; triton can, so ours must catch it.
        "speculative_tree": dsv32("--attention-backend", "triton", "--speculative-algorithm",
                                  "EAGLE", "--speculative-eagle-topk", "2",
                                  "--speculative-num-steps", "3",
                                  "--speculative-num-draft-tokens", "8"),
        "speculative_tree_native_first": dsv32("--speculative-algorithm", "EAGLE",
                                               "--speculative-eagle-topk", "2",
                                               "--speculative-num-steps", "3",
                                               "--speculative-num-draft-tokens", "8"),
        # Linear MTP, each rule of speculative_problems broken once.
        "speculative_nextn": dsv32("--speculative-algorithm", "NEXTN"),
        "speculative_non_overlap": dsv32(*LINEAR, "--disable-overlap-schedule"),
        "speculative_adaptive": dsv32(*LINEAR, "--speculative-adaptive"),
        "speculative_multi_layer": dsv32(*LINEAR, "--enable-multi-layer-eagle"),
        "speculative_buffer_below_rows": dsv32(*LINEAR,
                                               *config({"device_buffer_size": 6144})),
        "speculative_draft_past_page": {**dsv32(*LINEAR), "set": {"page_size": 2}},
        "speculative_pd_decode": dsv32(*LINEAR, "--disaggregation-mode", "decode"),
        "speculative_deepseek_v4": v4(*LINEAR),
        # The native comparison mode: SGLang's own data plane reads the config.
        "native_mode_default": {**dsv32(), "env": {"SGLANG_HISPARSE_NATIVE": "1"}},
        "pipeline_parallel": dsv32("--pp-size", "2", "--disable-overlap-schedule"),
        "several_problems": {"argv": ["--model-path", str(TINY_DSV32), "--device", "cuda",
                                      "--enable-hisparse", "--enable-mixed-chunk",
                                      *config("{bad")]},
        "deepseek_v4_mixed_chunk": v4("--enable-mixed-chunk"),
        "deepseek_v4_top_k_differs": v4(*config({"top_k": 2048})),
        # PD decode: both families retract to host (V4 with its device state).
        "pd_decode_dsa": dsv32("--disaggregation-mode", "decode"),
        "pd_decode_deepseek_v4": v4("--disaggregation-mode", "decode"),
        "pd_decode_deepseek_v4_nixl": v4("--disaggregation-mode", "decode",
                                         "--disaggregation-transfer-backend", "nixl"),
        # The decode receives into the host pool; which connectors can, per release.
        "pd_decode_nixl": dsv32("--disaggregation-mode", "decode",
                                "--disaggregation-transfer-backend", "nixl"),
        "pd_decode_mori": dsv32("--disaggregation-mode", "decode",
                                "--disaggregation-transfer-backend", "mori"),
        "pd_decode_mooncake_tcp": dsv32("--disaggregation-mode", "decode",
                                        "--disaggregation-transfer-backend", "mooncake_tcp"),
        "pd_prefill_nixl": dsv32("--disaggregation-mode", "prefill",
                                 "--disaggregation-transfer-backend", "nixl"),
        # 10^9 device-pool tokens x ratio 2 x 1152 B x 4 layers x 8 ranks:
        # about 67 TiB of pinned host memory, more than any node has. (No GPU
        # here, so only --max-total-tokens sizes the pool.)
        "host_memory_beyond_the_node": dsv32("--tp-size", "8", "--max-total-tokens",
                                             str(10**9)),
    }


CASES_WITHOUT_PLUGIN = {
    "default": dsv32(),
    "invalid_json": dsv32(*config("{bad")),
    "unknown_key": dsv32(*config({"topk": 64})),
    "buffer_below_model_top_k": dsv32(*config({"top_k": 64, "device_buffer_size": 128})),
    "buffer_below_default_top_k": dsv32(*config({"device_buffer_size": 1024})),
    "mixed_chunk": dsv32("--enable-mixed-chunk"),
    "pipeline_parallel": dsv32("--pp-size", "2", "--disable-overlap-schedule"),
}


@pytest.fixture(scope="module")
def runs(model_dirs):
    # Both interpreters at once: each spends most of its time importing SGLang.
    with ThreadPoolExecutor(2) as pool:
        ours = pool.submit(check_server_args_cases, cases_with_plugin(model_dirs), activate=True)
        native = pool.submit(check_server_args_cases, CASES_WITHOUT_PLUGIN, activate=False)
        return {"ours": ours.result(), "native": native.result()}


@pytest.fixture(scope="module")
def ours(runs):
    activation = runs["ours"]["activation"]
    assert activation["applied"], activation["error"]
    return runs["ours"]["results"]


@pytest.fixture(scope="module")
def native(runs):
    assert runs["native"]["activation"] is None
    return runs["native"]["results"]


def rejected(result: dict, *fragments: str) -> str:
    """Assert our check_server_args raised a ValueError containing every fragment."""
    assert not result["ok"], result
    assert result["stage"] == "check_server_args", result
    assert result["error_type"] == "HiSparseArgumentError", result
    for fragment in fragments:
        assert fragment in result["error"], (fragment, result["error"])
    return result["error"]


# --- happy paths -----------------------------------------------------------


def test_defaults_bf16_backends_and_top_k_from_model(ours):
    result = ours["default"]
    assert result["ok"], result
    fields = result["fields"]
    assert fields["kv_cache_dtype"] == "bfloat16"  # "auto" on SM90
    assert fields["dsa_prefill_backend"] == fields["dsa_decode_backend"] == "flashmla_sparse"
    sparse = result["sparse_config"]
    assert (sparse["top_k"], sparse["device_buffer_size"]) == (2048, 4096)
    assert sparse["host_to_device_ratio"] == 2
    assert sparse["sparse_extra_config"] == {"swap_in_block_size": None}


def test_fp8_backends_and_explicit_sizes(ours):
    result = ours["fp8"]
    assert result["ok"], result
    assert result["fields"]["dsa_prefill_backend"] == "flashmla_kv"
    assert result["fields"]["dsa_decode_backend"] == "flashmla_kv"
    sparse = result["sparse_config"]
    assert (sparse["top_k"], sparse["device_buffer_size"]) == (2048, 3072)
    assert sparse["host_to_device_ratio"] == 4


def test_explicit_top_k_equal_to_the_model_is_accepted(ours):
    assert ours["explicit_top_k_equal_to_model"]["ok"]


def test_deepseek_v4_keeps_native_dtype_and_backend(ours):
    result = ours["deepseek_v4"]
    assert result["ok"], result
    fields = result["fields"]
    assert (fields["attention_backend"], fields["kv_cache_dtype"]) == ("dsv4", "fp8_e4m3")
    assert fields["dsa_prefill_backend"] is None and fields["dsa_decode_backend"] is None
    assert result["sparse_config"]["top_k"] == 512  # the V4 config's index_topk
    assert result["sparse_config"]["device_buffer_size"] == 1024


def test_without_enable_hisparse_our_hooks_stay_out(ours):
    result = ours["hisparse_off"]
    assert result["ok"], result
    # SGLang's own SM90 bf16 defaults, not ours.
    assert result["fields"]["dsa_decode_backend"] == "fa3"


# --- one rule each -----------------------------------------------------------


def test_invalid_json(ours):
    rejected(ours["invalid_json"], "--hisparse-config is not valid JSON")


def test_non_object_json(ours):
    rejected(ours["non_object_json"], "--hisparse-config must be a JSON object", "list")


def test_unknown_key_lists_known_keys(ours):
    rejected(ours["unknown_key"], "unknown key(s) ['topk']",
             "['top_k', 'device_buffer_size', 'host_to_device_ratio', 'swap_in_block_size']")


def test_size_must_be_a_positive_integer_not_bool(ours):
    rejected(ours["bool_size"], "host_to_device_ratio must be a positive integer, got true")


def test_buffer_below_top_k(ours):
    rejected(ours["buffer_below_top_k"], "device_buffer_size (1024) must be >= top_k (2048)")
    rejected(ours["buffer_below_model_top_k"], "device_buffer_size (1024) must be >= top_k (2048)")


def test_top_k_must_equal_model_index_topk(ours):
    rejected(ours["top_k_differs_from_model"], "--hisparse-config: top_k is 64",
             "index_topk is 2048")
    rejected(ours["deepseek_v4_top_k_differs"], "top_k is 2048", "index_topk is 512")


def test_model_must_be_dsa_or_deepseek_v4(ours):
    rejected(ours["model_not_dsa"], "DSA models", "DeepSeek-V4",
             "'DeepseekV3ForCausalLM'")


def test_radix_cache_must_be_disabled(ours):
    rejected(ours["radix_cache_on"], "--enable-hisparse requires --disable-radix-cache")


def test_mixed_chunk_is_rejected(ours):
    rejected(ours["mixed_chunk"], "does not support --enable-mixed-chunk")
    rejected(ours["deepseek_v4_mixed_chunk"], "does not support --enable-mixed-chunk")


def test_kv_cache_dtype(ours):
    rejected(ours["kv_dtype"], "--kv-cache-dtype in ['bfloat16', 'fp8_e4m3'], got fp8_e5m2")
    # Through argv, SGLang's DSA default step asserts before our check runs.
    native_first = ours["kv_dtype_native_assert_first"]
    assert native_first["stage"] == "prepare_server_args"
    assert native_first["error_type"] == "AssertionError"
    assert "fp8_e4m3" in native_first["error"]


def test_dsa_backend_must_read_the_hisparse_pool(ours):
    rejected(ours["decode_backend_for_bf16"],
             "--kv-cache-dtype bfloat16 needs --dsa-decode-backend flashmla_sparse",
             "got tilelang")
    rejected(ours["prefill_backend_for_fp8"],
             "--kv-cache-dtype fp8_e4m3 needs --dsa-prefill-backend flashmla_kv",
             "got flashmla_sparse")


UNWIRED = "only on the sglang releases whose verify step it wires"


def test_linear_mtp_runs_where_the_verify_step_is_wired(ours):
    """Linear MTP/EAGLE (EAGLE or NEXTN, --speculative-eagle-topk 1) is
    accepted on a release whose verify seams are wired, with the default
    hot buffer (draft tokens + 1) x top_k; elsewhere it is refused naming
    the releases that wire it. A tree is refused everywhere for its top-k,
    and its 8 x 2048 rows would not fit the kernel either."""
    from sglang_hisparse.adapter import releases

    wired = releases.current.speculative_seams_wired()
    assert releases.speculative_releases() == tuple(
        v for v in ("0.5.13", "0.5.13.post1") if v in releases.pins.supported_versions())
    for case in ("speculative_linear", "speculative_nextn"):
        if wired:
            assert ours[case]["ok"], ours[case]
            assert ours[case]["sparse_config"]["device_buffer_size"] == 5 * 2048
        else:
            message = rejected(ours[case], UNWIRED, "(0.5.13 and 0.5.13.post1)",
                               "--speculative-algorithm must be unset, got")
            assert "problems with" not in message  # a linear draft breaks no other rule
    error = rejected(ours["speculative_tree"], "--speculative-eagle-topk must be 1, got 2",
                     "draft_tokens x top_k (8 x 2048) 16384")
    assert (UNWIRED in error) != wired
    # With the DSA attention backend SGLang already refuses topk > 1 on pages.
    native_first = ours["speculative_tree_native_first"]
    assert native_first["stage"] == "prepare_server_args"
    assert "page_size > 1" in native_first["error"]


@pytest.mark.parametrize("case,fragments", [
    ("speculative_non_overlap", ("needs the overlap scheduler", "--disable-overlap-schedule",
                                 "SGLANG_ENABLE_SPEC_V2")),
    ("speculative_adaptive", ("does not support --speculative-adaptive",)),
    ("speculative_multi_layer", ("does not support --enable-multi-layer-eagle",)),
    # SGLang's 3 steps make 4 draft tokens: 4 x 2048 rows do not fit 6144.
    ("speculative_buffer_below_rows", ("--hisparse-config", "device_buffer_size must be in "
                                       "[draft_tokens x top_k (4 x 2048), 32767]", "got 6144")),
    ("speculative_draft_past_page", ("--speculative-num-draft-tokens 4 exceeds --page-size "
                                     "2",)),
    ("speculative_pd_decode", ("speculative decoding on a PD decode node",)),
    ("speculative_deepseek_v4", ("on DeepSeek-V4 does not support speculative decoding",)),
])
def test_each_speculative_rule_names_its_flag(ours, case, fragments):
    from sglang_hisparse.adapter import releases

    wired = releases.current.speculative_seams_wired()
    message = rejected(ours[case], *fragments)
    assert (UNWIRED in message) != wired
    assert ("2 problems" in message) != wired  # on its own where the verify step is wired


def test_pipeline_parallelism_not_supported_yet(ours):
    rejected(ours["pipeline_parallel"], "pipeline parallelism yet", "--pp-size must be 1, got 2")


def test_deepseek_v4_on_a_mooncake_pd_decode_node_is_taken(ours):
    assert ours["pd_decode_deepseek_v4"]["ok"], ours["pd_decode_deepseek_v4"]
    assert ours["pd_decode_dsa"]["ok"], ours["pd_decode_dsa"]
    rejected(ours["pd_decode_deepseek_v4_nixl"], "DeepSeek-V4 PD decode node",
             "--disaggregation-transfer-backend in", "got nixl")


def test_a_pd_decode_node_needs_a_connector_that_receives_into_host_memory(ours):
    # 0.5.13 NIXL and mori register every KV buffer as GPU memory; from 0.5.15
    # NIXL is told the host pool is DRAM (adapter/releases).
    from sglang_hisparse.adapter import releases

    allowed = releases.current.decode_host_transfer_backends()
    for backend in ("nixl", "mori"):
        case = ours[f"pd_decode_{backend}"]
        if backend in allowed:
            assert case["ok"], case
        else:
            rejected(case, "--disaggregation-mode decode",
                     f"--disaggregation-transfer-backend in {list(allowed)}",
                     f"got {backend}", "pinned host pool", "GPU memory")
    assert "mori" not in allowed and "mooncake" in allowed
    # mooncake_tcp is mooncake over TCP; a prefill node sends from its GPU pool.
    assert ours["pd_decode_mooncake_tcp"]["ok"], ours["pd_decode_mooncake_tcp"]
    assert ours["pd_prefill_nixl"]["ok"], ours["pd_prefill_nixl"]


def test_pinned_host_memory_beyond_the_node_is_refused_before_weights_load(ours):
    message = rejected(ours["host_memory_beyond_the_node"], "--hisparse-config",
                       "host_to_device_ratio 2 needs about", "GiB of pinned host memory",
                       "x 8 ranks per node", "1000000000 tokens: --max-total-tokens",
                       "1152 B rows x 4 layers", "MemAvailable", "--mem-fraction-static")
    # 10^9 x 2 x 1152 B x 4 layers per rank, in GiB.
    assert f"{10**9 * 2 * 1152 * 4 / 2**30:.1f} GiB per rank" in message


def test_every_problem_is_reported_at_once(ours):
    message = rejected(ours["several_problems"], "3 problems with --enable-hisparse",
                       "not valid JSON", "--disable-radix-cache", "--enable-mixed-chunk")
    assert message.count("\n  - ") == 3


# --- what 0.5.13 accepts without us --------------------------------------


@pytest.mark.parametrize(
    "case",
    ["invalid_json", "unknown_key", "buffer_below_model_top_k",
     "buffer_below_default_top_k", "mixed_chunk", "pipeline_parallel"],
)
def test_sglang_alone_accepts_it_at_startup(native, case):
    assert native[case]["ok"], native[case]


def test_sglang_alone_fails_later_or_never(native):
    # Invalid JSON only fails when the model runner builds the pool.
    assert native["invalid_json"]["sparse_config_error"]["error_type"] == "ValueError"
    # An unknown key is carried along silently.
    assert native["unknown_key"]["sparse_config"]["sparse_extra_config"] == {"topk": 64}
    # top_k 64 is overridden by the model's index_topk (2048) in the model
    # runner, leaving a 128-token buffer for 2048 selected tokens.
    sparse = native["buffer_below_model_top_k"]["sparse_config"]
    assert (sparse["top_k"], sparse["device_buffer_size"]) == (64, 128)


def test_native_mode_gives_the_release_coordinator_the_release_block_size(ours, native):
    # From 0.5.15 SparseConfig.swap_in_block_size is the release coordinator's
    # kernel template argument. Ours leaves it None (our kernel picks); in the
    # native comparison mode SGLang's own coordinator reads it, and None made
    # 0.5.17's server die compiling its swap-in (H200, 2026-12-03).
    theirs = native["default"]["sparse_config"]
    assert native["default"]["ok"] and ours["native_mode_default"]["ok"]
    mode = ours["native_mode_default"]["sparse_config"]
    if "swap_in_block_size" not in theirs:  # 0.5.13: no such field
        assert "swap_in_block_size" not in mode
        return
    assert isinstance(theirs["swap_in_block_size"], int)
    assert mode["swap_in_block_size"] == theirs["swap_in_block_size"]
    assert ours["default"]["sparse_config"]["swap_in_block_size"] is None


# --- pure rules (no SGLang) ----------------------------------------------


def _dsa_args(**changes):
    from dataclasses import replace

    from sglang_hisparse.arg_rules import HiSparseServerArgs, ModelFamily

    args = HiSparseServerArgs(
        model_architecture="DeepseekV32ForCausalLM", model_family=ModelFamily.DSA,
        model_index_topk=2048, hisparse_config=None, disable_radix_cache=True,
        enable_mixed_chunk=False, pp_size=1, kv_cache_dtype="bfloat16",
        dsa_prefill_backend="flashmla_sparse", dsa_decode_backend="flashmla_sparse",
        speculative=None, disaggregation_mode="null",
    )
    return replace(args, **changes)


def test_rules_accept_the_bf16_alias_and_return_the_resolved_config():
    from sglang_hisparse.arg_rules import check_hisparse_server_args

    config = check_hisparse_server_args(_dsa_args(kv_cache_dtype="bf16"))
    assert (config.top_k, config.device_buffer_size) == (2048, 4096)


def test_rules_reject_an_unresolved_auto_kv_dtype():
    # SGLang resolves "auto" for DSA on CUDA/ROCm; anywhere else it reaches us.
    from sglang_hisparse.arg_rules import HiSparseArgumentError, check_hisparse_server_args

    with pytest.raises(HiSparseArgumentError, match=r"got auto"):
        check_hisparse_server_args(_dsa_args(kv_cache_dtype="auto"))


def test_rules_take_deepseek_v4_on_a_pd_decode_node():
    """Retraction keeps a V4 request's device state (retain_on_retract), so a
    V4 decode node is refused only for what its transfer needs."""
    from sglang_hisparse.arg_rules import ModelFamily, find_problems

    v4 = dict(model_architecture="DeepseekV4ForCausalLM", model_family=ModelFamily.DEEPSEEK_V4,
              model_index_topk=512)
    for mode in ("null", "prefill", "decode"):
        assert find_problems(_dsa_args(**v4, disaggregation_mode=mode))[0] == [], mode
    assert find_problems(_dsa_args(disaggregation_mode="decode"))[0] == []


def test_rules_name_the_device_index_transport_for_deepseek_v4_decode():
    """A V4 decode's device-tail pages travel in Mooncake's metadata only, so
    another connector is refused, even one that receives host KV."""
    from sglang_hisparse.arg_rules import (
        DEVICE_INDEX_TRANSFER_BACKENDS, HOST_TRANSFER_BACKENDS, ModelFamily, find_problems,
    )

    v4 = dict(model_architecture="DeepseekV4ForCausalLM", model_family=ModelFamily.DEEPSEEK_V4,
              model_index_topk=512, disaggregation_mode="decode")
    with_nixl = HOST_TRANSFER_BACKENDS + ("nixl",)
    (problem,) = find_problems(_dsa_args(**v4, transfer_backend="nixl",
                                         decode_host_transfer_backends=with_nixl))[0]
    assert (f"--disaggregation-transfer-backend in {list(DEVICE_INDEX_TRANSFER_BACKENDS)}, "
            "got nixl") in problem
    # DSA models do not need the device-tail pages
    assert find_problems(_dsa_args(disaggregation_mode="decode", transfer_backend="nixl",
                                   decode_host_transfer_backends=with_nixl))[0] == []


def test_rules_refuse_a_decode_transfer_backend_the_release_cannot_receive_host_kv_with():
    from sglang_hisparse.arg_rules import HOST_TRANSFER_BACKENDS, find_problems

    problems, _ = find_problems(_dsa_args(disaggregation_mode="decode", transfer_backend="nixl"))
    assert len(problems) == 1, problems
    assert "--disaggregation-transfer-backend in ['mooncake', 'mooncake_tcp', 'fake']" \
        in problems[0] and "got nixl" in problems[0]
    with_nixl = HOST_TRANSFER_BACKENDS + ("nixl",)
    assert find_problems(_dsa_args(disaggregation_mode="decode", transfer_backend="nixl",
                                   decode_host_transfer_backends=with_nixl))[0] == []
    # Only the decode receives into the host pool.
    for mode in ("null", "prefill"):
        assert find_problems(_dsa_args(disaggregation_mode=mode, transfer_backend="nixl"))[0] == []


def test_the_buffer_under_speculation_defaults_to_one_top_k_past_the_rows():
    from dataclasses import replace

    from sglang_hisparse.arg_rules import SpeculativeArgs, find_problems

    spec = SpeculativeArgs(algorithm="EAGLE", eagle_topk=1, num_draft_tokens=4,
                           adaptive=False, multi_layer_eagle=False, overlap_schedule=True,
                           spec_v2=True, overlap_plan_stream=True, page_size=64)
    problems, config = find_problems(_dsa_args(speculative=spec))
    assert config.device_buffer_size == 5 * 2048  # (4 draft tokens + 1) x top_k
    assert any("SGLANG_ENABLE_OVERLAP_PLAN_STREAM" in p for p in problems), problems
    # Five draft tokens' 10240 entries do not fit the kernel's shared memory.
    problems, _ = find_problems(_dsa_args(speculative=replace(spec, num_draft_tokens=5)))
    assert any("draft_tokens x top_k (5 x 2048) 10240" in p and "shared memory" in p
               for p in problems), problems
