"""The tree's architecture, enforced: the engine is SGLang-free and the
adapter is the only importer of ``sglang.srt``."""

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "sglang_hisparse"


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _modules(sub: str = ""):
    return sorted((PKG / sub).rglob("*.py"))


def test_only_the_adapter_imports_sglang_srt():
    offenders = [
        f"{p.relative_to(PKG)}: {m}"
        for p in _modules() if "adapter" not in p.relative_to(PKG).parts
        for m in _imports(p) if m == "sglang.srt" or m.startswith("sglang.srt.")
    ]
    assert offenders == []


def test_the_engine_imports_neither_sglang_nor_the_pools_nor_the_adapter():
    offenders = [
        f"{p.relative_to(PKG)}: {m}"
        for p in _modules("engine")
        for m in _imports(p)
        if m.split(".")[0] == "sglang"
        or m.startswith(("sglang_hisparse.adapter", "sglang_hisparse.pools"))
    ]
    assert offenders == []


def test_importing_the_engine_loads_no_sglang_module():
    code = ("import sys, sglang_hisparse.engine.coordinator; "
            "bad = [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_checker_sees_an_import():
    # The walk must find a plain `from sglang.srt...` import (or the tests above prove nothing).
    sample = PKG / "adapter" / "sglang_classes.py"
    assert any(m.startswith("sglang.srt.") for m in _imports(sample))


# What may ask which SGLang runs: the pin data and its checks (manifest,
# pins, the loader, doctor) and the table that picks a release module.
# Everything else reads per-release behaviour from the release modules
# (adapter/releases/sglang_*.py), so a new pin is one module, not version
# checks spread through the engine.
_VERSION_AWARE = {"__init__.py", "manifest.py", "pins.py", "pinned_source.py", "plugin.py",
                  "doctor.py", "adapter/releases/__init__.py"}
_RELEASE = r"^0\.5\.\d+"


def _version_reads(path: Path):
    import re

    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "sglang_version":
            yield f"{node.lineno}: sglang_version"
        elif isinstance(node, ast.Attribute) and node.attr in ("sglang_version", "__version__"):
            yield f"{node.lineno}: .{node.attr}"
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings and re.match(_RELEASE, node.value)):
            yield f"{node.lineno}: {node.value!r}"


def test_only_the_pin_data_and_the_release_table_ask_which_sglang_runs():
    offenders = [
        f"{p.relative_to(PKG)}:{read}"
        for p in _modules()
        if p.relative_to(PKG).as_posix() not in _VERSION_AWARE
        and not p.relative_to(PKG).as_posix().startswith("adapter/releases/sglang_")
        for read in _version_reads(p)
    ]
    assert offenders == []


def test_the_version_scan_sees_a_version_check(tmp_path):
    # A release comparison written into engine code must be found.
    sample = tmp_path / "sample.py"
    sample.write_text('"""Docs may name 0.5.13."""\n'
                      "from sglang_hisparse.pinned_source import sglang_version\n"
                      "if sglang_version() >= '0.5.15':\n    pass\n")
    assert sorted(r.split(": ", 1)[1] for r in _version_reads(sample)) == ["'0.5.15'", "sglang_version"]
