"""``python -m sglang_hisparse doctor`` on the pinned install and on a newer one."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_python
from sglang_hisparse.manifest import ENTRIES


def _doctor(*args):
    return subprocess.run(
        [sys.executable, "-m", "sglang_hisparse", "doctor", *args],
        capture_output=True,
        text=True,
        cwd=str(REPO),
        timeout=300,
    )


def test_doctor_on_pinned_release_passes():
    proc = _doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "sglang 0.5.13" in out and "supported: yes" in out
    for entry in ENTRIES:
        assert f"OK   {entry.kind.value:<12} {entry.target}" in out
    assert f"{len(ENTRIES)} of {len(ENTRIES)} entries OK" in out


def test_console_script_is_installed():
    script = Path(sys.executable).with_name("sglang-hisparse")
    assert script.exists()
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "doctor" in proc.stdout


@pytest.fixture(scope="session")
def sglang_0_5_15(tmp_path_factory):
    """sglang 0.5.15 in a second install location (its own files only)."""
    target = tmp_path_factory.mktemp("sglang-0.5.15")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
         str(target), "sglang==0.5.15"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return target


def test_doctor_lists_what_no_longer_matches_on_0_5_15(sglang_0_5_15):
    proc = _doctor("--sglang-root", str(sglang_0_5_15))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert "Traceback" not in out
    assert "sglang 0.5.15" in out and "supported: NO" in out
    # The decode-batch fix became native in 0.5.15: its source changed there.
    assert (
        "FAIL SOURCE_PATCH sglang.srt.managers.scheduler.Scheduler._build_hisparse_decode_batch"
        in out
    )
    # Every failing entry is followed by one line that says why.
    lines = out.splitlines()
    fails = [i for i, line in enumerate(lines) if line.lstrip().startswith("FAIL")]
    assert fails and all(lines[i + 1].lstrip().startswith("->") for i in fails)


def test_plugin_refuses_0_5_15_without_touching_it():
    # The loader's version gate, on the real running SGLang (reported as 0.5.15).
    proc = run_python(
        """
        import json
        from sglang_hisparse.plugin import activate
        from sglang.srt.plugins.hook_registry import HookRegistry
        act = activate(version="0.5.15")
        print(json.dumps(dict(applied=act.applied, error=act.error,
                              hooks=len(HookRegistry._hooks))))
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"applied": false' in proc.stdout and '"hooks": 0' in proc.stdout
    assert "sglang-hisparse not activated: sglang 0.5.15 is not supported" in proc.stderr


@pytest.mark.jit
def test_doctor_kernels_warms_every_variant_a_config_needs():
    proc = _doctor("--kernels", "--kernel-config", '{"top_k": 2048, "device_buffer_size": 4096}')
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    compiled = [line for line in proc.stdout.splitlines() if line.strip().startswith("compiled ")]
    # plain and plan-recording swap-in (the coordinator records plans), and the replay
    assert any("record_plan=False" in line for line in compiled)
    assert any("record_plan=True" in line for line in compiled)
    assert any("copy_planned(" in line for line in compiled)
