"""The CUDA kernels compile through SGLang's JIT loader (nvcc, no GPU needed).

The variants cover every template axis at least once: the production shape
(DSA bf16 rows, what serving builds), the C4 layout with plan recording,
skipped IO and the probe at a small size, the plan-replay kernel and the
exactness check in both layouts. Without a GPU the target is sm_90a. Also
checks that the serving variant carries no probe code, the size limits and
defaults, the wrappers' argument validation and the per-stream arrival
workspace choice, which need no GPU.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

from sglang_hisparse import kernels
from sglang_hisparse.kernels import bench, copy_planned as copy_mod, exactness, limits
from sglang_hisparse.kernels import swap_in as swap_mod

PRODUCTION = "swap_in(top_k=2048, hot_buffer_size=4096, item_bytes=1152, layout=rows, " \
             "record_plan=False, skip_io=False, block_size=1024, hash_scale=8, probe=False)"


@pytest.mark.jit
def test_compile_production_variant():
    """What serving (and doctor --kernels) builds for the default config: one variant."""
    t0 = time.monotonic()
    assert kernels.compile_variants(top_k=2048, device_buffer_size=4096) == [PRODUCTION]
    mod = swap_mod.swap_in_module(swap_mod.SwapInVariant(2048, 4096, 1152, 0))
    assert callable(getattr(mod, "swap_in"))
    print(f"production variant: {time.monotonic() - t0:.1f}s")


@pytest.mark.jit
def test_compile_c4_plan_skip_io_probe_and_replay():
    t0 = time.monotonic()
    names = kernels.compile_variants(
        top_k=64, hot_buffer_size=200, item_bytes=584, layout="dsv4_c4",
        record_plan=(True,), skip_io=(True,), probe=(True,), block_size=64, copy_planned=True,
    )
    assert len(names) == 2 and names[1].startswith("copy_planned(")
    assert "record_plan=True, skip_io=True, block_size=64, hash_scale=8, probe=True" in names[0]
    mod = copy_mod.copy_planned_module(584, 1)
    assert callable(getattr(mod, "copy_planned"))
    print(f"c4 variants: {time.monotonic() - t0:.1f}s")


@pytest.mark.jit
def test_compile_the_one_warp_replay():
    """The co-resident replay block (32 threads) builds for both layouts and
    is named apart from the 512-thread one."""
    names = kernels.compile_variants(top_k=64, hot_buffer_size=200, record_plan=(), copy_planned=True,
                                     copy_planned_threads=(512, 32))
    assert names == ["copy_planned(item_bytes=1152, layout=rows)",
                     "copy_planned(item_bytes=1152, layout=rows, threads=32)"]
    assert kernels.compile_variants(top_k=64, hot_buffer_size=200, item_bytes=584, layout="dsv4_c4",
                                    record_plan=(), copy_planned=True, copy_planned_threads=(32,)) == [
        "copy_planned(item_bytes=584, layout=dsv4_c4, threads=32)"]


@pytest.mark.jit
@pytest.mark.parametrize("layout,item_bytes", [("rows", 1152), ("dsv4_c4", 584)])
def test_compile_exactness_check(layout, item_bytes):
    names = kernels.compile_variants(top_k=64, item_bytes=item_bytes, layout=layout,
                                     record_plan=(), exactness_check=True)
    assert names == [f"exactness_check(item_bytes={item_bytes}, layout={layout})"]
    mod = exactness.check_module(item_bytes, limits.layout_id(layout))
    assert callable(getattr(mod, "exactness_check"))


def _ptx(tmp_path, instantiation: str) -> str:
    """PTX of one explicit instantiation of a swap_in.cuh template, built with
    the loader's include paths and flags (sm_90a)."""
    import tvm_ffi.libinfo
    from sglang_hisparse.adapter import releases

    include_dirs = releases.current.jit_include_dirs()

    from sglang_hisparse.kernels import _jit

    _jit._ensure_cuda_home()
    import os

    nvcc = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
    src = tmp_path / "variant.cu"
    src.write_text(f'#include "{swap_mod.SWAP_IN_SOURCE}"\n{instantiation}\n')
    out = tmp_path / "variant.ptx"
    includes = [f"-I{p}" for p in [tvm_ffi.libinfo.find_include_path(), *include_dirs]]
    cmd = [nvcc, "-ptx", "-arch=compute_90a", "-std=c++20", "-O3", "--expt-relaxed-constexpr",
           "-DSGL_CUDA_ARCH=900", *includes, str(src), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out.read_text()


@pytest.mark.jit
def test_serving_variant_contains_no_probe_code(tmp_path):
    """The probe is a template axis: the serving instantiation never reads
    %globaltimer, the kProbe one does (so the PTX check can tell them apart)."""
    args = "2048, 4096, 1152, 0, false, false, 1024, 8"
    serving = _ptx(tmp_path, f"template struct hisparse_plugin::SwapIn<{args}, false>;")
    probing = _ptx(tmp_path, f"template struct hisparse_plugin::SwapIn<{args}, true>;")
    assert ".entry" in serving and "globaltimer" not in serving
    assert "globaltimer" in probing


def test_compile_variants_accepts_a_hisparse_config():
    """doctor --kernels passes the --hisparse-config object through."""
    with pytest.raises(ValueError, match="hot_buffer_size must be in"):
        kernels.compile_variants(top_k=2048, device_buffer_size=1024, host_to_device_ratio=2)
    with pytest.raises(ValueError, match="block_size must be a multiple of 32"):
        kernels.compile_variants(top_k=64, swap_in_block_size=100)
    with pytest.raises(ValueError, match="too small for hot_buffer_size"):
        kernels.compile_variants(top_k=64, hot_buffer_size=30000, block_size=512)
    with pytest.raises(ValueError, match=r"needs \d+ B of shared memory per block; the limit is"):
        kernels.compile_variants(top_k=16384, hot_buffer_size=16384)
    with pytest.raises(ValueError, match="item_bytes must be 584"):
        kernels.compile_variants(top_k=64, layout="dsv4_c4", item_bytes=656)
    with pytest.raises(ValueError, match="layout must be one of"):
        kernels.compile_variants(top_k=64, layout="paged")


@pytest.mark.parametrize("top_k", [1, 64, 512, 2048, 4096])
def test_default_block_size_runs_every_buffer_the_kernel_allows(top_k):
    """DEFAULT_BLOCK_SIZE is a legal block (whole warps, within the bounds),
    and with it every hot buffer from top_k to the int16 limit that fits
    shared memory passes the kernel's size checks (at most 32 positions per
    thread) - the reason a single default serves every config."""
    block = kernels.DEFAULT_BLOCK_SIZE
    assert block % 32 == 0 and kernels.MIN_BLOCK_SIZE <= block <= kernels.MAX_BLOCK_SIZE
    fits = [hot for hot in (top_k, 2 * top_k, 4096, 16384, kernels.MAX_HOT_BUFFER_SIZE)
            if top_k <= hot and kernels.swap_in_smem_bytes(top_k, hot) <= kernels.MAX_SMEM_BYTES]
    assert fits
    for hot in fits:
        assert kernels.size_problem(top_k, hot) is None, (top_k, hot)
        assert kernels.size_problem(top_k, hot, block) is None, (top_k, hot)
    # one warp short of it cannot run the largest buffer
    assert "too small" in kernels.size_problem(64, kernels.MAX_HOT_BUFFER_SIZE, block - 32)


def test_verify_limits_count_every_row_of_a_request():
    """A verify step resolves draft_tokens x top_k entries per request: the
    buffer must hold them all, and their hash table must fit shared memory
    (DeepSeek-V3.2's top-k 2048 verifies at most 4 tokens; 5 do not fit)."""
    assert kernels.size_problem(2048, 8192, draft_tokens=4) is None
    assert "must be in [draft_tokens x top_k (4 x 2048), 32767]" in \
        kernels.size_problem(2048, 8000, draft_tokens=4)
    too_many = kernels.size_problem(2048, 10240, draft_tokens=5)
    assert "draft_tokens x top_k (5 x 2048) 10240" in too_many and "shared memory" in too_many
    assert swap_mod.resolve_hash_scale(2048, 8256, None, 4) == 2  # the 8192-entry table
    assert "draft_tokens must be >= 1" in kernels.size_problem(64, 128, draft_tokens=0)


@pytest.mark.jit
def test_compile_verify_variants():
    names = kernels.compile_variants(top_k=64, hot_buffer_size=200, draft_tokens=(1, 3),
                                     record_plan=(True,), block_size=128)
    assert len(names) == 2 and "draft_tokens" not in names[0]
    assert names[1].endswith("hash_scale=8, probe=False, draft_tokens=3)"), names[1]


def test_config_reads_the_kernel_limits_without_torch():
    """--hisparse-config validation imports the limits torch-free."""
    code = ("import sys, sglang_hisparse.config as c, sglang_hisparse.kernels.limits as l; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert (c.MIN_SWAP_IN_BLOCK_SIZE, c.MAX_SWAP_IN_BLOCK_SIZE) == "
            "(l.MIN_BLOCK_SIZE, l.MAX_BLOCK_SIZE)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_hash_scale_is_the_widest_that_fits():
    assert kernels.default_hash_scale(2048, 4096) == 8
    assert kernels.default_hash_scale(2048, 32767) == 8
    assert kernels.default_hash_scale(4096, 4096) == 4
    # 8192 entries: a 4x table alone would be 256 KiB, so the 2x one serves
    assert kernels.default_hash_scale(8192, 8192) == 2
    assert kernels.swap_in_smem_bytes(8192, 8192, 2) <= kernels.MAX_SMEM_BYTES
    with pytest.raises(ValueError, match="hash_scale must be one of 1, 2, 4, 8, 16, got 3"):
        kernels.compile_variants(top_k=64, hash_scale=3)
    with pytest.raises(ValueError, match="hash_scale 4 with top_k 8192 .* shared memory"):
        kernels.compile_variants(top_k=8192, hot_buffer_size=8192, hash_scale=4)


def test_wrapper_rejects_cpu_tensors_by_name():
    cpu = torch.zeros((1, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="top_k_tokens: must be a CUDA tensor"):
        swap_mod.swap_in(cpu, *([None] * 10))
    with pytest.raises(ValueError, match="top_k_tokens: dtype must be torch.int32"):
        swap_mod.swap_in(cpu.long(), *([None] * 10))
    with pytest.raises(ValueError, match="miss_src: must be a CUDA tensor"):
        copy_mod.copy_planned(cpu.long(), cpu, cpu[0], cpu[0, :1], None, None)


def test_package_names_one_thing_each():
    """swap_in / copy_planned are the modules; the data-plane entry is one function."""
    assert kernels.swap_in is swap_mod and kernels.copy_planned is copy_mod
    assert kernels.swap_in_selected is swap_mod.swap_in_selected
    assert not hasattr(kernels.reference, "swap_in_selected")
    for name in kernels.__all__:
        assert getattr(kernels, name) is not None, name


def test_arrival_workspace_is_per_stream_key():
    """pick_workspace: one buffer per (device, stream) key, grown when a
    batch outgrows it, never allocated while capturing."""
    table, keep, made = {}, [], []

    def allocate(n):
        made.append(n)
        return torch.zeros(n, dtype=torch.int32)

    a = swap_mod.pick_workspace(table, (0, 0x100), 8, capturing=False, allocate=allocate, keep=keep)
    b = swap_mod.pick_workspace(table, (0, 0x200), 8, capturing=False, allocate=allocate, keep=keep)
    assert a is not b and a.data_ptr() != b.data_ptr()
    assert swap_mod.pick_workspace(table, (0, 0x100), 100, capturing=True, allocate=allocate,
                                   keep=keep) is a  # big enough: found even while capturing
    assert made == [swap_mod.ARRIVALS_MIN_ROWS] * 2
    grown = swap_mod.pick_workspace(table, (0, 0x100), 10000, capturing=False, allocate=allocate,
                                    keep=keep)
    assert grown.numel() == 10000 and table[(0, 0x100)] is grown and table[(0, 0x200)] is b
    assert a in keep  # a graph captured with the old buffer may still use it
    with pytest.raises(RuntimeError, match="stream 0x300 on cuda:1 .* being captured"):
        swap_mod.pick_workspace(table, (1, 0x300), 8, capturing=True, allocate=allocate, keep=keep)
    with pytest.raises(RuntimeError, match="being captured"):
        swap_mod.pick_workspace(table, (0, 0x200), 20000, capturing=True, allocate=allocate, keep=keep)


def test_probe_phases_mirror_the_kernel_enum():
    """PROBE_PHASES names struct Probe's phase slots in probe.cuh, in order."""
    cuh = bench.PROBE_SOURCE.read_text()
    body = cuh[cuh.index("struct Probe {"):]
    body = body[: body.index("};")]
    slots = {re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower(): int(n)
             for name, n in re.findall(r"\bk(\w+) = (\d+),", body)}
    assert [slots[name] for name in bench.PROBE_PHASES] == list(range(len(bench.PROBE_PHASES)))
    assert slots["early_exit"] == bench.PROBE_EARLY_EXIT
    assert (slots["grid_entry"], slots["grid_exit"]) == (bench.PROBE_GRID_ENTRY, bench.PROBE_GRID_EXIT)
    assert slots["slots"] == bench.PROBE_SLOTS


def test_exactness_kinds_mirror_the_kernel_enums():
    cuh = exactness.CHECK_SOURCE.read_text()

    def enum(struct):
        body = cuh[cuh.index(f"struct {struct} {{"):]
        return {name: int(n) for name, n in re.findall(r"\bk(\w+) = (\d+)", body[: body.index("};")])}

    kinds = enum("CheckKind")
    assert {v: re.sub(r"(?<!^)(?=[A-Z])", "_", k).lower() for k, v in kinds.items() if v} == \
        exactness.KIND_NAMES
    slots = enum("FirstMismatch")
    assert slots.pop("Slots") == exactness.FIRST_SLOTS == len(exactness.FIRST_FIELDS)
    assert sorted(slots.values()) == list(range(exactness.FIRST_SLOTS))


def test_probe_phases_read_the_kernel_stamps():
    """The probe layout (struct Probe in probe.cuh) as the benchmark reads it."""
    probe = kernels.new_probe("cpu")
    assert probe.numel() == 16 and probe[14].item() == -1  # UINT64_MAX for atomicMin
    ns = [1000 * (i + 1) for i in range(len(kernels.PROBE_PHASES))]
    probe[: len(ns)] = torch.tensor(ns)
    probe[14], probe[15] = 500, 20000
    got = kernels.probe_phases_us(probe)
    assert [got[name] for name in kernels.PROBE_PHASES[1:]] == [1.0] * (len(ns) - 1)
    assert got["block0_total"] == 10.0 and got["grid_span"] == 19.5
    assert got["block0_start_lag"] == 0.5
    early = kernels.new_probe("cpu")
    early[0], early[11], early[14], early[15] = 100, 2100, 100, 2600
    got = kernels.probe_phases_us(early)
    assert got["early_exit"] == got["block0_total"] == 2.0 and got["grid_span"] == 2.5


def test_launch_checks_each_geometry_once(monkeypatch):
    """The full argument check runs once per combination of geometries; a new
    batch size, layout or host pool (even at the same address) is checked
    again. (The check itself and the module are stand-ins: no GPU here.)"""
    import weakref

    from kernel_cases import make_case

    checks, launches = [], []

    class Module:
        def swap_in(self, *args):
            launches.append(args)

    def validate(a, probe, hash_scale):
        checks.append(a)
        host_kv = a["host_kv"]
        return swap_mod._Verdict(Module(), 1, False, False, weakref.ref(host_kv.untyped_storage()),
                                 torch.empty(0, dtype=torch.int32), True)

    monkeypatch.setattr(swap_mod, "_validate", validate)
    monkeypatch.setattr(swap_mod, "_VERDICTS", {})
    case = make_case(seq_lens=[300, 40], top_k=16, hot=32, seed=2)
    swap_mod.swap_in(*case.args())
    assert len(checks) == 1 and len(launches) == 1
    views = list(case.args())
    views[4], views[5], views[6] = case.slot_tokens[:], case.slot_locs[:], case.lru[:]  # new view objects
    swap_mod.swap_in(*views)
    assert len(checks) == 1 and len(launches) == 2
    swap_mod.swap_in(*case.args(), layout="dsv4_c4")
    assert len(checks) == 2
    one = [t[:1] for t in case.args()[:3]] + list(case.args()[3:10]) + [case.out[:1]]
    swap_mod.swap_in(*one)
    assert len(checks) == 3
    # same address, shape and strides, but another storage: its pinning is unchecked
    views = list(case.args())
    views[8] = torch.from_numpy(case.host_kv.numpy())
    assert views[8].data_ptr() == case.host_kv.data_ptr()
    swap_mod.swap_in(*views)
    assert len(checks) == 4 and len(launches) == 5
    swap_mod.swap_in(*case.args(), tally=torch.zeros(2, dtype=torch.int64))
    assert len(checks) == 5
