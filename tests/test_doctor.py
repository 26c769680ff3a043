"""``python -m sglang_hisparse doctor`` on the pinned install and on a newer one,
and ``doctor --kernels``."""

import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import REPO, run_doctor, run_rebase
from sglang_hisparse.pinned_source import sglang_version
from sglang_hisparse.manifest import HOOKS, Kind, entries_of


def test_doctor_on_pinned_release_passes():
    proc = run_doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert f"sglang {sglang_version()}" in out and "supported: yes" in out
    entries = entries_of(sglang_version())
    for entry in entries:
        assert f"OK   {entry.kind.value:<12} {entry.process.value:<9} {entry.target}\n" in out
    assert f"{len(entries)} of {len(entries)} entries OK" in out
    # Each hook says what it installs, why and when it goes away.
    blocks = out.split("\n  OK   ")[1:]
    for entry, block in zip(entries_of(sglang_version(), HOOKS), blocks):
        assert block.startswith(f"{entry.kind.value:<12}"), block
        assert "\n       impl      " in block and "\n       why       " in block
        assert "\n       removal   " in block


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("sglang-hisparse")
    assert script.exists()
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "doctor" in proc.stdout


def test_doctor_lists_what_no_longer_matches_on_0_5_15(sglang_0_5_15):
    proc = run_doctor("--sglang-root", str(sglang_0_5_15))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert "Traceback" not in out
    assert "sglang 0.5.15" in out and "supported: NO" in out
    # Checked against the newest pin (0.5.15.post1), which changed the DSA
    # backend's decode path: a dependency fails on the release before it.
    assert (
        "FAIL DEPENDS      scheduler "
        "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_decode"
        in out
    )
    # Every failing entry is followed by one line that says why, then one
    # that says what a person does about it (the rebase step that settles it).
    lines = out.splitlines()
    fails = [i for i, line in enumerate(lines) if line.lstrip().startswith("FAIL")]
    assert fails and all(lines[i + 1].lstrip().startswith("->") for i in fails)
    assert all(lines[i + 2].lstrip().startswith("todo") for i in fails)
    forward_decode = lines.index(next(line for line in lines if line.endswith(
        "DeepseekSparseAttnBackend.forward_decode")))
    assert lines[forward_decode + 2].split() == [
        "todo", "re-read", "adapter.model_runner:HiSparseCoordinator.swap_in_selected_pages",
        "against", lines[forward_decode + 1].rsplit("(", 1)[1].rstrip(")") + ",", "then",
        "--accept", "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_decode"]
    # The listing closes with what the release runs with and the work by kind,
    # which adds up to the failures.
    summary = out[out.index("to support sglang 0.5.15 (rebased from the "):]
    assert "requires  sglang-kernel==0.4.4, torch==2.11.0" in summary
    counts = [int(line.split()[0]) for line in summary.splitlines()[2:]
              if line.split() and line.split()[0].isdigit()]
    assert sum(counts) == len(fails)
    assert "scripts/rebase.py" in summary and "--write" in summary


# doctor's closing lines, one per kind of work: "    12  hooks to re-read ..."
_WORK_KINDS = {"entries native": "native", "hooks to": "hooks", "source patches": "patches",
               "dependencies whose": "dependencies", "targets gone": "gone"}


@pytest.mark.parametrize("version", ["0.5.19", "0.5.23"])
def test_developers_quotes_what_doctor_and_rebase_say_of_a_later_release(
        version, request, sglang_0_5_17):
    """DEVELOPERS.md's upgrade procedure quotes, per release after the newest
    pin, what doctor lists and what rebase.py leaves to a person; both are
    rerun here against the downloaded wheel, so the text cannot go stale."""
    import re

    root = request.getfixturevalue("sglang_" + version.replace(".", "_"))
    out = run_doctor("--sglang-root", str(root)).stdout
    summary = out[out.index(f"to support sglang {version} (rebased from the "):]
    kernel, torch = re.search(r"requires  sglang-kernel==(\S+), torch==(\S+)\n", summary).groups()
    work = dict.fromkeys(_WORK_KINDS.values(), 0)
    for line in summary.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].isdigit():
            (kind,) = [k for prefix, k in _WORK_KINDS.items() if parts[1].startswith(prefix)]
            work[kind] = int(parts[0])
    rebase = run_rebase(str(root), "--old-root", str(sglang_0_5_17)).stdout
    for_a_person = int(re.search(r"^(\d+) entries need a human$", rebase, re.M).group(1))
    reanchored = len(re.findall(r"^  reapply ", rebase, re.M))
    # The two tools agree: rebase.py leaves to a person what doctor lists,
    # less the source patches it re-anchored by itself.
    assert for_a_person == sum(work.values()) - work["native"] - reanchored
    quoted = (f"- {version}: torch {torch}, sglang-kernel {kernel}; {work['native']} native, "
              f"{work['hooks']} hooks, {work['patches']} patches, {work['dependencies']} dependencies, "
              f"{work['gone']} gone; rebase.py: {for_a_person} need a person.")
    assert quoted in (REPO / "DEVELOPERS.md").read_text()


def test_todo_says_what_settles_each_kind_of_failure():
    from sglang_hisparse.doctor import todo
    from sglang_hisparse.manifest import ENTRIES

    def entry(kind, native_in=None):
        return next(e for e in ENTRIES if e.kind is kind
                    and (native_in is None) == (e.native_in is None))

    patch, hook = entry(Kind.SOURCE_PATCH), entry(Kind.REPLACE)
    depends, native = entry(Kind.DEPENDS), next(e for e in ENTRIES if e.native_in)
    changed = "source changed: sha256 aaaa != pinned bbbb (x.py:12)"
    assert todo(patch, changed, "9.9.9")[0] == "patch"
    assert "--patch " + patch.target + "=DIFF" in todo(patch, changed, "9.9.9")[1]
    assert todo(hook, changed, "9.9.9") == ("hook", (
        f"re-read {hook.impl} against x.py:12 (code that differs per release goes into "
        f"adapter/releases/), then --accept {hook.target}"))
    assert todo(depends, changed, "9.9.9")[0] == "depends"
    gone = "target not found (no module file for x under /r)"
    assert todo(depends, gone, "9.9.9")[0] == "find"
    assert f"--moved {depends.target}=NEW" in todo(depends, gone, "9.9.9")[1]
    # Native in the release: nothing to do; before it: the entry's own work.
    assert todo(native, changed, native.native_in)[0] == "drop"
    assert todo(native, changed, "0.5.14")[0] != "drop"


# ------------------------------------------------------------ --kernels
def test_row_bytes_are_0_5_13s_row_width():
    import torch

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    from sglang_hisparse.adapter import releases
    from sglang_hisparse.doctor import row_bytes

    model_config = ModelConfig(str(REPO / "tests" / "data" / "dsv32-geometry"))
    for dtype, name, backend, itemsize in (
        (torch.bfloat16, "bfloat16", "flashmla_sparse", 2),
        (torch.float8_e4m3fn, "fp8_e4m3", "flashmla_kv", 1),  # stored as uint8
    ):
        server_args = ServerArgs(model_path="dummy")
        server_args.dsa_prefill_backend = server_args.dsa_decode_backend = backend
        # The release's own calculate_mla_kv_cache_dim (a model runner method
        # before 0.5.17, reading only these three fields).
        dim = releases.current.mla_kv_cache_dim(model_config, dtype, server_args)
        assert row_bytes(name) == dim * itemsize
    assert (row_bytes("bfloat16"), row_bytes("fp8_e4m3")) == (1152, 656)


@pytest.fixture
def recorded_build(monkeypatch):
    """compile_variants replaced by a recorder (what doctor asks to build)."""
    from sglang_hisparse import kernels

    calls = []

    def compile_variants(**kwargs):
        calls.append(kwargs)
        return ["swap_in(recorded)"]

    # doctor asks by the real function's switches
    compile_variants.__signature__ = inspect.signature(kernels.compile_variants)
    monkeypatch.setattr(kernels, "compile_variants", compile_variants)
    monkeypatch.setattr(kernels, "nvcc_available", lambda: True)
    return calls


def _warmup(*args, **kwargs):
    import io

    from sglang_hisparse.doctor import run_kernel_warmup

    out, err = io.StringIO(), io.StringIO()
    rc = run_kernel_warmup(*args, out=out, err=err, **kwargs)
    return rc, out.getvalue(), err.getvalue()


def test_kernel_config_takes_the_hisparse_config_keys(recorded_build):
    rc, _, err = _warmup('{"top_k": 2048, "hot_buffer_size": 4096}')
    assert rc == 2 and not recorded_build
    assert err.startswith("doctor --kernel-config: unknown key(s) ['hot_buffer_size']")
    assert "known keys are ['top_k', 'device_buffer_size'" in err
    rc, _, err = _warmup('{"device_buffer_size": 1024}')
    assert rc == 2 and "device_buffer_size" in err and "top_k" in err


def test_kernel_warmup_asks_for_the_serving_variant_of_the_dtype(recorded_build):
    assert _warmup('{"top_k": 2048, "device_buffer_size": 4096}', "fp8_e4m3")[0] == 0
    assert _warmup(None)[0] == 0  # top_k 2048, buffer 2 x top_k, bf16
    assert _warmup('{"top_k": 512, "swap_in_block_size": 256}', layout="dsv4_c4")[0] == 0
    from sglang_hisparse.kernels import C4_ITEM_BYTES

    fp8, bf16, c4 = recorded_build
    assert fp8["item_bytes"] == 656 and bf16["item_bytes"] == 1152
    assert c4["item_bytes"] == C4_ITEM_BYTES and c4["layout"] == "dsv4_c4"
    assert (fp8["top_k"], fp8["hot_buffer_size"], fp8["block_size"]) == (2048, 4096, None)
    assert (bf16["top_k"], bf16["hot_buffer_size"]) == (2048, 4096)
    assert (c4["top_k"], c4["hot_buffer_size"], c4["block_size"]) == (512, 1024, 256)
    # Only what serving builds: no skip-IO or probe; for DSA rows the
    # IndexShare prefetch's plan-recording swap-in and copy-only replay too,
    # none for C4 (DeepSeek-V4 shares no indexer).
    for call in recorded_build:
        assert call.get("skip_io", (False,)) == (False,)
        assert call.get("probe", (False,)) == (False,)
    for call in (fp8, bf16):
        assert tuple(call["record_plan"]) == (False, True) and call["copy_planned"] is True
        assert tuple(call["copy_planned_threads"]) == (512,)  # SGLANG_HISPARSE_PREFETCH_GRID unset
    assert c4.get("record_plan", (False,)) == (False,) and c4.get("copy_planned", False) is False


def test_kernel_warmup_without_nvcc_is_one_line(monkeypatch):
    from sglang_hisparse import kernels

    monkeypatch.setattr(kernels, "nvcc_available", lambda: False)
    rc, out, err = _warmup('{"top_k": 2048}')
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("doctor --kernels: nvcc not found")


def test_kernel_options_need_kernels():
    proc = run_doctor("--kv-cache-dtype", "fp8_e4m3")
    assert proc.returncode == 2 and "need --kernels" in proc.stderr


@pytest.mark.jit
def test_doctor_kernels_warms_the_variant_a_server_builds():
    # three nvcc builds one after another (the plain swap-in, the anchor's, the replay)
    proc = run_doctor("--kernels", "--kernel-config", '{"top_k": 2048, "device_buffer_size": 4096}',
                   "--kv-cache-dtype", "fp8_e4m3", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    compiled = [line for line in proc.stdout.splitlines() if line.strip().startswith("compiled ")]
    # The plain swap-in, the IndexShare anchor's (it records the miss plan)
    # and the copy-only replay of that plan on the shared layers.
    assert len(compiled) == 3, compiled
    assert all("item_bytes=656" in line for line in compiled)
    swap_ins = [line for line in compiled if "record_plan=" in line]
    assert sorted("record_plan=True" in line for line in swap_ins) == [False, True]
    assert all("skip_io=False" in line for line in swap_ins)
    assert sum("copy_planned(" in line for line in compiled) == 1



# --- the PD transfer engine section (tests/test_pd_transfer.py loads the real one)


def test_transfer_engine_lines_say_what_is_missing_and_how_it_was_told(tmp_path):
    from sglang_hisparse import transfer_engine as te

    missing = te.status_lines(te.EngineStatus([], "not installed"))
    assert any('pip install "sglang-hisparse[pd]"' in line for line in missing), missing

    broken = te.status_lines(te.EngineStatus(
        [("mooncake-transfer-engine", "0.3.13.post1")],
        "ImportError: libcudart.so.12: cannot open shared object file"))
    text = "\n".join(broken)
    assert "mooncake-transfer-engine 0.3.13.post1 (CUDA 12" in text
    assert "import    FAIL ImportError: libcudart.so.12" in text
    assert "apt-get install libibverbs1 ibverbs-providers" in text
    torch_cuda = te._torch_cuda()
    if torch_cuda and not torch_cuda.startswith("12"):
        assert "install mooncake-transfer-engine-cuda13 instead" in text

    # RDMA is offered only where the kernel lists a verbs device.
    (tmp_path / "mlx5_0").mkdir()
    assert te.verbs_devices(str(tmp_path)) == ["mlx5_0"]
    assert te.verbs_devices(str(tmp_path / "absent")) == []
