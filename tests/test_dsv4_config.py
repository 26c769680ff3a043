"""The tiny random-weight DeepSeek-V4 that scripts/gpu_stages.sh's ``dsv4``
stage serves (tests/data/tiny-dsv4/config.json, issue #19), against the real
SGLang classes, on CPU and without tilelang: ``ModelConfig`` reads it as
DeepSeek-V4 with the values V4's kernels assert on, and every server command
``scripts/e2e_gpu.py`` builds for it (base and ours with the stage's
--hisparse-config, base with EAGLE MTP) passes ``prepare_server_args`` +
``check_server_args`` with our plugin active.
"""

import importlib.util
import json
import shlex
from pathlib import Path

import pytest

from conftest import run_python
from helpers_sglang import REPO, check_server_args_cases

TINY_DSV4 = REPO / "tests" / "data" / "tiny-dsv4"
SCRIPTS = REPO / "scripts"
# The stage's --hisparse-config (gpu_stages.sh GF_DSV4_HS; e2e_gpu.py's
# default for DeepSeek-V4): top-k and hot buffer in C4 rows (4 tokens each).
STAGE_HS = {"top_k": 512, "device_buffer_size": 1024, "host_to_device_ratio": 2}
STAGE_WORKLOADS = ("smoke", "concurrent", "capacity", "drain")


def _e2e():
    spec = importlib.util.spec_from_file_location("e2e_gpu_dsv4", SCRIPTS / "e2e_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_model_config_reads_the_tiny_dsv4_as_deepseek_v4():
    proc = run_python(f"""
import json
from sglang.srt.configs.model_config import ModelConfig, is_deepseek_v4
m = ModelConfig({str(TINY_DSV4)!r})
d = ModelConfig({str(TINY_DSV4)!r}, is_draft_model=True)
t = m.hf_text_config
print("RESULT " + json.dumps(dict(
    is_v4=is_deepseek_v4(m.hf_config), hybrid_swa=m.is_hybrid_swa, head_dim=m.head_dim,
    window=m.window_size, compress=list(m.compress_ratios), layers=m.num_hidden_layers,
    index_topk=t.index_topk, heads=t.num_attention_heads, kv_heads=t.num_key_value_heads,
    nextn=t.num_nextn_predict_layers, rope=dict(t.rope_scaling or {{}}),
    draft_arch=d.hf_config.architectures[0], draft_nextn=d.hf_config.num_nextn_predict_layers)))
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(line for line in proc.stdout.splitlines()
                          if line.startswith("RESULT "))[7:])
    assert got["is_v4"] and got["hybrid_swa"]
    # deepseek_v4_backend.py asserts head_dim 512, page 256 and a C4 top-k of
    # 512 or 1024; the backend's SWA window is 128; deepseek_v4.py one KV head,
    # each compress ratio in {0, 4, 128}, one NextN layer; FlashMLA's sm90
    # sparse decode has 64- and 128-head kernels only.
    assert (got["head_dim"], got["window"], got["kv_heads"], got["nextn"]) == (512, 128, 1, 1)
    assert got["index_topk"] in (512, 1024) and got["heads"] in (64, 128)
    assert len(got["compress"]) == got["layers"] and set(got["compress"]) <= {0, 4, 128}
    assert 4 in got["compress"]  # HiSparse's C4 pools need a C4 layer
    # deepseek_v4.py indexes these four yarn keys directly.
    assert {"factor", "beta_fast", "beta_slow", "original_max_position_embeddings"} <= set(got["rope"])
    assert (got["draft_arch"], got["draft_nextn"]) == ("DeepseekV4ForCausalLMNextN", 1)


# SGLang's fused MoE gate kernel (DeepSeek-V4's sqrtsoftplus router), where
# the installed release keeps it.
FUSED_GATE_SOURCES = ("jit_kernel/csrc/moe/moe_fused_gate.cuh",  # 0.5.13 - 0.5.15.post1
                      "kernels/jit/csrc/moe/moe_fused_gate.cuh")  # 0.5.17


def test_the_routed_experts_fill_the_fused_gate_kernels_warps():
    # Below 512 rows the kernel launches min(ceil(E / 32), 16) warps per
    # token but instantiates its reduction for 8, 12 or 16 warps (the first
    # that holds them). In 0.5.13 warp 0 then reads every one of those warps'
    # maxima, and a warp that was not launched leaves its slot uninitialized:
    # with the kit candidate's 8 experts (1 warp of 8) the tiny V4's first
    # prefill on the H200 died there, "an illegal instruction was
    # encountered" under CUDA_LAUNCH_BLOCKING (docs/gpu-runs/2026-12-04).
    # 0.5.15.post1 reads only the launched warps. DeepSeek-V4-Flash's 256
    # experts (and V4-Pro's 384) fill their warps exactly; so must the tiny
    # model's count wherever the kernel reads the others.
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    found = [root / rel for rel in FUSED_GATE_SOURCES if (root / rel).exists()]
    assert found, f"no moe_fused_gate.cuh under {root} ({FUSED_GATE_SOURCES})"
    src = found[0].read_text()
    cfg = json.loads((TINY_DSV4 / "config.json").read_text())
    experts = cfg["n_routed_experts"]
    assert "kMaxExperts = 512;" in src and "kMaxTopK = 16;" in src
    assert experts <= 512 and cfg["num_experts_per_tok"] + cfg["n_shared_experts"] <= 16
    # The instantiations and the launch rule the check below mirrors.
    assert "moe_fused_gate_kernel_small_token<8, kScoringFunc>" in src
    assert "moe_fused_gate_kernel_small_token<12, kScoringFunc>" in src
    assert "warps_per_token = std::min(warps_per_token, 16u);" in src
    if "(lane_id < kWarpsPerToken) ? warp_maxs[lane_id]" in src:  # 0.5.13's read
        assert min(-(-experts // 32), 16) in (8, 12, 16), experts


def _launch_argv(cmd: list[str]) -> list[str]:
    """The flags of an e2e_gpu server command (after ``-m sglang.launch_server``)."""
    return cmd[cmd.index("sglang.launch_server") + 1:]


@pytest.fixture(scope="module")
def stage_cases():
    e2e = _e2e()
    assert e2e.model_arch(str(TINY_DSV4)) == "dsv4"
    cases = {}
    for w in STAGE_WORKLOADS:
        for cfg in ("base", "ours"):
            cmd, env = e2e.server_cmd(str(TINY_DSV4), 30010, cfg, list(e2e.WORKLOADS[w][2]),
                                      hs_config=STAGE_HS, check=True)
            assert env["SGLANG_OPT_FP8_WO_A_GEMM"] == "0"
            cases[f"{cfg}_{w}"] = {"argv": [*_launch_argv(cmd), "--device", "cuda"]}
    mtp = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1",
           "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2"]
    cmd, _ = e2e.server_cmd(str(TINY_DSV4), 30010, "base", [], spec_flags=mtp)
    cases["base_mtp"] = {"argv": [*_launch_argv(cmd), "--device", "cuda"]}
    return cases


@pytest.fixture(scope="module")
def checked(stage_cases):
    return check_server_args_cases(stage_cases, activate=True)


def test_e2e_commands_for_the_tiny_dsv4_pass_the_argument_check(stage_cases, checked):
    assert checked["activation"] == {"applied": True, "error": None}
    e2e_workloads = _e2e().WORKLOADS
    for name in stage_cases:
        result = checked["results"][name]
        assert result["ok"], (name, result.get("error"), shlex.join(stage_cases[name]["argv"]))
        # What deepseek_v4_hook.py forces, whatever the command says.
        assert (result["fields"]["attention_backend"], result["fields"]["page_size"],
                result["fields"]["kv_cache_dtype"]) == ("dsv4", 256, "fp8_e4m3"), name
        # e2e_gpu.stream_generate adds up incremental events.
        assert result["fields"]["incremental_streaming_output"] is True, name
        # A prefill chunk takes SWA slots for all its tokens: one larger than
        # V4's SWA pool (the ratio SGLang sets x the pool) is never scheduled
        # (2026-12-04-s2: base V4 at --max-total-tokens 40000 hung).
        f = result["fields"]
        if f["max_total_tokens"]:
            swa_pool = f["swa_full_tokens_ratio"] * f["max_total_tokens"]
            assert f["chunked_prefill_size"] <= swa_pool, (name, f)
            # Nor are a prompt's SWA slots freed between its chunks: the whole
            # prompt must fit (2026-12-04-s4: both servers stopped 3584 tokens
            # into a 16000-token capacity prompt at 0.1 x 40000).
            workload = name.split("_", 1)[1]
            if workload in e2e_workloads:
                longest = max(n for group in e2e_workloads[workload][0] for n in group)
                assert longest <= swa_pool, (name, longest, swa_pool)
    for w in STAGE_WORKLOADS:
        sparse = checked["results"][f"ours_{w}"]["sparse_config"]
        assert (sparse["top_k"], sparse["device_buffer_size"], sparse["host_to_device_ratio"]) \
            == (512, 1024, 2)


def test_the_stage_workloads_read_from_host():
    # The hot buffer counts C4 rows (one per 4 tokens): the longest prompt of
    # each workload the stage runs must not fit it, or the check sees no host
    # reads (and a launch that checked nothing fails).
    e2e = _e2e()
    for w in STAGE_WORKLOADS:
        longest = max(n for group in e2e.WORKLOADS[w][0] for n in group)
        assert longest // 4 > STAGE_HS["device_buffer_size"] + 64, w
    assert e2e.ARCH_HS_CONFIG["dsv4"] == STAGE_HS
    # The dsv4 stage passes the same object on (GF_DSV4_HS's default).
    stages = (SCRIPTS / "gpu_stages.sh").read_text()
    assert json.dumps(STAGE_HS) in stages


def test_dsa_commands_are_unchanged(monkeypatch):
    monkeypatch.delenv("SGLANG_OPT_FP8_WO_A_GEMM", raising=False)
    e2e = _e2e()
    cmd, env = e2e.server_cmd(str(REPO / "tests" / "data" / "tiny-dsv32"), 1, "ours", [])
    argv = _launch_argv(cmd)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "bfloat16"
    assert argv[argv.index("--dsa-decode-backend") + 1] == "flashmla_sparse"
    assert json.loads(argv[argv.index("--hisparse-config") + 1]) == e2e.HS_CONFIG
    assert "SGLANG_OPT_FP8_WO_A_GEMM" not in env


def test_the_real_v4_model_and_its_draft_build_from_the_config():
    # 0.5.13's DeepseekV4ForCausalLM and its NextN draft on the meta device:
    # every config field the layers read, with the flags the stage sets
    # (SGLANG_OPT_FP8_WO_A_GEMM=0, which bf16 dummy weights need). Their
    # module imports tilelang (srt/layers/mhc.py). Not mocked: SGLang's
    # device probe (no accelerator here) and vllm's rotary op, which the
    # rotary embedding imports on a machine without CUDA.
    pytest.importorskip("tilelang")
    proc = run_python(f"""
import socket, sys, types
import torch
torch.cuda.get_device_capability = lambda d=None: (9, 0)
stub = types.ModuleType("vllm._custom_ops"); stub.rotary_embedding = None
sys.modules.update({{"vllm": types.ModuleType("vllm"), "vllm._custom_ops": stub}})
from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler
sa = prepare_server_args(["--model-path", {str(TINY_DSV4)!r}, "--device", "cuda",
                          "--load-format", "dummy", "--disable-radix-cache"])
set_global_server_args_for_scheduler(sa)
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                             distributed_init_method=f"tcp://127.0.0.1:{{port}}")
initialize_model_parallel(tensor_model_parallel_size=1)
from sglang.srt.configs.model_config import ModelConfig
mc = ModelConfig.from_server_args(sa)
from sglang.srt.layers.dp_attention import initialize_dp_attention
initialize_dp_attention(sa, mc)
from sglang.srt.layers.moe import initialize_moe_config
initialize_moe_config(sa)
import sglang.srt.utils.common as common
import sglang.srt.layers.rotary_embedding.rope_variant as rope_variant
common.get_device = rope_variant.get_device = lambda *a, **k: "cpu"
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.models.deepseek_v4_nextn import DeepseekV4ForCausalLMNextN
with torch.device("meta"):
    model = DeepseekV4ForCausalLM(mc.hf_config, quant_config=None)
    draft = DeepseekV4ForCausalLMNextN(ModelConfig({str(TINY_DSV4)!r}, is_draft_model=True).hf_config,
                                       quant_config=None)
print("BUILT", sum(p.numel() for p in model.parameters()), sum(p.numel() for p in draft.parameters()))
""", env={"SGLANG_OPT_FP8_WO_A_GEMM": "0"}, timeout=600)
    built = [line for line in proc.stdout.splitlines() if line.startswith("BUILT ")]
    assert proc.returncode == 0 and built, proc.stderr[-4000:]
    target, draft = (int(x) for x in built[0].split()[1:])
    # ~3.9 GB of bf16 weights for the target, most of it the 256 experts:
    # small next to the H200.
    assert 1e8 < target < 3e9 and 0 < draft < target
