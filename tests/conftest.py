"""Test set-up shared by every test module.

TRITON_INTERPRET must be set before anything imports triton (SGLang does at
import time), so it is set here, at the very top, for in-process tests and
for the subprocesses tests start. CUDA_HOME points the JIT loader at nvcc.

The Hugging Face hub is offline for every test: tests that build
``ServerArgs(model_path="dummy")`` reach ``get_model_config()`` (the
IndexShare roles read the model config), and online that is an HTTP lookup
of a repository named "dummy". Without a network it spent ~23 s per test in
retries (11 PD tests: ~4 min of a suite); with one it depends on the hub.
Every model a test builds is a local config directory.

Under pytest-xdist each worker gets its share of the cores for torch's
intra-op threads (OMP_NUM_THREADS, also for the servers and scripts tests
start): with ``-n 2`` on CI's 2 cores, two workers of 2 threads each made
every CPU op contend (a CPU soak of 200 steps beside another: 31.5 s with 2
threads, 19.6 s with 1).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS)))
    if "torch" in sys.modules:  # imported before this file (by a plugin): too late for the variable
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not os.environ.get("CUDA_HOME"):
    for _cand in ("/usr/local/cuda", "/usr/local/cuda-13.0"):
        if Path(_cand, "bin", "nvcc").exists():
            os.environ["CUDA_HOME"] = _cand
            break

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "jit: compiles CUDA with nvcc (skipped without it)")


def pytest_collection_modifyitems(config, items):
    import shutil

    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    has_nvcc = bool(shutil.which("nvcc")) or bool(
        os.environ.get("CUDA_HOME") and Path(os.environ["CUDA_HOME"], "bin", "nvcc").exists()
    )
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "jit" in item.keywords and not has_nvcc:
            item.add_marker(pytest.mark.skip(reason="needs nvcc"))


def run_python(code: str, env: dict | None = None, timeout: int = 300):
    """Run ``code`` in a fresh interpreter (SGLang's hook registry is process-global)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=str(REPO),
    )
    return proc


def run_rebase(*args, timeout: int = 600):
    """``scripts/rebase.py ARGS`` from the repository root, as DEVELOPERS.md runs it."""
    return subprocess.run([sys.executable, str(REPO / "scripts" / "rebase.py"), *args],
                          capture_output=True, text=True, cwd=str(REPO), timeout=timeout)


def run_doctor(*args, timeout: int = 300):
    """``python -m sglang_hisparse doctor ARGS`` from the repository root."""
    return subprocess.run([sys.executable, "-m", "sglang_hisparse", "doctor", *args],
                          capture_output=True, text=True, cwd=str(REPO), timeout=timeout)


def run_ranks(module: str, calls: list[str], env: dict | None = None,
              timeout: int = 600) -> list:
    """Run ``module.<call>`` for each call (e.g. ``run_rank(0, 2, ...)``) in
    its own interpreter at once, as the ranks of one group; return what each
    returned (JSON), in order. A rank that fails fails the test with its stderr."""
    import json

    procs = []
    for call in calls:
        code = textwrap.dedent(f"""
            import json, sys
            sys.path.insert(0, {str(REPO / "tests")!r})
            import {module} as t
            print("RESULT " + json.dumps(t.{call}))
        """)
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=str(REPO),
                                      env={**os.environ, **(env or {})}))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(line[len("RESULT "):]))
    return results


# Other SGLang releases, installed once per session (tests/releases.py):
# a fixture per release, named sglang_<version with dots as underscores>.
def _release_fixture(version: str):
    def fixture(tmp_path_factory):
        from releases import sglang_release

        return sglang_release(tmp_path_factory, version)

    fixture.__name__ = "sglang_" + version.replace(".", "_")
    fixture.__doc__ = f"sglang {version}, downloaded and unpacked once per session."
    return pytest.fixture(scope="session")(fixture)


sglang_0_5_13_post1 = _release_fixture("0.5.13.post1")
sglang_0_5_15 = _release_fixture("0.5.15")
sglang_0_5_15_post1 = _release_fixture("0.5.15.post1")
sglang_0_5_17 = _release_fixture("0.5.17")
sglang_0_5_19 = _release_fixture("0.5.19")  # releases after the newest pin, for doctor
sglang_0_5_23 = _release_fixture("0.5.23")
