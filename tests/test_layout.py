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
